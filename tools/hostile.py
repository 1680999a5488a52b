#!/usr/bin/env python3
"""Hostile-client soak: every known attack on the broker at once, honest users measuring.

    tools/hostile.py                    # 120 s against a broker of its own
    tools/hostile.py --duration 12      # CI-sized (tests/test_hostile.py)
    tools/hostile.py --address /run/sbus.socket --broker-pid 123

Each attack of issue 13 is a *role*: a function ``role(pipe, address, params)`` run in
a forked process that has become another user (UIDs 65534 and 65533 attack; 65532
and 65531 are honest), so the broker charges the kernel-verified UIDs an attacker
really has.  The same roles are used one at a time by tests/test_attacks_broker.py.
A role runs until ``params["seconds"]`` pass or the parent sends anything on the
pipe (the parent stops memory attacks at a cap, so a broken broker cannot take the
machine down); it may send ``("state", text)`` along the way and always ends with
``("done", stats)``.  Memory attacks also take a goal (``count``: so much sent, or the
broker stopped reading them): then they say so in a state and hold what they made the
broker keep until stopped, so a test ends the attack on that condition, not a clock.

Honest users meanwhile: a whoami prober (round trips, p99 and worst stall), a
reliable reader on ``blocking/soft/block`` of its own UID's sequenced publisher (nothing
lost or reordered), a cross-user publisher whose reader must get everything although
an attacker's ``""`` subscriber blocks, and secret users who exchange
``!/cred/G/U/P/…`` messages (every secret received must be the receiver's own).

Checks: broker RSS growth <= per-user budget x attacking users + a constant, honest
whoami p99 < 50 ms, nothing lost or reordered for honest readers, no secret leaked,
the broker alive.  Prints a table; exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from sbus.defaults import parse_size
from sbus.protocol import CLIENT_STATUS, DROPPED, REFUSED, STATUS, WHOAMI

ATTACKERS = (65534, 65533)
HONEST = (65532, 65531)
ASK = b"CMSG " + WHOAMI
ANSWER = ASK + b"\0"
REFUSAL = b"CMSG " + REFUSED + b"/"
DROP_NOTICE = b"CMSG " + DROPPED + b"\0"
SEQ = struct.Struct("!Q")
BIG_SNDBUF = 4 * 1024 * 1024  # what an unprivileged user may ask for here (wmem_max)

#: A control-byte laden, log-forging piece of client input.
FORGERY = b"\x1b[2J\x1b[31m\nsbus.broker: FORGED LINE uid 0\r"


# -- plumbing shared by roles ---------------------------------------------------------------

def connect(address: str, sndbuf: int | None = None, timeout: float = 5.0) -> socket.socket:
    """A raw connection; a full listen backlog (a connect storm) is retried for 30 s."""
    end = time.monotonic() + 30
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if sndbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        s.settimeout(timeout)
        try:
            s.connect(address)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > end:
                raise
            time.sleep(0.01)


def roundtrip(s: socket.socket, timeout: float = 10.0) -> list[bytes]:
    """Whoami round trip; returns what arrived before the answer, then the answer."""
    old = s.gettimeout()
    s.settimeout(timeout)
    try:
        s.send(ASK)
        got = []
        while True:
            p = s.recv(1 << 20)
            if not p:
                raise ConnectionError("the broker closed the connection")
            got.append(p)
            if p.startswith(ANSWER):
                return got
    finally:
        s.settimeout(old)


def drain(s: socket.socket, limit: int = 100_000) -> list[bytes]:
    """What is waiting on *s* now, without blocking."""
    out = []
    old = s.gettimeout()
    s.settimeout(0)  # MSG_DONTWAIT alone would still wait for the timeout first
    try:
        while len(out) < limit:
            p = s.recv(1 << 20)
            if not p:
                break
            out.append(p)
    except OSError:  # nothing more (BlockingIOError), or the broker left
        pass
    finally:
        s.settimeout(old)
    return out


class Clock:
    """A role's deadline and stop signal (anything arriving on the pipe)."""

    def __init__(self, pipe, params: dict) -> None:
        self.pipe = pipe
        self.end = time.monotonic() + params.get("seconds", 10)
        self._stopped = False

    def over(self) -> bool:
        if not self._stopped and (time.monotonic() > self.end or self.pipe.poll()):
            self._stopped = True
        return self._stopped

    def state(self, text: str) -> None:
        self.pipe.send(("state", text))

    def hold(self) -> None:
        """Keep what the attack made the broker hold until the time is over or stopped."""
        while not self.over():
            time.sleep(0.05)


def _send(s: socket.socket, packet: bytes) -> bool:
    """Blocking send that gives up after the socket's timeout (a paused sender)."""
    try:
        s.send(packet)
        return True
    except (TimeoutError, BlockingIOError):
        return False


# -- attacks: memory ------------------------------------------------------------------------

def cache_attack(pipe, address: str, params: dict) -> None:
    """Publish unique long keys nobody subscribes to (route-cache bytes)."""
    clock = Clock(pipe, params)
    key_len = params.get("key_len", 100_000)
    s = connect(address, BIG_SNDBUF, timeout=1.0)
    fill = bytes(random.Random(1).choices(b"abcdefgh", k=key_len))
    n, goal = 0, params.get("count", 10**9)
    while n < goal and not clock.over():
        for _ in range(8):
            if _send(s, b"MSG cache/%d/%s\0" % (n, fill)):
                n += 1
    if n >= goal:
        roundtrip(s, 30)  # the broker has looked every key up
        clock.state(f"{n} published")
        clock.hold()
    s.close()
    pipe.send(("done", {"published": n, "key_bytes": n * key_len}))


