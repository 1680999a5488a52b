"""The broker core (sbus/core.py) driven directly: no sockets, no sleeps, no clock.

A `Kernel` stands in for the clients' socket buffers (a chosen number of packets each,
so "the kernel is full" is a decision of the test), and `Batch` for a received
``PacketBatch`` (its ``send`` is the ``sendmmsg`` of a run into those buffers).
"""

from __future__ import annotations

import json
import logging

import pytest

from sbus import core as core_mod
from sbus import handover
from sbus.core import FULL, GONE, TOO_BIG, BrokerCore, Client
from sbus.flood import Hard, Order, Soft
from sbus.keys import Credentials
from sbus.limits import Limits


class Kernel:
    """Each link's receive buffer: at most ``room[link]`` packets until the client reads."""

    def __init__(self) -> None:
        self.buffers: dict[int, list[bytes]] = {}
        self.room: dict[int, int] = {}
        self.hung_up: set[int] = set()
        self.largest: dict[int, int] = {}  # link -> the largest packet its socket takes
        self.syscalls = 0

    def write(self, link: int, packet: bytes) -> int:
        """The core's ``write`` port: bytes taken, or `core.GONE` / `core.FULL`."""
        self.syscalls += 1
        if link in self.hung_up or link < 0:
            return GONE
        if len(packet) > self.largest.get(link, len(packet)):
            return TOO_BIG
        buf = self.buffers[link]
        if len(buf) >= self.room[link]:
            return FULL
        buf.append(bytes(packet))
        return len(packet)

    def at_eof(self, link: int) -> bool:
        return link in self.hung_up

    def write_run(self, link: int, packets: list[bytes]) -> int:
        """The core's ``write_run`` port (one ``sendmmsg`` of queued packets)."""
        self.syscalls += 1
        if link in self.hung_up:
            return GONE
        largest = self.largest.get(link)
        if largest is not None and len(packets[0]) > largest:
            return TOO_BIG
        buf = self.buffers[link]
        n = max(0, min(len(packets), self.room[link] - len(buf)))
        if largest is not None:  # (stops before a packet too large, as sendmmsg does)
            n = next((k for k, p in enumerate(packets[:n]) if len(p) > largest), n)
        buf.extend(bytes(p) for p in packets[:n])
        return n or FULL


class Batch:
    """Packets as the core sees a received batch: one buffer, offsets and lengths."""

    def __init__(self, kernel: Kernel, packets: list[bytes]) -> None:
        self.kernel = kernel
        self.buffer = b"".join(packets)
        self.offsets, at = [], 0
        for p in packets:
            self.offsets.append(at)
            at += len(p)
        self.lengths = [len(p) for p in packets]
        self.slots = len(packets)

    def copy(self, i: int) -> bytes:
        return self.buffer[self.offsets[i]:self.offsets[i] + self.lengths[i]]

    def heads(self, start: int, end: int, size: int) -> tuple[bytes, ...]:
        return tuple(self.buffer[at:at + size] for at in self.offsets[start:end])

    def send(self, link: int, start: int, count: int) -> int:
        """What the core's ``send`` port does with this batch (as ``sendmmsg`` would)."""
        self.kernel.syscalls += 1
        if link in self.kernel.hung_up:
            return GONE
        buf = self.kernel.buffers[link]
        n = max(0, min(count, self.kernel.room[link] - len(buf)))
        if n == 0:
            return FULL
        buf.extend(self.copy(i) for i in range(start, start + n))
        return n


class Bus:
    """A core with its fake kernel, and shorthands to connect, send and read."""

    def __init__(self, runs: bool = False, **kwargs) -> None:
        self.kernel = Kernel()
        self.core = BrokerCore(self.kernel.write, self.kernel.at_eof,
                               write_run=self.kernel.write_run if runs else None, **kwargs)
        self.core.debug = True
        self._links = 10

    def connect(self, uid: int = 1000, room: int = 1000, gid: int | None = None) -> Client:
        self._links += 1
        link = self._links
        self.kernel.buffers[link], self.kernel.room[link] = [], room
        c = self.core.connect(Credentials(gid=uid if gid is None else gid, uid=uid,
                                          pid=link * 10), link)
        return c

    def send(self, c: Client, *packets: bytes) -> None:
        self.core.receive(c, Batch(self.kernel, list(packets)), len(packets))

    def read(self, c: Client) -> list[bytes]:
        """What the client's kernel buffer holds (taken out, as by the client's read)."""
        got, self.kernel.buffers[c.link] = self.kernel.buffers[c.link], []
        return got

    def drain(self, c: Client) -> list[bytes]:
        """The client reads everything, and the core refills as it becomes writable."""
        got = []
        while True:
            got += self.read(c)
            if not c.wants_write:
                return got
            self.core.writable(c)

    def lines(self, level: int = logging.WARNING) -> list[str]:
        return [line for lvl, line in self.core.take_logs() if lvl >= level]


