"""The bridge's I/O: one bus connection, one MQTT connection (paho-mqtt, MQTT 5), one
``select`` loop; every decision is `BridgeCore`'s.

Flow control, so that no local publisher ever waits for MQTT:

* The bus connection says ``blocking/soft/queue`` + ``blocking/hard/discard`` as a
  subscriber (the broker queues for the bridge, then drops and reports
  ``blocking/dropped``, which is counted) and ``blocking/publisher/nowait`` as a
  publisher (a slow local subscriber loses imports instead of pausing the bridge).
* The bus is read only while MQTT can take more: nothing waiting to be written to the
  socket and, at QoS 1, fewer than `WINDOW` messages unacknowledged.  Otherwise the
  messages wait in the local broker's queue for the bridge (bounded, then dropped).
* MQTT is read only while the bus is connected: imports that cannot be delivered stay
  with the MQTT broker (at QoS 1 in the bridge's session) instead of being lost here.
  The bus connection is a `Client` with ``reconnect=True``: when the bus goes, the call
  that noticed waits for it (STATUS= says ``bus down`` first; SIGTERM still ends the
  bridge), so MQTT is not served meanwhile; after a long wait the MQTT broker drops the
  connection (keep-alive) and it is made again, the session's imports waiting.

Crashes: QoS 1 exports are written to the spool (`spool.Spool`) before paho gets them
and leave it when the broker acknowledges them; a restarted bridge sends what is left.
"""

from __future__ import annotations

import logging
import select
import signal
import socket
import struct
import time
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.exception import MQTTException
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from .. import protocol, sdnotify
from ..client import Client, SbusError
from ..defaults import MAX_MESSAGE
from ..display import printable
from ..errors import InvalidRequest
from ..limits import LogAllowance
from ..protocol import Publish
from ..session import Backoff, Refusal
from .core import MARKER, SCOPE, STAMP, STAMP0, BridgeCore
from .spool import Spool, StateDir

log = logging.getLogger("sbus.bridge")

__all__ = ["MqttSettings", "BridgeShell", "Retry"]

#: Messages taken from the bus per turn of the loop.
BATCH = 256
#: QoS 1 exports unacknowledged at once; also paho's in-flight window.  paho scans its
#: whole window on every acknowledgement, so a larger one costs more than it gains (1,000
#: made that scan 40 µs per message; 100 keeps ~30,000 msg/s in flight at 3 ms round trips).
WINDOW = 100
#: Seconds the local broker may take to answer whoami on connect.
BUS_TIMEOUT = 5.0
#: Seconds between STATUS= updates at most (one is sent when the line changed).
STATUS_EVERY = 0.5
#: Seconds between writes of the spool's acknowledgements at most (not one per turn).
ACK_EVERY = 0.05
#: MQTT packets processed per turn of the loop (keeps both sides served).
READ_TURN = 512
#: MQTT's largest packet, unless the broker says less (CONNACK Maximum Packet Size).
MQTT_MAX_PACKET = 268435460
#: A connection that stayed up this long (seconds) starts its side's backoff over.
STABLE_AFTER = 10.0
#: What paho raises on bytes it cannot parse: the stream cannot be resynchronised, so
#: the MQTT connection is dropped and made again (the bridge goes on).
MALFORMED = (ValueError, struct.error, IndexError, UnicodeDecodeError, MQTTException)


@dataclass(frozen=True)
class Broker:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class MqttSettings:
    brokers: list[Broker]  # tried in order: the first that accepts is used
    tls: bool = False
    username: str | None = None
    password: str | None = None
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    keepalive: int = 30
    session_expiry: int = 3600  # seconds the broker keeps our session (QoS 1 imports)
    max_queued: int = 10000  # QoS 1 exports held until acknowledged (the broker away)
    max_queued_bytes: int = 64 << 20  # and their bytes at most
    max_message: int = MAX_MESSAGE  # largest packet the broker may send us
    state_dir: str | None = None  # the spool, the counters, the import digest
    nodelay: bool = True  # TCP_NODELAY on the MQTT socket


