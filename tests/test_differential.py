"""Differential runs: random workloads against a real broker, checked by the reference model.

Raw SOCK_SEQPACKET clients (no client library) subscribe, unsubscribe, publish,
send junk and reconnect at random.  Each operation is followed by a whoami round
trip of the client that made it, so the broker has handled it (and fanned it out)
before the next one: that fixes one global order, in which the brute-force
`reference.Bus` predicts exactly which packets each client must receive, byte for
byte and in order.  Secret subscriptions are decided by construction (own, empty,
foreign or wildcard credential fields; truncated prefixes), not by `KeyRules`.
"""

from __future__ import annotations

import os
import random
import socket

import pytest
from conftest import raw
from reference import Bus, reference_match

OPS = 3000
SEEDS = [1, 2, 3, 4]


class Peer:
    """One raw client and everything it has received so far."""

    def __init__(self, address: str, sep: bytes) -> None:
        self.sock = raw(address)
        self.whoami = b"CMSG !" + sep + b"cred" + sep + b"whoami"
        self.inbox: list[bytes] = []
        self.refusals: list[bytes] = []  # the verb of each ``CMSG refused/VERB`` received

    def send(self, packet: bytes) -> None:
        self.sock.send(packet)

    def sync(self) -> None:
        """Round trip through the broker; keep what arrives meanwhile."""
        self.sock.send(self.whoami)
        while True:
            p = self.sock.recv(1 << 20)
            if p.startswith(self.whoami + b"\0"):
                return
            if p.startswith(b"CMSG refused/"):
                self.refusals.append(p[13:p.index(b"\0")])
            else:
                self.inbox.append(p)


class Workload:
    def __init__(self, rng: random.Random, sep: bytes, cred: tuple[int, int, int]) -> None:
        self.rng = rng
        self.sep = sep
        self.own = [b"%d" % n for n in cred]
        self.other = [b"%d" % (n + 1) for n in cred]

    def segments(self, wild: bool) -> bytes:
        atoms = [b"a", b"b", b"ab", b""] + ([b"*", b"a*", b"*", b"b*c"] if wild else [b"abc"])
        n = self.rng.randint(1, 4)
        return self.sep.join(self.rng.choice(atoms) for _ in range(n))

    def public_pattern(self) -> bytes:
        r = self.rng.random()
        if r < 0.05:
            return b""
        return self.segments(True) + (self.sep if r < 0.35 else b"")

    def secret_pattern(self) -> tuple[bytes, bytes | None]:
        """A secret pattern and what the broker stores for it (None: refused)."""
        sep, rng = self.sep, self.rng
        kind = rng.choice(["own", "empty", "mixed", "foreign", "wild", "truncated", "bare"])
        rest = self.public_pattern()
        if kind == "truncated":
            return sep.join([b"!", b"cred", self.own[0]]) + sep, None
        if kind == "bare":
            return b"!" + sep, None
        if kind == "own":
            fields = list(self.own)
        elif kind == "empty":
            fields = [b"", b"", b""]
        elif kind == "mixed":
            fields = [rng.choice([b"", f]) for f in self.own]
        else:
            fields = list(self.own)
            fields[rng.randrange(3)] = self.other[0] if kind == "foreign" else b"*"
        pattern = sep.join([b"!", b"cred", *fields]) + sep + rest
        if kind in ("foreign", "wild"):
            return pattern, None
        return pattern, sep.join([b"!", b"cred", *self.own]) + sep + rest

    def key(self) -> bytes:
        r = self.rng.random()
        if r < 0.25:
            creds = self.own if r < 0.18 else self.other
            return self.sep.join([b"!", b"cred", *creds]) + self.sep + self.segments(False)
        return self.segments(False)

    def payload(self) -> bytes:
        if self.rng.random() < 0.01:
            return os.urandom(150_000)
        return self.rng.randbytes(self.rng.randint(0, 40))


#: Junk packets and the verb the broker names when it refuses each.
JUNK = {b"": b"packet", b"HELLO": b"packet", b"MSG no-nul": b"packet", b"SUB": b"packet",
        b"UNSUB": b"packet", b"\0\0\0": b"packet", b"CMSG nonsense/x": b"cmsg",
        b"MSG": b"packet", b"PUB a\0b": b"packet"}


