"""Per-user accounting under hostile clients: one user's clients exhaust only that user's share.

Clients run as other users (forked children that setuid; root is exempt from the
limits by default), so these are the kernel-verified UIDs the broker charges.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import raw, sync
from faultkit import NOBODY, as_user, rss_kib, served

from sbus.rlimits import connections_per_user_for

OTHER = NOBODY - 1


def fleet(pipe, address: str) -> None:
    """A child's raw clients, driven by commands from the test over *pipe*."""
    socks: list[socket.socket] = []
    while True:
        cmd, *args = pipe.recv()
        if cmd == "connect":
            new = []
            for _ in range(args[0]):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(address)
                new.append(s)
            socks.extend(new)
            pipe.send([served(s, timeout=2) for s in new])
        elif cmd == "send":
            i, packets = args
            for p in packets:
                socks[i].send(p)
            pipe.send(served(socks[i], timeout=5))
        elif cmd == "drain":  # everything received by socket i (up to a whoami round trip)
            s = socks[args[0]]
            s.settimeout(10)
            got = []
            s.send(b"CMSG !/cred/whoami")
            while not (p := s.recv(1 << 20)).startswith(b"CMSG !/cred/whoami\0"):
                got.append(p)
            pipe.send(got)
        elif cmd == "close":
            socks[args[0]].close()
            pipe.send(True)
        elif cmd == "exit":
            pipe.send(True)
            return


def call(pipe, *cmd):
    pipe.send(cmd)
    if not pipe.poll(30):
        raise TimeoutError(f"child did not answer {cmd[0]}")
    return pipe.recv()


@pytest.fixture
def open_dir(short_tmp):
    os.chmod(short_tmp, 0o755)  # let other users reach the socket
    return short_tmp


def test_connections_per_user(make_broker, open_dir) -> None:
    b = make_broker("--max-connections-per-user", "5")
    hostile, hp = as_user(NOBODY, fleet, b.address)
    polite, pp = as_user(OTHER, fleet, b.address)
    try:
        answers = call(hp, "connect", 8)
        assert answers.count(True) == 5 and answers.count(False) == 3, answers
        assert call(pp, "connect", 5) == [True] * 5, "another user suffered from the first"
        root = raw(b.address)
        assert served(root)
        # freeing a connection gives the user its share back
        call(hp, "close", 0)
        time.sleep(0.2)
        assert call(hp, "connect", 1) == [True]
        assert call(hp, "connect", 1) == [False]
    finally:
        for p in (hp, pp):
            call(p, "exit")
        hostile.join(5)
        polite.join(5)
    log = b.log()
    assert f"uid {NOBODY} already holds 5 connections" in log
    assert f"uid {OTHER} already holds" not in log


def test_subscriptions_per_user(make_broker, open_dir) -> None:
    b = make_broker("--max-subscriptions-per-user", "10")
    hostile, hp = as_user(NOBODY, fleet, b.address)
    polite, pp = as_user(OTHER, fleet, b.address)
    try:
        assert call(hp, "connect", 2) == [True, True]
        assert call(pp, "connect", 1) == [True]
        # 16 distinct subscriptions over two connections of one user: 10 are kept
        for i in range(2):
            assert call(hp, "send", i, [b"SUB lim/%d/%d" % (i, n) for n in range(8)])
        assert call(pp, "send", 0, [b"SUB lim/1/%d" % n for n in range(8)])
        pub = raw(b.address)
        for i in range(2):
            for n in range(8):
                pub.send(b"MSG lim/%d/%d\0x" % (i, n))
        sync(pub)
        got = call(hp, "drain", 0) + call(hp, "drain", 1)
        assert len(got) == 10, f"user {NOBODY} holds {len(got)} effective subscriptions"
        assert len(call(pp, "drain", 0)) == 8, "another user's subscriptions were refused"
        # unsubscribing gives room back
        assert call(hp, "send", 0, [b"UNSUB lim/0/0", b"SUB lim/extra"])
        pub.send(b"MSG lim/extra\0y")
        sync(pub)
        assert call(hp, "drain", 0) == [b"MSG lim/extra\0y"]
    finally:
        for p in (hp, pp):
            call(p, "exit")
        hostile.join(5)
        polite.join(5)
    assert f"uid {NOBODY} already holds 10 subscriptions" in b.log()


