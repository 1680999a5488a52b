"""The client library against a real broker: blocking, trio and asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import select
import signal
import socket
import threading
import time

import anyio
import pytest
import trio

from sbus import AsyncClient, Client, ConnectError, Dropped, Publish, SbusError
from sbus.errors import ConnectionLost, NoResponders, Refused
from sbus.keys import Credentials


def test_publish_subscribe_receive(broker):
    with Client(broker.address) as sub, Client(broker.address) as pub:
        sub.subscribe("news/*")
        sub.whoami()  # round trip: the subscription is in place
        pub.publish("news/today", b"\0binary\xff")
        pub.publish(b"other", b"no")
        assert sub.receive(timeout=5) == Publish(b"news/today", b"\0binary\xff")
        with pytest.raises(TimeoutError):
            sub.receive(timeout=0.2)


def test_whoami_is_real_credentials_and_keeps_messages(broker):
    with Client(broker.address) as c:
        c.subscribe(b"self")
        c.publish(b"self", b"before whoami")
        assert c.credentials() == Credentials(os.getgid(), os.getuid(), os.getpid())
        assert c.receive(timeout=5) == Publish(b"self", b"before whoami")  # not lost


def test_fileno_works_with_select_and_flags_pass_through(broker):
    with Client(broker.address) as c:
        c.subscribe(b"k")
        c.whoami()
        assert select.select([c], [], [], 0.1)[0] == []
        c.publish(b"k", b"v", flags=socket.MSG_DONTWAIT)
        assert select.select([c], [], [], 5)[0] == [c]
        assert c.recv_packet(socket.MSG_PEEK) == b"MSG k\0v"  # peeked, still there
        assert list(c.receive_ready()) == [Publish(b"k", b"v")]
        with pytest.raises(BlockingIOError):
            c.recv_packet(socket.MSG_DONTWAIT)
        with pytest.raises(BlockingIOError):  # a select loop's reader (the MQTT bridge)
            c.receive(None, socket.MSG_DONTWAIT)
        c.publish(b"k", b"w")
        c.sync()
        assert c.receive(None, socket.MSG_DONTWAIT) == Publish(b"k", b"w")


def test_select_tells_the_truth_after_receive_and_sync(broker):
    """`receive` and `sync` leave what follows in the connection, so select on the client
    still sees it (a batch read would have taken it out of sight)."""
    with Client(broker.address) as c, Client(broker.address) as pub:
        c.subscribe(b"k")
        pub.publish(b"k", b"0")
        pub.sync()
        c.sync()  # "0" came before the answer: kept for receive
        for i in range(1, 4):
            pub.publish(b"k", b"%d" % i)
        pub.sync()
        assert c.receive(timeout=5).payload == b"0"
        for i in range(1, 4):
            assert select.select([c], [], [], 5)[0] == [c]  # the rest is still unread
            assert c.receive(timeout=5).payload == b"%d" % i
        assert select.select([c], [], [], 0.1)[0] == []


def test_iteration_skips_control_messages(make_broker):
    broker = make_broker("--queue-limit", "1k")
    with Client(broker.address) as c, Client(broker.address) as pub:
        c.subscribe(b"k")
        c.set_flood(soft="discard")
        c.whoami()
        for i in range(3000):
            pub.publish(b"k", b"%d" % i)
        pub.whoami()
        # the notice follows once this reader has made room: read until it comes
        event = c.receive(timeout=5)
        while not isinstance(event, Dropped):
            event = c.receive(timeout=5)
        assert event.count > 0 and c.dropped >= event.count
        c.publish(b"k", b"last")
        for msg in c:
            assert isinstance(msg, Publish)
            if msg.payload == b"last":
                break


def test_connect_error_names_address(short_tmp):
    missing = str(short_tmp / "nobody.sock")
    with pytest.raises(ConnectError, match=f"cannot connect to the sbus broker at {missing}"):
        Client(missing)


def test_closed_connection_is_an_error(broker):
    c = Client(broker.address)
    broker.stop()
    with pytest.raises(SbusError, match="closed the connection"):
        c.receive(timeout=5)


def test_a_reset_connection_is_closed_too(broker):
    """A broker that ends with packets of ours unread resets the connection (ECONNRESET,
    as under load) instead of an end of file: the same error, the same words."""
    c = Client(broker.address)
    c.whoami()
    os.kill(broker.proc.pid, signal.SIGSTOP)
    for _ in range(10):
        c.publish(b"unread", b"x")  # waits in the stopped broker's receive queue
    os.kill(broker.proc.pid, signal.SIGKILL)
    broker.proc.wait()
    with pytest.raises(SbusError, match="closed the connection"):
        c.receive(timeout=5)


async def _roundtrip(address: str) -> list:
    async with await AsyncClient.connect(address) as sub:
        await sub.subscribe("a/")
        await sub.set_flood(hard="block")
        who = await sub.whoami()
        async with await AsyncClient.connect(address) as pub:
            for i in range(50):
                await pub.publish(f"a/{i}", b"x" * i)
        got = []
        async for msg in sub:
            got.append(msg)
            if len(got) == 50:
                break
        return [who, got]


def test_async_client_under_trio(broker):
    who, got = trio.run(_roundtrip, broker.address)
    assert who == Credentials(os.getgid(), os.getuid(), os.getpid()).path()
    assert got == [Publish(b"a/%d" % i, b"x" * i) for i in range(50)]


def test_async_client_under_asyncio(broker):
    who, got = asyncio.run(_roundtrip(broker.address))
    assert got == [Publish(b"a/%d" % i, b"x" * i) for i in range(50)]


def _party_b(address: str) -> None:
    """B, in its own process: answers A's proof of identity as the protocol text shows."""
    code = 1
    try:
        with Client(address) as b:
            b.subscribe(b"!/cred////")
            b.subscribe(b"hello")
            b_cred = b.whoami()
            a_cred = b.receive(timeout=10).payload  # A sent its credentials
            b.publish(a_cred + b"/from-b", b_cred)  # B: B's credentials, private to A
            challenge = b.receive(timeout=10)  # A: random message private to B
            while challenge.key == b"hello":  # A may have said hello more than once
                challenge = b.receive(timeout=10)
            assert challenge.key == b_cred + b"/challenge"
            b.publish(a_cred + b"/answer", challenge.payload)  # B: send it back, private to A
            code = 0
    finally:
        os._exit(code)


