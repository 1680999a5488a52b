"""A broker's state as plain data, for the broker that follows it (zero-downtime
restart): encode/decode only, no I/O.

What crosses: every client's subscriptions (with their counts), flood policy, the
packets waiting in its queue (in arrival order, with their users: each keeps its share
of the queue across the restart) and the drops not yet reported to it,
plus the broker's counters.  Sockets cross separately (the systemd fd store, or
inheritance across ``exec``): all of them in flight inside one socket, the
``sbus-clients`` carrier (sbus/server.py), in the snapshot's order of clients -- one
fd-store entry and one short name whatever the number of clients (a name per client
would not fit ``LISTEN_FDNAMES`` beyond about 10,000: an environment string is limited
to 128 KiB).  Credentials are not in the snapshot at all: the successor asks the kernel
again (``SO_PEERCRED`` of the same socket).  The snapshot carries its format version:
a successor reads its own and the one before (`READS`), and refuses any other
(`HandoverError`), starting as after an ordinary restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from .defaults import DEFAULT_HARD, DEFAULT_ORDER, DEFAULT_SOFT

__all__ = ["FORMAT", "SNAPSHOT_NAME", "CLIENTS_NAME", "ClientState", "State",
           "HandoverError", "encode", "decode", "is_handover_name"]

#: Bump when the snapshot's layout or meaning changes (3: the users of queued packets;
#: 2: the clients in one carrier; 1 passed one descriptor per client, named
#: ``client-ID``).
FORMAT = "sbus-handover/3"
#: Formats this broker takes over: its own, and 2's (an upgrade from it): its queued
#: packets come without their users.
READS = (FORMAT, "sbus-handover/2")
#: The fd name of the snapshot (a memfd).
SNAPSHOT_NAME = "sbus-snapshot"
#: The fd name of the socket that holds every client socket in flight.
CLIENTS_NAME = "sbus-clients"
_FORMAT1_CLIENT = "client-"


class HandoverError(ValueError):
    """A snapshot this broker cannot take over (another version, or damaged)."""


@dataclass
class ClientState:
    id: int
    patterns: list[tuple[bytes, int]] = field(default_factory=list)
    soft: bytes = DEFAULT_SOFT
    hard: bytes = DEFAULT_HARD
    order: bytes = DEFAULT_ORDER
    nowait: bool = False
    queued: list[bytes] = field(default_factory=list)  # oldest first
    dropped: int = 0  # not yet reported with blocking/dropped
    owner: int | None = None  # whose share its messages take, if not its own (9th entry)
    #: the user of each queued packet (None: the broker's own), or None if not known
    #: (format 2)
    queued_owners: list[int | None] | None = None


@dataclass
class State:
    sep: bytes
    counters: dict[str, int]
    clients: list[ClientState]


def is_handover_name(name: str) -> bool:
    """Whether a passed descriptor's name is a predecessor's (of this format or of 1)."""
    return name in (SNAPSHOT_NAME, CLIENTS_NAME) or name.startswith(_FORMAT1_CLIENT)


def encode(state: State) -> bytes:
    clients = [[c.id, [[p, n] for p, n in c.patterns], c.soft, c.hard, c.order, c.nowait,
                c.queued, c.dropped, c.owner, c.queued_owners]
               for c in state.clients]
    return msgpack.packb([FORMAT, state.sep, state.counters, clients], use_bin_type=True)


def decode(data: bytes) -> State:
    try:
        fmt, sep, counters, clients = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise HandoverError(f"the snapshot cannot be read: {exc}") from None
    if fmt not in READS:
        raise HandoverError(f"the snapshot is of format {fmt!r}, this broker reads {FORMAT!r}")
    try:
        return State(_bytes(sep), {str(k): int(v) for k, v in counters.items()}, [
            ClientState(int(cid), [(_bytes(p), int(n)) for p, n in patterns], _bytes(soft),
                        _bytes(hard), _bytes(order), bool(nowait),
                        [_bytes(q) for q in queued], int(dropped), *_rest(fmt, rest))
            for cid, patterns, soft, hard, order, nowait, queued, dropped, *rest in clients])
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        raise HandoverError(f"the snapshot is damaged: {exc}") from None


def _rest(fmt: str, rest: list) -> tuple[int | None, list[int | None] | None]:
    """A client's owner and its queued packets' users: two more entries in this format,
    none or the owner in format 2."""
    if fmt == FORMAT:
        owner, owners = rest
        return (None if owner is None else int(owner),
                None if owners is None else [None if o is None else int(o) for o in owners])
    (owner,) = rest or (None,)
    return None if owner is None else int(owner), None


def _bytes(value: object) -> bytes:
    """Bytes as they were stored (``bytes(n)`` of a stored number would allocate n)."""
    if not isinstance(value, bytes):
        raise TypeError(f"{type(value).__name__} where bytes belong")
    return value
