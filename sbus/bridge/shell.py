"""The bridge's I/O: the bus through `sbus.client.AsyncClient`, MQTT through paho-mqtt
(MQTT 5) driven from the same anyio loop; every decision is `BridgeCore`'s.

The bus connection is the client library's: it connects (the first time too, however
long the bus takes to come: ``open(retry=True)``), reconnects, restores the flood policy,
``nowait`` and the subscriptions, with its session's one `Backoff`.  The bridge only
says what it wants and hears of each change (*on_connection*).  paho's socket is driven
by the loop through paho's external-loop calls (``loop_read``/``loop_write``/
``loop_misc``, the socket open/close/register-write callbacks); paho's connect, which
blocks (name lookup, TCP, TLS handshake), runs in a worker thread while nothing else
touches paho.

Tasks: the bus reader (takes a batch, hands it to paho), the MQTT reader (a turn of
`READ_TURN` packets, imports published on the bus), the MQTT writer (what paho could
not write at once), the MQTT driver (connects, fails over, keep-alive) and the
housekeeper (spool acknowledgements, STATUS=).  Each gives the others a turn after a
batch (the bus reader: after each receive; the MQTT reader: after `READ_TURN` packets).
The bus reader takes its batches in a worker thread, the export lane, which waits on
the bus socket itself and runs each export turn while trio waits for I/O
(`sbus.bridge.lane`: the threads never run the bridge's code at once); a bridge that
imports reads MQTT likewise, in the import lane.  A lane hands back to the trio task
whatever needs trio (waiting for room, a reconnect).

Flow control, so that no local publisher ever waits for MQTT:

* The bus connection says ``blocking/soft/queue`` + ``blocking/hard/discard`` as a
  subscriber (the broker queues for the bridge, then drops, first the messages of a local
  user holding much of that queue, and reports ``blocking/dropped``, which is counted)
  and ``blocking/publisher/nowait`` as a publisher (a slow local subscriber loses
  imports instead of pausing the bridge).
* The bus is read only while MQTT can take more: nothing waiting to be written to the
  socket and, at QoS 1, fewer than `WINDOW` messages unacknowledged (fewer if the MQTT
  broker's Receive Maximum is lower).  Otherwise the
  messages wait in the local broker's queue for the bridge (bounded, then dropped).
* MQTT is read only while the bus is up: imports that cannot be delivered stay with the
  MQTT broker (at QoS 1 in the bridge's session) instead of being lost here.  An import
  is acknowledged to the MQTT broker only once the local broker has read it: the PUBACKs
  are held (`BufferedClient.held`) until the broker answers the whoami question sent
  after the imports (its answer comes after it read them).  A bus connection lost before
  the answer may have taken them (a ``kill -9`` of the broker): the QoS 1 ones are sent
  again on the next connection (perhaps twice), the QoS 0 ones counted as perhaps lost,
  and both said.  After a long wait for the bus the MQTT broker drops the connection
  (keep-alive) and it is made again, the session's imports waiting.

Crashes: QoS 1 exports are written to the spool (`spool.Spool`) before paho gets them
and leave it when the broker acknowledges them; a restarted bridge sends what is left.
"""

from __future__ import annotations

import logging
import math
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import paho.mqtt.client as mqtt
import trio
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.exception import MQTTException
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from .. import protocol, sdnotify
from ..client import SLOTS, AsyncClient, SbusError
from ..defaults import MAX_MESSAGE
from ..display import printable
from ..errors import InvalidRequest
from ..limits import LogAllowance
from ..linger import LINGER, Linger
from ..protocol import Publish
from ..session import Backoff, Refusal
from .buffered import BufferedClient, quick_properties
from .core import MARKER, SCOPE, STAMP, STAMP0, BridgeCore
from .lane import Turns
from .spool import MAX_SEQ, Spool, StateDir
from .topics import MAX_TOPIC, topic_problem

log = logging.getLogger("sbus.bridge")

__all__ = ["MqttSettings", "BridgeShell", "Retry"]

#: Messages taken from the bus per turn at most (the client hands out one receive's
#: batch at a time, `sbus.client.SLOTS`).
BATCH = 256
#: A clean stop with MQTT away takes into the spool what waits on the bus
#: (`BridgeShell._take_in_before_closing`): until none comes for this long, at most
#: TAKE_IN_TIME seconds.
TAKE_IN_QUIET, TAKE_IN_TIME = 0.05, 2.0
#: QoS 1 exports unacknowledged at once: a burst is bound by round trips below ~300
#: (100: 4,400–32,300 msg/s, 1,000: 18,000–39,300 in alternating runs, issue 26).  Also
#: paho's in-flight window, but only while paho holds more (after a reconnect): with a
#: window paho scans all it holds on every acknowledgement (40 µs per message with
#: 1,000), so while the bridge keeps within it paho is told to keep none (`_window`).
#: A broker's Receive Maximum (CONNACK) lowers it: MQTT 5 forbids sending more
#: unacknowledged (mosquitto says 20 unless `max_inflight_messages` is set).
WINDOW = 1000
#: Seconds the local broker may take to answer whoami on connect (then asked again).
BUS_TIMEOUT = 5.0
#: Seconds between STATUS= updates at most (one is sent when the line changed).
STATUS_EVERY = 0.5
#: Seconds between writes of the spool's acknowledgements at most (not one per turn);
#: also the housekeeper's beat.
ACK_EVERY = 0.05
#: MQTT packets processed per turn of the MQTT reader (keeps both sides served).
READ_TURN = 512
#: Seconds a bridge without imports lets acknowledgements of its exports gather before
#: it reads them (a run per wake-up, not one wake-up per PUBACK at a steady rate); never
#: while the bus reader waits for room in the window.
ACK_RUN = 0.002
#: Bytes of imports taken from MQTT before they are published on the bus (else at the
#: end of the read turn).
IMPORT_BYTES = 256 * 1024
#: Seconds `_import` waits before it tries again a bus connection that is being replaced
#: (the bus reader reconnects; the imports wait for it).
IMPORT_RETRY = 0.005
#: Seconds a lane waits on its socket before it looks again whether that is still the
#: connection (a change wakes it at once: `_wake_lanes`; this is the backstop).
LANE_POLL = 1.0
#: Seconds between paho's keep-alive checks (``loop_misc``) at most.
MISC_EVERY = 1.0
#: MQTT's largest packet, unless the broker says less (CONNACK Maximum Packet Size).
MQTT_MAX_PACKET = 268435460
#: Connections in a row the MQTT broker ends with the same export the oldest one it has
#: not acknowledged, each but the first within `POISON_QUICK` seconds of its CONNACK:
#: the broker will not take that export (a rule of its own), and paho would send it
#: again at every reconnect, before every export behind it.  It is refused instead.
POISON_LOSSES = 3
POISON_QUICK = 5.0
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
    linger: float = LINGER  # seconds messages may gather above a rate (`sbus.linger.Linger`)


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