def test_identity_proof_from_the_protocol_text(broker):
    """Two processes prove their identities to each other with private keys."""
    with Client(broker.address) as a, Client(broker.address) as probe:
        a.subscribe(b"!/cred////")
        a_cred = a.whoami()
        pid = os.fork()
        if pid == 0:
            _party_b(broker.address)
        probe.subscribe(b"hello")
        for _ in range(200):  # until B is subscribed to hello (it starts late)
            a.publish(b"hello", a_cred)
            msg = a.receive(timeout=0.05) if select.select([a], [], [], 0.05)[0] else None
            if msg is not None:
                break
        assert msg.key == a_cred + b"/from-b"
        b_cred = msg.payload
        assert Credentials.parse(b_cred).pid == pid  # B's kernel-verified identity
        nonce = os.urandom(16)
        a.publish(b_cred + b"/challenge", nonce)
        assert a.receive(timeout=10) == Publish(a_cred + b"/answer", nonce)
        _, status = os.waitpid(pid, 0)
        assert status == 0


def test_a_batch_of_large_messages_arrives_whole(broker):
    """Many 200 KB messages waiting at once are taken in one batch, each whole (one
    slot per packet), and the batch's pages are handed back after."""
    with Client(broker.address) as sub, Client(broker.address) as pub:
        sub.set_flood(soft="queue", hard="block")
        sub.subscribe(b"big")
        payloads = [bytes([i]) * 200_000 for i in range(8)]
        for p in payloads:
            pub.publish(b"big", p)
        pub.sync()
        got: list[bytes] = []
        while len(got) < len(payloads):
            got.extend(ev.payload for ev in sub.receive_batch(timeout=5))
        assert got == payloads