def test_queued_bytes_per_user(make_broker, open_dir) -> None:
    """Eight connections of one user that never read cannot pin 8 x the per-client queue
    limit of broker memory: the user's total is capped, and another user's reader still
    gets everything."""
    b = make_broker("--max-queued-bytes-per-user", "4m")
    hostile, hp = as_user(NOBODY, fleet, b.address)
    polite, pp = as_user(OTHER, fleet, b.address)
    try:
        assert call(hp, "connect", 8) == [True] * 8
        for i in range(8):  # distinct keys, so the queues cannot share packets
            assert call(hp, "send", i, [b"SUB q/%d/" % i])
        assert call(pp, "connect", 1) == [True]
        assert call(pp, "send", 0, [b"SUB q/"])
        before = rss_kib(b.proc.pid)
        pub = raw(b.address)
        pub.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        got = []
        for n in range(300):  # 30 MB in all, spread over the eight idle readers
            pub.send(b"MSG q/%d/%d\0" % (n % 8, n) + os.urandom(100_000))
            if n % 20 == 19:
                got += call(pp, "drain", 0)
        sync(pub)
        got += call(pp, "drain", 0)
        assert [p.split(b"\0")[0] for p in got] == [b"MSG q/%d/%d" % (n % 8, n)
                                                     for n in range(300)]
        grown = rss_kib(b.proc.pid) - before
        assert grown < 12 * 1024, f"broker grew by {grown} KiB for one user's idle readers"
    finally:
        for p in (hp, pp):
            call(p, "exit")
        hostile.join(5)
        polite.join(5)


def test_a_full_queue_gives_way_to_the_user_holding_less(make_broker, open_dir) -> None:
    """One user floods a subscriber that does not read (the bridge, a shared reader);
    another user's 50 numbered messages to it all arrive, in order, while the flooder
    loses its own: every loss is reported to the subscriber with ``blocking/dropped``.
    Without the share (hard discard dropping whatever arrives at a full queue), 43 of the
    50 were lost."""
    b = make_broker("--queue-limit", "64k")
    sub = raw(b.address, timeout=10)
    sub.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sub.send(b"SUB shared/")
    sync(sub)
    flooder, fp = as_user(NOBODY, fleet, b.address)
    honest, hp = as_user(OTHER, fleet, b.address)
    try:
        assert call(fp, "connect", 1) == [True] and call(hp, "connect", 1) == [True]
        flood = [b"MSG shared/f/%d\0" % n + b"x" * 1000 for n in range(3000)]
        assert call(fp, "send", 0, flood[:2000])  # the queue is full, and then some
        for n in range(50):
            assert call(hp, "send", 0, [b"MSG shared/h/%d\0honest" % n])
        assert call(fp, "send", 0, flood[2000:])
        got, dropped = [], 0
        for _ in range(2):  # the drop report follows the drained queue, and the first reply
            sub.send(b"CMSG !/cred/whoami")
            while not (p := sub.recv(1 << 20)).startswith(b"CMSG !/cred/whoami\0"):
                if p.startswith(b"CMSG blocking/dropped\0"):
                    dropped += int(p.split(b"\0")[1])
                else:
                    got.append(p.split(b"\0")[0])
        mine = [k for k in got if k.startswith(b"MSG shared/h/")]
        theirs = [k for k in got if k.startswith(b"MSG shared/f/")]
        assert mine == [b"MSG shared/h/%d" % n for n in range(50)]
        assert len(theirs) + dropped == 3000 and dropped > 2000
        assert theirs == sorted(theirs, key=lambda k: int(k.rsplit(b"/", 1)[1]))
    finally:
        for p in (fp, hp):
            call(p, "exit")
        flooder.join(5)
        honest.join(5)
        sub.close()


def test_the_default_connection_limit_is_a_share_of_the_descriptors() -> None:
    """docs/security.md's arithmetic: min(1024, (N - 64) // 8) of the raised limit N."""
    assert [connections_per_user_for(n) for n in (100, 1024, 2048, 4096, 65536, 1 << 20)] \
        == [4, 120, 248, 504, 1024, 1024]


def test_a_long_running_command_raises_its_soft_descriptor_limit() -> None:
    """Every long-running command calls `raise_descriptor_limit` first: soft = hard."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 512)); "
            "from sbus.rlimits import raise_descriptor_limit as r; "
            "print(r(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    assert out == ["512", "(512, 512)\n"]