def msgs(packets: list[bytes]) -> list[bytes]:
    return [p for p in packets if p.startswith(b"MSG ")]


def test_publish_reaches_subscribers_in_order_with_one_send_per_run():
    bus = Bus()
    a, b, pub = bus.connect(), bus.connect(), bus.connect()
    bus.send(a, b"SUB news/")
    bus.send(b, b"SUB news/sport")
    packets = [b"MSG news/sport\0%d" % i for i in range(10)]
    bus.kernel.syscalls = 0
    bus.send(pub, *packets)
    assert bus.read(a) == packets and bus.read(b) == packets
    assert bus.kernel.syscalls == 2  # one sendmmsg per target for the whole run
    assert bus.core.published == 10 and bus.core.delivered == 20
    bus.send(pub, b"MSG weather\0x")
    assert bus.read(a) == [] and bus.core.published == 11


def test_a_one_packet_fan_out_writes_once_per_target_and_queues_for_the_full_ones():
    bus = Bus()
    free = [bus.connect() for _ in range(5)]
    full, gone = bus.connect(room=0), bus.connect()
    for c in [*free, full, gone]:
        bus.send(c, b"SUB fan")
    bus.kernel.hung_up.add(gone.link)
    pub = bus.connect()
    bus.kernel.syscalls = 0
    bus.send(pub, b"MSG fan\0one")  # a batch of one packet: the turn of a costly fan-out
    assert all(bus.read(c) == [b"MSG fan\0one"] for c in free)
    assert bus.kernel.syscalls == 7  # one write each (the full one is queued, not retried)
    assert full.wants_write and bus.read(full) == [] and gone.closed
    bus.send(pub, b"MSG fan\0two")  # behind what waits, not before it
    bus.kernel.room[full.link] = 10
    assert msgs(bus.drain(full)) == [b"MSG fan\0one", b"MSG fan\0two"]
    assert bus.core.delivered == 2 * 5 + 2 and bus.core.dropped == 0


def fan_out(bus: Bus, targets: int, pattern: bytes = b"SUB fan", **room) -> list[Client]:
    subs = [bus.connect(**room) for _ in range(targets)]
    for c in subs:
        bus.send(c, pattern)
    return subs


def test_a_costly_fan_out_is_held_and_served_in_bounded_steps_in_order():
    bus = Bus(limits=Limits(queued_bytes_per_user=1 << 30))
    subs = fan_out(bus, 100)
    pub = bus.connect(uid=2000)
    packets = [b"MSG fan\0%d" % i for i in range(32)]  # 3,200 deliveries
    batch = Batch(bus.kernel, packets)
    bus.kernel.syscalls = 0
    job = bus.core.receive(pub, batch, len(packets), hold=True)
    assert job is not None and bus.kernel.syscalls == 0 and bus.core.fanouts == [job]
    assert not pub.wants_read and pub in bus.core.dirty  # not read until it is done
    assert pub.out.budget.queued >= sum(map(len, packets))  # the held batch is charged
    assert bus.core.published == 32
    steps = 0
    while not bus.core.step(job, deliveries=512):
        steps += 1
        served = sum(len(bus.kernel.buffers[c.link]) for c in subs)
        assert served == steps * 512  # 16 targets of 32 packets per step, no more
    assert all(bus.read(c) == packets for c in subs)  # each a run, in order
    assert bus.kernel.syscalls == 100  # one sendmmsg per target for the whole batch
    assert bus.core.fanouts == [] and bus.core.freed == [batch]
    assert pub.wants_read and pub.fanout is None and pub.out.budget.queued == 0
    assert bus.core.delivered == 3200