# -- the shells across reconnects, refusals and fast readers ---------------------------


def _status(address: str) -> dict:
    with Client(address) as probe:
        probe.control(b"broker/status")
        return json.loads(probe.receive(timeout=5).payload)


def _patterns(address: str) -> tuple[list[list[str]], int]:
    """Each client's patterns, and how many subscriptions the broker holds (repeats
    counted)."""
    st = _status(address)
    return (sorted(sorted(c["patterns"]) for c in st["clients"] if c["patterns"]),
            st["broker"]["subscriptions"])


def test_a_subscription_sent_across_a_reconnect_is_held_once(broker):
    """SUB/UNSUB that fail because the broker went away are not sent again after the
    reconnect: the reopening already restored the session's patterns (the broker would
    otherwise hold the new pattern twice, and refuse an UNSUB of one it never had)."""
    with Client(broker.address, reconnect=True, on_connection=lambda up, line: None) as bus:
        bus.subscribe(b"a/")
        bus.subscribe(b"c/")
        broker.stop()
        broker.start()
        bus.subscribe(b"b/")  # the send fails: reconnects, then must not send it again
        broker.stop()
        broker.start()
        bus.unsubscribe(b"c/")
        bus.sync()  # no refusal of an UNSUB of a pattern the new connection never had
        assert _patterns(broker.address) == ([["a/", "b/"]], 2)


def test_a_call_that_gave_up_on_a_reconnect_leaves_the_client_usable(broker):
    """`request` and `sync` give up on a broker that does not come back within their
    timeout (`ConnectionLost`, in about that time: sync once waited on for good); the
    client then reconnects at its next use (it was left without a socket: every later
    call failed with an AttributeError)."""
    with contextlib.ExitStack() as stack:
        bus = stack.enter_context(Client(broker.address, reconnect=True,
                                         on_connection=lambda up, line: None))
        bus.subscribe(b"a/")
        broker.stop()
        for call in (lambda: bus.request(b"x/y", timeout=1.0), lambda: bus.sync(1.0)):
            started = time.monotonic()
            with pytest.raises(ConnectionLost, match="did not come back in time"):
                call()
            assert time.monotonic() - started < 3
        broker.start()
        other = stack.enter_context(Client(broker.address))
        bus.publish(b"z", b"reconnects here")
        bus.sync()
        assert _patterns(broker.address)[0] == [["a/"]]  # restored by the reconnect
        other.publish(b"a/b", b"after")
        assert bus.receive(timeout=5) == Publish(b"a/b", b"after")


def test_an_infinite_timeout_is_no_limit(broker):
    """``math.inf`` anywhere a timeout is taken waits as long as it takes (poll and
    ``settimeout`` refused it: OverflowError)."""
    with Client(broker.address, timeout=math.inf) as bus, Client(broker.address) as sub:
        sub.subscribe(b"a")
        bus.publish(b"a", b"x")
        bus.sync(math.inf)
        assert sub.receive(timeout=math.inf) == Publish(b"a", b"x")
        with pytest.raises(NoResponders):
            bus.request(b"nobody/here", timeout=math.inf)


def test_an_async_request_that_gave_up_leaves_the_client_usable(broker):
    """The same for `AsyncClient`: it said "not connected: use 'async with'" inside its
    own ``async with`` after a request gave up."""
    async def main() -> None:
        async with AsyncClient(broker.address, reconnect=True,
                               on_connection=lambda up, line: None) as bus:
            await bus.subscribe(b"a/")
            broker.stop()
            started = time.monotonic()
            with pytest.raises(ConnectionLost, match="did not come back in time"):
                await bus.request(b"x/y", timeout=1.0)
            assert time.monotonic() - started < 3
            broker.start()
            await bus.publish(b"z", b"reconnects here")
            await bus.sync()
            assert _patterns(broker.address)[0] == [["a/"]]
    trio.run(main)


