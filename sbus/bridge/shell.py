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
"""

from __future__ import annotations

import logging
import select
import signal
import socket
import time
from dataclasses import dataclass

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from .. import protocol, sdnotify
from ..client import Client, SbusError
from ..defaults import MAX_MESSAGE
from ..display import printable
from ..limits import LogAllowance
from ..protocol import Publish
from ..session import Refusal
from .core import MARKER, Backoff, BridgeCore

log = logging.getLogger("sbus.bridge")

__all__ = ["MqttSettings", "BridgeShell"]

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
#: MQTT packets processed per turn of the loop (keeps both sides served).
READ_TURN = 512


@dataclass
class MqttSettings:
    host: str
    port: int
    tls: bool = False
    username: str | None = None
    password: str | None = None
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    keepalive: int = 30
    export_qos: int = 1
    import_qos: int = 1
    session_expiry: int = 3600  # seconds the broker keeps our session (QoS 1 imports)
    max_queued: int = 10000  # QoS 1 exports held until acknowledged (the broker away)
    max_queued_bytes: int = 64 << 20  # and their bytes at most
    max_message: int = MAX_MESSAGE  # largest packet the broker may send us


class _PackedOnce(Properties):
    """The marker, the same on every message: packed once (paho packs per publish, which
    was a third of the bridge's time per exported message)."""

    def __init__(self, name: str, value: str) -> None:
        super().__init__(PacketTypes.PUBLISH)
        self.UserProperty = (name, value)
        object.__setattr__(self, "_packed", super().pack())

    def pack(self) -> bytes:
        return self._packed


class BridgeShell:
    def __init__(self, core: BridgeCore, address: str | None, settings: MqttSettings,
                 backoff_first: float = 0.2, backoff_max: float = 30.0) -> None:
        self.core = core
        self.address = address
        self.settings = settings
        self.bus: Client | None = None
        self.bus_backoff = Backoff(backoff_first, backoff_max)
        self.mqtt_backoff = Backoff(backoff_first, backoff_max)
        self.mqtt_up = False
        self.subscribed = False  # the broker acknowledged our subscriptions
        self._outstanding: dict[int, int] = {}  # QoS 1 mid -> bytes held for it
        self._outstanding_bytes = 0
        self._activity = 0
        self._stopping = False
        self._notify_failed = False
        self._allowance = LogAllowance()
        self._props = _PackedOnce(MARKER, core.client_id)
        self.mq = self._make_client()

    # -- MQTT client -----------------------------------------------------------------

    def _make_client(self) -> mqtt.Client:
        s = self.settings
        mq = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.core.client_id,
                         protocol=mqtt.MQTTv5)
        mq.max_inflight_messages_set(WINDOW)
        mq.max_queued_messages_set(s.max_queued)
        if s.tls:
            mq.tls_set(ca_certs=s.cafile, certfile=s.certfile, keyfile=s.keyfile)
        if s.username is not None:
            mq.username_pw_set(s.username, s.password)
        mq.on_connect = self._on_connect
        mq.on_disconnect = self._on_disconnect
        mq.on_message = self._on_message
        if s.export_qos == 1:  # at QoS 0 paho would build a reason and properties per message
            mq.on_publish = self._on_publish
        mq.on_subscribe = self._on_subscribe
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = s.session_expiry
        props.MaximumPacketSize = s.max_message + 1024  # MQTT header and properties
        mq.connect_async(s.host, s.port, s.keepalive, clean_start=s.session_expiry == 0,
                         properties=props)
        return mq

    def _on_connect(self, mq, userdata, flags, reason, properties) -> None:
        if reason.is_failure:
            log.error("MQTT broker %s:%d refused the connection: %s",
                      self.settings.host, self.settings.port, reason)
            return
        self.mqtt_up = True
        self.mqtt_backoff.up(time.monotonic())
        log.info("connected to MQTT broker %s:%d (session %s)", self.settings.host,
                 self.settings.port, "resumed" if flags.session_present else "new")
        filters = self.core.mqtt_filters()
        self.subscribed = not filters
        if filters:
            # No Local: never our own messages back; retainHandling 2: no retained
            # messages (sbus has no retained state; they would repeat on every reconnect).
            opts = SubscribeOptions(qos=self.settings.import_qos, noLocal=True,
                                    retainAsPublished=False, retainHandling=2)
            mq.subscribe([(f, opts) for f in filters])

    def _on_subscribe(self, mq, userdata, mid, reasons, properties) -> None:
        self.subscribed = True
        for f, reason in zip(self.core.mqtt_filters(), reasons, strict=False):
            if reason.is_failure:
                log.error("MQTT broker refused the subscription %s: %s", f, reason)

    def _on_disconnect(self, mq, userdata, flags, reason, properties) -> None:
        if self.mqtt_up:
            log.warning("lost the MQTT broker %s:%d: %s", self.settings.host,
                        self.settings.port, reason)
        self.mqtt_up = self.subscribed = False
        self.mqtt_backoff.failed(time.monotonic())

    def _on_publish(self, mq, userdata, mid, reason, properties) -> None:
        self._activity += 1
        size = self._outstanding.pop(mid, None)
        if size is not None:
            self._outstanding_bytes -= size
            if reason.is_failure:
                self.core.refused_by_broker()
                self._note(f"the MQTT broker refused an exported message: {reason}")

    def _on_message(self, mq, userdata, msg: mqtt.MQTTMessage) -> None:
        self._activity += 1
        marker = None
        for name, value in getattr(msg.properties, "UserProperty", None) or ():
            if name == MARKER:
                marker = value
                break
        try:
            topic = msg.topic.encode("utf-8")
        except UnicodeDecodeError:  # the broker should have refused it
            self.core.refused_by_broker()
            return
        key = self.core.from_mqtt(topic, msg.payload, marker)
        if key is None:
            return
        if self.bus is None:
            self.core.dropped()
            return
        try:
            self.bus.publish(key, msg.payload)
        except SbusError as exc:
            self.core.dropped()
            self._bus_lost(exc)
        else:
            self.core.imported()

    def _connect_mqtt(self, now: float) -> None:
        try:
            self.mq.reconnect()
        except (OSError, ValueError) as exc:
            delay = self.mqtt_backoff.failed(now)
            log.warning("cannot reach the MQTT broker %s:%d: %s; again in %.1f s",
                        self.settings.host, self.settings.port, exc, delay)

    # -- bus -------------------------------------------------------------------------

    def _connect_bus(self, now: float) -> None:
        try:
            bus = Client(self.address, on_drop=self.core.dropped, on_refusal=self._refused)
        except SbusError as exc:
            delay = self.bus_backoff.failed(now)
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
            delay = self.bus_backoff.failed(now)
            log.warning("bus at %s: %s; again in %.1f s", bus.address, exc, delay)
            return
        self.bus = bus
        self.core.bus_reset()
        self._tell_bus(self.status())
        self.bus_backoff.up(now)
        log.info("connected to the bus at %s", bus.address)

    def _bus_lost(self, exc: Exception) -> None:
        if self.bus is not None:
            log.warning("lost the bus: %s", exc)
            self.bus.close()
            self.bus = None
            self.bus_backoff.failed(time.monotonic())

    def _export_ready(self) -> bool:
        """May the bridge take more from the bus now? (module docstring)"""
        if not self.mqtt_up:
            return True  # QoS 1: paho queues up to max_queued; QoS 0: dropped, counted
        if self.mq.want_write():
            return False
        return self.settings.export_qos == 0 or len(self._outstanding) < WINDOW

    def _read_bus(self) -> None:
        assert self.bus is not None
        try:
            events = self.bus.receive_ready(BATCH)
        except SbusError as exc:
            self._bus_lost(exc)
            return
        qos, props, core = self.settings.export_qos, self._props, self.core
        for event in events:
            if isinstance(event, Publish):
                topic = core.from_bus(event.key, event.payload)
                if topic is None:
                    continue
                size = len(topic) + len(event.payload)
                if qos == 1 and self._outstanding_bytes + size > self.settings.max_queued_bytes:
                    core.dropped()
                    continue
                info = self.mq.publish(topic, event.payload, qos, properties=props)
                if info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (
                        qos == 1 and info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN):
                    core.exported()  # QoS 1 without a connection: queued by paho
                    if qos == 1:
                        self._outstanding[info.mid] = size
                        self._outstanding_bytes += size
                else:
                    core.dropped()

    def _refused(self, refusal: Refusal) -> None:
        """The broker refused a packet of ours (the client's *on_refusal*: not raised)."""
        if refusal.verb == "msg":
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
        return f"bus {'up' if self.bus else 'down'}, mqtt {mqtt_state}; {self.core.status()}"

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
        try:
            sdnotify.notify(state)
        except OSError as exc:  # the manager went away: keep bridging, say it once
            if not self._notify_failed:
                log.warning("cannot notify the service manager: %s", exc)
            self._notify_failed = True

    def stop(self, *_args) -> None:
        self._stopping = True

    def run(self) -> None:
        """Serve until `stop` (SIGTERM/SIGINT when run from the command line)."""
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
        ready = False
        next_status, last = 0.0, ""
        try:
            while not self._stopping:
                now = time.monotonic()
                if self.bus is None and now >= self.bus_backoff.next_at:
                    self._connect_bus(now)
                if self.mq.socket() is None and now >= self.mqtt_backoff.next_at:
                    self._connect_mqtt(now)
                if not ready:
                    self._notify(f"READY=1\nSTATUS={self.status()}")
                    ready = True
                self._turn(wake_r)
                self._log_refusals()
                now = time.monotonic()
                if now >= next_status and self.status() != last:
                    last = self.status()
                    self._notify(f"STATUS={last}")
                    self._tell_bus(last)
                    next_status = now + STATUS_EVERY
        finally:
            signal.set_wakeup_fd(old_wakeup)
            wake_r.close()
            wake_w.close()
            self._close()

    def _turn(self, wake: socket.socket) -> None:
        sock = self.mq.socket()
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
            waits.append(self.bus_backoff.next_at - now)
        if sock is None:
            waits.append(self.mqtt_backoff.next_at - now)
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
            self._read_mqtt()
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