def test_a_held_fan_out_goes_on_with_the_rest_of_the_batch_only_when_done():
    bus = Bus()
    subs = fan_out(bus, 50)
    other = bus.connect()
    bus.send(other, b"SUB fan")
    pub = bus.connect()
    first = [b"MSG fan\0%d" % i for i in range(30)]
    rest = [b"UNSUB fan", b"MSG fan\0late", b"MSG !/cred/uid/0/x\0no", b"CMSG what"]
    batch = Batch(bus.kernel, [*first, b"SUB fan", *rest])
    job = bus.core.receive(pub, batch, batch.slots, hold=True)
    assert job is not None and bus.core.index.patterns(pub) == {}  # SUB waits its turn
    while not bus.core.step(job, deliveries=300):
        assert bus.read(pub) == []  # nothing after the fan-out happens before it ends
    assert all(bus.read(c) == [*first, b"MSG fan\0late"] for c in [*subs, other])
    got = bus.read(pub)  # its own SUB, UNSUB in order: the late one is not for it
    assert [p.split(b"\0")[0] for p in got] == [b"CMSG refused/msg", b"CMSG refused/cmsg"]
    assert bus.core.freed == [batch] and pub.wants_read


def test_a_held_fan_out_skips_the_departed_and_queues_for_the_full():
    bus = Bus()
    subs = fan_out(bus, 40)
    full = fan_out(bus, 1, room=3)[0]
    pub = bus.connect()
    packets = [b"MSG fan\0%d" % i for i in range(32)]
    job = bus.core.receive(pub, Batch(bus.kernel, packets), 32, hold=True)
    bus.core.step(job, deliveries=64)  # the first two targets
    served = [c for c in subs if bus.kernel.buffers[c.link]]
    assert 1 <= len(served) <= 2  # (the full target may be one of the two)
    gone = next(c for c in subs if c not in served)  # targets are in no set order
    bus.kernel.hung_up.add(gone.link)
    bus.core.hangup(gone)
    bus.core.finish_fanouts()
    assert all(bus.read(c) == packets for c in subs if c is not gone)
    assert bus.read(gone) == []
    assert bus.read(full) == packets[:3] and msgs(bus.drain(full)) == packets[3:]
    assert bus.core.fanouts == [] and bus.core.dropped == 0


def test_small_or_large_batches_are_not_held():
    bus = Bus(max_message=1 << 21)
    fan_out(bus, 10)
    pub = bus.connect()
    few = [b"MSG fan\0x"] * 32  # 320 deliveries: at once
    assert bus.core.receive(pub, Batch(bus.kernel, few), 32, hold=True) is None
    fan_out(bus, 100)
    big = [b"MSG fan\0" + b"x" * (1 << 20)] * 2  # past HOLD_BYTES: at once
    assert bus.core.receive(pub, Batch(bus.kernel, big), 2, hold=True) is None
    assert bus.core.receive(pub, Batch(bus.kernel, few), 32) is None  # not allowed to hold
    assert bus.core.fanouts == [] and bus.core.published == 66


def test_refusals_answer_the_client_and_are_logged():
    bus = Bus(max_message=1000)
    c = bus.connect()
    bus.send(c, b"HELLO", b"UNSUB nothing", b"CMSG what/ever", b"x" * 1001,
             b"SUB a/" + b"/b" * 300, b"MSG !/oops\0x")
    got = bus.read(c)
    verbs = [p.split(b"\0")[0] for p in got]
    assert verbs == [b"CMSG refused/packet", b"CMSG refused/unsub", b"CMSG refused/cmsg",
                     b"CMSG refused/packet", b"CMSG refused/sub", b"CMSG refused/msg"]
    assert got[0].endswith(b"unknown message type: 'HELLO'")
    assert b"over the 1000-byte limit" in got[3]
    lines = bus.lines()
    assert len(lines) == 6 and all("uid 1000" in line for line in lines)


def test_empty_packet_is_refused_and_end_of_file_is_a_hangup():
    bus = Bus()
    c = bus.connect()
    bus.send(c, b"")
    assert bus.read(c) == [b"CMSG refused/packet\0empty packet"]
    bus.kernel.hung_up.add(c.link)
    bus.send(c, b"")
    assert c.closed and bus.core.gone == [c]
    assert not bus.core.tidy() and bus.core.connections == {}
    assert bus.core.empty_since == bus.core.now