def trie_patterns(kind: str, i: int) -> bytes:
    """SUB patterns that build many trie nodes: over the limits or just at them."""
    if kind == "segments-over":  # 20,000 one-byte segments
        return b"t%d/" % i + b"a/" * 20_000
    if kind == "prefix-over":  # one 100 KB prefix wildcard
        return b"w%d/" % i + b"p" * 100_000 + b"*"
    if kind == "segments-at":  # 256 segments
        return b"/".join([b"s%d" % i] + [b"a"] * 255)
    if kind == "prefix-at":  # 255-byte prefixes, 256 segments
        return b"/".join([b"q%d*" % i] + [b"p" * 255 + b"*"] * 255)
    raise ValueError(kind)


def trie_attack(pipe, address: str, params: dict) -> None:
    """Subscribe distinct patterns of many segments and long prefixes (trie nodes)."""
    clock = Clock(pipe, params)
    kinds = params.get("kinds", ["segments-over", "prefix-over", "segments-at", "prefix-at"])
    s = connect(address, BIG_SNDBUF, timeout=1.0)
    n, refused, goal = 0, 0, params.get("count", 10**9)
    while n < goal and not clock.over():
        if _send(s, b"SUB " + trie_patterns(kinds[n % len(kinds)], n)):
            n += 1
        refused += sum(p.startswith(REFUSAL + b"sub\0") for p in drain(s))
    try:
        refused += sum(p.startswith(REFUSAL + b"sub\0") for p in roundtrip(s, 30))
    except OSError:
        pass
    if n >= goal:
        clock.state(f"{n} subscribed")
        clock.hold()
    s.close()
    pipe.send(("done", {"subscribed": n, "refused": refused}))


def reply_attack(pipe, address: str, params: dict) -> None:
    """Ask whoami (and earn refusals) forever on *connections* connections, never reading
    an answer (reply queues).  Goal: ``count`` sent, or no connection taken anything for
    ``paused`` seconds (the broker stopped reading them all)."""
    clock = Clock(pipe, params)
    conns = [connect(address, params.get("sndbuf", BIG_SNDBUF))
             for _ in range(params.get("connections", 1))]
    for s in conns:
        s.setblocking(False)
    asks = [ASK] * 7 + [b"SUB !/cred/*/*/*/"]
    n, goal, paused = 0, params.get("count", 10**12), params.get("paused", 10**9)
    moved_at = time.monotonic()
    while not clock.over():
        before = n
        for s in conns:
            for p in asks * 8:
                try:
                    s.send(p)
                except BlockingIOError:
                    break
                n += 1
        now = time.monotonic()
        if n > before:
            moved_at = now
        else:
            time.sleep(0.005)
        if n >= goal or now - moved_at > paused:
            clock.state(f"{n} sent" if n >= goal else f"paused after {n}")
            clock.hold()
    for s in conns:
        s.close()
    pipe.send(("done", {"sent": n, "connections": len(conns)}))