class BridgeShell:
    def __init__(self, core: BridgeCore, address: str | None, settings: MqttSettings,
                 backoff_first: float = 0.2, backoff_max: float = 30.0) -> None:
        self.core = core
        self.settings = settings
        self.bus = AsyncClient(address, reconnect=True,
                               backoff=Backoff(backoff_first, backoff_max),
                               on_drop=core.bus_dropped, on_refusal=self._refused,
                               on_connection=self._bus_connection, confirm_reads=True)
        self.bus.on_answer = self._confirmed
        self.address = self.bus.address
        self.bus_up = False
        self._opened = False  # the bus's opening (policy, patterns, whoami) is done
        self.mqtt_retry = Retry(backoff_first, backoff_max)
        self.mqtt_up = False
        self.subscribed = False  # the broker acknowledged our subscriptions
        self._broker = 0  # index of the broker address tried or in use
        self._connecting = False  # a TCP connection made, no CONNACK yet
        self._in_thread = False  # paho's connect runs in a worker thread: hands off paho
        self._broken = False  # paho could not parse the stream: reconnect
        self._outstanding: dict[int, tuple[int, int]] = {}  # QoS 1 mid -> (spool seq, bytes)
        self._held_bytes = 0  # bytes of the QoS 1 exports held in memory only (no spool)
        self._imports: list[tuple[bytes, bytes, int]] = []  # taken from MQTT: key, payload, QoS
        self._import_bytes = 0  # their keys and payloads
        #: QoS 1 imports: reads make PUBACKs (coalesced under TCP_CORK)
        self._acked_imports = any(q for _, q in core.mqtt_subscriptions())
        #: imports sent on this bus connection that the broker has not confirmed (sent
        #: again if it is lost), the first `_covered` of them, and the first
        #: `_covered_acks` held PUBACKs, by the question last asked, whose answer is the
        #: session's `_confirm_at`-th (`_confirmed`)
        self._unacked: list[tuple[bytes, bytes, int]] = []
        self._covered = self._covered_acks = self._confirm_at = 0
        self._activity = 0
        self._acks = 0  # acknowledgements of exports read (`_on_publish`)
        self._stopping = False
        self._scope: anyio.CancelScope | None = None
        self._loop_thread: int | None = None
        self._token: trio.lowlevel.TrioToken | None = None  # (to reach trio from the lane)
        self._turns = Turns()
        self._lane_thread: int | None = None  # a lane's, during its turns
        self._lane_wake = -1  # an eventfd: the export lane looks again (`_wake_lanes`)
        self._mqtt_wake = -1  # the same for the import lane
        self.lane_turns = 0  # batches the export lane exported (the rest: the trio task's)
        self.import_turns = 0  # read turns the import lane took (the rest: the trio task's)
        self._waiters: list[list] = []  # [condition, anyio.Event] of tasks in `_until`
        self._exports_wait = False  # the bus reader waits for `_export_ready`
        self._first: set[str] = set()  # sides past their first attempt (READY=1 after both)
        self._notify = sdnotify.Reporter(log)
        self._allowance = LogAllowance()
        self._props = _PackedOnce((MARKER, core.client_id))
        self._stamp_head = b""  # the stamped template without its 16 hex digits
        self._stamp0_head = _PackedOnce(  # the same for QoS 0 exports (core.STAMP0)
            (MARKER, core.client_id), *((SCOPE, f) for f in core.stamp_scope(0)),
            (STAMP0, f"{core.epoch0}.{0:016x}")).pack()[:-16]
        self._paho_window = True  # paho keeps its in-flight window (`_window`)
        self.window = WINDOW  # at most the broker's Receive Maximum (`_on_connect`)
        self._limited = False  # paho keeps its window always (`_on_connect`)
        self.state: StateDir | None = None
        self._save_failed = ""  # why the last save of the state failed, if it did
        self.spool: Spool | None = None
        #: the filters a resumed MQTT session may still hold (an earlier configuration's)
        self._stale: list[str] = []
        self._left: list[tuple[int, bytes, bytes]] = []  # spooled by the last bridge
        self._resent_upto = 0  # records before this one were counted in `resent` once
        self._read_again = 0  # of the client's `read_again`: counted in `resent` so far
        self._reports_saved = 0  # the bus's drop reports counted when the state was saved
        self._max_out = MQTT_MAX_PACKET  # the broker's Maximum Packet Size (CONNACK)
        #: the export (packet id) that was the oldest unacknowledged one when the MQTT
        #: connection ended, how many connections in a row (`POISON_LOSSES`)
        self._suspect, self._suspect_losses = -1, 0
        self._connected_at = 0.0
        #: exports still to be sent one at a time after a connection the broker ended
        #: soon after accepting it (`_suspected`)
        self._probing = 0
        #: the bus connection the last bridge left in the service manager's fd store, if
        #: any, and the patterns state.json says the broker holds on it (`_open_bus`)
        self._kept: socket.socket | None = _kept_bus()
        self._kept_patterns: list[bytes] | None = None
        #: what state.json records of the bus connection in use: its socket's inode and
        #: the patterns asked for on it (`_keep_bus`; until then the last bridge's record
        #: of the connection taken up)
        self._bus_record: dict | None = None
        self._clean_start = True  # the last bridge stopped cleanly (state.json says)
        #: this bridge (saved: the last one) reads again what the one before it had read
        #: and not dealt with (`_open_bus`)
        self._rereading = self._reread_before = False
        if settings.state_dir:
            self._open_state(settings.state_dir)
        # a PUBLISH's bytes besides topic and payload: fixed header, topic length, packet
        # id, our properties and their length
        self._overhead = 5 + 2 + 2 + max(len(self._props.pack()), len(self._stamp_head) + 16,
                                         len(self._stamp0_head) + 16)
        self.mq = self._make_client()
        self._replay()

    # -- state on disk -----------------------------------------------------------------

    def _open_state(self, path: str) -> None:
        self.state = StateDir(path)
        saved, damage = self.state.load_state()
        if damage:
            log.warning("%s: the counters start from 0, and the MQTT session's import "
                        "filters of an earlier configuration are not unsubscribed", damage)
        counters = saved.get("counters")
        if isinstance(counters, dict):
            self.core.counters.restore(counters)
        old = saved.get("filters")
        if isinstance(old, list):
            now = set(self.core.mqtt_filters())
            bad = sum(not _filter(f) for f in old)
            if bad:
                log.warning("%s: %d saved import filters are not MQTT topic filters "
                            "(damaged): not unsubscribed", self.state.path / "state.json", bad)
            self._stale = [f for f in dict.fromkeys(f for f in old if _filter(f))
                           if f not in now]
        if 1 in self.core.export_qos_levels:
            # the numbers the last bridge gave (before saves that had it: none known)
            since = saved.get("spooled")
            since = since if type(since) is int and 0 <= since < MAX_SEQ else None
            try:
                self.spool = Spool(self.state.path, self.settings.max_queued,
                                   self.settings.max_queued_bytes)
                self._left = self.spool.load(since or 0)
            except OSError as exc:
                raise SbusError(f"cannot use the spool in {self.state.path}: "
                                f"{exc.strerror or exc}") from None
            for line in self.spool.problems:  # damage found and set right: said
                log.warning("the spool: %s", line)
            self.core.dropped(self.spool.lost)
            self._stamp_head = self._stamp_template(self.spool.epoch)
            # exports spooled after the last save of the counters were counted by nobody
            if since is not None and self.spool.next_seq > since:
                self.core.counters.exported += self.spool.next_seq - since
                self.core.counters.exported_bytes += sum(
                    len(t) + len(p) for seq, t, p in self._left if seq >= since)
        self._kept_patterns = _kept_patterns(saved.get("bus"), self._kept)
        if self._kept_patterns is not None:  # still its record until `_keep_bus` (a crash
            self._bus_record = saved["bus"]  # before then leaves the next bridge it too)
        upto = saved.get("resent_upto")
        self._resent_upto = upto if type(upto) is int and upto >= 0 else 0
        if saved.get("clean_exit"):  # else what it remembers may be older than it saw
            self.core.restore_senders(saved.get("senders"))
        self._clean_start = not saved or bool(saved.get("clean_exit"))
        self._reread_before = saved.get("rereading") is True
        if not self._clean_start:
            log.warning("the last bridge did not stop cleanly: counters other than exported "
                        "may miss its last %.1f s", STATUS_EVERY)
        self._save_state(clean_exit=False)

    def _stamp_template(self, epoch: str) -> bytes:
        """The marker, the scope and a `STAMP` in *epoch*, packed, without the 16 hex
        digits of the sequence number that end it."""
        return _PackedOnce((MARKER, self.core.client_id),
                           *((SCOPE, f) for f in self.core.stamp_scope()),
                           (STAMP, f"{epoch}.{0:016x}")).pack()[:-16]

    def _save_state(self, clean_exit: bool = False) -> None:
        self._reports_saved = self.bus.dropped
        if self.state is None:
            return
        failed = self.state.save_state({
            "counters": self.core.counters.saved(),
            "filters": self.core.mqtt_filters() + self._stale,
            "spooled": self.spool.next_seq if self.spool is not None else 0,  # (len 0: empty)
            "resent_upto": self._resent_upto,
            "clean_exit": clean_exit,
            "rereading": self._rereading,
            **({"bus": self._bus_record} if self._bus_record else {}),
            **({"senders": self.core.senders_saved()} if clean_exit else {})})
        if failed != self._save_failed:  # said once, until it changes
            if failed:
                log.warning("%s", failed)
            self._save_failed = failed

    def _replay(self) -> None:
        """Hand paho what the last bridge had not had acknowledged (sent on connect)."""
        left, self._left = [], self._left
        damaged = []
        heads: dict[str, bytes] = {}  # stamp templates of the runs that wrote them
        for seq, topic, payload in self._left:  # counted as exported by the last bridge
            if topic_problem(topic) is None:
                assert self.spool is not None
                epoch = self.spool.epoch_of(seq)
                if epoch not in heads:
                    heads[epoch] = self._stamp_template(epoch)
                left.append(seq)
                self._publish(topic, payload, seq, len(topic) + len(payload), count=False,
                              head=heads[epoch])
            else:  # the bridge spools none such: damage
                damaged.append(seq)
        self.mq.record()
        self._left = []
        if damaged:
            assert self.spool is not None
            for seq in damaged:
                self.spool.acked(seq)
            self.core.dropped(len(damaged))
            log.warning("the spool: %d records (the first numbered %d) have a topic no MQTT "
                        "broker takes, so they are damaged: dropped", len(damaged),
                        damaged[0])
        if left:  # each counted once, however many restarts find it still there
            self.core.counters.resent += sum(seq >= self._resent_upto for seq in left)
            self._resent_upto = max(self._resent_upto, left[-1] + 1)
            self._save_state()  # (at once: a bridge killed soon after must not lose it)
            log.info("%d exports from the spool will be sent again", len(left))

    # -- MQTT client -----------------------------------------------------------------

    def _make_client(self) -> BufferedClient:
        s = self.settings
        quick_properties()
        mq = BufferedClient(CallbackAPIVersion.VERSION2, client_id=self.core.client_id,
                            protocol=mqtt.MQTTv5)
        mq.max_inflight_messages_set(WINDOW)
        mq.max_queued_messages_set(s.max_queued)
        mq.held = [] if self._acked_imports else None  # PUBACKs once the bus confirms
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
        mq.on_quick_message = self._received
        mq.close_later = self._close_later
        if 1 in self.core.export_qos_levels:  # at QoS 0 paho would build a reason and
            mq.on_publish = self._on_publish          # properties per message
        mq.on_subscribe = self._on_subscribe
        mq.on_socket_open = self._on_socket_open
        mq.on_socket_close = self._on_socket_close
        # paho then queues what it sends (no write inside publish): the loop writes (one
        # send per flush: `BufferedClient`)
        mq.on_socket_register_write = self._on_register_write
        return mq

    @property
    def broker(self) -> Broker:
        return self.settings.brokers[self._broker]

    def _on_socket_open(self, mq, userdata, sock) -> None:
        """TCP_NODELAY: a lone message goes at once, not after the peer's delayed ACK
        (paho sets nothing); a run of packets is one write already (`BufferedClient`).
        (In the worker thread of `_connect_mqtt`.)"""
        if self.settings.nodelay:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass  # not TCP (a unix socket): nothing to set

    def _on_socket_close(self, mq, userdata, sock) -> None:
        """paho is about to close *sock*: wake the tasks waiting on it (a wait on a closed
        descriptor would never end)."""
        if threading.get_ident() == self._loop_thread:
            self._closing(sock)
        elif threading.get_ident() == self._lane_thread:
            pass  # trio is told before the socket closes (`_close_later`)
        elif self._loop_thread is not None:  # paho's connect, in its worker thread
            anyio.from_thread.run_sync(self._closing, sock)
        self._wake_lanes()

    def _close_later(self, sock) -> bool:
        """paho closes *sock*: in a lane, leave it to trio (`BufferedClient.close_later`).
        Closed there and then, its descriptor could be reused before trio forgot a wait
        on it (the writer's), which would then never end."""
        if threading.get_ident() != self._lane_thread:
            return False
        self._soon(self._close_socket, sock)
        return True

    def _close_socket(self, sock) -> None:
        self._closing(sock)
        sock.close()

    def _closing(self, sock) -> None:
        anyio.notify_closing(sock)
        self._poke()

    def _on_register_write(self, mq, userdata, sock) -> None:
        """paho has something to write.  Set so that paho queues instead of writing inside
        `publish` and `loop_read`: every path that makes paho queue ends in `_flush`
        (or pokes the writer task), which writes unless PUBACKs must wait."""

    def _window(self, on: bool) -> None:
        """Give paho its in-flight window (*on*: it may hold more than `WINDOW`, after a
        reconnect) or take it away (it holds at most `WINDOW`, all of them in flight:
        nothing for paho's per-acknowledgement scan to find)."""
        if on != self._paho_window and not self._probing:
            self._paho_window = on
            self.mq.set_window(self.window if on or self._limited else 0)

    def _on_connect(self, mq, userdata, flags, reason, properties) -> None:
        self._connecting = False  # answered: a disconnect now is no TLS-port mystery
        if reason.is_failure:
            log.error("MQTT broker %s refused the connection: %s", self.broker, reason)
            return
        self.mqtt_up = True
        self._connected_at = time.monotonic()
        self.mqtt_retry.up(self._connected_at)
        if mq.held:  # the last connection's: the broker sends those PUBLISHes again
            mq.held.clear()
        self._covered_acks = 0
        self._poke()
        log.info("connected to MQTT broker %s (session %s)", self.broker,
                 "resumed" if flags.session_present else "new")
        # the largest packet the broker takes: a larger one would make it close the
        # connection, and paho would send it again on every reconnect
        limit = getattr(properties, "MaximumPacketSize", None)
        self._max_out = limit if isinstance(limit, int) and limit > 0 else MQTT_MAX_PACKET
        self._refuse_held_over(mq.drop_over(self._max_out))
        if self._suspect_losses >= POISON_LOSSES:
            self._refuse_suspect()
        self._probing = min(self._probing, len(self._outstanding))
        most = getattr(properties, "ReceiveMaximum", None)  # unacknowledged QoS 1 it takes
        most = most if isinstance(most, int) and most > 0 else 65535  # (MQTT 5's default)
        self.window = min(WINDOW, most)
        # the bridge stops reading the bus at its window, but hands paho a whole batch:
        # under a limit that a batch could cross, paho keeps the window itself, always
        self._limited = most < WINDOW + BATCH
        self.mq.set_window(self.window if self._paho_window or self._limited else 0)
        if self._probing:
            self.mq.one_at_a_time()
        if self.window < WINDOW:
            log.info("MQTT broker %s takes at most %d unacknowledged messages",
                     self.broker, self.window)
        if self._stale and flags.session_present:
            # an earlier configuration's filters: they would pull traffic the bridge
            # filters out, and deliver twice what overlaps the new ones
            log.info("the imports changed: unsubscribing the session's old filters %s",
                     ", ".join(printable(f, 80) for f in self._stale[:10])
                     + (f" and {len(self._stale) - 10} more" if len(self._stale) > 10 else ""))
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

    def _refuse_held_over(self, mids: list[int]) -> None:
        """Exports held while MQTT was away (or from the spool) that are over the
        broker's Maximum Packet Size: refused, counted and said, as one over it is when
        exported (`_too_large`), instead of ending every connection."""
        for mid in mids:
            self._refused_held(mid)
        if mids:
            self._note(f"not exported: {len(mids)} held while MQTT was away are over the "
                       f"broker's maximum packet size of {self._max_out}")

    def _refused_held(self, mid: int) -> None:
        """An export paho held (*mid*) that the broker will not take: off the spool or
        the bytes held, counted."""
        seq, size = self._outstanding.pop(mid, (-1, 0))
        if seq >= 0 and self.spool is not None:
            self.spool.acked(seq)
        elif seq < 0:
            self._held_bytes -= size
        self.core.refused_by_broker()

    def _suspected(self, now: float) -> None:
        """The MQTT connection ended: the oldest export it had not had acknowledged is
        suspect once more if it was the last time too and the broker ended this one soon
        after accepting it (`POISON_LOSSES`).  Ended that soon, the exports it held are
        sent one at a time on the next (`_probing`): a broker that ends the connection
        over one may not have acknowledged those sent ahead of it, which would then be
        the oldest, suspect in its place, and sent again and again with it."""
        head = next(iter(self._outstanding), -1)
        quick = now - self._connected_at < POISON_QUICK
        if head >= 0 and head == self._suspect and quick:
            self._suspect_losses += 1
        else:
            self._suspect, self._suspect_losses = head, int(head >= 0)
        if quick and head >= 0:
            self._probing = len(self._outstanding)

    def _refuse_suspect(self) -> None:
        """Before paho sends what it holds again: the export the broker ended
        `POISON_LOSSES` connections in a row for is refused, counted and said."""
        mid, self._suspect, self._suspect_losses = self._suspect, -1, 0
        topic = self.mq.drop(mid)
        if topic is None:
            return
        self._refused_held(mid)
        self._note(f"not exported: the MQTT broker {self.broker} ended {POISON_LOSSES} "
                   f"connections in a row with {printable(topic, 80)} the first message it "
                   "had not acknowledged: refused, so that the exports behind it go on")

    def _on_subscribe(self, mq, userdata, mid, reasons, properties) -> None:
        self.subscribed = True
        for f, reason in zip(self.core.mqtt_filters(), reasons, strict=False):
            if reason.is_failure:
                log.error("MQTT broker refused the subscription %s: %s", f, reason)

    def _on_disconnect(self, mq, userdata, flags, reason, properties) -> None:
        now = time.monotonic()
        refusal, mq.refusal = mq.refusal, ""
        if refusal:  # (a packet read is not counted in any other way)
            self.core.refused_by_broker()
        if self._stopping:
            pass  # our own goodbye
        elif self.mqtt_up:
            log.warning("lost the MQTT broker %s: %s", self.broker, refusal or reason)
            self._suspected(now)
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
        self._poke()

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
        self._acks += 1
        held = self._outstanding.pop(mid, None)
        if mid == self._suspect:
            self._suspect, self._suspect_losses = -1, 0
        if self._probing:  # (paho sends the next after we return, at the window set here)
            self._probing -= 1
            if not self._probing:
                self._paho_window = True
                mq.set_window(self.window)
        elif self._paho_window and len(self._outstanding) < self.window:
            self._window(False)  # (paho holds this one too until we return: <= window)
        if held is not None:
            if held[0] >= 0 and self.spool is not None:
                self.spool.acked(held[0])
            elif held[0] < 0:
                self._held_bytes -= held[1]
            if reason.is_failure:
                self.core.refused_by_broker()
                self._note(f"the MQTT broker refused an exported message: {reason}")

    def _on_message(self, mq, userdata, msg: mqtt.MQTTMessage) -> None:
        """A message paho read itself (most come by `BufferedClient`'s short cut)."""
        self._received(msg._topic, msg.payload, msg.qos, bool(msg.dup),
                               getattr(msg.properties, "UserProperty", None) or [])

    def _received(self, topic: bytes, payload: bytes, qos: int, dup: bool,
                          props: list) -> None:
        """One message from MQTT (from paho, or `BufferedClient`'s short cut): whatever
        it holds, it is counted and never raises."""
        self._activity += 1
        marker = stamp = None
        numbering = 1
        scope: list[str] = []
        for prop in props:
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
            topic.decode("utf-8")
        except UnicodeDecodeError:  # the broker should have refused it
            self.core.refused_by_broker()
            self._note("the MQTT broker sent a topic that is not UTF-8")
            return
        key = self.core.from_mqtt(topic, payload, marker, stamp, tuple(scope), numbering)
        if key is None:
            return
        if not self.bus_up:
            self.core.dropped()
            return
        if dup:
            self.core.redelivered()
        self._imports.append((key, payload, qos))  # published by `_import`
        self._import_bytes += len(key) + len(payload)

    def _connect_mqtt(self) -> None:
        """paho's connect (it blocks: name lookup, TCP, TLS), in the worker thread."""
        s, broker = self.settings, self.broker
        self._window(True)  # paho sends again what it holds, WINDOW at a time
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = s.session_expiry
        props.MaximumPacketSize = self.mq.max_in = s.max_message + 1024  # with headers
        self.mq.connect_async(broker.host, broker.port, s.keepalive,
                              clean_start=s.session_expiry == 0, properties=props)
        self.mq.reconnect()

    async def _mqtt_driver(self) -> None:
        """Connect (again) when there is no usable connection and the backoff allows;
        otherwise paho's keep-alive (`loop_misc`) every `MISC_EVERY` seconds at most."""
        mq = self.mq
        while True:
            if mq.socket() is None or self._broken:
                wait = self.mqtt_retry.next_at - time.monotonic()
                if wait > 0:  # (a fail-over to the next address moves it nearer)
                    await self._until(lambda: time.monotonic() >= self.mqtt_retry.next_at,
                                      wait)
                    continue
                await self._mqtt_attempt()
                continue
            mq.loop_misc()
            self._flush()
            if mq.socket() is None and self.mqtt_up:  # closed without on_disconnect
                self._on_disconnect(mq, None, None, "connection closed", None)
            await self._until(lambda: mq.socket() is None or self._broken, MISC_EVERY)

    async def _mqtt_attempt(self) -> None:
        broker = self.broker
        self._in_thread = True  # nothing else touches paho meanwhile
        try:
            # abandoned when the bridge stops: the thread ends by itself (connect timeout)
            await anyio.to_thread.run_sync(self._connect_mqtt, abandon_on_cancel=True)
        except (OSError, ValueError) as exc:
            self._in_thread = False
            delay = self._next_broker(time.monotonic())
            log.warning("cannot reach the MQTT broker %s: %s%s", broker, exc,
                        f"; again in {delay:.1f} s" if delay else "; trying the next")
        else:
            self._in_thread = False
            self._connecting = True
            self._broken = False
        finally:
            self._first_done("mqtt")
        self._poke()

    def _mqtt_live(self) -> bool:
        return not self._in_thread and not self._broken and self.mq.socket() is not None

    async def _mqtt_reader(self) -> None:
        """Read MQTT while the bus is up: a turn of up to `READ_TURN` packets at a time,
        a run when they come fast (`Linger`; acknowledgements only: `ACK_RUN`).  A bridge
        that imports reads in its import lane (`_mqtt_lane`) while it can go on."""
        mq = self.mq
        runs = not self.core.mqtt_subscriptions()  # nothing else to come: no import waits
        pace = Linger(self.settings.linger)
        while True:
            if self._imports or self._unasked():  # what the import lane left (they wait
                await self._import()  # for room on the bus), or its question
                self._flush()
            if not (self.bus_up and self._mqtt_live()):
                await self._until(lambda: self.bus_up and self._mqtt_live())
                continue
            if not runs:
                after = await anyio.to_thread.run_sync(self._mqtt_lane, pace,
                                                       abandon_on_cancel=True)
                if after == "stop":
                    await anyio.sleep_forever()  # (the housekeeper cancels us)
                continue
            sock = mq.socket()
            buffered = mq.pending() > 0  # read already, or (TLS) decrypted: poll can't see
            if not buffered:
                try:
                    await anyio.wait_readable(sock)
                except anyio.ClosedResourceError:  # paho closed it
                    continue
                if sock is not mq.socket() or not (self.bus_up and self._mqtt_live()):
                    continue
            activity, acks = self._activity, self._acks
            try:
                if not self._read_turn():
                    await self._import()
                self._flush()
            finally:
                if self._exports_wait:
                    self._poke()  # acknowledged exports: room for more
            wait = pace.after(time.monotonic(), self._activity - activity)
            if self._acks != acks:
                wait = max(wait, ACK_RUN)
            if wait and not self._exports_wait:
                self._quick_ack(sock)
                # the next messages as a run (at once if the window fills)
                await self._until(lambda: self._exports_wait, wait)
            elif buffered:
                await anyio.lowlevel.checkpoint()  # (else the wait above gives the turn)

    def _mqtt_lane(self, pace: Linger) -> str:
        """The import lane (`sbus.bridge.lane`), in a worker thread: wait on the MQTT
        socket, read a turn and publish its imports on the bus, as long as both sides are
        up, the socket is the one it began with and the bus takes the imports at once.
        Returns why it ended: "trio" (imports wait for room on the bus, or a connection
        changed: the trio task's to handle) or "stop"."""
        mq, turns = self.mq, self._turns
        with turns:
            if self._stopping:
                return "stop"
            sock = mq.socket()
            if not (self.bus_up and self._mqtt_live()) or sock is None or sock.fileno() < 0:
                return "trio"
            poller = select.poll()
            poller.register(self._mqtt_wake, select.POLLIN)
            poller.register(sock, select.POLLIN)
            buffered = mq.pending() > 0
        while True:
            ready = poller.poll(0 if buffered else LANE_POLL * 1000)
            with turns:
                if self._stopping:
                    return "stop"
                if not (self.bus_up and self._mqtt_live()) or mq.socket() is not sock:
                    return "trio"
                if not buffered and all(fd == self._mqtt_wake for fd, _ in ready):
                    _drain(self._mqtt_wake)
                    continue
                activity = self._activity
                self._lane_thread = threading.get_ident()
                try:
                    if not self._read_turn():
                        return "trio"
                    self._flush()
                    if self._exports_wait:
                        self._poke()  # acknowledged exports: room for more
                finally:
                    self._lane_thread = None
                self.import_turns += 1
                buffered = mq.pending() > 0
            wait = pace.after(time.monotonic(), self._activity - activity)
            if wait and not self._exports_wait:
                self._quick_ack(sock)
                select.select([self._mqtt_wake], [], [], wait)  # the next ones as a run

    def _quick_ack(self, sock) -> None:
        """Have the kernel acknowledge what comes while the reader waits at once, not
        with the PUBACKs of its next turn: a broker without TCP_NODELAY (mosquitto's
        default) holds each small write until the one before is acknowledged, which
        doubled the wait (2.3 ms at 8,000 msg/s with a 1 ms linger).  The kernel clears
        the mode by itself, so it is set before every wait."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except (OSError, AttributeError):
            pass  # not TCP (a unix socket): nothing to set

    def _read_turn(self) -> bool:
        """Process what the MQTT socket holds, up to `READ_TURN` packets, and publish its
        imports on the bus as far as it takes them now (`_import_nowait`): False when some
        are left waiting for room (their PUBACKs with them)."""
        for _ in range(READ_TURN):
            before = self._activity
            try:
                rc = self.mq.loop_read()
            except MALFORMED as exc:  # paho could not parse what the broker sent
                self._note(f"malformed data from the MQTT broker {self.broker}: "
                           f"{printable(str(exc), 200)}; reconnecting")
                self.mqtt_up = self.subscribed = False
                self._broken = True  # reconnect() replaces the socket and paho's state
                self.mqtt_retry.failed(time.monotonic())
                self._poke()
                break
            # on the bus before the next read: what came in this one (20 µs sooner for a
            # lone message), or a large run
            if (self._import_bytes >= IMPORT_BYTES or not self.mq.pending()) \
                    and not self._import_nowait():
                return False
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or self._activity == before \
                    or not self.bus_up:
                break
        return self._import_nowait()

    def _import_nowait(self) -> bool:
        """Publish on the bus, in order, the imports it takes now: runs of them in one
        system call (`AsyncClient.send_run_nowait`); one it refuses is counted and said.
        Then a whoami question, whose answer lets their PUBACKs go (`_confirmed`).  True
        when nothing is left to send; else the rest wait in `_imports` (for `_import`)."""
        imports = self._imports
        self._import_bytes = 0
        if imports:
            self._send_imports()
            if imports:
                return False
        return not self._unasked() or self._asked(self.bus.send_run_nowait(
            [self.bus.session.ask()]) == 1)

    def _send_imports(self) -> None:
        """`_import_nowait`'s sending: what went moves to `_unacked`.  (The question goes
        in a system call of its own: with the last run, the broker's wake-up that
        delivers the imports also answered it, and that answer woke the bridge while the
        subscribers' deliveries went: 15-20 µs more per import at 1,000 msg/s.)"""
        imports = self._imports
        bus, core, packet = self.bus, self.core, self.bus.session.publish
        done, count = 0, len(imports)
        while done < count:
            run: list[bytes] = []
            refused = None
            for key, payload, _ in imports[done:done + SLOTS]:  # (encoded once, mostly)
                try:
                    run.append(packet(key, payload))
                except InvalidRequest as exc:  # too large for the bus, or a key it refuses
                    refused = exc
                    break
            if run:
                went = bus.send_run_nowait(run)
                for key, payload, _ in imports[done:done + went]:
                    core.imported(len(key) + len(payload))
                self._unacked += imports[done:done + went]
                done += went
                if went < len(run):
                    break  # no room now: `_import` waits for it
            if refused is not None:
                core.refused_by_broker()
                self._note(f"not imported: {printable(str(refused), 200)}")
                done += 1
        del imports[:done]

    def _asked(self, sent: bool) -> bool:
        """The question that confirms the imports sent, and the PUBACKs held, so far was
        *sent* (made by `Session.ask`): its place among the answers is noted, or (not
        sent) forgotten.  Returns *sent*."""
        session = self.bus.session
        if not sent:
            session.unask()
            return False
        held = self.mq.held
        self._covered, self._covered_acks = len(self._unacked), len(held or ())
        self._confirm_at = session.answers + session.asked
        return True

    def _unasked(self) -> bool:
        """Were imports sent, or PUBACKs held, since the last question?"""
        return len(self._unacked) > self._covered \
            or len(self.mq.held or ()) > self._covered_acks

    def _confirmed(self) -> None:
        """A whoami answer was read (`AsyncClient.on_answer`, by whichever task reads the
        bus): if it is the last question's, the broker has read every import sent before
        it, and their PUBACKs go."""
        if self.bus.session.answers < self._confirm_at \
                or not (self._covered or self._covered_acks):
            return
        del self._unacked[:self._covered]
        self.mq.release(self._covered_acks)
        self._covered = self._covered_acks = 0
        self._flush()
        sock = self.mq.socket()
        if sock is not None:
            self._quick_ack(sock)

    async def _import(self) -> None:
        """Publish the imports left by `_import_nowait`, in order, as the bus has room
        for them, or once it is back (the bus reader reconnects; this never does, so no
        import goes on a connection before those the last one may have taken:
        `_import_again`).  If the bridge stops first, they never go (`_close` counts the
        QoS 0 imports left as dropped; the QoS 1 ones the MQTT broker sends again)."""
        bus = self.bus
        while not self._import_nowait():
            if not self.bus_up:
                await self._until(lambda: self.bus_up)
                continue
            fd = bus.fileno()
            try:
                if fd >= 0:
                    await anyio.wait_writable(fd)
            except anyio.ClosedResourceError:
                continue
            left = len(self._imports)
            if self._import_nowait():
                return
            if len(self._imports) == left:  # writable, yet nothing went: a broken
                await anyio.sleep(IMPORT_RETRY)  # connection that the reader replaces

    async def _mqtt_writer(self) -> None:
        """Write what paho queued and could not write at once (a full socket, or packets
        queued between flushes: PINGREQ, SUBSCRIBE, the PUBACKs of confirmed imports)."""
        mq = self.mq
        while True:
            await self._until(lambda: self._mqtt_live()
                              and mq.want_write())
            sock = mq.socket()
            try:
                await anyio.wait_writable(sock)
            except anyio.ClosedResourceError:
                continue
            if sock is mq.socket():
                self._flush()

    def _flush(self) -> None:
        """Write what paho queued, unless paho is connecting in its thread."""
        mq = self.mq
        if not self._mqtt_live() or not mq.want_write():
            return
        mq.flush()
        if self._exports_wait or mq.want_write():  # room for exports, or the writer's turn
            self._poke()

    # -- bus -------------------------------------------------------------------------

    async def _open_bus(self) -> None:
        """The bus connection: the one the last bridge left in the fd store if there is
        one and state.json says which patterns it holds (taken up: docs/bridge.md, "Its
        bus connection across its own restart"), else a new one, waited for however long
        it takes (the client's reconnect driver, also for the first connection); then the
        flood policy, ``nowait`` and the patterns, which the client's session restores on
        every reconnect."""
        bus, kept, held = self.bus, self._kept, self._kept_patterns
        self._kept = None
        adopted = kept is not None and held is not None
        if adopted:
            await bus.adopt(kept, held)
            log.info("took up the bus connection the last bridge left in the fd store: "
                     "what the broker kept for it meanwhile comes first")
            if not self._clean_start:  # killed: what it read and had not spooled is read
                log.warning("the last bridge did not stop cleanly: what it had read from "
                            "the bus and not yet spooled is read again (the client says "
                            "how much), and may be exported twice")
            if bus.rereading and self._reread_before:  # a third time: it may be what kills
                lost = bus.skip_again()
                self.core.dropped(lost)
                log.warning("the last bridge died before it had dealt with what the one "
                            "before it had read from the bus and not dealt with either: "
                            "those %d messages are dropped (counted), not read a third time",
                            lost)
        else:
            if kept is not None:  # no record of what it holds: let it go (with its queue)
                kept.close()
                _unkeep()
                log.warning("the bus connection the last bridge left in the fd store is "
                            "not taken up: state.json has no usable record of it; what the "
                            "broker queued on it is lost")
            await bus.open(retry=True)
        await bus.send_packet(bus.session.publisher_nowait())
        await bus.set_flood(soft="queue", hard="discard")
        wanted = self.core.bus_patterns()
        for pattern in set(bus.session.patterns) - set(wanted):  # (an earlier config's)
            await bus.unsubscribe(pattern)
        for pattern in wanted:
            if not bus.session.patterns[pattern]:
                await bus.subscribe(pattern, wait=False)
        # A connection taken up is not read before the lanes run: what waited on it would
        # be held in memory (a kill -9 then lost it all), and what was sent on it the
        # broker acts on whatever becomes of this process (`_keep_bus`); its dialect was
        # checked when it was opened.  A new one waits for its opening's answer: the
        # subscriptions in force, the dialect known.
        while not adopted:
            try:
                me = await bus.whoami(timeout=BUS_TIMEOUT)  # the barrier: all in force
            except TimeoutError:
                log.warning("the bus at %s did not answer within %g s; asking again",
                            self.address, BUS_TIMEOUT)
                continue
            if not me.startswith(b"!/"):
                raise SbusError("the broker speaks the early-draft dialect (separator "
                                "'.'); the bridge maps only '/' keys to MQTT topics")
            bus.confirm_reads()  # (the opening's answers; messages kept are not taken)
            break
        self._opened = self.bus_up = True
        self.core.bus_reset()
        self._keep_bus()
        self._tell_bus(self.status())
        log.info("connected to the bus at %s", self.address)
        self._first_done("bus")
        self._poke()

    def _bus_connection(self, up: bool, line: str) -> None:
        """The client lost the bus (the task that noticed waits for it: MQTT is not read
        meanwhile, and imports wait at the MQTT broker) or has it again."""
        if up:
            log.info("%s", line)
        else:
            log.warning("%s", line)
        if not self._opened:  # the first connection: `_open_bus` goes on
            if not up:
                self._first_done("bus")
            return
        self.bus_up = up
        if up:
            self.core.bus_reset()  # no echo of an earlier import comes on this connection
            self._keep_bus()
        else:
            self._bus_record = None  # (saved below)
            _unkeep()
            self._import_again()
        self._wake_lanes()  # (it waits on the connection that was)
        self._save_state()
        self._notify(f"STATUS={self.status()}")
        self._poke()

    def _keep_bus(self) -> None:
        """The bus connection's opening is sent (and, on a new one, answered): record the
        patterns asked for on it in state.json, then leave it in the service manager's fd
        store, so that the next bridge takes it up after a restart or a crash
        (`_open_bus`) and the broker queues for it meanwhile.  Packets sent on a kept
        connection are acted on by the broker even if this process dies: what was asked
        is what the next bridge finds.  Recorded first: a connection kept without its
        record is let go by the next bridge, never taken up with the wrong patterns."""
        sock = self.bus.sock
        if sock is None or sock.fileno() < 0:
            return
        self._bus_record = {
            "inode": os.fstat(sock.fileno()).st_ino,
            "patterns": [p.decode("utf-8", "surrogateescape")
                         for p in self.bus.session.patterns]}
        self._save_state()
        if self.state is not None:  # (no state directory: the next bridge can't take it)
            _keep(sock)

    def _import_again(self) -> None:
        """The bus connection was lost before the broker confirmed the last imports:
        it may have taken them.  The QoS 1 ones go again first on the next connection
        (their PUBACKs still wait: a copy rather than a loss); the QoS 0 ones are not
        sent twice, and are counted as perhaps lost.  Said, with both counts."""
        self._covered = self._covered_acks = 0  # (that question is never answered)
        if not self._unacked:
            return
        again = [item for item in self._unacked if item[2]]
        maybe = len(self._unacked) - len(again)
        self._unacked.clear()
        self._imports[:0] = again
        if maybe:
            self.core.dropped(maybe)
        log.warning("the bus connection was lost before the broker confirmed %d import(s):"
                    " %d QoS 1 sent again when it is back (perhaps twice), %d QoS 0 perhaps "
                    "lost (counted dropped)", len(again) + maybe, len(again), maybe)

    async def _bus_reader(self) -> None:
        """Take a batch from the bus whenever MQTT can take more, and hand it to paho:
        in the export lane while it can go on, else here, one batch at a time."""
        await self._open_bus()
        pace = Linger(self.settings.linger)
        while True:
            if not self._export_ready():
                self._exports_wait = True
                self._poke()  # the MQTT reader reads acknowledgements now (`ACK_RUN`)
                self._wake_lanes(exports=False)  # (and the import lane's linger ends)
                try:
                    await self._until(self._export_ready)
                finally:
                    self._exports_wait = False
            after = await anyio.to_thread.run_sync(self._lane, pace, abandon_on_cancel=True)
            if after == "stop":
                await anyio.sleep_forever()  # (the housekeeper cancels us)
            if after == "wait":
                continue
            try:
                events = await self._bus_batch()
            except SbusError as exc:
                self._bus_error(exc)
                continue
            self._export_events(events)
            self.bus.confirm_reads()
            wait = pace.after(time.monotonic(), len(events))
            if wait:  # the next batch as a run
                await anyio.sleep(wait)

    def _lane(self, pace: Linger) -> str:
        """The export lane (module docstring), in a worker thread: wait on the bus
        socket, take what came and export it in a turn (`Turns`), as long as MQTT can
        take more and the connection is the one it began with.  Returns why it ended:
        "wait" (for room in MQTT), "trio" (the next batch is the trio task's: the
        connection changed or ended, and `receive_batch` reconnects) or "stop"."""
        bus, turns = self.bus, self._turns
        with turns:  # (the socket may be mid-reconnect: closed, its descriptor -1)
            if self._stopping:
                return "stop"
            sock = bus.sock
            if sock is None or sock.fileno() < 0:
                return "trio"
            poller = select.poll()
            poller.register(self._lane_wake, select.POLLIN)
            poller.register(sock, select.POLLIN)
        while True:
            # (events kept by a reconnect's opening are not on the socket: no wait then)
            ready = poller.poll(0 if bus.kept else LANE_POLL * 1000)
            with turns:
                if self._stopping:
                    return "stop"
                if not self._export_ready():
                    return "wait"
                if bus.sock is not sock:
                    return "trio"
                self._lane_thread = threading.get_ident()
                try:
                    answers = bus.session.answers
                    events = bus.receive_ready(BATCH)
                    if events:
                        self._export_events(events)
                        bus.confirm_reads()  # (spooled: off the socket)
                        self.lane_turns += 1
                    elif bus.session.answers != answers:  # the answer to an import's
                        bus.confirm_reads()  # question (`_confirmed` took it): off too
                    elif any(fd != self._lane_wake for fd, _ in ready):
                        return "trio"  # readable, but nothing: an end, or a reconnect
                    else:
                        _drain(self._lane_wake)
                        continue
                except SbusError as exc:
                    self._bus_error(exc)
                    continue
                finally:
                    self._lane_thread = None
            wait = pace.after(time.monotonic(), len(events))
            if wait:  # the next batch as a run
                time.sleep(wait)

    def _wake_lanes(self, exports: bool = True) -> None:
        """Have the lanes look again at once (a connection changed, the bridge stops;
        not *exports*: the import lane only, to end its linger).  Safe from any thread
        and from a signal handler."""
        for fd in (self._lane_wake, self._mqtt_wake) if exports else (self._mqtt_wake,):
            if fd >= 0:
                try:
                    os.eventfd_write(fd, 1)
                except OSError:  # closed meanwhile: the lane is gone too
                    pass

    def _bus_error(self, exc: SbusError) -> None:
        """The broker sent a malformed packet: said, skipped."""
        self._note(f"the bus at {self.address}: {printable(str(exc), 200)}")

    def _export_events(self, events: list) -> None:
        """Hand the messages of a batch from the bus to paho (`_export`).  Those the
        last bridge had read and not dealt with (killed: read again, `AsyncClient.adopt`)
        are counted as `resent` too: perhaps a second copy."""
        core = self.core
        again = self.bus.read_again - self._read_again
        if again:  # (the head of this batch)
            if not self._read_again:  # the first: on disk before it is dealt with, so
                self._rereading = True  # that a bridge killed by it is known (`_open_bus`)
                self._save_state()
            self._read_again += again
            core.counters.resent += sum(type(event) is Publish for event in events[:again])
        taken: list[tuple[str, bytes, int]] = []
        for event in events:
            if type(event) is Publish:
                topic = core.from_bus(event.key, event.payload)
                if topic is None:
                    continue
                if len(event.payload) + 4 * len(topic) + self._overhead > self._max_out \
                        and self._too_large(topic, event.payload):
                    continue
                taken.append((topic, event.payload, core.last_qos))
        self._export(taken)
        if again or self.bus.dropped != self._reports_saved:
            # saved before the caller takes the batch off the socket (`confirm_reads`):
            # killed before, the next bridge reads it again (the broker's drop reports
            # too); after, what it counted is on disk
            self._rereading = self.bus.rereading
            self._save_state()

    async def _bus_batch(self) -> list:
        """The next batch from the bus, waited for on the socket itself (the turn of the
        loop the other tasks get between batches), then taken as it is: one turn and one
        receive per batch.  Through `receive_batch` when the client has more to do (an
        end of connection: it reconnects)."""
        bus = self.bus
        fd = bus.fileno()
        if fd >= 0:  # (-1: closed, being replaced)
            try:
                await anyio.wait_readable(fd)
            except anyio.ClosedResourceError:  # closed meanwhile
                pass
        answers = bus.session.answers
        events = bus.receive_ready(BATCH)
        if events or bus.session.answers != answers:  # (an import's answer: taken)
            return events
        return await bus.receive_batch(BATCH)

    def _export_ready(self) -> bool:
        """May the bridge take more from the bus now? (module docstring)"""
        if self._in_thread:
            return False  # paho is connecting: not to be touched
        if not self.mqtt_up:  # QoS 0: dropped, counted; QoS 1: spooled up to half
            return self._half_held()
        if self.mq.want_write():
            return False
        return len(self._outstanding) < self.window

    def _half_held(self) -> bool:
        """Is less than half the room for QoS 1 exports taken (`--max-queued`, and its
        bytes)?  With MQTT away the bridge reads the bus only while it is: past it the
        exports wait in the local broker's queue for the bridge, where each local user
        holds a share, so one user's burst cannot take all the room (docs/bridge.md,
        "Local exporters share the bridge")."""
        s, spool = self.settings, self.spool
        held, nbytes = (len(spool), spool.held_bytes) if spool is not None else \
            (len(self._outstanding), self._held_bytes)
        return held < s.max_queued // 2 and nbytes < s.max_queued_bytes // 2

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
        if taken:
            try:
                self._export_run(taken)
                self._flush()
            finally:  # paho's records of what went: after the send, off its way
                self.mq.record()

    def _export_run(self, taken: list[tuple[str, bytes, int]]) -> None:
        core, spool, head0 = self.core, self.spool, self._stamp0_head
        keep: list[tuple[bytes, bytes]] = []
        room = 0
        for topic, payload, qos in taken:
            if qos == 0:  # numbered only if paho takes it (else dropped: no gap)
                stamped = _Stamped(head0 + b"%016x" % core.next0)
                data = topic.encode("utf-8")
                if self.mq.publish0_now(data, payload, stamped) or self.mq.publish(
                        topic, payload, 0, properties=stamped  # type: ignore[arg-type]
                        ).rc == MQTTErrorCode.MQTT_ERR_SUCCESS:
                    core.exported(len(data) + len(payload), numbered=True)
                else:
                    core.dropped()
            elif spool is None:  # no state directory: held in memory only
                data = topic.encode("utf-8")
                self._publish(data, payload, -1, len(data) + len(payload))
            else:
                data = topic.encode("utf-8")
                size = len(data) + len(payload)
                if len(spool) + len(keep) < spool.max_count and \
                        spool.held_bytes + room + size <= spool.max_bytes:
                    keep.append((data, payload))
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
            for seq, (data, payload) in zip(seqs, keep, strict=True):
                self._publish(data, payload, seq, len(data) + len(payload))

    def _publish(self, topic: bytes, payload: bytes, seq: int, size: int,
                 count: bool = True, head: bytes | None = None) -> None:
        """Hand one QoS 1 export (*size*: topic and payload bytes) to paho, which queues
        it while MQTT is away: written at once where it can be (`publish_now`).  *head*:
        the stamp's template, if not this run's (a record an earlier run spooled)."""
        if seq < 0 and (self._held_bytes + size > self.settings.max_queued_bytes
                        or len(self._outstanding) >= self.settings.max_queued):
            self.core.dropped()
            return
        props = self._props if seq < 0 else _Stamped((head or self._stamp_head)
                                                     + b"%016x" % seq)
        mq = self.mq
        mid = mq.publish_now(topic, payload, props)
        if mid is None:
            mq.record()  # (paho keeps its messages in order: those written before first)
            info = mq.publish(topic.decode("utf-8", "replace"), payload, 1,
                              properties=props)  # type: ignore[arg-type]
            rc, mid = info.rc, info.mid
        else:
            rc = MQTTErrorCode.MQTT_ERR_SUCCESS
        if rc in (MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN):
            if count:
                self.core.exported(size)  # without a connection: queued by paho
            self._outstanding[mid] = (seq, size)
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
        else:  # its own SUB/UNSUB/CMSG: one line each, rationed (many make it a log flood)
            self._note(f"the bus refused {printable(refusal.verb)}: "
                       f"{printable(refusal.reason, 200)}", logging.ERROR)

    # -- the loop ----------------------------------------------------------------------

    def _note(self, line: str, level: int = logging.WARNING) -> None:
        held = self._allowance.take(0)
        if held is not None:
            log.log(level, "%s%s", line, f" ({held} similar lines held back)" if held else "")

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
        or away (the next change sends it again)."""
        if self.bus_up:
            self.bus.control_nowait(protocol.CLIENT_STATUS, line)

    # -- the loop ----------------------------------------------------------------------

    def _poke(self) -> None:
        """Something a waiting task may wait for changed: wake those whose condition now
        holds (only those: a wake-up is a turn of the loop).  From the export lane: by
        trio, once the lane's turn is over."""
        if threading.get_ident() == self._lane_thread:
            self._soon(self._poke)
            return
        for waiter in self._waiters:
            if waiter[0]():
                waiter[1].set()

    def _soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run *fn* in the trio thread as soon as it has the turn (from the export lane,
        which holds it: waiting for trio there would never end)."""
        try:
            self._token.run_sync_soon(fn, *args)  # type: ignore[union-attr]
        except trio.RunFinishedError:
            pass  # the bridge has stopped: nothing waits any more

    async def _until(self, ready: Callable[[], bool], timeout: float = math.inf) -> None:
        """Wait until *ready*() (checked at each `_poke`), at most *timeout* seconds."""
        if ready():
            return
        waiter = [ready, anyio.Event()]
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(timeout):
                while True:
                    await waiter[1].wait()
                    if ready():
                        return
                    waiter[1] = anyio.Event()  # it changed back meanwhile
        finally:
            self._waiters.remove(waiter)

    def _first_done(self, side: str) -> None:
        """*side* is past its first attempt: after both, READY=1 (with the STATUS= line)."""
        if len(self._first) < 2:
            self._first.add(side)
            if len(self._first) == 2:
                self._notify(f"READY=1\nSTATUS={self.status()}")

    async def _housekeeper(self) -> None:
        """Spool acknowledgements, refusals to log, STATUS= when it changed; a `stop`
        from a signal handler or another thread is noticed here."""
        next_status, last = 0.0, ""
        while True:
            if self._stopping and self._scope is not None:
                self._scope.cancel()
            if self.spool is not None:
                self.spool.flush()  # acknowledgements since: a crash sends those again,
            self._log_refusals()  # and receiving bridges drop the copies
            now = time.monotonic()
            if now >= next_status and self.status() != last:
                last = self.status()
                self._save_state()  # first: what STATUS= says survives a crash
                self._notify(f"STATUS={last}")
                self._tell_bus(last)
                next_status = now + STATUS_EVERY
            await anyio.sleep(ACK_EVERY)

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                self._stopping = True
                if self._scope is not None:
                    self._scope.cancel()

    def stop(self, *_args) -> None:
        """End `run` (soon: the housekeeper notices).  Safe from a signal handler and
        from another thread; `run` itself ends on SIGTERM/SIGINT in the main thread."""
        self._stopping = True
        self._wake_lanes()

    def run(self) -> None:
        """Serve until `stop` or SIGTERM/SIGINT."""
        try:
            anyio.run(self._serve, backend="trio")
        except BaseExceptionGroup as group:  # a task's error: the first, as it is
            raise _first(group) from None
        finally:  # no loop to tell of a socket paho closes from now on (its __del__)
            self._loop_thread = None

    async def _serve(self) -> None:
        self._loop_thread = threading.get_ident()
        self._token = trio.lowlevel.current_trio_token()
        self._lane_wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._mqtt_wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._turns.start()
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                if threading.current_thread() is threading.main_thread():
                    tg.start_soon(self._signals)
                tg.start_soon(self._housekeeper)
                tg.start_soon(self._bus_reader)
                tg.start_soon(self._mqtt_driver)
                tg.start_soon(self._mqtt_reader)
                tg.start_soon(self._mqtt_writer)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self._close()
            finally:
                self._turns.end()  # a lane still waiting for its turn finds it must stop
                wakes = self._lane_wake, self._mqtt_wake
                self._lane_wake = self._mqtt_wake = -1
                for fd in wakes:
                    os.close(fd)

    async def _take_in_before_closing(self) -> None:
        """A clean stop with MQTT away: what waits for the bridge in the local broker's
        queue (left there while the spool is half full, `_half_held`) would go with the
        bus connection, unsaid.  Take it into the spool, up to its full room (the rest
        dropped, counted), for the next run to send: until none comes for
        `TAKE_IN_QUIET`, at most `TAKE_IN_TIME`."""
        if self.mqtt_up or self.spool is None or not self.bus_up:
            return
        bus = self.bus
        with anyio.move_on_after(TAKE_IN_TIME):
            while True:
                try:
                    events = bus.receive_ready(BATCH)
                    if not events:
                        with anyio.move_on_after(TAKE_IN_QUIET):
                            events = await bus.receive_batch(BATCH)
                except SbusError:
                    return  # the bus went: nothing more to take
                if not events:
                    return
                self._export_events(events)
                bus.confirm_reads()

    async def _close(self) -> None:
        """Say goodbye to MQTT (what paho holds written, 1 s at most; the PUBACKs of
        imports the bus has not confirmed stay held: the MQTT broker sends those again),
        close the bus, save the state."""
        self._stopping = True
        self._wake_lanes()
        lost = sum(1 for _, _, qos in self._imports if qos == 0)
        if lost:  # (the QoS 1 ones stay unacknowledged: the MQTT broker sends them again)
            self.core.dropped(lost)
        if self.bus.kept and self.bus_up:  # read while a reconnect's opening waited:
            self._export_events(self.bus.receive_ready())  # exported now
            self.bus.confirm_reads()
        await self._take_in_before_closing()
        mq = self.mq
        if self._mqtt_live():
            self.mqtt_up = False  # a goodbye, not a loss
            with anyio.move_on_after(1.0):
                said = False
                while True:
                    sock = mq.socket()
                    if sock is None:
                        break  # gone, or closed after its DISCONNECT
                    if not mq.want_write():
                        if said:
                            break
                        # what was queued has gone: the DISCONNECT then goes at once
                        # (paho closes the socket right after writing it)
                        mq.disconnect()
                        said = True
                    mq.flush()
                    if mq.socket() is not None and mq.want_write():
                        try:
                            await anyio.wait_writable(sock)
                        except anyio.ClosedResourceError:
                            break
        await self.bus.aclose()
        self._save_state(clean_exit=True)
        if self.spool is not None:
            self.spool.close()
        if self.state is not None:
            self.state.close()


#: The name of the bus connection in the service manager's fd store.
KEPT_NAME = "bus"
#: Patterns a record of the kept connection may list; more is damage, not a bridge's
#: configuration (the audit's hand-made record of 50,000 that were not held made the
#: bridge unsubscribe each before it read a refusal: both sides stalled for minutes).
MAX_KEPT_PATTERNS = 4096


def _kept_bus() -> socket.socket | None:
    """The bus connection an earlier bridge left in the fd store (``LISTEN_FDNAMES``)."""
    sock = None
    for fd, name in sdnotify.listen_fds():
        if name != KEPT_NAME or sock is not None:
            os.close(fd)
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            continue
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_SEQPACKET:
            sock.close()
            sock = None
    return sock


def _kept_patterns(record: object, kept: socket.socket | None) -> list[bytes] | None:
    """The patterns state.json says the broker holds on *kept*, or None when it has no
    record of that very connection (another socket's, or damaged)."""
    if kept is None or not isinstance(record, dict):
        return None
    patterns = record.get("patterns")
    try:
        same = record.get("inode") == os.fstat(kept.fileno()).st_ino
        if not same or not isinstance(patterns, list) or len(patterns) > MAX_KEPT_PATTERNS \
                or not all(isinstance(p, str) for p in patterns):
            return None
        return [p.encode("utf-8", "surrogateescape") for p in patterns]
    except (OSError, UnicodeEncodeError):
        return None


def _keep(sock: socket.socket) -> None:
    """Leave *sock* in the fd store in place of the one there (none is the same)."""
    try:
        sdnotify.notify(f"FDSTOREREMOVE=1\nFDNAME={KEPT_NAME}", timeout=0)
        sdnotify.notify(f"FDSTORE=1\nFDNAME={KEPT_NAME}", [sock.fileno()], timeout=0)
    except OSError as exc:
        log.warning("cannot leave the bus connection in the fd store: %s; a restart of "
                    "the bridge loses what is published meanwhile", exc.strerror or exc)


def _unkeep() -> None:
    """The bus connection was lost: none is kept for the next bridge."""
    try:
        sdnotify.notify(f"FDSTOREREMOVE=1\nFDNAME={KEPT_NAME}", timeout=0)
    except OSError:
        pass  # (the next keep says it)


def _filter(saved: object) -> bool:
    """Is *saved* (from state.json, which a damaged file makes anything) an MQTT topic
    filter paho can unsubscribe?  (One it cannot failed every connection: taken for
    malformed data from the broker, reconnected, tried again.)"""
    if not isinstance(saved, str) or not saved or "\0" in saved:
        return False
    try:
        return len(saved.encode("utf-8")) <= MAX_TOPIC
    except UnicodeEncodeError:  # a lone surrogate, which JSON can spell
        return False


def _drain(fd: int) -> None:
    """Take what an eventfd holds (nothing: fine)."""
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


def _first(group: BaseExceptionGroup) -> BaseException:
    """The first error in *group* (task groups wrap what their tasks raised)."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error
