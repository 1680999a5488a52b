"""The gateway wire protocol, sans-IO: bytes in, frame events out, and back.

The stream is a sequence of MessagePack values without any length prefix.  A
keep-alive is the single value ``0`` (the byte ``0x00``); every other frame is
three consecutive values (not an array): the type as an integer, the topic as
bytes and the body as bytes or nil::

    0                       keep-alive (one value only)
    1, topic, secret        authenticate  (topic unused: nil or bytes)
    2, topic, body          subscribe     (body unused)
    3, topic, body          unsubscribe   (body unused)
    4, topic, body          publish       (nil body = empty body)

Decoding uses msgpack's streaming `Unpacker` with limits set, so a peer cannot
make us buffer more than one frame's worth of bytes.  An `Unpacker` costs about
40 KiB, so `FrameDecoder` only holds one while a frame is incomplete: an idle
connection, or one that only sends keep-alives, holds none.

Encoding is by hand (three tiny headers) because it is on the fan-out path; the
tests check it against ``msgpack.packb`` byte for byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from ..defaults import MAX_MESSAGE

__all__ = [
    "KeepAlive", "Authenticate", "Subscribe", "Unsubscribe", "Publish", "Frame",
    "FrameError", "FrameDecoder", "KEEPALIVE", "DEFAULT_MAX_FRAME",
    "keepalive", "authenticate", "subscribe", "unsubscribe", "publish", "encode",
]

KEEP_ALIVE, AUTHENTICATE, SUBSCRIBE, UNSUBSCRIBE, PUBLISH = range(5)

#: The keep-alive frame: the MessagePack value 0.
KEEPALIVE = b"\x00"

#: Topic plus body bytes of one frame; the broker's own default limit for a whole
#: ``MSG key\\0payload`` packet is 256 KiB, so a frame a little under it always fits.
DEFAULT_MAX_FRAME = MAX_MESSAGE - 1024

#: Bytes of an incomplete publish frame the decoder keeps itself (beyond: the unpacker,
#: whose buffer grows without copying everything at each read).
TAIL_BYTES = 4096

#: Bytes of MessagePack headers a frame may carry beyond its topic and body.
_OVERHEAD = 16


@dataclass(frozen=True, slots=True)
class KeepAlive:
    pass


@dataclass(frozen=True, slots=True)
class Authenticate:
    secret: bytes


@dataclass(frozen=True, slots=True)
class Subscribe:
    topic: bytes


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    topic: bytes


@dataclass(frozen=True, slots=True)
class Publish:
    topic: bytes
    body: bytes


Frame = KeepAlive | Authenticate | Subscribe | Unsubscribe | Publish

_KEEPALIVE_EVENT = KeepAlive()
_NAMES = {AUTHENTICATE: "authenticate", SUBSCRIBE: "subscribe",
          UNSUBSCRIBE: "unsubscribe", PUBLISH: "publish"}


class FrameError(ValueError):
    """The peer sent something that is not a valid frame; the message says what and where."""


# -- encoding ------------------------------------------------------------------

_bin16 = struct.Struct(">BH").pack
_bin32 = struct.Struct(">BI").pack


def _bin(data: bytes) -> bytes:
    """``data`` as a MessagePack bin value."""
    n = len(data)
    if n < 0x100:
        return bytes((0xC4, n)) + data
    if n < 0x10000:
        return _bin16(0xC5, n) + data
    if n < 0x1_0000_0000:
        return _bin32(0xC6, n) + data
    raise ValueError(f"{n} bytes cannot be one MessagePack bin value")


def keepalive() -> bytes:
    return KEEPALIVE


def authenticate(secret: bytes) -> bytes:
    """Topic is unused and sent as nil; the body is the secret."""
    return b"\x01\xc0" + _bin(secret)


def subscribe(topic: bytes) -> bytes:
    return b"\x02" + _bin(topic) + b"\xc0"


def unsubscribe(topic: bytes) -> bytes:
    return b"\x03" + _bin(topic) + b"\xc0"


def publish(topic: bytes, body: bytes) -> bytes:
    return b"\x04" + _bin(topic) + _bin(body)


def encode(frame: Frame) -> bytes:
    """Any frame event back to its bytes (the inverse of `FrameDecoder.feed`)."""
    match frame:
        case KeepAlive():
            return KEEPALIVE
        case Authenticate(secret):
            return authenticate(secret)
        case Subscribe(topic):
            return subscribe(topic)
        case Unsubscribe(topic):
            return unsubscribe(topic)
        case Publish(topic, body):
            return publish(topic, body)
    raise TypeError(f"not a gateway frame: {frame!r}")


# -- decoding ------------------------------------------------------------------

def _kind(value: object) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a float", bytes: "bytes", list: "an array",
            dict: "a map"}.get(type(value), type(value).__name__)


#: Memory of a msgpack `Unpacker` part-way through a frame besides the bytes it holds
#: (its fixed parse stack; docs/security.md measures ~44 KiB).
UNPACKER_BYTES = 44 * 1024


class FrameDecoder:
    """Streaming decoder: `feed` it bytes as they arrive, get back complete frames.

    Raises `FrameError` on the first thing that is not a valid frame; the stream
    cannot be resynchronised after that, so the caller should disconnect.
    ``str`` values are accepted where bytes are expected (older MessagePack
    encoders have only one raw type); the encoder always writes bin.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, read_size: int = 65536) -> None:
        #: Largest topic + body accepted, in bytes.
        self.max_frame = max_frame
        #: Largest chunk the caller passes to `feed`; with it, the unpacker's buffer
        #: limit only trips for a value that is really too big.
        self.read_size = read_size
        self._unpacker: msgpack.Unpacker | None = None
        self._fed = 0
        self._pending: list[object] = []  # values of the frame being assembled
        self._base = 0  # stream offset where the current unpacker started
        self._tail = b""  # the start of a frame split by hand, awaiting its rest
        self.offset = 0  # stream offset of the next unconsumed value, for messages

    def _new_unpacker(self) -> msgpack.Unpacker:
        limit = self.max_frame + _OVERHEAD
        return msgpack.Unpacker(
            raw=True, use_list=True, max_buffer_size=limit + self.read_size,
            max_bin_len=limit, max_str_len=limit,
            max_array_len=0, max_map_len=0, max_ext_len=0,
        )

    def feed(self, data: bytes) -> list[Frame]:
        """Frames completed by *data* (possibly none)."""
        if self._unpacker is None and not self._pending:
            # the common cases (keep-alives, publishes of bin topics and bodies) split by
            # hand: no unpacker; it takes over from the first frame that is anything else
            # (or an incomplete one over TAIL_BYTES)
            if self._tail:
                data = self._tail + data
                self._tail = b""
            lead, used, incomplete = self._split(data)
            self.offset += used
            if used == len(data):
                return lead
            rest = data[used:] if used else data
            if incomplete and len(rest) <= TAIL_BYTES:
                self._tail = rest  # the start of a frame written in pieces (the Go client)
                return lead
            return lead + self._unpack(rest) if lead else self._unpack(rest)
        return self._unpack(data)

    def _unpack(self, data: bytes) -> list[Frame]:
        """`feed` through the unpacker."""
        if len(data) > self.read_size:
            out: list[Frame] = []
            view = memoryview(data)
            for start in range(0, len(data), self.read_size):
                out += self.feed(bytes(view[start:start + self.read_size]))
            return out
        unpacker = self._unpacker
        if unpacker is None:
            unpacker = self._unpacker = self._new_unpacker()
            self._fed = 0
            self._base = self.offset
        try:
            unpacker.feed(data)
        except msgpack.BufferFull:
            raise FrameError(f"frame at byte {self.offset} is larger than the "
                             f"{self.max_frame}-byte limit") from None
        self._fed += len(data)
        frames: list[Frame] = []
        base = self._base
        pending = self._pending
        while True:
            try:
                value = unpacker.unpack()
            except msgpack.OutOfData:
                break
            except ValueError as exc:  # FormatError, StackError and limit errors
                what = str(exc) or {msgpack.FormatError: "not a valid MessagePack type byte",
                                    msgpack.StackError: "nested too deeply"}.get(
                                        type(exc), type(exc).__name__)
                for kind in ("array", "map", "ext"):
                    if f"max_{kind}_len" in what:
                        raise FrameError(f"MessagePack {kind} at byte {self.offset}: frames "
                                         "hold only integers, bytes and nil") from None
                if "exceeds max_" in what:
                    raise FrameError(f"value at byte {self.offset} is larger than the "
                                     f"{self.max_frame}-byte frame limit") from None
                raise FrameError(f"malformed MessagePack at byte {self.offset}: "
                                 f"{what}") from None
            position = self.offset
            self.offset = base + unpacker.tell()
            frame = self._value(value, position)
            if frame is not None:
                frames.append(frame)
        if not pending and unpacker.tell() == self._fed:
            self._unpacker = None  # nothing buffered: let an idle connection hold none
        return frames

    def _split(self, data: bytes) -> tuple[list[Frame], int, bool]:
        """The leading keep-alives and publish frames whose topic is a bin 8 and whose body
        a bin 8 or bin 16 value (what the Go client sends), within the frame limit; the
        bytes they take; and whether what follows is the start of one more such frame
        (else it is another kind of frame, for the unpacker)."""
        out: list[Frame] = []
        i, n, limit = 0, len(data), self.max_frame
        while i < n:
            kind = data[i]
            if kind == KEEP_ALIVE:
                out.append(_KEEPALIVE_EVENT)
                i += 1
                continue
            if kind != PUBLISH:
                return out, i, False
            if i + 3 > n:  # the topic's header incomplete
                return out, i, i + 1 == n or data[i + 1] == 0xC4
            if data[i + 1] != 0xC4:
                return out, i, False
            topic = i + 3
            at = topic + data[i + 2]  # the body's header
            if at >= n:
                return out, i, True
            head = data[at]
            if head == 0xC4:
                start = at + 2
            elif head == 0xC5:
                start = at + 3
            else:
                return out, i, False
            if start > n:
                return out, i, True
            size = data[at + 1] if head == 0xC4 else data[at + 1] << 8 | data[at + 2]
            if at - topic + size > limit:
                return out, i, False  # too large: the unpacker says so, and where
            end = start + size
            if end > n:
                return out, i, True
            out.append(Publish(data[topic:at], data[start:end]))
            i = end
        return out, i, False

    @property
    def held(self) -> int:
        """Bytes of the incomplete frame held between two `feed`s (what a peer that never
        finishes a frame makes us keep; the caller bounds it before authentication)."""
        if self._unpacker is None:
            return len(self._tail)
        return (self._fed - self._unpacker.tell()
                + sum(len(v) for v in self._pending[1:] if type(v) is bytes))

    def _value(self, value: object, position: int) -> Frame | None:
        pending = self._pending
        if not pending:
            if type(value) is not int:
                raise FrameError(f"frame type at byte {position} is {_kind(value)}, "
                                 "expected an integer 0-4")
            if value == KEEP_ALIVE:
                return _KEEPALIVE_EVENT
            if value not in _NAMES:
                raise FrameError(f"unknown frame type {value} at byte {position}")
            pending.append(value)
            return None
        kind = pending[0]
        name = _NAMES[kind]
        if len(pending) == 1:  # the topic
            if value is None:
                if kind != AUTHENTICATE:
                    raise FrameError(f"{name} frame with a nil topic at byte {position}")
            elif type(value) is not bytes:
                raise FrameError(f"{name} frame topic at byte {position} is {_kind(value)}, "
                                 "expected bytes")
            pending.append(value)
            return None
        topic = pending[1]
        pending.clear()
        if value is not None and type(value) is not bytes:
            raise FrameError(f"{name} frame body at byte {position} is {_kind(value)}, "
                             "expected bytes or nil")
        body = value or b""
        if len(topic or b"") + len(body) > self.max_frame:
            raise FrameError(f"{name} frame ending at byte {self.offset} carries "
                             f"{len(topic or b'') + len(body)} bytes, over the "
                             f"{self.max_frame}-byte limit")
        if kind == PUBLISH:
            return Publish(topic, body)
        if kind == SUBSCRIBE:
            return Subscribe(topic)
        if kind == UNSUBSCRIBE:
            return Unsubscribe(topic)
        if value is None:
            raise FrameError(f"authenticate frame with a nil secret at byte {position}")
        return Authenticate(body)

    @property
    def idle(self) -> bool:
        """True at a frame boundary with nothing buffered."""
        return self._unpacker is None and not self._pending and not self._tail
