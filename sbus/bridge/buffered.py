"""paho's client with its socket I/O batched: one ``recv`` per read turn and one ``send``
per flush, instead of paho's three ``recv`` per packet (command byte, length bytes,
body) and one ``send`` per packet.

paho does all of its socket I/O through two methods, ``_sock_recv`` and ``_sock_send``;
this subclass puts a read buffer and a write buffer behind them: every byte read is
still framed and parsed by paho.  What paho "sends" is gathered until `push` (the shell's
flush) writes it at once; what it "receives" comes from one large read.  The buffers are
bounded: the read buffer by `READ_CHUNK`, the write buffer by `WRITE_CHUNK` (the shell
stops taking exports while anything waits: `want_write`).  It also lets the shell change
paho's in-flight window on a live connection (`set_window`).

paho decodes the properties of every PUBLISH and PUBACK into a `Properties`, whose
constructor builds two tables of 27 entries each and whose ``unpack`` first clears all 27
names one by one: a third of the bridge's time per imported message, with no property
on it.  `QuickProperties` is the same class with those tables built once and ``clear``
of what is set; paho's decoder is given it (`quick_properties`).

An exporting bridge reads one PUBACK per message, and paho's way through one (its read
state machine, the decoder, a new reason code and properties) cost a quarter of a QoS 1
export.  A PUBACK of success with no properties is 4 bytes (0x40, remaining length 2, the
packet identifier: MQTT 5 section 3.4.2.1, what mosquitto sends); one found whole in the
read buffer is handed to paho's own ``_do_on_publish`` as paho's reader would
(`BufferedClient._packet_read`).  Every other packet, and a PUBACK split across reads,
is paho's to read.

An importing bridge reads one PUBLISH per message, and paho's way through one cost 25 µs
of an import at 1,000 msg/s (docs/performance.md, "The import lane"): three reads, the
decoder, an `MQTTMessage` (whose info object builds a `threading.Condition`), a topic
match against the per-topic callbacks, the PUBACK queued with locks.  A PUBLISH at QoS 0
or 1 found whole in the read buffer, with no property but User Properties (MQTT 5
section 3.3.2.3.7; what mosquitto forwards from a plain or an sbus publisher), is parsed
here and handed to `on_quick_message` (topic and payload as bytes, QoS, DUP, the user
properties); its PUBACK goes into the write buffer as 4 bytes, as paho's would, unless
packets wait in paho's queue ahead of it (then paho queues it, after them).  Any other
PUBLISH, or one that does not parse, is paho's to read (and to refuse).

Likewise on the way out: paho's ``publish`` of a QoS 1 message, then its ``loop_write``,
cost 45–65 µs of a bridge woken for one export at 1,000 msg/s (docs/performance.md,
"Bridge"), most of it locks, a packet queue and a copy for a message written at once.
`BufferedClient.publish_now` writes the PUBLISH (MQTT 5 section 3.3) into the write
buffer itself and records the message as paho's ``publish`` does (packet identifier,
in-flight count, the message kept until its PUBACK, sent again by paho on a reconnect),
when nothing is queued ahead of it and the window has room; otherwise paho's path takes
it.  `publish0_now` does the same at QoS 0 (no identifier, nothing kept).  All of this
leans on paho's private names (checked by tests/test_bridge_core.py against the installed
paho, which is pinned).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from typing import Protocol

import paho.mqtt._packet as paho_packet
import paho.mqtt.client as mqtt
from paho.mqtt.enums import MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

__all__ = ["BufferedClient", "QuickProperties", "READ_CHUNK", "WRITE_CHUNK",
           "remaining_length"]

_CONNECTED = mqtt._ConnectionState.MQTT_CS_CONNECTED


def remaining_length(n: int) -> bytes:
    """MQTT's Remaining Length of *n* bytes: 7 bits a byte, the high bit saying that more
    follow (MQTT 5 section 1.5.5; 3.1.1 section 2.2.3)."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _Packable(Protocol):
    """What paho takes as a PUBLISH's properties: it only packs them."""

    def pack(self) -> bytes: ...

#: Bytes asked of the socket per read (paho asks for one packet's bytes at a time).
READ_CHUNK = 64 * 1024
#: Bytes gathered at most before they are written (paho keeps the rest queued).
WRITE_CHUNK = 256 * 1024