def test_secrets_reach_only_their_owner():
    bus = Bus()
    owner, other, snoop = bus.connect(uid=1000), bus.connect(uid=1001), bus.connect(uid=1001)
    bus.send(owner, b"SUB !/cred////")  # empty fields are filled with the subscriber's own
    bus.send(snoop, b"SUB ")  # everything public
    bus.send(other, b"SUB !/cred/1000/1000/110/")  # the owner's secrets: refused
    refusal = bus.read(other)
    assert refusal[0].startswith(b"CMSG refused/sub\0secret pattern")
    key = owner.cred.path() + b"/hi"
    bus.send(other, b"MSG " + key + b"\0psst", b"CMSG !/cred/whoami")
    assert bus.read(owner) == [b"MSG " + key + b"\0psst"]
    assert bus.read(snoop) == []
    assert bus.read(other) == [b"CMSG !/cred/whoami\0" + other.cred.path()]


def test_soft_discard_counts_and_reports_drops():
    bus = Bus()
    sub, pub = bus.connect(room=2), bus.connect()
    bus.send(sub, b"CMSG blocking/soft/discard", b"SUB k")
    bus.send(pub, *[b"MSG k\0%d" % i for i in range(5)])
    assert len(bus.read(sub)) == 2 and bus.core.dropped == 3
    assert sub.wants_write  # a drop report is due
    bus.core.writable(sub)
    assert bus.read(sub) == [b"CMSG blocking/dropped\x003"]
    assert not sub.wants_write


@pytest.mark.parametrize("runs", [False, True])
def test_drops_are_reported_under_a_flood_that_never_lets_the_queue_drain(runs):
    """The drop report waits for the queue to drain, but no longer than the packets that
    waited when the first drop was seen: a publisher that keeps the queue full (the
    audit of 2026-11-28: a bridge said "dropped 0" for the 65 s of a flood) still has
    its losses reported, each exactly once, at about one queue's worth of delay."""
    bus = Bus(runs=runs, queue_limit=1000)
    sub, pub = bus.connect(room=4), bus.connect()
    bus.send(sub, b"SUB k")
    reported = delivered = offered = 0
    for _ in range(200):  # the queue is topped up before each read: it never drains
        bus.send(pub, *[b"MSG k\0" + b"." * 90 for _ in range(8)])
        offered += 8
        bus.core.writable(sub)
        for packet in bus.read(sub):
            if packet.startswith(b"CMSG blocking/dropped\0"):
                reported += int(packet.split(b"\0")[1])
            else:
                delivered += 1
        assert len(sub.out) > 0
    assert reported > 0, "no drop reported while the queue stayed full"
    assert delivered + reported + len(sub.out) + sub.out.dropped == offered
    assert bus.core.dropped == reported + sub.out.dropped


@pytest.mark.parametrize("runs", [False, True])
def test_queue_keeps_order_until_the_hard_limit_then_drops(runs):
    bus = Bus(runs=runs, queue_limit=1000)
    sub, pub = bus.connect(room=1), bus.connect()
    bus.send(sub, b"SUB k")
    packets = [b"MSG k\0" + b"%03d" % i + b"." * 90 for i in range(20)]
    bus.send(pub, *packets)
    got = msgs(bus.drain(sub))
    kept = len(got)
    assert got == packets[:kept] and 5 < kept < 20  # ~1000 bytes queued, the rest dropped
    assert bus.core.dropped == 20 - kept


def test_block_pauses_a_publisher_of_the_same_user_and_resumes_it_once_drained():
    bus = Bus()
    sub, pub = bus.connect(room=2), bus.connect()
    bus.send(sub, b"CMSG blocking/soft/block", b"SUB k")
    bus.send(pub, *[b"MSG k\0%d" % i for i in range(6)])
    assert not pub.wants_read and pub.waiting_on == [sub] and sub.paused == [pub]
    assert "1 publishers paused" in bus.core.status()
    assert len(msgs(bus.drain(sub))) == 6
    assert pub.wants_read and sub.paused == []