def test_a_reconnect_cancelled_and_taken_up_again_does_not_say_a_call_gave_up(broker):
    """A publish that waits for a reconnect and is cancelled (the FUSE mount tries 50 ms,
    then waits in a pool), then a publish that goes on: its line said "was not back
    when an earlier call gave up waiting", though nothing gave up (the audit of
    2026-11-27: 28 of 28 restarts under a writing mount).  It is said again (the
    gateway learns from it that the socket changed), as the same outage."""
    lines: list[tuple[bool, str]] = []

    async def main() -> None:
        async with AsyncClient(broker.address, reconnect=True,
                               on_connection=lambda up, line: lines.append((up, line))
                               ) as bus:
            broker.stop()
            with trio.move_on_after(0.05) as quick:
                await bus.publish(b"k", b"first")
            assert quick.cancelled_caught
            broker.start()
            await bus.publish(b"k", b"second")
            await bus.sync()
    trio.run(main)
    assert [up for up, _ in lines] == [False, False, True], lines
    assert "gave up" not in lines[1][1] and "still away" in lines[1][1], lines


def test_async_subscription_across_a_reconnect_is_held_once(broker):
    async def main() -> None:
        async with AsyncClient(broker.address, reconnect=True,
                               on_connection=lambda up, line: None) as bus:
            await bus.subscribe(b"a/")
            broker.stop()
            broker.start()
            await bus.subscribe(b"b/")
            assert _patterns(broker.address) == ([["a/", "b/"]], 2)
    trio.run(main)


def test_confirmed_reads_leave_what_was_not_dealt_with_to_the_process_that_adopts(broker):
    """With *confirm_reads*, what a receive returned stays on the socket until the next
    receive or `confirm_reads`: a client that stops without confirming (a process
    killed) leaves it to the one that adopts the connection, which receives it again
    and counts it in `read_again`; what was confirmed is not received twice; what a
    sync kept for the next receive is not taken off by a confirm before it is given."""

    async def main() -> tuple[list[bytes], int]:
        async with AsyncClient(broker.address) as pub:
            first = AsyncClient(broker.address, confirm_reads=True)
            await first.open()
            await first.subscribe(b"k/")
            await pub.publish(b"k/a", b"1")
            await pub.publish(b"k/a", b"2")
            await pub.sync()
            await first.sync()  # reads both before its answer: kept
            first.confirm_reads()  # not given yet: nothing taken
            assert [e.payload for e in await first.receive_batch()] == [b"1", b"2"]
            first.confirm_reads()  # dealt with
            for n in (3, 4, 5):
                await pub.publish(b"k/a", b"%d" % n)
            await pub.sync()
            with trio.fail_after(5):
                got = []
                while len(got) < 3:
                    got += [e.payload for e in await first.receive_batch()]
            assert got == [b"3", b"4", b"5"]  # given, never confirmed: then "killed"
            left = socket.socket(fileno=os.dup(first.sock.fileno()))
            first.sock.close()
            await pub.publish(b"k/a", b"6")
            await pub.sync()
            second = AsyncClient(broker.address, confirm_reads=True)
            await second.adopt(left, [b"k/"])
            again: list[bytes] = []
            with trio.fail_after(5):
                while len(again) < 4:
                    again += [e.payload for e in await second.receive_batch()
                              if type(e) is Publish]
            n = second.read_again
            await second.aclose()
            return again, n

    assert trio.run(main) == ([b"3", b"4", b"5", b"6"], 3)


