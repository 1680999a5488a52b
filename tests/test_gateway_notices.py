"""The gateway's notices (`sbus.gateway.notices`): a remote client subscribed to
``!/gateway/notices`` is told what it missed, and the counts add up, message by message.

Real processes throughout: a broker, `sbus gateway`, raw TCP clients; the faults are
real too (a client that does not read, a gateway stopped with SIGSTOP while the bus
floods it, a broker handing over with SIGUSR2).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BrokerProcess, raw, sync
from test_gateway import SECRET, GatewayProcess, roundtrip, subscribe_bridged

from sbus.gateway import codec, notices
from sbus.gateway.codec import FrameDecoder

N = notices.TOPIC


@pytest.fixture
def ndir():
    d = Path(tempfile.mkdtemp(prefix="sbus-gn-", dir="/tmp"))  # short: socket paths
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Tally:
    """What one remote client received: the numbers of its messages on *key*, in order,
    and the notices, read by a thread until `stop`."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock, self.key = sock, key
        self.numbers: list[int] = []
        self.notices: list[dict] = []
        self.others: list[object] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder = FrameDecoder()
        self.sock.settimeout(0.1)
        while not self._done.is_set():
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            for frame in decoder.feed(data):
                if type(frame) is codec.Publish and frame.topic == self.key \
                        and frame.body != b"probe":  # (a late one of `subscribed`'s)
                    self.numbers.append(int(frame.body.split(b" ")[0]))
                elif type(frame) is codec.Publish and frame.topic == N:
                    self.notices.append(notices.parse(frame.body))
                else:
                    self.others.append(frame)

    def count(self, event: str) -> int:
        return sum(n.get("count", 0) for n in self.notices if n["event"] == event)

    def accounted(self) -> int:
        return len(self.numbers) + self.count("discarded") + self.count("bus-dropped")

    def wait(self, total: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.accounted() < total and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def subscribed(gw: GatewayProcess, local: socket.socket, key: bytes,
               rcvbuf: int | None = None) -> socket.socket:
    """A remote client subscribed to the notices and to *key*, on the bus."""
    s = gw.connect(rcvbuf=rcvbuf)
    s.sendall(codec.subscribe(N))
    subscribe_bridged(s, key, local, key)
    return s


class Bus:
    """A broker, a gateway on it and a local raw client (`served`); what to close."""

    def __init__(self, ndir: Path, bus_args: tuple[str, ...], gw_args: tuple[str, ...]):
        self.address = str(ndir / "bus.sock")
        self.bus = BrokerProcess(self.address, *bus_args).start()
        self.gw = GatewayProcess(ndir, self.address, *gw_args).start()
        self.local = raw(self.address)
        self.held: list = []  # sockets and tallies
        self.log = ""  # the broker's, once stopped

    def keep(self, thing):
        self.held.append(thing)
        return thing


@contextlib.contextmanager
def served(ndir: Path, bus_args: tuple[str, ...] = (),
           gw_args: tuple[str, ...] = ()) -> Iterator[Bus]:
    b = Bus(ndir, bus_args, gw_args)
    try:
        yield b
    finally:
        for thing in reversed(b.held):
            (thing.stop if isinstance(thing, Tally) else thing.close)()
        b.local.close()
        b.gw.stop()
        b.log = b.bus.stop()


def publish(local: socket.socket, key: bytes, count: int, size: int) -> None:
    pad = b" " + b"x" * size
    for i in range(count):
        local.send(b"MSG " + key + b"\0%d" % i + pad)
    sync(local)


def test_each_notice_is_one_frame_on_the_topic_whose_body_parses_back():
    """Pure: the frames `notices` makes decode as publishes on `notices.TOPIC` (which the
    bus can never carry: a secret-looking key it refuses), and `parse` reads them back."""
    frames = FrameDecoder().feed(notices.discarded([3, 0, 2]) + notices.bus_away()
                                 + notices.bus_back(1.23456) + notices.bus_dropped(7))
    assert {f.topic for f in frames} == {N}
    assert [notices.parse(f.body) for f in frames] == [
        {"event": "discarded", "count": 5, "causes": {"own": 3, "pool": 2}},
        {"event": "bus-away"}, {"event": "bus-back", "away": 1.235},
        {"event": "bus-dropped", "count": 7}]
    from sbus.keys import KeyRefused, KeyRules
    with pytest.raises(KeyRefused):
        KeyRules(b"/").check_key(N)
    for junk in (b"[]", b"{}", b'{"event": 1}'):
        with pytest.raises(ValueError):
            notices.parse(junk)


def test_a_client_that_does_not_read_is_told_how_many_it_lost_to_the_message(ndir):
    """A client with a 10-message buffer reads nothing while 2,000 numbered messages come:
    what it then reads and what its notices say were discarded add up to 2,000 exactly
    (before: the gateway's log counted them; the client could not know)."""
    with served(ndir, gw_args=("--buffer-messages", "10")) as b:
        slow = b.keep(subscribed(b.gw, b.local, b"n/seq", rcvbuf=4096))
        publish(b.local, b"n/seq", 2000, 200)
        tally = b.keep(Tally(slow, b"n/seq"))  # reads from now on
        tally.wait(2000)
        print(f"read {len(tally.numbers)}, told discarded {tally.count('discarded')} in "
              f"{len(tally.notices)} notices")
        assert tally.accounted() == 2000, (len(tally.numbers), tally.notices)
        assert tally.numbers == sorted(tally.numbers)  # the survivors in order
        assert 10 <= len(tally.numbers) < 1000 and tally.count("discarded") > 1000
        assert {n["event"] for n in tally.notices} <= {"discarded", "bus-dropped"}
        assert all(sum(n["causes"].values()) == n["count"] for n in tally.notices)
        assert not tally.others


def test_what_the_broker_drops_for_a_stopped_gateway_is_told_and_adds_up(ndir):
    """The gateway stopped (SIGSTOP) while a local publisher floods its 64 KiB queue in
    the broker (``hard=discard``): the broker drops for it and reports the count, the
    gateway passes it on, and a prompt remote reader's messages plus its notices add
    up to every message published."""
    with served(ndir, bus_args=("--queue-limit", "64k")) as b:
        remote = b.keep(subscribed(b.gw, b.local, b"d/seq"))
        tally = b.keep(Tally(remote, b"d/seq"))
        os.kill(b.gw.proc.pid, signal.SIGSTOP)
        try:
            publish(b.local, b"d/seq", 5000, 300)
        finally:
            os.kill(b.gw.proc.pid, signal.SIGCONT)
        b.local.send(b"MSG d/seq\0%d" % 5000)  # the broker's report comes with what follows
        tally.wait(5001)
        print(f"read {len(tally.numbers)}, told bus-dropped {tally.count('bus-dropped')}, "
              f"discarded {tally.count('discarded')}")
        assert tally.accounted() == 5001, (len(tally.numbers), tally.notices)
        assert tally.count("bus-dropped") > 1000, tally.notices
        assert tally.numbers == sorted(tally.numbers) and tally.numbers[-1] == 5000
        assert not tally.others
        assert re.search(r"the broker dropped \d+ messages for the gateway", b.gw.log())


def test_a_hand_over_loses_nothing_and_says_nothing(ndir):
    """SIGUSR2: the broker re-executes itself and takes its connections over; the
    gateway's stays, nothing is missed, and a client subscribed to the notices gets none."""
    with served(ndir) as b:
        remote = b.keep(subscribed(b.gw, b.local, b"h/seq"))
        tally = b.keep(Tally(remote, b"h/seq"))
        b.bus.proc.send_signal(signal.SIGUSR2)
        for i in range(300):
            b.local.send(b"MSG h/seq\0%d" % i)
            time.sleep(0.002)
        tally.wait(300)
        time.sleep(0.3)
        assert tally.numbers == list(range(300)), tally.notices
        assert tally.notices == [] and not tally.others
        assert "lost the bus" not in b.gw.log()
    assert "took over" in b.log, b.log  # (a hand-over it was)


def test_a_client_far_behind_is_still_told_of_an_outage(ndir):
    """A client behind by its whole buffer, whose keep-alives' echoes fill the room that
    forced frames have (twice the message bound), is still told of an outage: the
    outage's notices have room of their own (before: neither came, and nothing said so,
    the audit of 2026-11-28)."""
    with served(ndir, gw_args=("--buffer-messages", "10")) as b:
        slow = b.keep(subscribed(b.gw, b.local, b"o/seq", rcvbuf=2048))
        publish(b.local, b"o/seq", 3000, 300)
        slow.sendall(b"\x00" * 100)  # an ordinary client's keep-alives while it is behind
        time.sleep(0.3)
        b.bus.proc.kill()
        b.bus.proc.wait()
        os.unlink(b.address)
        b.bus = BrokerProcess(b.address).start()
        b.gw.wait_log("the bus is back after", timeout=20)
        time.sleep(1.5)  # (the notices' next round)
        tally = b.keep(Tally(slow, b"o/seq"))
        tally.wait(3000)
        time.sleep(0.5)
        events = [n["event"] for n in tally.notices]
        assert "bus-away" in events and "bus-back" in events, events
        assert events.index("bus-away") < events.index("bus-back")
        assert tally.accounted() == 3000, (len(tally.numbers), tally.notices)


def test_publishes_a_killed_broker_took_are_counted_for_their_own_publisher(ndir):
    """The gateway confirms remote publishes with the broker a few times a second: when a
    broker killed with ``kill -9`` takes some with it (sent while it was stopped, never
    read), the gateway's log says how many at most, and each remote publisher subscribed
    to the notices is told its own count (``unconfirmed``) after ``bus-away``; one whose
    publishes were all confirmed is told none.  Numbered end to end: the local subscriber
    misses exactly the counted ones (before: nothing said them)."""
    with served(ndir) as b:
        sub = b.keep(raw(b.address))
        sub.send(b"SUB k/seq")
        sync(sub)
        quiet, busy = (b.keep(b.gw.connect()) for _ in range(2))
        for s in (quiet, busy):
            s.sendall(codec.subscribe(N) + codec.authenticate(SECRET))
            roundtrip(s)
        for i in range(100):
            (quiet if i % 2 else busy).sendall(codec.publish(b"k/seq", b"%d" % i))
        got = [int(sub.recv(100).split(b"\0")[1]) for _ in range(100)]
        assert sorted(got) == list(range(100))
        time.sleep(0.8)  # confirmed (a question every 0.25 s while publishes go)
        told = {s: b.keep(Tally(s, b"k/seq")) for s in (quiet, busy)}
        os.kill(b.bus.proc.pid, signal.SIGSTOP)
        for i in range(100, 150):  # into the stopped broker's socket: never read
            busy.sendall(codec.publish(b"k/seq", b"%d" % i))
        time.sleep(0.5)
        b.bus.proc.kill()
        b.bus.proc.wait()
        os.unlink(b.address)
        b.bus = BrokerProcess(b.address).start()
        log = b.gw.wait_log("connected to the bus at", timeout=20, times=2)
        sub = b.keep(raw(b.address))
        sub.send(b"SUB k/seq")
        sync(sub)
        for i in range(150, 200):
            busy.sendall(codec.publish(b"k/seq", b"%d" % i))
        after = [int(sub.recv(100).split(b"\0")[1]) for _ in range(50)]
        assert after == list(range(150, 200))  # the 50 in between: lost with the broker
        assert "up to 50 remote publish(es) of 1 client(s), sent since the broker last " \
               "confirmed, may be lost with the connection" in log, log
        time.sleep(1.5)  # (the notices' next round)
        busy_events = [n["event"] for n in told[busy].notices]
        assert busy_events[:3] == ["bus-away", "unconfirmed", "bus-back"], busy_events
        assert told[busy].count("unconfirmed") == 50
        assert [n["event"] for n in told[quiet].notices] == ["bus-away", "bus-back"]


def test_a_publisher_waiting_for_a_stopped_broker_leaves_its_address_served(ndir):
    """A publisher from one address floods while the broker is stopped (SIGSTOP): its
    run waits for room on the bus connection.  Another client of the same address (a
    NAT) still has its keep-alives echoed within a second, not after the outage (before:
    the waiting publisher held the address's turn, 5 s in the audit of 2026-11-28)."""
    from test_gateway import next_loopback
    with served(ndir) as b:
        source = next_loopback()
        flood, other = (b.keep(b.gw.connect(source=source)) for _ in range(2))
        flood.sendall(codec.authenticate(SECRET))
        roundtrip(flood)
        os.kill(b.bus.proc.pid, signal.SIGSTOP)
        try:
            frame = codec.publish(b"f/x", b"y" * 10_000)
            stop = time.monotonic() + 4

            def send() -> None:
                with contextlib.suppress(OSError):  # (held back, then closed by the test)
                    while time.monotonic() < stop:
                        flood.sendall(frame)

            threading.Thread(target=send, daemon=True).start()
            time.sleep(1.0)  # the bus connection full, the flood's run waiting for room
            took = []
            for _ in range(3):
                t0 = time.monotonic()
                roundtrip(other)
                took.append(time.monotonic() - t0)
                time.sleep(0.2)
        finally:
            os.kill(b.bus.proc.pid, signal.SIGCONT)
        assert max(took) < 1.0, took


def test_outages_past_the_notices_held_are_told_as_one_with_every_count():
    """Pure: a broker in a restart loop makes more outages in a notice round than are
    held (`NOTICES_HELD`); they are merged into one away, each client's summed counts and
    the last back, so no count is dropped and none comes after a back (the audit of
    2026-11-28 lost most of a flooder's counts with 20 ms restarts, and saw "B U B")."""
    import types

    from sbus.gateway.server import NOTICES_HELD, Gateway
    held = types.SimpleNamespace(_bus_notices=[])
    away = notices.bus_away()

    def kinds() -> str:
        return "".join("U" if type(x) is dict else {"bus-away": "A", "bus-back": "B"}[
            notices.parse(FrameDecoder().feed(x)[0].body)["event"]]
            for x in held._bus_notices)

    def total() -> Counter:
        counts: Counter = Counter()
        for x in held._bus_notices:
            if type(x) is dict:
                counts.update(x)
        return counts

    for i in range(50):
        Gateway._hold_notice(held, away)
        Gateway._hold_notice(held, {"a": 1, "b": i})
        Gateway._hold_notice(held, notices.bus_back(0.02))
        assert len(held._bus_notices) <= NOTICES_HELD
        assert re.fullmatch("(AUB)+", kinds()), kinds()
        assert total() == Counter({"a": i + 1, "b": sum(range(i + 1))})
    Gateway._hold_notice(held, away)  # away again at the round's end: no back after it
    assert re.fullmatch("(AUB)*AU?", kinds()), kinds()
    assert total()["a"] == 50