def test_block_across_users_is_a_privilege():
    bus = Bus(limits=Limits(trusted=frozenset({2000})))
    blocker, pub = bus.connect(uid=1000, room=1), bus.connect(uid=1001)
    bus.send(blocker, b"CMSG blocking/soft/block", b"SUB ")
    bus.send(pub, *[b"MSG k\0%d" % i for i in range(4)])
    assert pub.wants_read, "another user's block paused the publisher"
    trusted = bus.connect(uid=2000, room=1)
    bus.send(trusted, b"CMSG blocking/soft/block", b"SUB t")
    bus.send(pub, b"MSG t\0a", b"MSG t\0b")
    assert not pub.wants_read  # a trusted user's subscriber may hold it back
    bus.send(trusted, b"CMSG blocking/soft/discard")  # a new policy lets it go at once
    assert pub.wants_read
    nowait = bus.connect(uid=1000)
    bus.send(nowait, b"CMSG blocking/publisher/nowait", *[b"MSG z\0%d" % i for i in range(4)])
    assert nowait.wants_read  # never paused, even by its own user


def test_a_paused_publishers_excess_is_charged_to_its_user_then_dropped():
    limit = 4000
    bus = Bus(queue_limit=1000, limits=Limits(queued_bytes_per_user=limit))
    sub, pub = bus.connect(room=0), bus.connect()
    bus.send(sub, b"CMSG blocking/hard/block", b"SUB k")
    big = [b"MSG k\0" + b"x" * 300 for _ in range(20)]
    bus.send(pub, *big)
    budget = pub.out.budget
    assert budget is sub.out.budget and budget.queued <= limit + 400
    assert pub.held > 0 and bus.core.dropped > 0  # past the budget: dropped, not held
    bus.core.hangup(pub)
    assert pub.held == 0  # what it held is released when it goes


def test_error_policy_disconnects_with_one_line():
    bus = Bus()
    sub, pub = bus.connect(room=0), bus.connect()
    bus.send(sub, b"CMSG blocking/soft/error", b"SUB k")
    bus.send(pub, b"MSG k\0x")
    assert sub.closed and sub in bus.core.gone
    assert any("its flood policy is 'error'" in line for line in bus.lines())


def test_order_random_sends_largest_first():
    bus = Bus()
    sub, pub = bus.connect(room=0), bus.connect()
    bus.send(sub, b"CMSG order/random", b"SUB k")
    bus.send(pub, b"MSG k\0a", b"MSG k\0ccc", b"MSG k\0bb")
    bus.kernel.room[sub.link] = 10
    bus.core.writable(sub)
    assert bus.read(sub) == [b"MSG k\0ccc", b"MSG k\0bb", b"MSG k\0a"]


def test_a_client_that_does_not_read_its_replies_is_not_read_from():
    bus = Bus(queue_limit=2000)
    c = bus.connect(room=0)
    bus.send(c, *[b"CMSG !/cred/whoami"] * 60)
    assert c.own_full and not c.wants_read
    bus.kernel.room[c.link] = 1000
    bus.core.writable(c)
    assert c.wants_read and len(bus.read(c)) == 60


def test_user_limits_refuse_connections_and_subscriptions():
    bus = Bus(limits=Limits(connections_per_user=2, subscriptions_per_user=3))
    a = bus.connect(uid=1000)
    bus.connect(uid=1000)
    assert bus.connect(uid=1000) is None
    assert any("connection refused: uid 1000 already holds 2 connections" in line
               for line in bus.lines())
    assert bus.connect(uid=0) is not None  # root is exempt
    bus.send(a, b"SUB a", b"SUB b", b"SUB c", b"SUB d")
    assert bus.read(a)[0].startswith(b"CMSG refused/sub\0'd': uid 1000 already holds 3")
    bus.send(a, b"UNSUB a", b"SUB d")
    assert bus.read(a) == [] and bus.core.subscription_count == 3


def test_log_lines_are_rationed_per_user_with_time_handed_in():
    bus = Bus()
    c = bus.connect()
    bus.send(c, *[b"JUNK"] * 30)
    assert len(bus.lines()) == 10  # the burst
    bus.core.advance(bus.core.now + 120)  # two intervals later: two more lines
    bus.send(c, *[b"JUNK"] * 5)
    lines = bus.lines()
    assert len(lines) == 2 and "(20 more lines about uid 1000 were not logged)" in lines[0]


def test_turn_budgets_make_expensive_clients_read_fewer_packets():
    bus = Bus(batch_slots=32)
    c = bus.connect()
    assert c.slots == core_mod.FIRST_SLOTS
    bus.core.turn_taken(c, c.slots, 0.0001)  # cheap and full: earns more
    assert c.slots == 2 * core_mod.FIRST_SLOTS
    for _ in range(5):
        bus.core.turn_taken(c, c.slots, 0.0001)
    assert c.slots == 32
    bus.core.turn_taken(c, 32, 10 * core_mod.TURN_SECONDS)  # overran its turn
    assert c.slots == 3
    bus.core.turn_taken(c, 3, 100 * core_mod.TURN_SECONDS)
    assert c.slots == 1