def run_workload(address: str, sep: bytes, seed: int, ops: int = OPS) -> dict[str, int]:
    rng = random.Random(seed)
    peers = [Peer(address, sep) for _ in range(5)]
    cred = (os.getgid(), os.getuid(), os.getpid())
    work = Workload(rng, sep, cred)
    model = Bus(sep)
    expected: dict[int, list[bytes]] = {id(p): [] for p in peers}
    retired: list[Peer] = []
    subs: dict[int, list[bytes]] = {id(p): [] for p in peers}
    refusals: dict[int, list[bytes]] = {id(p): [] for p in peers}
    stats = {"sub": 0, "refused": 0, "unsub": 0, "pub": 0, "delivered": 0, "junk": 0,
             "reconnect": 0}
    for step in range(ops):
        i = rng.randrange(len(peers))
        peer = peers[i]
        r = rng.random()
        if r < 0.30:
            if rng.random() < 0.3:
                pattern, stored = work.secret_pattern()
            else:
                pattern = stored = work.public_pattern()
            peer.send(b"SUB " + pattern + (b"\0trailer" if rng.random() < 0.1 else b""))
            if stored is None:
                stats["refused"] += 1
                refusals[id(peer)].append(b"sub")
            else:
                model.subscribe(id(peer), stored)
                subs[id(peer)].append(pattern)
                stats["sub"] += 1
        elif r < 0.42:
            mine = subs[id(peer)]
            if mine and rng.random() < 0.8:
                pattern = mine.pop(rng.randrange(len(mine)))
            else:
                pattern = work.public_pattern()
            stored = pattern
            if pattern.startswith(b"!" + sep):
                stored = sep.join([b"!", b"cred", *work.own]) + sep + pattern.split(sep, 5)[5]
            peer.send(b"UNSUB " + pattern)
            if not model.unsubscribe(id(peer), stored):
                refusals[id(peer)].append(b"unsub")
            stats["unsub"] += 1
        elif r < 0.92:
            key = work.key()
            packet = b"MSG " + key + b"\0" + work.payload()
            peer.send(packet)
            for target in model.match(key):
                expected[target].append(packet)
                stats["delivered"] += 1
            stats["pub"] += 1
        elif r < 0.97:
            junk = rng.choice(list(JUNK))
            peer.send(junk)
            refusals[id(peer)].append(JUNK[junk])
            stats["junk"] += 1
        else:
            # disconnect abruptly (maybe with unread packets) and come back as a new client
            peer.sync()
            peer.sock.close()
            model.remove_client(id(peer))
            retired.append(peer)
            peers[i] = Peer(address, sep)
            expected[id(peers[i])] = []
            subs[id(peers[i])] = []
            refusals[id(peers[i])] = []
            stats["reconnect"] += 1
            continue
        peer.sync()
        if step % 50 == 49:
            for p in peers:
                p.sync()
    for p in peers:
        p.sync()
    for p in retired + peers:
        assert p.inbox == expected[id(p)], _first_difference(p.inbox, expected[id(p)])
        assert p.refusals == refusals[id(p)]  # each refused packet answered, in order
    for p in peers:
        p.sock.close()
    return stats


def _first_difference(got: list[bytes], want: list[bytes]) -> str:
    for n, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return f"packet {n}: got {g[:60]!r}, expected {w[:60]!r}"
    return f"got {len(got)} packets, expected {len(want)}"


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_matches_the_model(broker, seed: int) -> None:
    stats = run_workload(broker.address, b"/", seed)
    assert stats["delivered"] > 50 and stats["refused"] > 5 and stats["reconnect"] > 0
    log = broker.log()
    assert "Traceback" not in log


def test_random_workload_early_draft_dialect(make_broker) -> None:
    b = make_broker("--separator", ".")
    stats = run_workload(b.address, b".", seed=7)
    assert stats["delivered"] > 50


def test_model_predictions_are_not_vacuous() -> None:
    """Guard the guard: the generated workload exercises wildcards, tails and secrets."""
    rng = random.Random(1)
    work = Workload(rng, b"/", (1, 2, 3))
    pats = [work.public_pattern() for _ in range(200)]
    keys = [work.key() for _ in range(200)]
    hits = sum(reference_match(p, k) for p in pats for k in keys)
    assert 0 < hits < len(pats) * len(keys)
    assert any(k.startswith(b"!/cred/1/2/3/") for k in keys)
    assert any(work.secret_pattern()[1] for _ in range(20))


def test_whoami_matches_this_process(broker) -> None:
    """The differential model assumes the broker reports our real credentials."""
    p = Peer(broker.address, b"/")
    p.sock.send(b"CMSG !/cred/whoami")
    answer = p.sock.recv(1024)
    assert answer == b"CMSG !/cred/whoami\0!/cred/%d/%d/%d" % (
        os.getgid(), os.getuid(), os.getpid())
    assert p.sock.type == socket.SOCK_SEQPACKET
