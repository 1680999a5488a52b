"""PacketBatch: recvmmsg/sendmmsg over real SEQPACKET socket pairs."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import struct
import threading
import time

import pytest

from sbus.core import BrokerCore
from sbus.keys import Credentials
from sbus.packetio import (
    SO_PEEK_OFF,
    PacketBatch,
    PacketSender,
    discard,
    start_peeking,
    take_heads,
)


@pytest.fixture
def pairs():
    made = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    yield made
    for a, b in made:
        a.close()
        b.close()


def test_receive_copy_and_send_runs(pairs):
    (a, b), (c, d) = pairs
    batch = PacketBatch(8, 101)
    with pytest.raises(BlockingIOError):
        batch.receive(b.fileno())
    packets = [b"p%d\0" % i * (i + 1) for i in range(10)]
    for p in packets:
        a.send(p)
    assert batch.receive(b.fileno()) == 8
    assert batch.lengths == [len(p) for p in packets[:8]]
    assert [batch.copy(i) for i in range(8)] == packets[:8]
    assert batch.send(c.fileno(), 2, 3) == 3
    assert batch.send(c.fileno(), 7, 1) == 1
    assert [d.recv(200) for _ in range(4)] == packets[2:5] + packets[7:8]
    assert batch.receive(b.fileno()) == 2  # the rest, into the same slots
    assert [batch.copy(i) for i in range(2)] == packets[8:]
    assert batch.send(c.fileno(), 0, 2) == 2  # lengths are the new packets' lengths
    assert [d.recv(200) for _ in range(2)] == packets[8:]



def test_heads_read_the_start_of_each_packet_in_one_call(pairs):
    """`heads` (the broker's check that a batch is one key throughout) reads the slots'
    first bytes; a second layout (another size or count) is cached beside the first."""
    (a, b), _ = pairs
    batch = PacketBatch(8, 101)
    packets = [b"MSG k.%d\0" % (i % 3) + b"x" * i for i in range(6)]
    for p in packets:
        a.send(p)
    assert batch.receive(b.fileno()) == 6
    assert batch.heads(1, 6, 7) == tuple(p[:7] for p in packets[1:6])
    assert batch.heads(0, 2, 4) == (b"MSG ", b"MSG ")
    assert batch.heads(3, 5, 7) == (b"MSG k.0", b"MSG k.1")


def test_the_one_key_check_does_not_read_what_a_slot_held_before(pairs):
    """A packet shorter than the batch's head leaves the end of the previous head in its
    slot: the core's one-key check must look at lengths, not only at the slots' bytes."""
    (pub, b), (sub, d) = pairs
    core = BrokerCore(os.write, lambda link: False)
    batch = PacketBatch(4, 101)
    replies, answers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    publisher = core.connect(Credentials(gid=1, uid=1, pid=1), replies.fileno())
    target = core.connect(Credentials(gid=1, uid=1, pid=2), sub.fileno())
    core.subscribe(target, b"k")
    d.setblocking(False)
    for packets in ([b"MSG k\0%d" % i for i in range(4)],
                    [b"MSG k\0a", b"MSG ", b"MSG k\0b", b"MSG k\0c"],  # slot 1 held "k\01"
                    [b"MSG k\0d", b"MSG k", b"MSG k", b"MSG k"],  # one size, each short of "\0"
                    [b"MSG k\0" + b"x" * 95, b"MSG k\0y"]):  # sizes differ: min and max
        for p in packets:
            pub.send(p)
        core.receive(publisher, batch, batch.receive(b.fileno()))
        got = []
        while True:
            try:
                got.append(d.recv(200))
            except BlockingIOError:
                break
        assert got == [p for p in packets if p not in (b"MSG ", b"MSG k")]
    assert core.published == 10
    for _ in range(4):  # the 4-byte "MSG ", and three "MSG k" without the key's end
        assert answers.recv(200).startswith(b"CMSG refused/packet\0")
    replies.close()
    answers.close()

def test_oversized_packet_is_cut_to_the_slot(pairs):
    (a, b), _ = pairs
    batch = PacketBatch(2, 101)
    a.send(b"x" * 500)
    assert batch.receive(b.fileno()) == 1
    assert batch.lengths == [101]  # one more than 100: the caller can tell it was too big


def test_end_of_file_reads_as_empty_packets(pairs):
    (a, b), _ = pairs
    batch = PacketBatch(4, 64)
    a.send(b"last")
    a.close()
    assert batch.receive(b.fileno()) == 4
    assert batch.lengths == [4, 0, 0, 0]


def test_peeks_go_on_where_the_last_ended_until_discard_takes_them_off(pairs):
    """A peek leaves the packets on the socket and the next peek reads on after them;
    `discard` takes the first ones off unread (the peek offset follows); a new process's
    `start_peeking` reads from the first packet again, whatever the offset was."""
    (a, b), _ = pairs
    for i in range(10):
        a.send(b"p%d" % i)
    batch = PacketBatch(4, 64)
    start_peeking(b.fileno())
    assert batch.receive(b.fileno(), peek=True) == 4
    assert batch.receive(b.fileno(), limit=3, peek=True) == 3
    assert batch.copy(0) == b"p4" and batch.copy(2) == b"p6"
    assert b.getsockopt(socket.SOL_SOCKET, SO_PEEK_OFF) == 14  # 7 packets of 2 bytes
    assert discard(b.fileno(), 5) == 5  # p0..p4: off, unread
    assert b.getsockopt(socket.SOL_SOCKET, SO_PEEK_OFF) == 4  # p5, p6 still peeked
    assert batch.receive(b.fileno(), peek=True) == 3 and batch.copy(0) == b"p7"
    with pytest.raises(BlockingIOError):
        batch.receive(b.fileno(), peek=True)  # all peeked: nothing new
    start_peeking(b.fileno())  # as a process that takes the socket over
    assert batch.receive(b.fileno(), peek=True) == 4 and batch.copy(0) == b"p5"
    assert discard(b.fileno(), 100) == 5  # fewer waited: all of them, no error
    with pytest.raises(BlockingIOError):
        batch.receive(b.fileno())


def test_take_heads_takes_packets_off_until_the_bytes_are_covered(pairs):
    """What an earlier reader left unconfirmed (its peek offset, in bytes) taken off
    unread: whole packets, however long, their first bytes returned; no more."""
    (a, b), _ = pairs
    for packet in (b"MSG a\0" + b"x" * 5000, b"CMSG q\0", b"MSG b\0", b"MSG c\0"):
        a.send(packet)
    assert take_heads(b.fileno(), 5006 + 7) == [b"MSG ", b"CMSG"]
    assert take_heads(b.fileno(), 1, size=6) == [b"MSG b\0"]  # one byte: a whole packet
    assert b.recv(64) == b"MSG c\0"
    assert take_heads(b.fileno(), 100) == []  # nothing waits: no more, no error


def test_send_reports_a_full_buffer_and_a_gone_peer(pairs):
    (a, b), (c, d) = pairs
    batch = PacketBatch(32, 1025)
    for _ in range(32):
        a.send(b"y" * 1024)
    batch.receive(b.fileno())
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sent = 0
    while (k := batch.send(c.fileno(), 0, 32)) > 0:
        sent += k
    assert 0 < sent < 32 * 50  # the kernel took some, then would have blocked: 0, no error
    d.close()
    with pytest.raises(ConnectionError):  # reset: it left unread packets behind
        batch.send(c.fileno(), 0, 1)


def test_release_hands_the_pages_back(pairs):
    (a, b), _ = pairs
    batch = PacketBatch(2, 100_001)
    a.send(b"z" * 100_000)
    batch.receive(b.fileno())
    assert batch.copy(0) == b"z" * 100_000
    batch.release()
    assert batch.buffer[:100_000] == bytes(100_000)  # fresh zero pages: nothing kept


def test_trim_keeps_the_packets_and_hands_back_the_rest(pairs):
    """A batch kept aside for a fan-out holds its packets' pages only, not what larger
    packets received into it before left resident."""
    (a, b), _ = pairs
    batch = PacketBatch(3, 100_001)
    for _ in range(3):
        a.send(b"z" * 100_000)
    batch.receive(b.fileno())
    for i in range(2):
        a.send(b"small %d" % i)
    assert batch.receive(b.fileno()) == 2
    batch.trim(2)
    assert [batch.copy(0), batch.copy(1)] == [b"small 0", b"small 1"]
    for at in (0, 100_001):
        # its own page and the one it shares with the next slot, at most
        assert batch.buffer[at + 7:at + 100_000].count(b"z") < 2 * mmap.PAGESIZE
    assert batch.buffer[200_002:300_003] == bytes(100_001)  # an unused slot: all back


def test_waiting_receive_times_out_takes_a_batch_and_yields_to_signals(pairs):
    (a, b), _ = pairs
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 0, 50_000))
    batch = PacketBatch(8, 64)
    started = time.monotonic()
    with pytest.raises(BlockingIOError):  # nothing came within the receive timeout
        batch.receive(b.fileno(), wait=True)
    assert time.monotonic() - started >= 0.04
    sender = threading.Timer(0.05, lambda: [a.send(b"p%d" % i) for i in range(3)])
    sender.start()
    n = batch.receive(b.fileno(), wait=True)  # woke by the first, with what else came
    got = [batch.copy(i) for i in range(n)]
    sender.join()
    if n < 3:
        got += [batch.copy(i) for i in range(batch.receive(b.fileno()))]
    assert n >= 1 and got == [b"p0", b"p1", b"p2"]
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 5, 0))
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(InterruptedError):  # the caller gets to look at its flags
            batch.receive(b.fileno(), wait=True)
    finally:
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("port", ["C loop", "Python"])
def test_write_each_sends_each_packet_to_its_socket_in_order_until_one_is_refused(port):
    """The broker's ``write_each`` port, through sbus/_sendeach.c (tools/setup.sh builds
    it) and through Python: every packet to its own socket, in order, and nothing after
    the first one refused (the core retries that one and the rest, and learns why)."""
    from sbus import broker, packetio

    if port == "C loop":
        assert packetio.HAS_SEND_EACH, "sbus/_sendeach.so is not built: run tools/setup.sh"
        write_each = broker._link_send_each
    else:
        write_each = broker._link_write_each
    made = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(4)]
    try:
        (pub, me), (x, x_peer), (full, full_peer), (gone, gone_peer) = made
        batch = PacketBatch(8, 101)
        packets = [b"MSG k.%d\0%s" % (i, b"p" * i) for i in range(8)]
        for p in packets:
            pub.send(p)
        assert batch.receive(me.fileno()) == 8
        full.setblocking(False)
        while True:  # its peer reads nothing: the kernel takes no more
            try:
                full.send(b"z" * 64)
            except BlockingIOError:
                break
        gone_peer.close()
        fds = [x.fileno(), full.fileno(), gone.fileno()]
        assert write_each(batch, [0, 2, 5], [fds[0], fds[0], fds[0]]) == 3
        assert write_each(batch, [1, 3, 4, 6], [fds[0], fds[0], fds[1], fds[0]]) == 2
        assert write_each(batch, [7, 6], [fds[2], fds[0]]) == 0
        x_peer.setblocking(False)
        got = []
        with pytest.raises(BlockingIOError):
            while True:
                got.append(x_peer.recv(200))
        assert got == [packets[i] for i in (0, 2, 5, 1, 3)]  # not 6, after the refused one
    finally:
        for a, b in made:
            a.close()
            b.close()


def test_a_sender_sends_separate_packets_from_separate_bytes(pairs):
    """`PacketSender`: one sendmmsg for a run of packets held as separate bytes objects,
    each arriving as its own packet; a full socket takes part of a run, then none."""
    (a, b), _ = pairs
    sender = PacketSender(4)
    packets = [b"x" * i for i in range(1, 11)]
    assert sender.send(a.fileno(), packets) == 4  # at most `slots` per call
    assert sender.send(a.fileno(), packets, 4) == 4
    assert sender.send(a.fileno(), packets, 8) == 2
    assert [b.recv(100) for _ in range(10)] == packets
    a.setblocking(False)
    big = [b"y" * 60000] * 4
    taken = 0
    while (n := sender.send(a.fileno(), big)) == 4:
        taken += n
    taken += n
    assert sender.send(a.fileno(), big) == 0  # full: nothing, no error
    b.setblocking(False)
    got = 0
    while True:
        try:
            assert b.recv(65536) == b"y" * 60000
        except BlockingIOError:
            break
        got += 1
    assert got == taken
    with pytest.raises(OSError):
        sender.send(-1, packets)