def test_receive_packets_returns_what_sync_kept(broker):
    """Messages read while waiting for the barrier (`sync`, a reconnect's opening) are
    kept in the shell: `receive_packets` returns them first, as packets, not never."""
    with Client(broker.address) as sub, Client(broker.address) as pub:
        sub.subscribe(b"k")
        pub.publish(b"k", b"one")
        pub.publish(b"k", b"two")
        pub.sync()
        sub.sync()  # reads both messages before the whoami answer: kept
        pub.publish(b"k", b"three")
        got: list[bytes] = []
        while len(got) < 3:
            got += sub.receive_packets(timeout=2)
        assert got == [b"MSG k\0one", b"MSG k\0two", b"MSG k\0three"]

    async def main() -> list[bytes]:
        async with AsyncClient(broker.address) as sub, AsyncClient(broker.address) as pub:
            await sub.subscribe(b"k")
            await pub.publish(b"k", b"one")
            await pub.sync()
            await sub.sync()
            with trio.fail_after(2):
                return await sub.receive_packets()
    assert trio.run(main) == [b"MSG k\0one"]


def test_receive_batch_raises_a_refusal_that_arrives_alone(broker):
    """A batch holding only a refusal does not leave `receive_batch` waiting: it raises
    (or, with *on_refusal*, says it there); a fast reader's next call raises it too."""
    with Client(broker.address) as bus:
        bus.subscribe(b"!/cred/0/0/1/", wait=False)
        with pytest.raises(Refused, match="names PID 1"):
            bus.receive_batch(timeout=5)
        bus.subscribe(b"!/cred/0/0/1/", wait=False)
        bus.receive_frames(timeout=5)  # the refusal's batch: taken in, raised next
        with pytest.raises(Refused, match="names PID 1"):
            bus.receive_frames(timeout=5)
    said = []
    with Client(broker.address, on_refusal=said.append) as bus:
        bus.subscribe(b"!/cred/0/0/1/", wait=False)
        with pytest.raises(TimeoutError):
            bus.receive_batch(timeout=1)
        assert [r.verb for r in said] == ["sub"]

    async def main() -> None:
        async with AsyncClient(broker.address) as bus:
            await bus.subscribe(b"!/cred/0/0/1/", wait=False)
            with trio.fail_after(5), pytest.raises(Refused, match="names PID 1"):
                await bus.receive_batch()
    trio.run(main)


def test_receive_frames_hands_messages_and_takes_in_the_rest(make_broker):
    """`receive_frames`: the messages as the buffer holds them; a drop report among them
    counted by the session (and *on_drop*), a whoami answer consumed."""
    broker = make_broker("--queue-limit", "64k")
    drops: list[int] = []
    with Client(broker.address, on_drop=drops.append) as sub, Client(broker.address) as pub:
        sub.subscribe(b"k")
        sent = [b"%d" % i + bytes(4000) for i in range(100)]  # beyond the queue limit
        for p in sent:
            pub.publish(b"k", p)
        pub.sync()
        sub.control(b"!/cred/whoami")
        pub.publish(b"k", b"last")
        pub.sync()
        got: list[bytes] = []
        others: list = []
        # the drop report comes when the subscriber's queue runs empty: before "last"
        # or, if "last" was queued when it ran empty, after it
        while b"last" not in got or sub.dropped < len(sent) + 1 - len(got):
            frames = sub.receive_frames(timeout=5)
            assert not frames.kept
            b = frames.batch
            for i in range(frames.count):
                if i in frames.others:
                    others.append(frames.others[i])
                else:
                    packet = b.buffer[b.offsets[i]:b.offsets[i] + b.lengths[i]]
                    got.append(packet[len(b"MSG k\0"):])
        lost = len(sent) + 1 - len(got)
        assert lost > 0 and sum(drops) == sub.dropped == lost
        assert None in others  # the whoami answer, consumed
        assert [e for e in others if e is not None] and all(
            type(e) is Dropped for e in others if e is not None)
        assert got == [p for p in sent if p in got] + [b"last"]
        # an idle wait ends at its timeout; a plain receive after it still waits as long
        # as it takes (the socket's receive timeout is the fast reader's only)
        with pytest.raises(TimeoutError):
            sub.receive_frames(timeout=0.2)
        later = threading.Timer(0.5, lambda: pub.publish(b"k", b"later"))
        later.start()
        assert sub.receive() == Publish(b"k", b"later")
        later.join()


def _socket_fds() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
               for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))