def test_a_departed_clients_subscriptions_go_a_few_hundred_at_a_time():
    bus = Bus()
    c = bus.connect()
    bus.send(c, *[b"SUB p/%d" % i for i in range(1200)])
    assert bus.core.subscription_count == 1200
    bus.core.hangup(c)
    assert bus.core.tidy()  # more left after one turn
    assert bus.core.subscription_count == 1200 - core_mod.REMOVALS_PER_TURN
    while bus.core.tidy():
        pass
    assert bus.core.subscription_count == 0 and not bus.core.connections


def test_status_answer_shows_own_users_clients_only():
    bus = Bus()
    mine, theirs = bus.connect(uid=1000), bus.connect(uid=1001)
    bus.send(theirs, b"SUB secret/plans")
    bus.core.advance(12.5)
    bus.send(mine, b"SUB a/", b"CMSG broker/status")
    answer = json.loads(bus.read(mine)[0].split(b"\0", 1)[1])
    assert answer["broker"]["clients"] == 2 and answer["broker"]["uptime"] == 12.5
    assert [c["id"] for c in answer["clients"]] == [mine.id]
    assert answer["clients"][0]["patterns"] == ["a/"]


def test_a_clients_own_status_line_is_shown_bounded_to_who_may_see_it():
    bus = Bus()
    bridge, other, root = bus.connect(uid=1000), bus.connect(uid=1001), bus.connect(uid=0)
    bus.send(bridge, b"CMSG client/status\0exported=5 imported=2", b"CMSG client/status\0" +
             b"\x1b[2J" + b"x" * 5000)  # the later one counts, cut to its bound
    bus.send(other, b"CMSG broker/status")
    assert json.loads(bus.read(other)[0].split(b"\0", 1)[1])["clients"][0]["status"] == ""
    bus.send(root, b"CMSG broker/status")
    seen = {c["id"]: c["status"] for c in
            json.loads(bus.read(root)[0].split(b"\0", 1)[1])["clients"]}
    assert seen[bridge.id] == "\x1b[2J" + "x" * 196  # JSON keeps ESC escaped; 200 bytes
    bus.send(bridge, b"CMSG client/status")  # no payload: cleared
    bus.send(root, b"CMSG broker/status")
    seen = {c["id"]: c["status"] for c in
            json.loads(bus.read(root)[0].split(b"\0", 1)[1])["clients"]}
    assert seen[bridge.id] == ""


def test_a_failed_send_disconnects_the_target_only():
    bus = Bus()
    gone, ok, pub = bus.connect(), bus.connect(), bus.connect()
    for c in (gone, ok):
        bus.send(c, b"SUB k")
    bus.kernel.hung_up.add(gone.link)
    bus.send(pub, b"MSG k\0x", b"MSG k\0y", b"MSG k\0z")
    assert gone.closed and not ok.closed and len(bus.read(ok)) == 3


def test_a_client_found_gone_by_a_write_is_read_to_its_end_first():
    """A write to a client fails because it closed: what it sent before is still on its
    socket, in order, and is delivered (never answered) before it departs at its end of
    file; nothing more is written to it, and the snapshot still hands it on."""
    bus = Bus()
    gone, sub, other = bus.connect(), bus.connect(), bus.connect()
    bus.send(gone, b"SUB o")
    bus.send(sub, b"SUB k")
    bus.kernel.hung_up.add(gone.link)  # it sent its publishes, then closed
    bus.send(other, b"MSG o\0for it")
    assert gone.closed and gone.draining and gone.wants_read and not gone.wants_write
    assert bus.core.gone == [] and [c.id for c in bus.core.snapshot().clients] == [
        gone.id, sub.id, other.id]
    bus.send(gone, b"MSG k\0one", b"SUB k", b"CMSG !/cred/whoami", b"MSG k\0two")
    bus.send(other, b"MSG o\0more")  # its patterns deliver nothing now
    assert bus.read(sub) == [b"MSG k\0one", b"MSG k\0two"] and bus.read(gone) == []
    bus.send(gone, b"")  # its end of file
    assert bus.core.gone == [gone] and not gone.wants_read
    while bus.core.tidy():
        pass
    assert bus.core.subscription_count == 1 and list(bus.core.connections) == [sub.id, other.id]
    assert bus.core.dropped == 0