_TABLES = Properties(PacketTypes.PUBLISH)  # paho's tables, built once
_OWN = frozenset(("packetType", "types", "names", "properties"))
_IDENT = {name.replace(" ", ""): ident for name, ident in _TABLES.names.items()}
_NAME = {ident: name for name, ident in _TABLES.names.items()}


class QuickProperties(Properties):
    """paho's `Properties` without rebuilding its tables per packet (module docstring):
    they are shared (paho never changes them), names are looked up in dicts."""

    def __init__(self, packetType: int) -> None:
        object.__setattr__(self, "packetType", packetType)
        object.__setattr__(self, "types", _TABLES.types)
        object.__setattr__(self, "names", _TABLES.names)
        object.__setattr__(self, "properties", _TABLES.properties)

    def clear(self) -> None:
        for name in [n for n in vars(self) if n not in _OWN]:
            delattr(self, name)

    def getIdentFromName(self, compressedName: str) -> int:
        return _IDENT.get(compressedName, -1)

    def getNameFromIdent(self, identifier: int) -> str | None:
        return _NAME.get(identifier)


def quick_properties() -> None:
    """Have paho's packet decoder build `QuickProperties` (the same values, faster).  For
    this process: the bridge's, whose only MQTT client this is."""
    if getattr(paho_packet, "Properties", None) is Properties:
        paho_packet.Properties = QuickProperties


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """MQTT's Variable Byte Integer at *at* (1 to 4 bytes): (value, where it ends), or
    (-1, at) if it is cut off or longer than 4 bytes."""
    value = shift = 0
    for i in range(at, min(at + 4, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    return -1, at


#: The one condition of every `_SentInfo`: nobody waits on the bridge's messages.
_NOBODY_WAITS = threading.Condition()


class _SentInfo(mqtt.MQTTMessageInfo):
    """paho's info of a message `publish_now` wrote.  paho builds a `threading.Condition`
    for each, for a ``wait_for_publish`` the bridge never calls: a third of what a QoS 1
    export cost in a burst (docs/performance.md, "paho's records").  These share one,
    so paho's ``_set_as_published`` still runs unchanged."""

    __slots__ = ()

    def __init__(self, mid: int) -> None:  # (paho's, but the condition)
        self.mid = mid
        self._published = False
        self._condition = _NOBODY_WAITS
        self.rc = MQTTErrorCode.MQTT_ERR_SUCCESS
        self._iterpos = 0


class _Sent(mqtt.MQTTMessage):
    """paho's record of a QoS 1 message `publish_now` wrote and whose PUBACK it waits
    for: the attributes paho's ``publish`` gives it, set once."""

    __slots__ = ()

    def __init__(self, mid: int, topic: bytes, payload: bytes, properties: _Packable,
                 now: float) -> None:
        self.timestamp = now
        self.state = mqtt.mqtt_ms_wait_for_puback
        self.dup = self.retain = False
        self.mid = mid
        self._topic = topic
        self.payload = payload
        self.qos = 1
        self.info = _SentInfo(mid)
        self.properties = properties  # type: ignore[assignment]


class BufferedClient(mqtt.Client):
    """`paho.mqtt.client.Client` reading and writing in runs (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rdata = b""  # the last read from the socket, served from `_rpos` on
        self._rpos = 0
        self._wbuf = bytearray()  # what paho wrote since the last `push`
        self._wlast = 0  # a send that could not go: retried with this length (TLS)
        #: what `publish_now` wrote and paho has no record of yet (`record`): packet
        #: identifier, topic, payload, properties, when
        self._unrecorded: list[tuple[int, bytes, bytes, _Packable, float]] = []
        # what paho's decoder gives for a 2-byte PUBACK: success, no properties (shared:
        # the bridge's on_publish only reads them)
        self._acked = (ReasonCode(PacketTypes.PUBACK), Properties(PacketTypes.PUBACK))
        #: a PUBLISH read by the short cut (module docstring): topic, payload, QoS, DUP and
        #: user properties; None: paho reads every PUBLISH
        self.on_quick_message: Callable[[bytes, bytes, int, bool, list[tuple[str, str]]],
                                        None] | None = None
        #: called with the socket paho is about to close: True if it will close it itself
        #: (a thread that must not close a descriptor another thread's loop may wait on)
        self.close_later: Callable[[object], bool] | None = None
        #: the Maximum Packet Size announced in CONNECT: a larger packet ends the
        #: connection before its body is read (MQTT 5 section 3.1.2.11.4)
        self.max_in = 1 << 28
        #: why the last connection was ended here (`_refused`), for the shell to say
        self.refusal = ""
        #: packet identifiers of the PUBLISHes read whose PUBACKs wait (`release`), in
        #: the order read; None: each PUBACK is written as the PUBLISH is read
        self.held: list[int] | None = None

    # -- what paho calls -------------------------------------------------------------

    def _packet_read(self) -> MQTTErrorCode:
        """paho's, but a 4-byte PUBACK of success or a plain PUBLISH whole in the buffer
        is taken here (module docstring)."""
        data, pos = self._rdata, self._rpos
        if self._in_packet["command"] != 0:
            return super()._packet_read()  # in the middle of a packet: paho's
        if pos >= len(data):  # (read here, as paho's first read would, to look at it)
            try:
                data = super()._sock_recv(READ_CHUNK)
            except BlockingIOError:
                return MQTTErrorCode.MQTT_ERR_AGAIN
            except OSError:
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            if not data:
                return MQTTErrorCode.MQTT_ERR_CONN_LOST
            self._rdata, self._rpos, pos = data, 0, 0
        if len(data) - pos >= 4:
            if data[pos] == 0x40 and data[pos + 1] == 2:
                self._rpos = pos + 4
                self._last_bytes_received = mqtt.time_func()  # (paho's keep-alive)
                mid = data[pos + 2] << 8 | data[pos + 3]
                with self._out_message_mutex:
                    if mid in self._out_messages:  # (else a duplicate: paho ignores it)
                        return self._do_on_publish(mid, *self._acked)
                return MQTTErrorCode.MQTT_ERR_SUCCESS
            if data[pos] >> 4 == 3 and self.on_quick_message is not None \
                    and self._quick_publish(data, pos):
                return MQTTErrorCode.MQTT_ERR_SUCCESS
        return super()._packet_read()

    def _quick_publish(self, data: bytes, pos: int) -> bool:
        """Take the PUBLISH at *pos* if it is whole and plain (module docstring): whether
        it was taken."""
        head = data[pos]
        qos = head >> 1 & 3
        if qos > 1:
            return False
        size, i = _varint(data, pos + 1)
        end = i + size
        if size < 0 or end > len(data) or i + 2 > end or end - pos > self.max_in:
            return False
        at = i + 2 + (data[i] << 8 | data[i + 1])
        if at > end:
            return False
        topic = data[i + 2:at]
        mid = 0
        if qos:
            if at + 2 > end:
                return False
            mid = data[at] << 8 | data[at + 1]
            if not mid:
                return False
            at += 2
        size, at = _varint(data, at)
        stop = at + size
        if size < 0 or stop > end:
            return False
        props: list[tuple[str, str]] = []
        try:
            while at < stop:
                if data[at] != 0x26:  # User Property; any other: paho's
                    return False
                n = data[at + 1] << 8 | data[at + 2]
                key = data[at + 3:at + 3 + n].decode("utf-8")
                at += 3 + n
                m = data[at] << 8 | data[at + 1]
                value = data[at + 2:at + 2 + m].decode("utf-8")
                at += 2 + m
                props.append((key, value))
        except (IndexError, UnicodeDecodeError):
            return False
        if at != stop:
            return False
        self._rpos = end
        self._last_bytes_received = mqtt.time_func()  # (paho's keep-alive)
        self.on_quick_message(topic, data[stop:end], qos, bool(head & 8), props)
        if qos:
            if self.held is not None:
                self.held.append(mid)
            else:
                self._puback(mid)
        return True

    def _puback(self, mid: int) -> None:
        if self._out_packet or len(self._wbuf) >= WRITE_CHUNK:
            super()._send_puback(mid)  # after what paho queued first
        else:
            self._wbuf += bytes((0x40, 2, mid >> 8, mid & 0xFF))

    def _send_puback(self, mid: int) -> MQTTErrorCode:
        """paho's, for a PUBLISH it read itself: held as `_quick_publish` holds them."""
        if self.held is not None:
            self.held.append(mid)
            return MQTTErrorCode.MQTT_ERR_SUCCESS
        return super()._send_puback(mid)

    def _refused(self, command: int, length: int, header: int) -> str:
        """Why a packet whose fixed header paho has read so far must not be read on (an
        error that ends the connection), or "": a PUBLISH at QoS 2, which the bridge
        never asks for (paho would hold each until its PUBREL, without a bound), or one
        over `max_in` (its body would be held whole)."""
        if command >> 4 == 3 and command & 6 == 4:
            return "the MQTT broker sent a PUBLISH at QoS 2, which the bridge never asks for"
        if header + length > self.max_in:
            return (f"the MQTT broker sent a packet of {header + length} bytes, over the maximum "
                    f"of {self.max_in} the bridge announced")
        return ""

    def _sock_recv(self, bufsize: int) -> bytes:
        packet = self._in_packet
        if packet["have_remaining"]:  # paho reads a body: is it one to read?
            why = self._refused(packet["command"], packet["remaining_length"],
                                1 + len(packet["remaining_count"]))
            if why:
                self.refusal = why
                raise OSError(errno.EPROTO, why)
        data, pos = self._rdata, self._rpos
        if pos >= len(data):
            # the socket's errors and its end (b"") reach paho as from its own read
            data = super()._sock_recv(max(bufsize, READ_CHUNK))
            if len(data) <= bufsize:
                return data
            self._rdata, pos = data, 0
        end = min(pos + bufsize, len(data))
        self._rpos = end
        return data[pos:end]

    def _sock_send(self, buf: bytes | bytearray) -> int:
        if len(self._wbuf) >= WRITE_CHUNK:
            raise BlockingIOError  # paho keeps the packet queued: `flush` goes on
        self._wbuf += buf
        return len(buf)

    def _sock_close(self) -> None:
        """paho closes the socket right after writing a DISCONNECT: send what is gathered
        first (best effort, as paho's own last write), then forget both buffers.  Where
        `close_later` takes the socket, paho forgets it and that closes it, later."""
        sock = self._sock
        if sock is not None:
            self.push()
        self._wbuf.clear()
        self._wlast = 0
        self._rdata, self._rpos = b"", 0
        later = self.close_later
        if sock is None or later is None or not later(sock):
            super()._sock_close()
            return
        self._sock = None
        self._call_socket_unregister_write(sock)
        self._call_socket_close(sock)

    # -- what the shell calls ----------------------------------------------------------

    def release(self, n: int) -> None:
        """Write the PUBACKs of the first *n* held PUBLISHes (`held`), in order."""
        held = self.held
        if held is None:
            return
        for mid in held[:n]:
            self._puback(mid)
        del held[:n]

    def publish_now(self, topic: bytes, payload: bytes, properties: _Packable) -> int | None:
        """A QoS 1 PUBLISH of *topic* (valid: no wildcard, not empty) put straight into the
        write buffer, as paho's ``publish`` would queue it and its ``loop_write`` copy it
        there (module docstring): its packet identifier.  paho's own record of it (the
        message in flight that a PUBACK ends and a reconnect sends again) is made by
        `record`, which the caller runs after the send, off the message's way, and before
        paho reads or sends anything else.  None when paho's path must take it: no live
        connection, packets or messages queued ahead of it, the window full, the buffer
        full, or the next identifier still in flight."""
        inflight = self._inflight_messages
        if (not self._writable()
                or 0 < self._max_inflight_messages <= inflight
                or len(self._out_messages) > inflight):  # some wait for the window: first
            return None
        mid = self._mid_generate()
        if mid in self._out_messages:
            return None
        self._frame(0x32, topic, mid.to_bytes(2, "big"), properties, payload)
        self._inflight_messages = inflight + 1  # (the window counts it from now on)
        self._unrecorded.append((mid, topic, payload, properties, self._last_msg_out))
        return mid

    def publish0_now(self, topic: bytes, payload: bytes, properties: _Packable) -> bool:
        """`publish_now` at QoS 0: nothing to record, no identifier, no window (paho
        sends QoS 0 ahead of messages waiting for the window too).  False when paho's
        path must take it: no live connection, packets queued ahead, the buffer full."""
        if not self._writable():
            return False
        self._frame(0x30, topic, b"", properties, payload)
        return True

    def _writable(self) -> bool:
        """May a PUBLISH go straight into the write buffer (`publish_now`)?"""
        return (self._state == _CONNECTED and self._sock is not None
                and not self._out_packet and len(self._wbuf) < WRITE_CHUNK)

    def _frame(self, head: int, topic: bytes, mid: bytes, properties: _Packable,
               payload: bytes) -> None:
        """A PUBLISH into the write buffer (MQTT 5 section 3.3: *head* carries the QoS,
        *mid* is empty at QoS 0), as paho writes it."""
        packed = properties.pack()
        buf = self._wbuf
        buf.append(head)
        buf += remaining_length(2 + len(topic) + len(mid) + len(packed) + len(payload))
        buf += len(topic).to_bytes(2, "big")
        buf += topic
        buf += mid
        buf += packed
        buf += payload
        self._last_msg_out = mqtt.time_func()  # (paho's keep-alive, as after a write)

    def record(self) -> None:
        """paho's records of what `publish_now` wrote, as its ``publish`` makes them
        (`_Sent`: without the `threading.Condition` paho builds for each)."""
        if not self._unrecorded:
            return
        made = [_Sent(*entry) for entry in self._unrecorded]
        self._unrecorded.clear()
        with self._out_message_mutex:
            for message in made:
                self._out_messages[message.mid] = message

    def drop_over(self, limit: int) -> list[int]:
        """Forget the messages held for sending whose PUBLISH would be over *limit*
        bytes (a broker's Maximum Packet Size, learnt in its CONNACK: it would close the
        connection on each, and paho send it again on every reconnect); their packet
        identifiers.  Called from ``on_connect``, before paho sends what it holds, when
        none is in flight."""
        over = []
        with self._out_message_mutex:
            for mid, m in self._out_messages.items():
                props = m.properties.pack() if m.properties is not None else b"\0"
                body = 2 + len(m._topic) + (2 if m.qos else 0) + len(props) + len(m.payload)
                if 1 + len(remaining_length(body)) + body > limit:
                    over.append(mid)
            for mid in over:
                del self._out_messages[mid]
        return over

    def drop(self, mid: int) -> str | None:
        """Forget the message held for sending with packet identifier *mid* (one the
        broker ends the connection for); its topic, or None if none is held.  Called
        from ``on_connect``, before paho sends what it holds (see `drop_over`)."""
        with self._out_message_mutex:
            message = self._out_messages.pop(mid, None)
        return None if message is None else message.topic

    def one_at_a_time(self) -> None:
        """From ``on_connect``: of the QoS 1 messages held for sending, only the oldest
        goes now, and each next one once the one before is acknowledged (a window of 1;
        paho's reconnect would otherwise send all it holds at once)."""
        with self._out_message_mutex:
            for i, message in enumerate(self._out_messages.values()):
                if i and message.qos == 1 and message.state == mqtt.mqtt_ms_publish:
                    message.state = mqtt.mqtt_ms_queued
        self._max_inflight_messages = 1

    def set_window(self, n: int) -> None:
        """paho's in-flight window (0: none), also on an established connection, which
        ``max_inflight_messages_set`` refuses: paho reads the value only where it sends
        (publish, an acknowledgement, a reconnect), so a change takes effect there."""
        self._max_inflight_messages = n

    def pending(self) -> int:
        """Bytes read but not yet handed to paho, and (TLS) decrypted bytes the socket
        holds: a poll of the socket would not show them."""
        sock = self._sock
        more = getattr(sock, "pending", None)
        return len(self._rdata) - self._rpos + (more() if more is not None else 0)

    def unsent(self) -> int:
        return len(self._wbuf)

    def want_write(self) -> bool:
        return bool(self._wbuf) or super().want_write()

    def flush(self) -> None:
        """Have paho write what it queued, and write it to the socket, as much as the
        socket takes now (`want_write` then says whether something waits)."""
        while True:
            if self._out_packet:
                self.loop_write()
            self.push()
            if self._wbuf or not self._out_packet:
                return

    def push(self) -> None:
        """Write what paho gathered, as much as the socket takes now (the rest waits for
        the next push).  A failed connection drops it: paho's next read meets the failure
        and says so (``on_disconnect``)."""
        buf = self._wbuf
        while buf:
            size = self._wlast or len(buf)
            try:
                sent = super()._sock_send(buf if size >= len(buf) else buf[:size])
            except BlockingIOError:
                self._wlast = size  # TLS wants the same write again
                return
            except OSError:
                buf.clear()
                self._wlast = 0
                return
            self._wlast = 0
            del buf[:sent]