async def _two_tasks_across_a_restart(broker) -> tuple[int, int, int]:
    """A sending and a receiving task of one client both notice the broker go: one
    reconnect, one connection, both go on."""
    async with AsyncClient(broker.address, reconnect=True,
                           on_connection=lambda up, line: None) as bus:
        await bus.subscribe(b"echo")
        before = _socket_fds()
        got: list[bytes] = []
        async with anyio.create_task_group() as tasks:
            async def send() -> None:
                n = 0
                while True:
                    n += 1
                    await bus.publish(b"echo", b"%d" % n)
                    await anyio.sleep(0.005)

            tasks.start_soon(send)
            while len(got) < 5:
                got += [ev.payload for ev in await bus.receive_batch()]
            broker.stop()
            broker.start()
            with anyio.fail_after(20):
                target = len(got) + 20
                while len(got) < target:
                    got += [ev.payload for ev in await bus.receive_batch()]
            tasks.cancel_scope.cancel()
        clients = _status(broker.address)["broker"]["clients"]  # ours and the probe's
        return bus.connections, _socket_fds() - before, clients


def test_two_tasks_reconnect_once(broker):
    assert trio.run(_two_tasks_across_a_restart, broker) == (2, 0, 2)
    assert asyncio.run(_two_tasks_across_a_restart(broker)) == (2, 0, 2)


def test_a_message_too_large_to_receive_whole_is_a_counted_drop_never_a_cut_message(
        make_broker):
    """A broker with a larger --max-message forwards packets over the client's receive
    slot; the kernel would cut them to it.  Every way of receiving reports a drop of one
    instead (and counts it in ``cut``): no reader ever gets a cut message as if whole."""
    from conftest import raw

    from sbus.client import SLOT_BYTES

    broker = make_broker("--max-message", "4M")
    big = b"MSG big\0" + b"x" * 2_000_000
    drops: list[int] = []
    with Client(broker.address, on_drop=drops.append) as c:
        c.subscribe(b"big")
        c.subscribe(b"after")
        pub = raw(broker.address)
        pub.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        for way in ("receive", "receive_batch", "receive_packets"):
            pub.send(big)
            pub.send(b"MSG after\0" + way.encode())
            got: list = []
            while not any(type(e) is Publish for e in got):
                if way == "receive":
                    got.append(c.receive(timeout=10))
                elif way == "receive_batch":
                    got += c.receive_batch(timeout=10)
                else:
                    got += [c.session.receive(p) for p in c.receive_packets(timeout=10)]
            assert all(type(e) is not Publish or len(e.payload) < SLOT_BYTES for e in got)
            assert [e for e in got if type(e) is Publish] == [Publish(b"after", way.encode())]
            assert Dropped(1) in got, (way, got)
        assert c.cut == 3 and c.cut_key == b"big"
        assert drops[:2] == [1, 1]  # receive_packets' caller takes its own report in


def test_skip_again_takes_what_was_left_off_unread_and_counts_its_drop_reports():
    """What an earlier process left unconfirmed, skipped instead of read again: its
    messages counted in the return, its drop reports as drop reports (*on_drop*), and
    nothing past it taken."""
    from sbus.packetio import start_peeking

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for packet in (b"MSG k/a\0one", b"CMSG blocking/dropped\x005", b"MSG k/a\0" + b"x" * 500,
                   b"MSG k/a\0two", b"MSG k/a\0after"):
        a.send(packet)
    start_peeking(b.fileno())  # the earlier process read four of them, and died
    for _ in range(4):
        b.recv(1024, socket.MSG_PEEK)
    drops: list[int] = []

    async def main() -> int:
        bus = AsyncClient("/nonexistent", confirm_reads=True, on_drop=drops.append)
        await bus.adopt(b, [])
        assert bus.rereading
        skipped = bus.skip_again()
        assert not bus.rereading and bus.dropped == 5
        return skipped

    assert trio.run(main) == 3 and drops == [5]
    assert b.recv(1024) == b"MSG k/a\0after"  # the one it had not read: still there
    a.close()
    b.close()