def paused_attack(pipe, address: str, params: dict) -> None:
    """One never-reading ``block`` subscriber and many publishers it pauses, each with a
    batch of large packets already sent (held bytes of paused publishers)."""
    clock = Clock(pipe, params)
    size = params.get("packet", 200_000)
    per = params.get("per_publisher", 10)
    key = b"paused/%d" % os.getpid()
    sub = connect(address)
    sub.send(b"CMSG blocking/soft/block")
    sub.send(b"SUB " + key)
    roundtrip(sub)
    pubs = []
    sent = 0
    body = b"MSG " + key + b"\0" + b"x" * size
    while not clock.over() and len(pubs) < params.get("publishers", 400):
        try:
            p = connect(address, per * (size + 4096) // 2 + 65536)
        except OSError:
            break
        p.setblocking(False)
        pubs.append(p)
        for _ in range(per):
            try:
                p.send(body)
                sent += 1
            except (BlockingIOError, OSError):
                break
        time.sleep(0.005)
    clock.state(f"{len(pubs)} publishers")
    clock.hold()
    for p in pubs:
        p.close()
    sub.close()
    pipe.send(("done", {"publishers": len(pubs), "sent": sent}))


def held_attack(pipe, address: str, params: dict) -> None:
    """Fan-outs the broker holds over several turns (`core.Fanout`), each read into a
    buffer that large packets touched just before: "touchers" publish 240 KB packets
    nobody subscribed to, "fanners" bursts of small packets to many own never-reading
    subscribers (pages a held buffer keeps beyond its packets)."""
    clock = Clock(pipe, params)
    subs = []
    for _ in range(params.get("subscribers", 40)):
        s = connect(address)
        s.send(b"CMSG blocking/soft/discard")
        s.send(b"SUB held/")
        subs.append(s)
    roundtrip(subs[-1])
    count = params.get("publishers", 16)
    pubs = [connect(address, BIG_SNDBUF, timeout=0.2) for _ in range(count)]
    touch = b"MSG nobody/%d\0" % os.getpid() + b"t" * 240_000
    fan = b"MSG held/x\0" + b"f" * 100
    bursts, goal = 0, params.get("count", 10**9)
    while bursts < goal and not clock.over():
        for i, p in enumerate(pubs):
            packet, burst = (touch, 16) if i % 2 else (fan, 64)
            for _ in range(burst):
                if not _send(p, packet):
                    break
            bursts += 1
    if bursts >= goal:
        clock.state(f"{bursts} bursts")
        clock.hold()
    for s in [*pubs, *subs]:
        s.close()
    pipe.send(("done", {"bursts": bursts}))


def tiny_attack(pipe, address: str, params: dict) -> None:
    """Tiny packets queued for a subscriber that never reads (per-packet overhead)."""
    clock = Clock(pipe, params)
    subs = []
    for i in range(params.get("subscribers", 1)):
        s = connect(address)
        s.send(b"SUB t%d" % i)
        roundtrip(s)
        subs.append(s)
    pub = connect(address, BIG_SNDBUF, timeout=1.0)
    packets = [b"MSG t%d\0" % i for i in range(len(subs))]  # 7 bytes each
    n, goal, paused = 0, params.get("count", 10**9), False
    while n < goal and not paused and not clock.over():
        for p in packets * 16:
            if _send(pub, p):
                n += 1
            else:  # the broker has not read for a second: it paused this publisher
                paused = True
                break
    if not paused:
        try:
            roundtrip(pub, 30)
        except OSError:
            pass
    clock.state(f"{n} sent" + " (paused)" * paused)
    clock.hold()
    for s in [pub, *subs]:
        s.close()
    pipe.send(("done", {"sent": n}))


# -- attacks: loop time ---------------------------------------------------------------------

def sub_batch_attack(pipe, address: str, params: dict) -> None:
    """Batches of SUB/UNSUB of long patterns (work per turn, and cache clearing)."""
    clock = Clock(pipe, params)
    kinds = params.get("kinds", ["segments-over", "prefix-at", "segments-at"])
    s = connect(address, BIG_SNDBUF, timeout=1.0)
    n = 0
    while not clock.over():
        batch = []
        for i in range(16):
            pattern = trie_patterns(kinds[(n + i) % len(kinds)], i)
            batch += [b"SUB " + pattern, b"UNSUB " + pattern]
        for p in batch:
            if _send(s, p):
                n += 1
        drain(s)
    s.close()
    pipe.send(("done", {"sent": n}))


def crowd_attack(pipe, address: str, params: dict) -> None:
    """Costly packets (SUB/UNSUB of 256-segment patterns) on *connections* connections at
    once, each kept full: every connection's turn is bounded, so what it buys is a turn
    per connection in every round (the loop's time per user)."""
    clock = Clock(pipe, params)
    conns = [connect(address, BIG_SNDBUF) for _ in range(params.get("connections", 100))]
    for s in conns:
        s.setblocking(False)
    pairs = []
    for i in range(8):
        pattern = trie_patterns("segments-at", i)
        pairs += [b"SUB " + pattern, b"UNSUB " + pattern]
    n = 0
    clock.state("connected")
    while not clock.over():
        before = n
        for s in conns:
            for p in pairs:
                try:
                    s.send(p)
                except BlockingIOError:
                    break
                n += 1
            drain(s)
        if n == before:
            time.sleep(0.002)
    for s in conns:
        s.close()
    pipe.send(("done", {"sent": n, "connections": len(conns)}))


def order_attack(pipe, address: str, params: dict) -> None:
    """Fill one's own queue with tiny packets, then flip ``order/random``/``order/queue``."""
    clock = Clock(pipe, params)
    sub = connect(address, BIG_SNDBUF, timeout=1.0)
    sub.send(b"SUB order/")
    roundtrip(sub)
    pub = connect(address, BIG_SNDBUF, timeout=1.0)
    filled = 0
    for _ in range(params.get("fill", 600_000)):
        if clock.over():
            break
        if _send(pub, b"MSG order/\0"):
            filled += 1
    try:
        roundtrip(pub, 30)
    except OSError:
        pass
    clock.state(f"{filled} queued")
    flips = 0
    while not clock.over():
        for order in (b"random", b"queue", b"stack", b"random"):
            if _send(sub, b"CMSG order/" + order):
                flips += 1
        time.sleep(0.001)
    pub.close()
    sub.close()
    pipe.send(("done", {"filled": filled, "flips": flips}))


def prefix_attack(pipe, address: str, params: dict) -> None:
    """Thousands of sibling ``prefix*`` patterns, then unique keys that miss them all."""
    clock = Clock(pipe, params)
    s = connect(address, BIG_SNDBUF, timeout=5.0)
    for i in range(1, params.get("siblings", 10_000)):
        s.send(b"SUB a%d*" % i)
    roundtrip(s, 60)
    clock.state("subscribed")
    s.settimeout(1.0)
    n = 0
    while not clock.over():
        for _ in range(32):
            if _send(s, b"MSG b%d\0" % n):
                n += 1
        drain(s)
    s.close()
    pipe.send(("done", {"published": n}))


def churn_attack(pipe, address: str, params: dict) -> None:
    """SUB/UNSUB of patterns unrelated to anyone's keys, at a steady rate."""
    clock = Clock(pipe, params)
    rate = params.get("rate", 2000)
    s = connect(address, timeout=1.0)
    n, t0 = 0, time.monotonic()
    while not clock.over():
        if n > rate * (time.monotonic() - t0):
            time.sleep(0.002)
            continue
        p = params.get("pattern", b"churn/%d/x") % (n % 1000)
        _send(s, b"SUB " + p)
        _send(s, b"UNSUB " + p)
        n += 2
        if n % 256 == 0:
            drain(s)
        if n == 256:
            clock.state("churning")
    s.close()
    pipe.send(("done", {"sent": n}))


def fanout_attack(pipe, address: str, params: dict) -> None:
    """Many own subscribers (``soft/discard``, never reading) of one prefix, and publishes
    of unique keys under it: every packet is one write per subscriber, and every key a
    cache entry as large as the subscriber list."""
    clock = Clock(pipe, params)
    subs = []
    for _ in range(params.get("subscribers", 1000)):
        try:  # the user's connection limit (or the broker) may refuse some
            s = connect(address)
            s.send(b"CMSG blocking/soft/discard")
            s.send(b"SUB fan/")
            if len(subs) % 100 == 99:
                roundtrip(s, 5)  # now and then: let the broker catch up
        except OSError:
            continue
        subs.append(s)
    clock.state(f"{len(subs)} subscribers")
    pub = connect(address, BIG_SNDBUF, timeout=1.0)
    n = 0
    while not clock.over():
        for _ in range(32):
            if _send(pub, b"MSG fan/%d\0" % n):
                n += 1
        drain(pub)
    for s in [pub, *subs]:
        s.close()
    pipe.send(("done", {"subscribers": len(subs), "published": n}))


def walk_patterns(depth: int = 8, count: int = 8000) -> list[bytes]:
    """Every pattern of *depth* segments from ``a``, ``*``, ``a*``, upper levels first
    (digits reversed), so that however many are accepted, they share few nodes: a key
    ``a/a/…`` makes a lookup visit every one of those nodes."""
    choice = [b"a", b"*", b"a*"]
    out = []
    for i in range(min(count, 3 ** depth)):
        segs = []
        for _ in range(depth):
            i, d = divmod(i, 3)
            segs.append(choice[d])
        out.append(b"/".join(segs))
    return out


def walk_attack(pipe, address: str, params: dict) -> None:
    """Patterns that all match one key shape (until the budget refuses more), then unique
    keys of that shape: a cache miss walks every pattern's nodes."""
    clock = Clock(pipe, params)
    depth = params.get("depth", 8)
    s = connect(address, BIG_SNDBUF, timeout=30)
    accepted = 0
    patterns = walk_patterns(depth)
    for start in range(0, len(patterns), 500):
        chunk = patterns[start:start + 500]
        for p in chunk:
            s.send(b"SUB " + p)
        refused = sum(p.startswith(REFUSAL) for p in roundtrip(s, 60))
        accepted += len(chunk) - refused
        if refused or clock.over():
            break
    clock.state(f"{accepted} patterns")
    s.settimeout(1.0)
    stem = b"/".join([b"a"] * depth)
    n = 0
    while not clock.over():
        for _ in range(32):
            if _send(s, b"MSG %s/%d\0" % (stem, n)):
                n += 1
        drain(s)
    s.close()
    pipe.send(("done", {"patterns": accepted, "published": n}))


def accept_storm(pipe, address: str, params: dict) -> None:
    """Connect and hang up as fast as possible: the broker's accept loop against the backlog."""
    clock = Clock(pipe, params)
    n = refused = 0
    while not clock.over():
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            try:
                s.connect(address)
                n += 1
            except OSError:
                refused += 1
            s.close()
    pipe.send(("done", {"connects": n, "backlog_full": refused}))


def status_attack(pipe, address: str, params: dict) -> None:
    """Clients that hold what makes an introspection answer costly, then ``CMSG
    broker/status`` asked over and over (paging through every answer) by the first: it
    holds a few dozen ~200 KB patterns of invalid UTF-8 (each byte escaped when shown),
    the next client a 70 KB pattern (an entry larger than a page), and many small clients
    come after them (those a paging that stops early would hide).  Reports the answers
    and their round trips."""
    clock = Clock(pipe, params)
    costly = connect(address, BIG_SNDBUF, timeout=30)
    refused = 0
    for i in range(params.get("long", 40)):
        costly.send(b"SUB %d/" % i + b"\xff\xfe" * (params.get("long_bytes", 200_000) // 2))
        refused += sum(p.startswith(REFUSAL) for p in roundtrip(costly, 60))
    big = connect(address, BIG_SNDBUF, timeout=30)
    big.send(b"SUB big/" + b"\xff" * params.get("big", 70_000))
    big.send(b"CMSG " + CLIENT_STATUS + b"\0" + b"\xfe" * 4096)
    held = [costly, big]
    for i in range(params.get("clients", 200)):
        s = connect(address, timeout=30)
        s.send(b"SUB small/%d/\xff" % i)
        held.append(s)
    for s in held:
        roundtrip(s, 60)
    clock.state(f"{len(held)} clients, {refused} patterns refused")
    asker = costly
    lat, pages, largest, after = [], 0, 0, None
    while not clock.over():
        t = time.monotonic()
        asker.send(b"CMSG " + STATUS + (b"" if after is None else b"\0" + after))
        while True:
            p = asker.recv(1 << 20)
            if not p:
                raise ConnectionError("the broker closed the connection")
            if p.startswith(b"CMSG " + STATUS + b"\0"):
                break
        lat.append(time.monotonic() - t)
        pages += 1
        largest = max(largest, len(p))
        page = json.loads(p[len(STATUS) + 6:])
        # a page that says "more" but not where (an entry larger than a page): start over
        after = json.dumps(page["next"]).encode() if "next" in page else None
    for s in held:
        s.close()
    pipe.send(("done", {"clients": len(held), "refused": refused, "pages": pages,
                        "largest_answer": largest, **{
                            f"answer_{k}": v for k, v in latency_figures(lat).items()}}))


def descriptor_attack(pipe, address: str, params: dict) -> None:
    """Open connections (each answered, so the broker has taken it) until the broker
    refuses one or ``max`` are held, and hold them: the broker's descriptors."""
    clock = Clock(pipe, params)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker's own, too
    held = []
    while len(held) < params.get("max", 5000) and not clock.over():
        try:
            s = connect(address, timeout=5)
            roundtrip(s, 5)
        except OSError:
            break  # refused (closed at once), or the connect itself failed
        held.append(s)
    clock.state(f"{len(held)} held")
    while not clock.over():
        time.sleep(0.05)
    for s in held:
        s.close()
    pipe.send(("done", {"held": len(held)}))


# -- attacks: block, logs -------------------------------------------------------------------

def blocker(pipe, address: str, params: dict) -> None:
    """A subscriber of everything (or *pattern*) on ``blocking/soft/block`` that never reads."""
    clock = Clock(pipe, params)
    s = connect(address)
    s.send(b"CMSG blocking/" + params.get("policy", b"soft/block"))
    s.send(b"SUB " + params.get("pattern", b""))
    roundtrip(s)
    clock.state("blocking")
    while not clock.over():
        time.sleep(0.05)
    s.close()
    pipe.send(("done", {}))


def log_attack(pipe, address: str, params: dict) -> None:
    """Complaints that would flood or forge the broker's log: long refused patterns with
    control bytes, junk over many reconnects, and connections past the per-user limit."""
    clock = Clock(pipe, params)
    stats = Counter()
    kinds = params.get("kinds", ["long", "reconnect", "connections"])
    if "long" in kinds:
        s = connect(address, BIG_SNDBUF)
        s.send(b"SUB !/cred/*/*/*/" + FORGERY + b"x" * 200_000)
        s.send(b"SUB " + FORGERY + b"/!/" + b"y" * 200_000)
        roundtrip(s)
        s.close()
        stats["long"] = 2
    reconnects = params.get("reconnects", 100)
    while "reconnect" in kinds and stats["reconnects"] < reconnects and not clock.over():
        try:
            s = connect(address)
            for i in range(20):
                s.send([b"JUNK " + FORGERY, b"UNSUB nothing/%d" % i, b"CMSG bogus/x"][i % 3])
            roundtrip(s)
            s.close()
            stats["reconnects"] += 1
        except OSError:
            stats["reconnect_failed"] += 1
    held = []
    while "connections" in kinds and len(held) < params.get("connections", 300) \
            and not clock.over():
        try:
            held.append(connect(address))
        except OSError:
            stats["connect_failed"] += 1
            break
    # all are checked while all are held, then closed: closing each after its check
    # would free a slot for one the broker has not reached yet in its backlog
    for s in held:
        stats["connections_answered"] += bool(_answered(s))
    for s in held:
        s.close()
    clock.state("logged")
    pipe.send(("done", dict(stats)))


def _answered(s: socket.socket) -> bool:
    try:
        roundtrip(s, 2)
        return True
    except OSError:
        return False


def storm(pipe, address: str, params: dict) -> None:
    """Keep connecting and vanishing (the connection-limit refusals, repeated)."""
    clock = Clock(pipe, params)
    n = 0
    while not clock.over():
        try:
            s = connect(address, timeout=1.0)
            s.send(b"JUNK")
            s.close()
        except OSError:
            pass
        n += 1
        time.sleep(0.002)
    pipe.send(("done", {"connects": n}))


# -- honest users -----------------------------------------------------------------------------

def prober(pipe, address: str, params: dict) -> None:
    """Whoami round trips every few ms: the latency another user sees.  Says ``"marked"``
    once *mark* round trips are done (a baseline before an attack starts)."""
    clock = Clock(pipe, params)
    s = connect(address, timeout=30)
    lat = []
    failed = 0
    while not clock.over():
        if len(lat) == params.get("mark"):
            clock.state("marked")
        t = time.monotonic()
        try:
            roundtrip(s, 30)
        except OSError:
            failed += 1
            s.close()
            s = connect(address, timeout=30)
            continue
        lat.append(time.monotonic() - t)
        time.sleep(params.get("interval", 0.005))
    s.close()
    pipe.send(("done", {"latencies": lat, "failed": failed}))


def latency_figures(lat: list[float]) -> dict:
    if not lat:
        return {"probes": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    lat = sorted(lat)
    return {"probes": len(lat), "p50_ms": round(lat[len(lat) // 2] * 1000, 2),
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 2),
            "max_ms": round(lat[-1] * 1000, 2)}


def reliable_pair(pipe, address: str, params: dict) -> None:
    """A sequenced publisher and a reader on soft block of the same user: all, in order."""
    clock = Clock(pipe, params)
    key = b"honest/rel/%d" % os.getpid()
    reader = connect(address, timeout=10)
    reader.send(b"CMSG blocking/soft/block")
    reader.send(b"SUB " + key)
    roundtrip(reader)
    pub = connect(address, timeout=0.05)
    sent = expect = bad = 0
    while not clock.over():
        for _ in range(50):
            if not _send(pub, b"MSG " + key + b"\0" + SEQ.pack(sent) + b"r" * 100):
                break
            sent += 1
        for p in drain(reader, 200):
            if p.startswith(b"MSG "):
                seq = SEQ.unpack_from(p, len(key) + 5)[0]
                bad += seq != expect
                expect = seq + 1
        time.sleep(0.002)
    reader.settimeout(30)
    try:
        roundtrip(pub, 60)  # the broker has read everything sent
        while expect < sent:
            p = reader.recv(1 << 20)
            if p.startswith(b"MSG "):
                seq = SEQ.unpack_from(p, len(key) + 5)[0]
                bad += seq != expect
                expect = seq + 1
    except OSError:
        pass
    pipe.send(("done", {"sent": sent, "received": expect, "out_of_order": bad}))


def cross_reader(pipe, address: str, params: dict) -> None:
    """Reads everything under *prefix* (default queue policy), counting per publisher key;
    ends early once it got *expect* (``{key: count}``) messages.  With *flush*, a whoami
    round trip at the end brings what the broker routed here before it was stopped."""
    clock = Clock(pipe, params)
    s = connect(address, timeout=0.2)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.send(b"SUB " + params["prefix"])
    roundtrip(s)
    clock.state("reading")
    got: Counter[bytes] = Counter()
    last: dict[bytes, int] = {}
    bad = dropped = 0

    def count(p: bytes) -> None:
        nonlocal bad, dropped
        if p.startswith(b"MSG "):
            key, _, body = p[4:].partition(b"\0")
            seq = SEQ.unpack_from(body)[0]
            bad += last.get(key, -1) + 1 != seq
            last[key] = seq
            got[key] += 1
        elif p.startswith(DROP_NOTICE):
            dropped += int(p[len(DROP_NOTICE):])

    expect = {k.encode(): n for k, n in params.get("expect", {}).items()}
    while not clock.over() and not (expect and all(got[k] >= n for k, n in expect.items())):
        try:
            count(s.recv(1 << 20))
        except TimeoutError:
            continue
    if params.get("flush"):
        for p in roundtrip(s, 30):
            count(p)
    s.close()
    pipe.send(("done", {"got": {k.decode(): v for k, v in got.items()}, "out_of_order": bad,
                        "dropped": dropped}))


def sequenced_publisher(pipe, address: str, params: dict) -> None:
    """Publishes *count* numbered messages on *key* (blocking sends); reports how many the
    kernel took within the time (a paused publisher stops; with *until_paused*, it ends
    once no send went through for that many seconds)."""
    clock = Clock(pipe, params)
    s = connect(address, timeout=0.2)
    key = params["key"]
    n, goal, rate = 0, params.get("count", 10**9), params.get("rate")
    pad = b"p" * params.get("size", 200)
    t0 = sent_at = time.monotonic()
    while n < goal and not clock.over():
        if rate and n > rate * (time.monotonic() - t0):
            time.sleep(0.002)
            continue
        if _send(s, b"MSG " + key + b"\0" + SEQ.pack(n) + pad):
            n += 1
            sent_at = time.monotonic()
        elif time.monotonic() - sent_at > params.get("until_paused", 10**9):
            break
    if params.get("flush"):  # then the broker has routed all of them
        roundtrip(s, 30)
    clock.state(f"{n} sent")
    while not clock.over():
        time.sleep(0.05)
    s.close()
    pipe.send(("done", {"sent": n}))


def secret_user(pipe, address: str, params: dict) -> None:
    """Subscribes its own secrets and ``""``, sends secrets to everyone it was told of; every
    ``!/`` key it receives must be its own."""
    clock = Clock(pipe, params)
    s = connect(address, timeout=0.05)
    own = roundtrip(s)[-1][len(ANSWER):] + b"/"
    s.send(b"SUB !/cred////")
    s.send(b"SUB ")
    s.send(b"SUB !/")
    pipe.send(("state", own.decode()))
    peers = pipe.recv() if pipe.poll(10) else []
    clock = Clock(pipe, params)
    stats = Counter()
    while not clock.over():
        for peer in peers:
            _send(s, b"MSG " + peer.encode() + b"secret\0" + own)
            stats["sent"] += 1
        _send(s, b"MSG " + own + b"mine\0")
        for p in drain(s, 500):
            if p.startswith(b"MSG !/"):
                if p.startswith(b"MSG " + own):
                    stats["secrets_received"] += 1
                else:
                    stats["secret_leaks"] += 1
        time.sleep(0.01)
    s.close()
    pipe.send(("done", dict(stats)))


def refusal_probe(pipe, address: str, params: dict) -> None:
    """SUB each of *patterns*, one round trip each: which ones were refused (a
    ``CMSG refused/sub`` before the answer), and the refusal texts."""
    s = connect(address, BIG_SNDBUF)
    out = []
    for pattern in params["patterns"]:
        s.send(b"SUB " + pattern)
        got = roundtrip(s)
        out.append([p.decode("utf-8", "replace") for p in got if p.startswith(REFUSAL)])
    s.close()
    pipe.send(("done", {"refusals": out}))


def throughput_publisher(pipe, address: str, params: dict) -> None:
    """An S-style publisher: rounds of messages over a set of keys (all cached after the
    first round), each round timed up to the broker's answer; reports msg/s per round."""
    clock = Clock(pipe, params)
    keys = [b"MSG tp/k%d\0" % i + b"v" * 16 for i in range(params.get("keys", 1000))]
    s = connect(address, BIG_SNDBUF, timeout=30)
    rates = []
    while not clock.over():
        t = time.monotonic()
        for packet in keys * params.get("repeat", 10):
            s.send(packet)
        roundtrip(s, 30)
        rates.append(len(keys) * params.get("repeat", 10) / (time.monotonic() - t))
    s.close()
    pipe.send(("done", {"rates": rates}))


ROLES = {f.__name__: f for f in (
    cache_attack, trie_attack, reply_attack, paused_attack, held_attack, tiny_attack,
    sub_batch_attack, crowd_attack,
    order_attack, prefix_attack, churn_attack, fanout_attack, walk_attack, accept_storm,
    blocker, log_attack, status_attack, descriptor_attack, storm, prober, reliable_pair,
    cross_reader, sequenced_publisher, secret_user, refusal_probe, throughput_publisher)}


# -- orchestration ----------------------------------------------------------------------------

def _become(uid: int, role, pipe, address: str, params: dict) -> None:
    if params.get("nice"):
        os.nice(params["nice"])  # before giving up root: a measurer is not starved
    if uid != os.getuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    try:
        role(pipe, address, params)
    except Exception as exc:  # noqa: BLE001 - a role's failure is reported, not hidden
        pipe.send(("done", {"error": repr(exc)}))


class Role:
    """One role in a forked process of *uid*."""

    def __init__(self, uid: int, name: str, address: str, **params) -> None:
        ctx = multiprocessing.get_context("fork")
        self.pipe, child = ctx.Pipe()
        self.uid, self.name = uid, name
        self.proc = ctx.Process(target=_become, args=(uid, ROLES[name], child, address, params),
                                daemon=True)
        self.proc.start()
        child.close()
        self.states: list[str] = []
        self.result: dict | None = None

    def poll(self) -> None:
        while self.result is None and self.pipe.poll():
            kind, value = self.pipe.recv()
            if kind == "done":
                self.result = value
            else:
                self.states.append(value)

    def wait_state(self, timeout: float) -> str | None:
        end = time.monotonic() + timeout
        while not self.states and self.result is None and time.monotonic() < end:
            if self.pipe.poll(0.05):
                self.poll()
        return self.states[-1] if self.states else None

    def stop(self) -> None:
        try:
            self.pipe.send("stop")
        except OSError:
            pass

    def finish(self, timeout: float = 60, stop: bool = True) -> dict:
        """Its report: at once (*stop*), or when its time is over (within *timeout*)."""
        if stop:
            self.stop()
        end = time.monotonic() + timeout
        while self.result is None and time.monotonic() < end:
            if self.pipe.poll(0.1):
                self.poll()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        return self.result if self.result is not None else {"error": "no report (hung)"}


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


#: Messages per second the cross-user publisher sends (it must manage that many).
CROSS_RATE = 2000
#: Longest single honest round trip allowed: the issue's ~10 ms per turn, with room for a
#: loaded two-core machine.
MAX_STALL_MS = 500

#: Per-user limits the soak gives its broker (small, so the RSS bound is tight).
SOAK_LIMITS = {
    "--max-queued-bytes-per-user": "8m",
    "--max-subscription-bytes-per-user": "4m",
    "--max-cache-bytes": "4m",
    "--max-cache-bytes-per-user": "1m",
    "--max-connections-per-user": "512",
}
#: What one connection costs the broker (docs/security.md: about 11-12 KB).
CONNECTION_KIB = 12
#: Batch buffer (8 MiB), the whole route cache, honest clients, allocator slack.
CONSTANT_KIB = 48 * 1024


def per_user_budget_kib() -> int:
    """What one attacking UID may make the broker hold under `SOAK_LIMITS`."""
    charged = ("--max-queued-bytes-per-user", "--max-subscription-bytes-per-user",
               "--max-cache-bytes-per-user")
    return (sum(parse_size(SOAK_LIMITS[k]) for k in charged) // 1024
            + int(SOAK_LIMITS["--max-connections-per-user"]) * CONNECTION_KIB)


class OwnBroker:
    """`sbus serve` with `SOAK_LIMITS` (those it knows), at nice -5 like tools/soak.py: on a
    small machine the dozens of attacking processes must not starve it of CPU (the soak
    measures what clients do to the broker's loop, not the scheduler)."""

    def __init__(self, directory: Path) -> None:
        self.address = str(directory / "bus.sock")
        self.log_path = directory / "broker.log"
        known = subprocess.run([sys.executable, "-m", "sbus.cli", "serve", "--help"],
                               capture_output=True, text=True).stdout
        self.args = [a for k, v in SOAK_LIMITS.items() if k in known for a in (k, v)]
        self.missing = [k for k in SOAK_LIMITS if k not in known]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sbus.cli", "serve", "--address", self.address,
                 "--mode", "666", *self.args], stdout=log, stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.nice(-5),
                env={k: v for k, v in os.environ.items()
                     if k not in ("LISTEN_FDS", "NOTIFY_SOCKET")})
        end = time.monotonic() + 20
        while True:
            try:
                roundtrip(connect(self.address), 5)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise SystemExit(f"hostile: broker did not start: {self.log()}") from None
                time.sleep(0.1)
        self.pid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def attack_plan(seconds: float) -> list[tuple[int, str, dict]]:
    """Every broker attack class, split over the two attacking users."""
    a, b = ATTACKERS
    return [
        (a, "cache_attack", {"seconds": seconds, "key_len": 20_000}),
        (a, "trie_attack", {"seconds": seconds}),
        (a, "reply_attack", {"seconds": seconds, "connections": 50}),
        (a, "blocker", {"seconds": seconds}),
        (a, "log_attack", {"seconds": seconds, "reconnects": 50, "connections": 100}),
        (a, "churn_attack", {"seconds": seconds, "pattern": b"*/%d"}),
        (a, "fanout_attack", {"seconds": seconds, "subscribers": 300}),
        (a, "crowd_attack", {"seconds": seconds, "connections": 100}),
        (b, "paused_attack", {"seconds": seconds, "publishers": 100}),
        (b, "tiny_attack", {"seconds": seconds, "count": 400_000}),
        (b, "sub_batch_attack", {"seconds": seconds}),
        (b, "order_attack", {"seconds": seconds, "fill": 300_000}),
        (b, "prefix_attack", {"seconds": seconds, "siblings": 5000}),
        (b, "walk_attack", {"seconds": seconds, "depth": 24}),
        (b, "accept_storm", {"seconds": seconds}),
        # within the soak's 4 MiB of subscriptions per user: 8 long patterns, 50 clients
        (b, "status_attack", {"seconds": seconds, "long": 8, "clients": 50}),
    ]


def run(address: str, broker_pid: int, duration: float, cap_kib: int,
        without: frozenset[str] = frozenset()) -> tuple[dict, list]:
    honest_a, honest_b = HONEST
    base = rss_kib(broker_pid)
    t = duration + 10
    honest = {
        "prober": Role(honest_a, "prober", address, seconds=duration, nice=-5),
        "reliable": Role(honest_b, "reliable_pair", address, seconds=duration),
        "cross_reader": Role(honest_b, "cross_reader", address, seconds=t,
                             prefix=b"honest/cross/", flush=True),
    }
    secrets = [Role(uid, "secret_user", address, seconds=duration)
               for uid in (*HONEST, ATTACKERS[0])]
    owns = [s.wait_state(10) for s in secrets]
    for s in secrets:
        s.pipe.send([o for o in owns if o])
    honest["cross_reader"].wait_state(10)
    # attackers at nice 19: on two cores their twenty busy processes would otherwise take
    # the CPU from the broker itself, and the soak would measure the kernel's scheduler,
    # not whether the broker's loop serves everyone (a real system bus runs as a service,
    # its cgroup weighted against users' processes)
    attackers = [Role(uid, name, address, **{"nice": 19, **params})
                 for uid, name, params in attack_plan(duration) if name not in without]
    honest["cross_pub"] = Role(honest_a, "sequenced_publisher", address, seconds=duration,
                               key=b"honest/cross/a", rate=CROSS_RATE, flush=True)
    peak, capped = base, False
    end = time.monotonic() + duration
    while time.monotonic() < end:
        rss = rss_kib(broker_pid)
        peak = max(peak, rss)
        if rss - base > cap_kib and not capped:
            capped = True
            for r in attackers:
                r.stop()
        time.sleep(0.05)
    # the cross-user reader is stopped once its publisher is done: then a whoami round
    # trip brings it what is still on its way (both say `flush`)
    results = {name: r.finish() for name, r in honest.items() if name != "cross_reader"}
    results["cross_reader"] = honest["cross_reader"].finish()
    attacks = {f"{r.name}@{r.uid}": r.finish() for r in attackers}
    secret_stats = Counter()
    for s in secrets:
        secret_stats.update({k: v for k, v in s.finish().items() if isinstance(v, int)})
    problems = []
    budget = per_user_budget_kib() * len(ATTACKERS) + CONSTANT_KIB
    grown = peak - base
    if capped:
        problems.append(f"broker RSS passed the cap: +{grown} KiB; the attacks were stopped")
    if grown > budget:
        problems.append(f"broker RSS grew by {grown} KiB, over the bound {budget} KiB "
                        f"({len(ATTACKERS)} attacking users x {per_user_budget_kib()} KiB "
                        f"+ {CONSTANT_KIB} KiB)")
    lat = latency_figures(results["prober"].get("latencies", []))
    if lat["p99_ms"] is None or lat["p99_ms"] >= 50:
        problems.append(f"honest whoami p99 {lat['p99_ms']} ms (max {lat['max_ms']} ms): "
                        f"must stay under 50 ms")
    elif lat["max_ms"] >= MAX_STALL_MS:  # a freeze of seconds hides in a fast p99
        problems.append(f"honest whoami waited {lat['max_ms']} ms once: the broker stalled "
                        f"(allowed {MAX_STALL_MS} ms on a loaded machine)")
    rel = results["reliable"]
    if rel.get("sent", 0) == 0 or rel.get("received") != rel.get("sent") \
            or rel.get("out_of_order"):
        problems.append(f"honest reliable reader: {rel}")
    sent = results["cross_pub"].get("sent", 0)
    got = results["cross_reader"].get("got", {}).get("honest/cross/a", 0)
    if sent < CROSS_RATE * duration * 0.8:
        problems.append(f"cross-user publisher sent {sent} of {CROSS_RATE * duration:.0f} in "
                        f"{duration} s: it was held back (another user's block?)")
    if sent == 0 or got != sent or results["cross_reader"].get("out_of_order"):
        problems.append(f"cross-user reader got {got} of {sent} (another user's block must "
                        f"not pause this publisher): {results['cross_reader']}")
    if secret_stats["secret_leaks"] or not secret_stats["secrets_received"]:
        problems.append(f"secrets: {dict(secret_stats)}")
    for name, res in results.items():  # an attacker's error is in its table row
        if "error" in res:
            problems.append(f"{name} failed: {res['error']}")
    figures = {
        "duration_s": duration,
        "attacks": len(attackers),
        "rss_base_kib": base,
        "rss_peak_kib": peak,
        "rss_growth_kib": grown,
        "rss_bound_kib": budget,
        "whoami_probes": lat["probes"],
        "whoami_p50_ms": lat["p50_ms"],
        "whoami_p99_ms": lat["p99_ms"],
        "whoami_max_ms": lat["max_ms"],
        "reliable_sent": rel.get("sent"),
        "reliable_received_in_order": rel.get("received") if not rel.get("out_of_order")
        else 0,
        "cross_user_sent": sent,
        "cross_user_received": got,
        "secrets_received": secret_stats["secrets_received"],
        "secret_leaks": secret_stats["secret_leaks"],
    }
    for name, res in attacks.items():
        figures[f"attack {name}"] = " ".join(f"{k}={v}" for k, v in res.items())
    return figures, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=120, help="seconds of attack (120)")
    ap.add_argument("--address", help="attack this broker instead of starting one")
    ap.add_argument("--broker-pid", type=int, help="its pid, for RSS (with --address)")
    ap.add_argument("--cap", default="400m", help="stop the attacks once broker RSS grew "
                                                  "this much (default 400m)")
    ap.add_argument("--without", action="append", default=[], metavar="ROLE",
                    help="leave this attack out (e.g. accept_storm), to see the others")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args(argv)
    if os.getuid() != 0:
        print("hostile: run as root (roles setuid to other users)", file=sys.stderr)
        return 2
    directory = Path(tempfile.mkdtemp(prefix="sbus-hostile-", dir="/tmp"))
    os.chmod(directory, 0o755)
    broker = None
    if args.address:
        address, pid = args.address, args.broker_pid or 0
    else:
        broker = OwnBroker(directory)
        address, pid = broker.address, broker.pid
    status = 1
    try:
        figures, problems = run(address, pid, args.duration, parse_size(args.cap) // 1024,
                                frozenset(args.without))
        if broker is not None:
            if broker.proc.poll() is not None:
                problems.append(f"the broker died (exit {broker.proc.returncode})")
            log = broker.log()
            if "Traceback" in log:
                problems.append("the broker logged a traceback")
            figures["broker_log_lines"] = log.count("\n")
            figures["broker_log_longest_line"] = max(map(len, log.splitlines()), default=0)
            if broker.missing:
                figures["broker_lacks_flags"] = " ".join(broker.missing)
        width = max(map(len, figures))
        print(f"{'figure':<{width}}  value")
        for k, v in figures.items():
            print(f"{k:<{width}}  {v}")
        for p in problems:
            print(f"PROBLEM: {p}")
        print("hostile: " + ("FAILED" if problems else "OK: memory bounded, honest round "
                             "trips fast, nothing lost, no secret leaked"))
        if args.json:
            print("JSON " + json.dumps({"figures": figures, "problems": problems}))
        status = 1 if problems else 0
        return status
    finally:
        if broker is not None:
            broker.stop()
        if status == 0:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"hostile: files kept in {directory}")


if __name__ == "__main__":
    sys.exit(main())