class Retry:
    """When to try a side again: `sbus.session.Backoff` (the one reconnect policy), started
    over once a connection stayed up `stable` seconds."""

    def __init__(self, first: float, maximum: float, stable: float = STABLE_AFTER) -> None:
        self.stable = stable
        self.delays = Backoff(first, maximum)
        self.next_at = 0.0
        self._up_at: float | None = None

    def up(self, now: float) -> None:
        self._up_at = now

    def failed(self, now: float) -> float:
        """A connection attempt failed or a connection broke: the delay until the next."""
        if self._up_at is not None and now - self._up_at >= self.stable:
            self.delays.reset()
        self._up_at = None
        delay = self.delays.next()
        self.next_at = now + delay
        return delay


class _PackedOnce(Properties):
    """The marker, the same on every message: packed once (paho packs per publish, which
    was a third of the bridge's time per exported message)."""

    def __init__(self, *pairs: tuple[str, str]) -> None:
        super().__init__(PacketTypes.PUBLISH)
        self.UserProperty = list(pairs)
        object.__setattr__(self, "_packed", super().pack())

    def pack(self) -> bytes:
        return self._packed


class _Stamped:
    """The marker and an export's stamp (`core.STAMP`, `core.STAMP0`): paho's own packing
    of a template whose last 16 bytes are the sequence number in hex, replaced per message
    (paho only calls ``pack()``, at the time it sends)."""

    __slots__ = ("_packed",)

    def __init__(self, packed: bytes) -> None:
        self._packed = packed

    def pack(self) -> bytes:
        return self._packed


class _Stopped(Exception):
    """Raised by the signal handler while `Client` waits for a lost bus."""