def test_a_message_cut_to_its_slot_under_confirmed_reads_is_one_drop(make_broker):
    """Read with ``MSG_PEEK`` (*confirm_reads*), the kernel moves the peek offset by what
    it copied: the rest of a cut message would come as packets of its own, and taking
    the batch off the socket would take a message more than was read.  It is one drop;
    the messages around it arrive whole, once, and nothing stays on the socket."""
    from conftest import raw

    broker = make_broker("--max-message", "4M")

    async def main() -> list:
        bus = AsyncClient(broker.address, confirm_reads=True)
        await bus.open()
        await bus.subscribe(b"k/")
        pub = raw(broker.address)
        pub.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        for packet in (b"MSG k/a\0before", b"MSG k/big\0" + b"x" * 2_000_000,
                       b"MSG k/a\0after", b"MSG k/a\0" + b"y" * 1_200_000, b"MSG k/a\0end"):
            pub.send(packet)
        got: list = []
        with trio.fail_after(10):
            while Publish(b"k/a", b"end") not in got:
                got += await bus.receive_batch()
                bus.confirm_reads()
        pub.send(b"MSG k/a\0later")
        with trio.fail_after(10):
            got += await bus.receive_batch()
        bus.confirm_reads()
        assert bus._peeked == 0
        with pytest.raises(BlockingIOError):
            bus.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        assert bus.cut == 2
        await bus.aclose()
        pub.close()
        return got

    assert trio.run(main) == [Publish(b"k/a", b"before"), Dropped(1), Publish(b"k/a", b"after"),
                              Dropped(1), Publish(b"k/a", b"end"), Publish(b"k/a", b"later")]


def test_send_packets_sends_every_packet_in_order_past_a_full_socket(broker):
    """`AsyncClient.send_packets` (one sendmmsg per run): 20,000 numbered packets, far more
    than the socket buffer holds while the subscriber is not reading, all arrive, once,
    in order; `receive_packets_ready` takes what waits and says [] when nothing does."""
    count = 20000

    async def main() -> list[bytes]:
        async with AsyncClient(broker.address) as sub, AsyncClient(broker.address) as pub:
            await sub.subscribe(b"n")
            await sub.set_flood(hard="block")
            await sub.sync()
            assert sub.receive_packets_ready() == []
            packets = [pub.session.publish(b"n", b"%d" % i) for i in range(count)]
            got: list[bytes] = []
            async with trio.open_nursery() as nursery:
                async def send() -> None:
                    for start in range(0, count, 500):
                        await pub.send_packets(packets[start:start + 500])
                nursery.start_soon(send)
                with trio.fail_after(30):
                    while len(got) < count:
                        ready = sub.receive_packets_ready()
                        got += ready or await sub.receive_packets()
            return got

    got = trio.run(main)
    assert got == [b"MSG n\0%d" % i for i in range(count)]


@pytest.mark.parametrize("how", ["one", "batch"])
def test_what_a_killed_broker_delivered_is_read_before_its_loss(broker, how):
    """The broker dies (kill -9) with a packet of ours unread: the kernel reports the
    close as a reset once, before the messages it had delivered, which are still there.
    They are received, then the loss is said (they were lost unsaid before)."""
    sub = Client(broker.address)
    sub.subscribe("k/")
    with Client(broker.address) as pub:
        for i in range(20):
            pub.publish("k/x", b"%d" % i)
        pub.whoami()
    deadline = time.monotonic() + 10
    while len(select.select([sub], [], [], 0)[0]) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(broker.proc.pid, signal.SIGSTOP)
    sub.publish("never/read", b"")  # a packet of ours, unread when it dies
    broker.proc.kill()
    broker.proc.wait()
    got = []
    with pytest.raises(ConnectionLost):
        while True:
            if how == "one":
                got.append(sub.receive(timeout=5))
            else:
                got += sub.receive_batch(timeout=5)
    assert got == [Publish(b"k/x", b"%d" % i) for i in range(20)]
    sub.close()