def test_snapshot_round_trip_restores_clients_queues_and_policies():
    bus = Bus()
    sub, pub = bus.connect(room=1), bus.connect(uid=1001)
    bus.send(sub, b"CMSG blocking/soft/discard", b"CMSG order/stack", b"SUB k/", b"SUB k/",
             b"SUB !/cred////")
    bus.send(sub, b"CMSG blocking/soft/queue")
    bus.send(pub, b"CMSG blocking/publisher/nowait", *[b"MSG k/%d\0" % i for i in range(4)])
    state = handover.decode(handover.encode(bus.core.snapshot()))
    assert [c.id for c in state.clients] == [sub.id, pub.id]
    assert state.clients[0].patterns == [(sub.cred.path() + b"/", 1), (b"k/", 2)]
    assert state.clients[0].queued == [b"MSG k/%d\0" % i for i in (1, 2, 3)]

    after = Bus()
    peers = {}
    for c, link in ((sub, 51), (pub, 52)):
        after.kernel.buffers[link], after.kernel.room[link] = [], 100
        peers[c.id] = (c.cred, link)
    taken = after.core.restore(state, peers)
    assert [c.id for c in taken] == [sub.id, pub.id]
    again = handover.decode(handover.encode(after.core.snapshot()))
    assert again == state
    new_sub, new_pub = taken
    assert new_sub.out.order is Order.STACK and new_pub.nowait
    after.core.writable(new_sub)  # queued packets go out, newest first (stack)
    assert after.read(new_sub) == [b"MSG k/%d\0" % i for i in (3, 2, 1)]
    after.send(new_pub, b"MSG k/x\0y")
    assert after.read(new_sub) == [b"MSG k/x\0y"] * 1  # each client once, despite two SUBs
    newcomer = after.connect()
    assert newcomer.id > max(c.id for c in taken)
    with pytest.raises(handover.HandoverError, match="separator"):
        Bus(sep=b".").core.restore(state, peers)


def test_restore_lets_go_of_clients_the_limits_now_refuse():
    bus = Bus()
    clients = [bus.connect(uid=1000) for _ in range(3)]
    state = bus.core.snapshot()
    after = Bus(limits=Limits(connections_per_user=2))
    peers = {c.id: (c.cred, c.link) for c in clients}
    for c in clients:
        after.kernel.buffers[c.link], after.kernel.room[c.link] = [], 10
    taken = after.core.restore(state, peers)
    assert len(taken) == 2 and after.core.connections.keys() == {c.id for c in taken}


def test_defaults_apply_to_new_clients():
    bus = Bus(defaults=(Soft.BLOCK, Hard.BLOCK, Order.RANDOM))
    c = bus.connect()
    assert (c.out.soft, c.out.hard, c.out.order) == (Soft.BLOCK, Hard.BLOCK, Order.RANDOM)


def test_a_packet_too_large_for_its_socket_is_dropped_and_reported_not_retried():
    """The link port's `TOO_BIG`: that packet is lost (counted, reported with
    ``blocking/dropped``), the client stays, and what follows it is delivered."""
    bus = Bus()
    sub = bus.connect(room=0)
    pub = bus.connect()
    bus.send(sub, b"SUB k")
    bus.send(pub, b"MSG k\0" + b"x" * 100, b"MSG k\0small")
    assert sub.wants_write and len(sub.out) == 2
    bus.kernel.room[sub.link], bus.kernel.largest[sub.link] = 10, 50
    bus.core.writable(sub)
    assert bus.read(sub) == [b"MSG k\0small", b"CMSG blocking/dropped\0" + b"1"]
    assert not sub.closed and not sub.wants_write and bus.core.dropped == 1
    assert any("too large" in line for line in bus.lines())


