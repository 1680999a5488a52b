"""What the gateway lets remote peers hold: connections and shared byte pools (pure, no I/O).

A remote peer has no UID to charge, only an address.  The gateway bounds what any
number of peers can make it hold by a total connection cap and a cap per peer
address (so one host cannot take every slot), and bounds the bytes shared by all
connections (outgoing buffers, subscriptions) by pools with a fixed size.  Each
per-connection structure is bounded on its own, and each peer address (`Peer`) has a
share of the pools, so the gateway's memory is at most the caps times those bounds
plus the pools, and one host cannot take what the others need.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from collections import Counter
from collections.abc import Iterable

from ..protocol import FIRST_NON_UID

__all__ = ["Caps", "Peer", "Pool", "Tarpit", "owner_of", "peer_group", "peer_of"]


def peer_group(host: str) -> str:
    """What caps and log rations are counted by: the IPv4 address (also when mapped into
    IPv6), or the IPv6 /64 (one host usually owns a whole /64, so a per-address cap on
    single IPv6 addresses would be no cap)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return host


def peer_of(stream: object) -> tuple[str, str]:
    """(group, host:port) of the peer of *stream*: caps and log rations count by the
    group (`admission.peer_group`: the IPv4 address or the IPv6 /64)."""
    sock_stream = getattr(stream, "transport_stream", stream)
    try:
        host, port = sock_stream.socket.getpeername()[:2]
    except (AttributeError, OSError):
        return "?", "?"
    return peer_group(host), (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


#: The key of `owner_of`'s hash: this process's own, so no address can be chosen to
#: share another's number.
_OWNER_KEY = os.urandom(16)


def owner_of(host: str) -> int:
    """The number under which the broker counts a peer address's publishes (its share of
    a full local queue): the same for the address as long as the gateway runs, whether
    its connections come and go (a new number per connection would give a flooder a
    fresh share with each reconnect), and none a UID (from `FIRST_NON_UID`).  A keyed
    hash: nothing is kept per address."""
    digest = hashlib.blake2b(host.encode(), key=_OWNER_KEY, digest_size=7).digest()
    return FIRST_NON_UID + int.from_bytes(digest, "big")


class Peer:
    """What all connections from one peer address hold together: connections, outgoing
    bytes queued (bounded by *queue_limit*), the distinct patterns they subscribe, what
    their subscriptions take of the gateway's subscription pool, their turn (the
    server's lock that lets one of them work at a time), their TLS handshakes in
    progress (the server's semaphore), their outgoing buffers (`boxes`: where
    `outbox.make_room` takes frames from an address holding too much of the pool) and
    the messages discarded for them since the last line said so, by cause, and what
    their incomplete frames hold."""

    __slots__ = ("host", "conns", "queued", "queue_limit", "sub_bytes", "patterns",
                 "pool_bytes", "turn", "handshakes", "owner", "boxes", "evict_at",
                 "dropped", "half_frames")

    def __init__(self, host: str, queue_limit: int = 1 << 62) -> None:
        self.host = host
        #: whose share of a full local queue its publishes take (`Bridge.publish_packets`)
        self.owner = owner_of(host)
        self.conns = 0
        self.queued = 0
        self.queue_limit = queue_limit
        self.sub_bytes = 0  # the cost of `patterns`, each counted once
        self.patterns: Counter[bytes] = Counter()  # distinct patterns -> its clients holding
        self.pool_bytes = 0  # its clients' subscriptions, each client's counted in full
        self.turn: object = None  # made by the server at the address's first read
        self.handshakes: object = None  # made by the server at its first TLS handshake
        self.boxes: list = []  # its clients' `Outbox`es
        self.evict_at = 0  # the last of `boxes` evicted from
        self.dropped = [0, 0, 0]  # discarded for its clients, by `outbox.CAUSES`
        self.half_frames = 0  # what its connections' incomplete frames hold


class Caps:
    """Open connections, in total and per peer address (each address a `Peer`)."""

    __slots__ = ("total", "per_peer", "open", "_by_peer", "refused", "queue_limit")

    def __init__(self, total: int, per_peer: int, queue_limit: int = 1 << 62) -> None:
        if total < 1 or per_peer < 1:
            raise ValueError("connection caps must be positive")
        self.total = total
        self.per_peer = per_peer
        self.queue_limit = queue_limit  # outgoing bytes one address may have queued
        self.open = 0
        self._by_peer: dict[str, Peer] = {}
        self.refused = 0  # connections turned away, ever

    def admit(self, host: str) -> str | None:
        """Take a slot for a connection from *host*; None if admitted, else why not."""
        if self.open >= self.total:
            self.refused += 1
            return f"at the cap of {self.total} connections"
        peer = self._by_peer.get(host)
        if peer is not None and peer.conns >= self.per_peer:
            self.refused += 1
            return f"at the cap of {self.per_peer} connections from one address"
        if peer is None:
            peer = self._by_peer[host] = Peer(host, self.queue_limit)
        self.open += 1
        peer.conns += 1
        return None

    def peer(self, host: str) -> Peer:
        """The account of an admitted address."""
        return self._by_peer[host]

    def accounts(self) -> Iterable[Peer]:
        """The accounts of the addresses with connections."""
        return self._by_peer.values()

    def release(self, host: str) -> None:
        self.open -= 1
        peer = self._by_peer[host]
        peer.conns -= 1
        if peer.conns <= 0:
            del self._by_peer[host]

    def peers(self) -> int:
        return len(self._by_peer)


class Pool:
    """Bytes shared by every connection (e.g. all outgoing buffers together)."""

    __slots__ = ("limit", "used", "heaviest", "left_out")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        #: The addresses holding the most of the buffer pool, and the most held by one
        #: left out of them when they were found: `outbox.make_room`.
        self.heaviest: list[Peer] = []
        self.left_out = 0

    def fits(self, n: int) -> bool:
        return self.used + n <= self.limit

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class Tarpit:
    """Connections turned away at the caps, held open and unread for a while before they
    are closed: clients that redial the moment they are closed (the getlantern/pubsub Go
    client does) then make one attempt per hold, not thousands a second.  The tarpit is
    bounded in total and per peer address, so it cannot become what an attacker
    exhausts; past its bounds a connection is closed at once (counted in `overflow`)."""

    __slots__ = ("total", "per_peer", "held", "_by_peer", "overflow")

    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self.held = 0
        self._by_peer: dict[str, int] = {}
        self.overflow = 0  # closed at once: the tarpit was full

    def take(self, host: str) -> bool:
        n = self._by_peer.get(host, 0)
        if self.held >= self.total or n >= self.per_peer:
            self.overflow += 1
            return False
        self.held += 1
        self._by_peer[host] = n + 1
        return True

    def give(self, host: str) -> None:
        self.held -= 1
        n = self._by_peer[host] - 1
        if n:
            self._by_peer[host] = n
        else:
            del self._by_peer[host]