class BridgeShell:
    def __init__(self, core: BridgeCore, address: str | None, settings: MqttSettings,
                 backoff_first: float = 0.2, backoff_max: float = 30.0) -> None:
        self.core = core
        self.address = address
        self.settings = settings
        self.bus: Client | None = None
        self.bus_up = False
        self.bus_retry = Retry(backoff_first, backoff_max)
        self.mqtt_retry = Retry(backoff_first, backoff_max)
        self.mqtt_up = False
        self.subscribed = False  # the broker acknowledged our subscriptions
        self._broker = 0  # index of the broker address tried or in use
        self._connecting = False  # a TCP connection made, no CONNACK yet
        self._broken = False  # paho could not parse the stream: reconnect
        self._outstanding: dict[int, tuple[int, int]] = {}  # QoS 1 mid -> (spool seq, bytes)
        self._held_bytes = 0  # bytes of the QoS 1 exports held in memory only (no spool)
        self._activity = 0
        self._stopping = False
        self._notify_failed = False
        self.notify_skipped = 0  # STATUS= lines not sent: the manager was not reading
        self._allowance = LogAllowance()
        self._props = _PackedOnce((MARKER, core.client_id))
        self._stamp_head = b""  # the stamped template without its 16 hex digits
        self._stamp0_head = _PackedOnce(  # the same for QoS 0 exports (core.STAMP0)
            (MARKER, core.client_id), *((SCOPE, f) for f in core.stamp_scope(0)),
            (STAMP0, f"{core.epoch0}.{0:016x}")).pack()[:-16]
        self._cork: socket.socket | None = None  # the MQTT socket, when TCP (TCP_CORK)
        self.state: StateDir | None = None
        self.spool: Spool | None = None
        #: the filters a resumed MQTT session may still hold (an earlier configuration's)
        self._stale: list[str] = []
        self._left: list[tuple[int, bytes, bytes]] = []  # spooled by the last bridge
        self._max_out = MQTT_MAX_PACKET  # the broker's Maximum Packet Size (CONNACK)
        # a PUBLISH's bytes besides topic and payload: fixed header, topic length, packet
        # id, our properties and their length
        if settings.state_dir:
            self._open_state(settings.state_dir)
        self._overhead = 5 + 2 + 2 + max(len(self._props.pack()), len(self._stamp_head) + 16,
                                         len(self._stamp0_head) + 16)
        self.mq = self._make_client()
        self._replay()

    # -- state on disk -----------------------------------------------------------------

    def _open_state(self, path: str) -> None:
        self.state = StateDir(path)
        saved = self.state.load_state()
        counters = saved.get("counters")
        if isinstance(counters, dict):
            self.core.counters.restore(counters)
        old = saved.get("filters")
        if isinstance(old, list):
            self._stale = [f for f in old if isinstance(f, str)
                           and f not in self.core.mqtt_filters()]
        if 1 in self.core.export_qos_levels:
            try:
                self.spool = Spool(self.state.path, self.settings.max_queued,
                                   self.settings.max_queued_bytes)
                self._left = self.spool.load()
            except OSError as exc:
                raise SbusError(f"cannot use the spool in {self.state.path}: "
                                f"{exc.strerror or exc}") from None
            template = _PackedOnce((MARKER, self.core.client_id),
                                   *((SCOPE, f) for f in self.core.stamp_scope()),
                                   (STAMP, f"{self.spool.epoch}.{0:016x}")).pack()
            self._stamp_head = template[:-16]
            # exports spooled after the last save of the counters were counted by nobody
            since = saved.get("spooled", self.spool.next_seq)
            since = since if isinstance(since, int) else self.spool.next_seq
            if self.spool.next_seq > since:
                self.core.counters.exported += self.spool.next_seq - since
                self.core.counters.exported_bytes += sum(
                    len(t) + len(p) for seq, t, p in self._left if seq >= since)
        if saved.get("clean_exit"):  # else what it remembers may be older than it saw
            self.core.restore_senders(saved.get("senders"))
        if saved and not saved.get("clean_exit"):
            log.warning("the last bridge did not stop cleanly: counters other than exported "
                        "may miss its last %.1f s", STATUS_EVERY)
        self._save_state(clean_exit=False)

    def _save_state(self, clean_exit: bool = False) -> None:
        if self.state is None:
            return
        self.state.save_state({
            "counters": self.core.counters.saved(),
            "filters": self.core.mqtt_filters() + self._stale,
            "spooled": self.spool.next_seq if self.spool else 0,
            "clean_exit": clean_exit,
            **({"senders": self.core.senders_saved()} if clean_exit else {})})

    def _replay(self) -> None:
        """Hand paho what the last bridge had not had acknowledged (sent on connect)."""
        left, self._left = self._left, []
        for seq, topic, payload in left:  # counted as exported by the last bridge
            self._publish(topic.decode("utf-8", "replace"), payload, seq,
                          len(topic) + len(payload), count=False)
        if left:
            self.core.counters.resent += len(left)
            log.info("%d exports from the spool will be sent again", len(left))

    # -- MQTT client -----------------------------------------------------------------

    def _make_client(self) -> mqtt.Client:
        s = self.settings
        mq = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.core.client_id,
                         protocol=mqtt.MQTTv5)
        mq.max_inflight_messages_set(WINDOW)
        mq.max_queued_messages_set(s.max_queued)
        if s.tls:
            try:
                mq.tls_set(ca_certs=s.cafile, certfile=s.certfile, keyfile=s.keyfile)
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise SbusError(f"TLS set-up for the MQTT broker failed: {exc}") from None
        if s.username is not None:
            mq.username_pw_set(s.username, s.password)
        mq.on_connect = self._on_connect
        mq.on_disconnect = self._on_disconnect
        mq.on_message = self._on_message
        if 1 in self.core.export_qos_levels:  # at QoS 0 paho would build a reason and
            mq.on_publish = self._on_publish          # properties per message
        mq.on_subscribe = self._on_subscribe
        mq.on_socket_open = self._on_socket_open
        return mq

    @property
    def broker(self) -> Broker:
        return self.settings.brokers[self._broker]

    def _on_socket_open(self, mq, userdata, sock) -> None:
        """TCP_NODELAY: a lone message goes at once, not after the peer's delayed ACK
        (paho sets nothing); bursts are coalesced by `_corked` instead."""
        self._cork = None
        if self.settings.nodelay:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                return  # not TCP (a unix socket): nothing to set
            self._cork = sock

    def _corked(self, on: bool) -> None:
        """TCP_CORK around a run of packets (a batch of exports, the PUBACKs of a read):
        paho sends each packet by itself, which with TCP_NODELAY is a segment each; the
        cork makes full segments of them and uncorking sends the rest at once."""
        if self._cork is not None:
            try:
                self._cork.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1 if on else 0)
            except OSError:
                self._cork = None  # closed meanwhile: the next connection sets it again
    def _on_connect(self, mq, userdata, flags, reason, properties) -> None:
        self._connecting = False  # answered: a disconnect now is no TLS-port mystery
        if reason.is_failure:
            log.error("MQTT broker %s refused the connection: %s", self.broker, reason)
            return
        self.mqtt_up = True
        self.mqtt_retry.up(time.monotonic())
        log.info("connected to MQTT broker %s (session %s)", self.broker,
                 "resumed" if flags.session_present else "new")
        # the largest packet the broker takes: a larger one would make it close the
        # connection, and paho would send it again on every reconnect
        limit = getattr(properties, "MaximumPacketSize", None)
        self._max_out = limit if isinstance(limit, int) and limit > 0 else MQTT_MAX_PACKET
        if self._stale and flags.session_present:
            # an earlier configuration's filters: they would pull traffic the bridge
            # filters out, and deliver twice what overlaps the new ones
            log.info("the imports changed: unsubscribing the session's old filters %s",
                     ", ".join(printable(f, 80) for f in self._stale))
            mq.unsubscribe(list(self._stale))
        self._stale = []  # gone: unsubscribed, or a new session
        self._save_state()
        subscriptions = self.core.mqtt_subscriptions()
        self.subscribed = not subscriptions
        if subscriptions:
            # No Local: never our own messages back; retainHandling 2: no retained
            # messages (sbus has no retained state; they would repeat on every reconnect).
            mq.subscribe([(f, SubscribeOptions(qos=q, noLocal=True, retainAsPublished=False,
                                               retainHandling=2))
                          for f, q in subscriptions])

    def _on_subscribe(self, mq, userdata, mid, reasons, properties) -> None:
        self.subscribed = True
        for f, reason in zip(self.core.mqtt_filters(), reasons, strict=False):
            if reason.is_failure:
                log.error("MQTT broker refused the subscription %s: %s", f, reason)

    def _on_disconnect(self, mq, userdata, flags, reason, properties) -> None:
        now = time.monotonic()
        if self._stopping:
            pass  # our own goodbye
        elif self.mqtt_up:
            log.warning("lost the MQTT broker %s: %s", self.broker, reason)
            self._broker = 0  # the first address is preferred: start there again
            self.mqtt_retry.failed(now)
        elif self._connecting:  # closed before any CONNACK
            hint = "" if self.settings.tls else " (a TLS port? then use mqtts://)"
            log.warning("the MQTT broker %s closed the connection before accepting it: "
                        "%s%s", self.broker, reason, hint)
            self._next_broker(now)
        else:  # it refused us in its CONNACK (logged by _on_connect)
            self._next_broker(now)
        self.mqtt_up = self.subscribed = self._connecting = False

    def _next_broker(self, now: float) -> float:
        """Fail over to the next address; after the last, wait (backoff) and start over."""
        self._broker += 1
        if self._broker < len(self.settings.brokers):
            self.mqtt_retry.next_at = now
            return 0.0
        self._broker = 0
        return self.mqtt_retry.failed(now)

    def _on_publish(self, mq, userdata, mid, reason, properties) -> None:
        self._activity += 1
        held = self._outstanding.pop(mid, None)
        if held is not None:
            if held[0] >= 0 and self.spool is not None:
                self.spool.acked(held[0])
            elif held[0] < 0:
                self._held_bytes -= held[1]
            if reason.is_failure:
                self.core.refused_by_broker()
                self._note(f"the MQTT broker refused an exported message: {reason}")

    def _on_message(self, mq, userdata, msg: mqtt.MQTTMessage) -> None:
        """One message from MQTT: whatever it holds, it is counted and never raises."""
        self._activity += 1
        marker = stamp = None
        numbering = 1
        scope: list[str] = []
        for prop in getattr(msg.properties, "UserProperty", None) or ():
            if isinstance(prop, tuple) and len(prop) == 2:
                if prop[0] == MARKER:
                    marker = prop[1]
                elif prop[0] == STAMP:
                    stamp, numbering = prop[1], 1
                elif prop[0] == STAMP0:
                    stamp, numbering = prop[1], 0
                elif prop[0] == SCOPE:
                    scope.append(prop[1])
        try:
            topic = msg.topic.encode("utf-8")
        except UnicodeDecodeError:  # the broker should have refused it
            self.core.refused_by_broker()
            self._note("the MQTT broker sent a topic that is not UTF-8")
            return
        payload = msg.payload
        key = self.core.from_mqtt(topic, payload, marker, stamp, tuple(scope), numbering)
        if key is None:
            return
        if self.bus is None:
            self.core.dropped()
            return
        try:
            self.bus.publish(key, payload)
        except InvalidRequest as exc:  # too large for the bus, or a key it refuses
            self.core.refused_by_broker()
            self._note(f"not imported: {printable(str(exc), 200)}")
        except SbusError as exc:
            self.core.dropped()
            self._bus_lost(exc)
        else:
            self.core.imported(len(key) + len(payload))

    def _connect_mqtt(self, now: float) -> None:
        s, broker = self.settings, self.broker
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = s.session_expiry
        props.MaximumPacketSize = s.max_message + 1024  # MQTT header and properties
        try:
            self.mq.connect_async(broker.host, broker.port, s.keepalive,
                                  clean_start=s.session_expiry == 0, properties=props)
            self.mq.reconnect()
        except (OSError, ValueError) as exc:
            delay = self._next_broker(now)
            log.warning("cannot reach the MQTT broker %s: %s%s", broker, exc,
                        f"; again in {delay:.1f} s" if delay else "; trying the next")
            return
        self._connecting = True
        self._broken = False

    # -- bus -------------------------------------------------------------------------

    def _connect_bus(self, now: float) -> None:
        """The bus connection, made once: from then on `Client` reconnects by itself
        (``reconnect=True``: the one reconnect driver, `session.Backoff`, the flood policy
        and subscriptions restored), and tells `_bus_connection`.  Only a first connection
        that fails, or a broken one (a malformed packet), comes back here."""
        try:
            delays = self.bus_retry.delays
            bus = Client(self.address, reconnect=True,
                         backoff=Backoff(delays.first, delays.maximum),
                         on_drop=self.core.bus_dropped, on_refusal=self._refused,
                         on_connection=self._bus_connection)
        except SbusError as exc:
            delay = self.bus_retry.failed(now)
            log.warning("%s; again in %.1f s", exc, delay)
            return
        try:
            bus.set_flood(soft="queue", hard="discard")
            bus.control(protocol.PUBLISHER_NOWAIT)
            if not bus.whoami(timeout=BUS_TIMEOUT).startswith(b"!/"):
                raise SbusError("the broker speaks the early-draft dialect (separator '.'); "
                                "the bridge maps only '/' keys to MQTT topics")
            for pattern in self.core.bus_patterns():
                bus.subscribe(pattern)
        except (SbusError, TimeoutError) as exc:
            bus.close()
            delay = self.bus_retry.failed(now)
            log.warning("bus at %s: %s; again in %.1f s", bus.address, exc, delay)
            return
        self.bus = bus
        self.bus_up = True
        self.core.bus_reset()
        self._tell_bus(self.status())
        self.bus_retry.up(now)
        log.info("connected to the bus at %s", bus.address)

    def _bus_connection(self, up: bool, line: str) -> None:
        """`Client` lost the bus (it waits for it, inside the call that noticed: MQTT is
        not read meanwhile, and imports wait at the broker) or has it again.  A SIGTERM
        that came while the bus was still up (`stop` only set `_stopping`) ends the
        bridge here, before the wait: nothing else would, as the bus may never return."""
        self.bus_up = up
        if up:
            log.info("%s", line)
            self.core.bus_reset()  # no echo of an earlier import comes on this connection
            assert self.bus is not None
            self.bus.control(protocol.PUBLISHER_NOWAIT)
        else:
            log.warning("%s", line)
            if self._stopping:
                raise _Stopped
        self._save_state()
        self._notify(f"STATUS={self.status()}")  # the loop waits with the call

    def _bus_lost(self, exc: Exception) -> None:
        """The connection cannot go on (e.g. the broker sent a malformed packet): drop it
        and connect anew."""
        if self.bus is not None:
            log.warning("lost the bus: %s", exc)
            self.bus.close()
            self.bus = None
            self.bus_up = False
            self.bus_retry.failed(time.monotonic())

    def _export_ready(self) -> bool:
        """May the bridge take more from the bus now? (module docstring)"""
        if not self.mqtt_up:
            return True  # QoS 1: spooled up to max_queued; QoS 0: dropped, counted
        if self.mq.want_write():
            return False
        return len(self._outstanding) < WINDOW

    def _read_bus(self) -> None:
        """Take up to `BATCH` messages from the bus; one at a time, so that what was read
        before the bus went away is still carried."""
        assert self.bus is not None
        bus, core = self.bus, self.core
        taken: list[tuple[str, bytes, int]] = []
        try:
            for _ in range(BATCH):
                event = bus.receive(None, socket.MSG_DONTWAIT)
                if type(event) is Publish:
                    topic = core.from_bus(event.key, event.payload)
                    if topic is None:
                        continue
                    if len(event.payload) + 4 * len(topic) + self._overhead > self._max_out \
                            and self._too_large(topic, event.payload):
                        continue
                    taken.append((topic, event.payload, core.last_qos))
        except BlockingIOError:
            pass
        except SbusError as exc:
            self._export(taken)
            self._bus_lost(exc)
            return
        self._export(taken)

    def _too_large(self, topic: str, payload: bytes) -> bool:
        """Is this export over the broker's Maximum Packet Size? (refused, counted)"""
        size = len(topic.encode("utf-8")) + len(payload) + self._overhead
        if size <= self._max_out:
            return False
        self.core.refused_by_broker()
        self._note(f"not exported: {size} bytes to {printable(topic, 80)} is over the MQTT "
                   f"broker's maximum packet size of {self._max_out}")
        return True

    def _export(self, taken: list[tuple[str, bytes, int]]) -> None:
        """Hand what was taken to paho: QoS 0 at once (dropped, counted, without a
        connection), QoS 1 through the spool (dropped, counted, when it is full)."""
        if len(taken) > 1:
            self._corked(True)
            try:
                self._export_run(taken)
            finally:
                self._corked(False)
        elif taken:
            self._export_run(taken)

    def _export_run(self, taken: list[tuple[str, bytes, int]]) -> None:
        core, spool, head0 = self.core, self.spool, self._stamp0_head
        keep: list[tuple[bytes, bytes]] = []
        texts: list[str] = []  # the topics of *keep*, as paho takes them
        room = 0
        for topic, payload, qos in taken:
            if qos == 0:  # numbered only if paho takes it (else dropped: no gap)
                stamped = _Stamped(head0 + b"%016x" % core.next0)
                info = self.mq.publish(topic, payload, 0, properties=stamped)  # type: ignore[arg-type]
                if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                    core.exported(len(topic) + len(payload), numbered=True)
                else:
                    core.dropped()
            elif spool is None:  # no state directory: held in memory only
                self._publish(topic, payload, -1, len(topic.encode("utf-8")) + len(payload))
            else:
                data = topic.encode("utf-8")
                size = len(data) + len(payload)
                if len(spool) + len(keep) < spool.max_count and \
                        spool.held_bytes + room + size <= spool.max_bytes:
                    keep.append((data, payload))
                    texts.append(topic)
                    room += size
                else:
                    core.dropped()  # the spool is full: the newest go (docs/bridge.md)
        if keep:
            assert spool is not None
            try:
                seqs = spool.append(keep)
            except OSError as exc:  # e.g. a full disk: these are lost, and said so
                core.dropped(len(keep))
                self._note(f"cannot write the spool in {spool.path}: {exc}; "
                           f"{len(keep)} exports dropped")
                return
            for seq, text, (data, payload) in zip(seqs, texts, keep, strict=True):
                self._publish(text, payload, seq, len(data) + len(payload))

    def _publish(self, topic: str, payload: bytes, seq: int, size: int,
                 count: bool = True) -> None:
        """Hand one QoS 1 export (*size*: topic and payload bytes) to paho, which queues
        it while MQTT is away."""
        if seq < 0 and (self._held_bytes + size > self.settings.max_queued_bytes
                        or len(self._outstanding) >= self.settings.max_queued):
            self.core.dropped()
            return
        props = self._props if seq < 0 else _Stamped(self._stamp_head + b"%016x" % seq)
        info = self.mq.publish(topic, payload, 1, properties=props)  # type: ignore[arg-type]
        if info.rc in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            if count:
                self.core.exported(size)  # without a connection: queued by paho
            self._outstanding[info.mid] = (seq, size)
            if seq < 0:
                self._held_bytes += size
        else:
            self.core.dropped()
            if seq >= 0 and self.spool is not None:
                self.spool.acked(seq)

    def _refused(self, refusal: Refusal) -> None:
        """The broker refused a packet of ours (the client's *on_refusal*: not raised)."""
        if refusal.verb in ("msg", "packet"):  # an import the bus would not take
            self.core.refused_by_broker()
            self._note(f"the bus refused an import: {printable(refusal.reason, 200)}")
        else:
            log.error("the bus refused %s: %s", printable(refusal.verb),
                      printable(refusal.reason, 200))

    # -- the loop ----------------------------------------------------------------------

    def _note(self, line: str) -> None:
        held = self._allowance.take(0)
        if held is not None:
            log.warning("%s%s", line, f" ({held} similar lines held back)" if held else "")

    def _log_refusals(self) -> None:
        while self.core.refusals:
            self._note("refused " + self.core.refusals.popleft())

    def status(self) -> str:
        mqtt_state = ("down" if not self.mqtt_up else "up" if self.subscribed else
                      "subscribing")
        where = f" at {self.broker}" if self.mqtt_up else ""
        queued = f", spooled {len(self.spool)}" if self.spool is not None else ""
        return (f"bus {'up' if self.bus_up else 'down'}, mqtt {mqtt_state}{where}; "
                f"{self.core.status()}{queued}")

    def _tell_bus(self, line: str) -> None:
        """Put the counters beside this connection in `sbus status` and sbus-top's clients
        pane (protocol.CLIENT_STATUS); skipped, not waited for, while the bus is backed up
        (the next change sends it again)."""
        if self.bus is None:
            return
        try:
            self.bus.control(protocol.CLIENT_STATUS, line, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except SbusError as exc:
            self._bus_lost(exc)

    def _notify(self, state: str) -> None:
        """Tell the service manager, never waiting for it: a notify socket nobody drains
        costs this STATUS= line (counted), not the bridge."""
        try:
            sdnotify.notify(state, nonblocking=True)
        except BlockingIOError:
            if not self.notify_skipped:
                log.warning("the service manager does not read its notify socket: STATUS= "
                            "lines are skipped until it does")
            self.notify_skipped += 1
        except OSError as exc:  # the manager went away: keep bridging, say it once
            if not self._notify_failed:
                log.warning("cannot notify the service manager: %s", exc)
            self._notify_failed = True

    def stop(self, *_args) -> None:
        self._stopping = True
        if self.bus is not None and not self.bus_up:
            raise _Stopped  # out of the Client's wait for the bus (a signal handler)

    def run(self) -> None:
        """Serve until `stop` (SIGTERM/SIGINT when run from the command line)."""
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        try:
            self._serve(wake_r)
        except _Stopped:
            pass
        finally:
            signal.set_wakeup_fd(old_wakeup)
            wake_r.close()
            wake_w.close()
            self._close()

    def _serve(self, wake_r: socket.socket) -> None:
        ready = False
        next_status, next_ack, last = 0.0, 0.0, ""
        while not self._stopping:
            now = time.monotonic()
            if self.bus is None and now >= self.bus_retry.next_at:
                self._connect_bus(now)
            if (self.mq.socket() is None or self._broken) \
                    and now >= self.mqtt_retry.next_at:
                self._connect_mqtt(now)
            if not ready:
                self._notify(f"READY=1\nSTATUS={self.status()}")
                ready = True
            self._turn(wake_r)
            if self.spool is not None and now >= next_ack:
                self.spool.flush()  # acknowledgements since: a crash sends those again,
                next_ack = now + ACK_EVERY  # and receiving bridges drop the copies
            self._log_refusals()
            now = time.monotonic()
            if now >= next_status and self.status() != last:
                last = self.status()
                self._save_state()  # first: what STATUS= says survives a crash
                self._notify(f"STATUS={last}")
                self._tell_bus(last)
                next_status = now + STATUS_EVERY

    def _turn(self, wake: socket.socket) -> None:
        sock = None if self._broken else self.mq.socket()
        readers: list = [wake]
        writers: list = []
        if self.bus is not None and self._export_ready():
            readers.append(self.bus)
        if sock is not None:
            if self.bus is not None:
                readers.append(sock)
            if self.mq.want_write():
                writers.append(sock)
        now = time.monotonic()
        waits = [1.0]
        if self.bus is None:
            waits.append(self.bus_retry.next_at - now)
        if sock is None:
            waits.append(self.mqtt_retry.next_at - now)
        # TLS may hold decrypted bytes that select cannot see; read them only for a bus
        pending = (sock is not None and self.bus is not None
                   and getattr(sock, "pending", lambda: 0)())
        timeout = 0.0 if pending else max(0.0, min(waits))
        readable, writable, _ = select.select(readers, writers, [], timeout)
        if wake in readable:
            try:
                wake.recv(64)
            except BlockingIOError:
                pass
        if sock is not None and sock in writable:
            self.mq.loop_write()
        if sock is not None and (sock in readable or pending):
            self._corked(True)  # the PUBACKs of this read, coalesced
            try:
                self._read_mqtt()
            except MALFORMED as exc:  # paho could not parse what the broker sent
                self._note(f"malformed data from the MQTT broker {self.broker}: "
                           f"{printable(str(exc), 200)}; reconnecting")
                self.mqtt_up = self.subscribed = False
                self._broken = True  # reconnect() replaces the socket and paho's state
                self.mqtt_retry.failed(time.monotonic())
            finally:
                self._corked(False)
        if self.bus is not None and self.bus in readable:
            self._read_bus()
        if self.mq.socket() is not None:
            self.mq.loop_misc()
            if self.mq.want_write():
                self.mq.loop_write()
        elif self.mqtt_up:  # closed without on_disconnect
            self._on_disconnect(self.mq, None, None, "connection closed", None)

    def _read_mqtt(self) -> None:
        """Process what the MQTT socket holds, up to `READ_TURN` packets."""
        for _ in range(READ_TURN):
            before = self._activity
            rc = self.mq.loop_read()
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or self._activity == before:
                break
            if self.bus is None:
                break

    def _close(self) -> None:
        self._stopping = True
        if self.mq.socket() is not None:
            self.mqtt_up = False  # a goodbye, not a loss
            self.mq.disconnect()
            deadline = time.monotonic() + 1.0
            while self.mq.want_write() and time.monotonic() < deadline:
                sock = self.mq.socket()
                if sock is None or self.mq.loop_write() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    break
                select.select([], [sock], [], 0.1)
        if self.bus is not None:
            self.bus.close()
            self.bus = None
        self._save_state(clean_exit=True)
        if self.spool is not None:
            self.spool.close()
        if self.state is not None:
            self.state.close()