def test_a_queue_drains_in_runs_in_order_and_a_packet_too_large_is_still_dropped():
    """With the ``write_run`` port a plain queue goes out in runs (one system call each)
    in order; a run stops before a packet too large for the socket, which is then
    dropped, counted and reported as with single writes; lanes go one at a time."""
    bus = Bus(runs=True, queue_limit=1 << 20)
    sub, pub = bus.connect(room=0), bus.connect()
    bus.send(sub, b"SUB k")
    packets = [b"MSG k\0%d" % i for i in range(200)]
    packets[150] = b"MSG k\0" + b"x" * 100
    bus.send(pub, *packets)
    bus.kernel.room[sub.link], bus.kernel.largest[sub.link] = 1000, 50
    bus.kernel.syscalls = 0
    got = bus.drain(sub)
    assert got == packets[:150] + packets[151:] + [b"CMSG blocking/dropped\0" + b"1"]
    assert bus.kernel.syscalls <= 8  # 64 + 64 + 22 | the large one | 49, the report
    assert bus.core.dropped == 1 and bus.core.delivered == 199


def test_a_trusted_connection_publishing_for_its_users_gives_each_a_share():
    """One connection carrying two users' messages (a root mount's writers) to a full
    queue: without ``publisher/for`` they are one user, and the flood takes everyone's
    place; with it, the flooder loses its own messages and the other's all arrive."""
    def run(name_users: bool) -> tuple[list[bytes], int]:
        bus = Bus(queue_limit=10_000)
        sub, mount = bus.connect(uid=1000, room=0), bus.connect(uid=0)
        bus.send(sub, b"SUB k/")
        bus.send(mount, b"CMSG blocking/publisher/nowait")
        for i in range(200):
            if name_users:
                bus.send(mount, b"CMSG blocking/publisher/for\x002001")
            bus.send(mount, b"MSG k/flood\0" + b"f" * 100)
            if i % 10 == 0:
                if name_users:
                    bus.send(mount, b"CMSG blocking/publisher/for\x002002")
                bus.send(mount, b"MSG k/quiet\0%d" % i)
        bus.kernel.room[sub.link] = 10**6
        got = msgs(bus.drain(sub))
        return [p for p in got if p.startswith(b"MSG k/quiet")], bus.core.dropped

    quiet, dropped = run(name_users=True)
    assert quiet == [b"MSG k/quiet\0%d" % i for i in range(0, 200, 10)] and dropped > 100
    quiet, _ = run(name_users=False)
    assert len(quiet) < 10  # one share for both: the quiet user's messages were lost


def test_only_a_trusted_user_publishes_for_another():
    bus = Bus(limits=Limits(trusted=frozenset({2000})))
    plain, trusted, root = bus.connect(uid=1000), bus.connect(uid=2000), bus.connect(uid=0)
    bus.send(plain, b"CMSG blocking/publisher/for\x002001")
    assert plain.owner == 1000 and b"only a trusted user" in bus.read(plain)[0]
    bus.send(trusted, b"CMSG blocking/publisher/for\x002001")
    bus.send(root, b"CMSG blocking/publisher/for\x00-1", b"CMSG blocking/publisher/for\x00x")
    assert trusted.owner == 2001 and root.owner == 0
    assert [p.split(b"\0")[1] for p in bus.read(root)] == [
        b"publishing for '-1': not a user number", b"publishing for 'x': not a user number"]
    bus.send(trusted, b"CMSG blocking/publisher/for")  # an empty payload: its own again
    assert trusted.owner == 2000
    named = Bus(limits=Limits(trusted=frozenset({"sbus-gateway"})),  # a DynamicUser=
                user_name=lambda uid: "sbus-gateway" if uid == 61_000 else None)
    gateway, stranger = named.connect(uid=61_000), named.connect(uid=61_001)
    named.send(gateway, b"CMSG blocking/publisher/for\x00%d" % (1 << 32))
    named.send(stranger, b"CMSG blocking/publisher/for\x00%d" % (1 << 32))
    assert gateway.owner == 1 << 32 and stranger.owner == 61_001
    bus.send(root, b"CMSG blocking/publisher/for\x002001")
    bus.send(root, b"CMSG broker/status")
    shown = json.loads(bus.read(root)[0].split(b"\0", 1)[1])["clients"]
    assert [c["publishing_for"] for c in shown] == [None, None, 2001]
    state = handover.decode(handover.encode(bus.core.snapshot()))
    assert [c.owner for c in state.clients] == [None, None, 2001]
    old = handover.msgpack.unpackb(handover.encode(state))  # a predecessor's 8 entries
    old[0], old[3] = "sbus-handover/2", [c[:8] for c in old[3]]
    assert [c.owner for c in handover.decode(handover.msgpack.packb(old)).clients] == \
        [None] * 3
