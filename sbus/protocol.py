"""The sbus wire protocol, sans-IO: one packet in, one event out, and back.

Every packet on the SOCK_SEQPACKET socket is exactly one message, so there is no
framing state: `parse` is a pure function of one packet's bytes. Keys, patterns
and payloads are bytes; nothing here decodes text.

Grammar (from the protocol text, as regular expressions over bytes)::

    SUB <pattern>[\\0<ignored>]      ^SUB ([^\\0]*)(\\0.*)?$
    UNSUB <pattern>[\\0<ignored>]    ^UNSUB ([^\\0]*)(\\0.*)?$
    MSG <key>\\0<payload>            ^MSG ([^\\0]*)\\0(.*)$
    CMSG <key>[\\0<payload>]         ^CMSG ([^\\0]*)(\\0(.*))$  (\\0 part optional from clients)
"""

from __future__ import annotations

from dataclasses import dataclass

from .display import brief

__all__ = [
    "Subscribe",
    "Unsubscribe",
    "Publish",
    "Control",
    "Event",
    "ProtocolError",
    "parse",
    "encode",
    "publish_key",
    "MSG_VERB",
    "WHOAMI",
    "DROPPED",
    "REFUSED",
    "PUBLISHER_NOWAIT",
    "PUBLISHER_FOR",
    "OWNER_LIMIT",
    "FIRST_NON_UID",
    "STATUS",
    "REACH",
    "parse_batch",
    "publish_head",
    "SOFT",
    "HARD",
    "ORDER",
]

#: The four bytes every publish starts with (the fast paths compare them directly).
MSG_VERB = b"MSG "

# Control keys, each defined once (docs/protocol.md explains them).
#: client -> broker: "who am I?"; broker -> client: the answer, ``!/cred/GID/UID/PID``.
WHOAMI = b"!/cred/whoami"
#: broker -> client: payload is the decimal count of messages dropped for this client.
DROPPED = b"blocking/dropped"
#: broker -> client: ``refused/VERB`` (sub, unsub, msg, cmsg, packet): the client's packet
#: was refused; the payload is one line of UTF-8 saying why.
REFUSED = b"refused"
#: client -> broker: this connection publishes for many parties (a gateway, a mount):
#: never pause it; a subscriber that would block it loses the message (counted) instead.
PUBLISHER_NOWAIT = b"blocking/publisher/nowait"
#: client -> broker, from a trusted user only (root, ``sbus serve --trusted-user``):
#: ``PUBLISHER_FOR\0N``, "my next messages are user N's" (a mount's writer, a gateway's
#: remote client): each user's share of a full queue is then that user's; an empty
#: payload, the connection's own UID again.  N: decimal, below `OWNER_LIMIT`.
PUBLISHER_FOR = b"blocking/publisher/for"
OWNER_LIMIT = 1 << 62
#: The first owner number that is no UID (UIDs are 32-bit): for users a carrier tells
#: apart itself, such as the gateway's peer addresses.
FIRST_NON_UID = 1 << 32
#: client -> broker: "tell me about yourself" (payload optional: ``{"after": ID}``);
#: broker -> client: a JSON object (sbus/introspect.py, docs/protocol.md).
STATUS = b"broker/status"
#: client -> broker: ``REACH\0KEY``, "how many subscribers would a message of mine on KEY
#: reach?"; broker -> client: ``REACH\0KEY\0N`` (N decimal), or ``REACH\0KEY\0?`` for a
#: secret key of another process (whose subscriptions are nobody else's business).
REACH = b"broker/reach"
#: client -> broker: the payload is this client's own one-line status (a bridge's
#: counters, say), shown beside it by ``broker/status`` to whoever may see the client;
#: cut to `CLIENT_STATUS_BYTES`, an empty payload clears it.
CLIENT_STATUS = b"client/status"
CLIENT_STATUS_BYTES = 200
#: client -> broker, flood control: ``SOFT/queue|discard|block|error``,
#: ``HARD/discard|block|error``, ``ORDER/queue|stack|random`` (sbus/flood.py).
SOFT = b"blocking/soft"
HARD = b"blocking/hard"
ORDER = b"order"


@dataclass(frozen=True, slots=True)
class Subscribe:
    pattern: bytes


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    pattern: bytes


@dataclass(frozen=True, slots=True)
class Publish:
    key: bytes
    payload: bytes


@dataclass(frozen=True, slots=True)
class Control:
    key: bytes
    #: None when the packet had no ``\\0payload`` part (allowed from clients only).
    payload: bytes | None = None


Event = Subscribe | Unsubscribe | Publish | Control
_SET_KEY, _SET_PAYLOAD = Publish.key.__set__, Publish.payload.__set__  # type: ignore[attr-defined]


class ProtocolError(ValueError):
    """A packet that matches none of the protocol's four message forms."""


def _describe(packet: bytes) -> str:
    return brief(packet, 24)


def parse(packet: bytes) -> Event:
    """Turn one packet into an event, or raise `ProtocolError` saying why not."""
    if not packet:
        raise ProtocolError("empty packet")
    space = packet.find(b" ", 0, 6)
    verb = packet[:space] if space > 0 else b""
    if verb == b"MSG":
        nul = packet.find(b"\0", 4)
        if nul < 0:
            raise ProtocolError(f"MSG without NUL after the key: {_describe(packet)}")
        return Publish(packet[4:nul], packet[nul + 1 :])
    if verb == b"SUB" or verb == b"UNSUB":
        start = space + 1
        nul = packet.find(b"\0", start)
        pattern = packet[start:] if nul < 0 else packet[start:nul]
        return Subscribe(pattern) if verb == b"SUB" else Unsubscribe(pattern)
    if verb == b"CMSG":
        nul = packet.find(b"\0", 5)
        if nul < 0:
            return Control(packet[5:], None)
        return Control(packet[5:nul], packet[nul + 1 :])
    raise ProtocolError(f"unknown message type: {_describe(packet)}")


def parse_batch(buf, offsets, lengths, others: list[int] | None = None) -> list[Event]:
    """`parse` for many packets in one buffer (``buf[offsets[i]:offsets[i] + lengths[i]]``,
    *buf* a bytes-like object with ``find`` and slicing to bytes, e.g. an mmap): the
    events in order.  A ``MSG`` takes the fast path (one ``find``, two slices); anything
    else goes through `parse`, which raises `ProtocolError` for a malformed packet; the
    indices of those events are appended to *others* (so a caller need not look at every
    event to find the few that are not messages)."""
    out: list[Event] = []
    append = out.append
    find = buf.find
    new, set_key, set_payload = object.__new__, _SET_KEY, _SET_PAYLOAD
    for i, (at, size) in enumerate(zip(offsets, lengths, strict=False)):
        end = at + size
        if size > 4 and find(MSG_VERB, at, at + 4) == at:
            nul = find(b"\0", at + 4, end)
            if nul >= 0:
                # a `Publish` made field by field: the dataclass's frozen __init__ costs
                # twice as much, and this is the whole per-message cost of a fast reader
                event = new(Publish)
                set_key(event, buf[at + 4:nul])
                set_payload(event, buf[nul + 1:end])
                append(event)
                continue
        append(parse(buf[at:end]))
        if others is not None:
            others.append(i)
    return out


def encode(event: Event) -> bytes:
    """Turn an event into the packet that carries it."""
    match event:
        case Publish(key, payload):
            _check_key(key)
            return b"MSG " + key + b"\0" + payload
        case Subscribe(pattern):
            _check_key(pattern)
            return b"SUB " + pattern
        case Unsubscribe(pattern):
            _check_key(pattern)
            return b"UNSUB " + pattern
        case Control(key, payload):
            _check_key(key)
            return b"CMSG " + key if payload is None else b"CMSG " + key + b"\0" + payload
    raise TypeError(f"not an sbus event: {event!r}")


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray | memoryview):
        raise TypeError(f"keys and patterns are bytes, not {type(key).__name__}")
    if b"\0" in key:
        raise ProtocolError("a routing key or pattern cannot contain NUL")


def publish_head(key: bytes) -> bytes:
    """What every packet publishing on *key* starts with: a fast publisher sends
    ``publish_head(key) + payload`` (the same bytes as `encode`)."""
    _check_key(key)
    return MSG_VERB + key + b"\0"


def publish_key(packet: bytes) -> bytes | None:
    """The routing key of a well-formed MSG packet, else None: the broker's fast path."""
    if packet[:4] == MSG_VERB:
        nul = packet.find(b"\0", 4)
        if nul >= 0:
            return packet[4:nul]
    return None
