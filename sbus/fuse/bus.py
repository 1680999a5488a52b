"""The mount's connections to the broker, each a thin trio shell around a `Session`.

* one *monitor* subscribed to everything (and the mount's own secrets) with the
  ``discard`` flood policy: it only teaches the `KnownTree` which names are live;
* one shared *publisher* for all writes (``blocking/publisher/nowait``): each
  ``write(2)`` is one ``MSG``;
* one connection per open readable file, subscribed before ``open()`` returns (the
  session's whoami barrier proves the broker has the ``SUB`` in force, or raises its
  refusal).  A pump task moves its packets into the handle's `Outbox`; it stops reading
  while the outbox is full, so a slow reader pushes back on the broker, whose flood
  policy then applies.

When the broker goes away, every connection opens again with its session's opening
(policy, patterns, barrier), backing off with the session's `Backoff`, for up to
``reconnect_timeout`` seconds (socket activation keeps the socket while the broker
restarts); readers then simply go on.  After that, readers get EIO and a log line.
"""

from __future__ import annotations

import errno
import logging
import socket
import time

import pyfuse3
import trio
from pyfuse3 import FUSEError
from trio.lowlevel import ParkingLot, wait_readable, wait_writable

from ..client import connect_socket
from ..display import brief
from ..errors import ConnectError, ConnectionLost, InvalidRequest, Refused
from ..keys import Credentials
from ..protocol import ProtocolError
from ..session import Backoff, Dropped, Refusal, Session, Whoami
from . import mapping
from .framing import Outbox, frame

log = logging.getLogger("sbus.fuse")

#: A reader's pump stops reading from the broker above this many waiting bytes...
OUTBOX_HIGH = 4 * 1024 * 1024
#: ...and starts again below this.
OUTBOX_LOW = 1024 * 1024
#: Packets a pump drains before letting other tasks run.
PUMP_BATCH = 512
#: The broker has to answer a subscription's whoami round trip within this time.
SUBSCRIBE_TIMEOUT = 5.0
#: Receive buffer beyond the largest packet: a little room for the newline the
#: ``lines`` format appends in place, so a message is copied once.
RECV_SPARE = 64
#: Packets the monitor drains before pausing; during floods it learns from a sample
#: (the broker discards the rest for it) instead of competing with readers for CPU.
MONITOR_BATCH = 64
MONITOR_PAUSE = 0.05
#: A pump that found only a few packets waits this long before looking again, so a
#: steady stream is handled in batches (fewer wakeups, fewer FUSE round trips) at the
#: price of at most this much latency; the first packet after a quiet spell goes
#: through at once.
PUMP_COALESCE = 0.002
PUMP_SMALL = 32


def _connect(address: str) -> socket.socket:
    sock = connect_socket(address)
    sock.setblocking(False)
    return sock


async def _send(sock: socket.socket, packet: bytes) -> None:
    while True:
        try:
            sock.send(packet)
            return
        except BlockingIOError:
            await wait_writable(sock)


class Reader:
    """One open readable file: its subscription, waiting bytes and waiting callers."""

    def __init__(self, pattern: bytes, fmt: str) -> None:
        self.pattern = pattern
        self.fmt = fmt
        self.session = Session(sep=mapping.SEP)
        self.out = Outbox(one_per_read=fmt == "raw")
        self.sock: socket.socket | None = None
        self.lot = ParkingLot()  # read() calls waiting for data
        self.space: trio.Event | None = None  # set when the pump may read again
        self.poll_handle: pyfuse3.PollHandle | None = None
        self.failed = False
        self.scope = trio.CancelScope()

    def wake(self) -> None:
        self.lot.unpark_all()
        ph, self.poll_handle = self.poll_handle, None
        if ph is not None:
            try:
                ph.notify()
            except OSError as exc:
                log.debug("poll notify failed: %s", exc)

    def close(self) -> None:
        self.scope.cancel()
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class MountBus:
    """Every broker connection of one mount.  Call `start` inside a nursery first."""

    def __init__(self, address: str, fmt: str, tree: mapping.KnownTree, buffer_size: int,
                 reconnect_timeout: float) -> None:
        self.address = address
        self.fmt = fmt
        self.tree = tree
        self.reconnect_timeout = reconnect_timeout
        self.own: mapping.Path | None = None  # (GID, UID, PID) the broker sees for us
        self.cred: Credentials | None = None
        self.closing = False
        self.nursery: trio.Nursery | None = None
        self.readers: set[Reader] = set()
        self._publisher: socket.socket | None = None
        self._publishing = Session(sep=mapping.SEP)
        self._publishing.publisher_nowait()  # a slow subscriber must not stall writers
        self._publish_lock = trio.Lock()
        self._buf = bytearray(buffer_size + RECV_SPARE)
        self._recv_size = len(self._buf) - RECV_SPARE
        self._view = memoryview(self._buf)

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Learn our credentials and start the monitor; raises `ConnectError` if no broker."""
        self.nursery = nursery
        sock = _connect(self.address)
        monitor = Session(sep=mapping.SEP)
        monitor.connected()
        cred = await self._handshake(sock, monitor, [monitor.ask()], None)
        try:
            self.cred = Credentials.parse(cred, mapping.SEP)
            self.own = tuple(cred.split(mapping.SEP)[2:5])
        except ValueError:
            log.warning("the broker's whoami answer %s is not a credentials path; "
                        "secret keys are not reachable through this mount", brief(cred))
        packets = [monitor.subscribe(b"")]
        if self.own is not None:
            packets.append(monitor.subscribe(b"!/cred/" + b"/".join(self.own) + b"/"))
        packets += monitor.set_flood(soft="discard")
        for packet in packets:
            await _send(sock, packet)
        nursery.start_soon(self._monitor, sock, monitor)

    def shutdown(self) -> None:
        """Unmounting: blocked reads end (EOF) instead of holding up the main loop."""
        self.closing = True
        for r in list(self.readers):
            r.wake()

    async def _handshake(self, sock: socket.socket, session: Session, packets: list[bytes],
                         reader: Reader | None) -> bytes:
        """Send *packets* (ending with a whoami question) and wait until the broker has
        acted on them; returns its whoami answer.  Messages meanwhile go to *reader*; a
        refusal raises `Refused`."""
        for p in packets:
            await _send(sock, p)
        refusal: Refusal | None = None
        with trio.fail_after(SUBSCRIBE_TIMEOUT):
            while True:
                try:
                    n = sock.recv_into(self._buf, self._recv_size)
                except BlockingIOError:
                    await wait_readable(sock)
                    continue
                if n == 0:
                    raise ConnectionLost(f"the broker at {self.address} closed the connection")
                packet = self._view[:n].tobytes()
                if packet.startswith(b"MSG "):
                    if reader is not None:
                        self._deliver(reader, packet)
                    continue
                try:
                    event = session.receive(packet)
                except ProtocolError:
                    continue
                if type(event) is Refusal:
                    refusal = refusal or event
                elif type(event) is Whoami and not session.asked:
                    if refusal is not None:
                        raise refusal.error()
                    return event.path
                elif reader is not None:
                    self._note(reader, event)

    async def _reopen(self, session: Session, reader: Reader | None) -> socket.socket | None:
        """A fresh connection with *session*'s opening, retried (the session's `Backoff`)
        until `reconnect_timeout`; None after."""
        deadline = trio.current_time() + self.reconnect_timeout
        backoff = Backoff()
        while True:
            try:
                sock = _connect(self.address)
            except ConnectError:
                pass
            else:
                try:
                    await self._handshake(sock, session, session.opening(), reader)
                    return sock
                except (OSError, ConnectionLost, trio.TooSlowError, Refused):
                    sock.close()
            if trio.current_time() >= deadline or self.closing:
                return None
            await trio.sleep(backoff.next())

    async def _monitor(self, sock: socket.socket, session: Session) -> None:
        """Learn live keys: everything public, and our own secrets."""
        learn = self.tree.learn
        seen: dict[bytes, mapping.Path | None] = {}
        batch = 0
        while True:
            try:
                n = sock.recv_into(self._buf, self._recv_size)
            except BlockingIOError:
                batch = 0
                await wait_readable(sock)
                continue
            except OSError:
                n = 0
            if n == 0:
                sock.close()
                log.warning("lost the broker at %s; reconnecting", self.address)
                while True:
                    new = await self._reopen(session, None)
                    if new is not None:
                        break
                    log.error("no broker at %s for %.0f s; still trying", self.address,
                              self.reconnect_timeout)
                sock = new
                log.warning("reconnected to the broker at %s", self.address)
                continue
            # the buffer is shared: use the packet before the next await
            nul = self._buf.find(b"\0", 4, n) if self._buf.startswith(b"MSG ") else -1
            if nul >= 0:
                key = self._view[4:nul].tobytes()
                if key in seen:
                    path = seen[key]
                else:
                    if len(seen) >= 4096:
                        seen.clear()
                    path = seen[key] = mapping.key_segments(key)
                if path is not None:
                    learn(path)
            batch += 1
            if batch >= MONITOR_BATCH:
                batch = 0
                await trio.sleep(MONITOR_PAUSE)

    # -- readers -------------------------------------------------------------------

    async def start_reader(self, r: Reader) -> None:
        """Subscribe *r* (in force on return) and start its pump; FUSEError otherwise."""
        try:
            sock = _connect(self.address)
        except ConnectError as exc:
            log.error("cannot subscribe to %s: %s", brief(r.pattern), exc)
            raise FUSEError(errno.EIO) from None
        try:
            r.session.connected()
            r.session.subscribe(r.pattern)
            await self._handshake(sock, r.session, r.session.opening(), r)
        except (Refused, InvalidRequest) as exc:
            sock.close()
            log.info("cannot subscribe to %s: %s", brief(r.pattern), exc)
            raise FUSEError(errno.EACCES) from None
        except (OSError, ConnectionLost, trio.TooSlowError) as exc:
            sock.close()
            log.error("cannot subscribe to %s at %s: %s", brief(r.pattern), self.address, exc)
            raise FUSEError(errno.EIO) from None
        except BaseException:  # cancelled: the caller was interrupted
            sock.close()
            raise
        r.sock = sock
        self.readers.add(r)
        assert self.nursery is not None
        self.nursery.start_soon(self._pump, r)

    def _deliver(self, r: Reader, packet: bytes | memoryview) -> None:
        if packet[:4] == b"MSG ":
            raw = bytes(packet)
            nul = raw.find(b"\0", 4)
            if nul >= 0:
                r.out.push(frame(r.fmt, raw[4:nul], raw[nul + 1:], time.time()))
            return
        try:
            self._note(r, r.session.receive(bytes(packet)))
        except ProtocolError:
            pass

    def _note(self, r: Reader, event: object) -> None:
        if type(event) is Dropped:
            log.warning("the broker dropped %d messages for a reader of %s (it was too slow)",
                        event.count, brief(r.pattern))
        elif type(event) is Refusal:
            log.warning("the broker refused a packet of the reader of %s: %s",
                        brief(r.pattern), brief(event.reason.encode(), 200))

    async def _pump(self, r: Reader) -> None:
        with r.scope:
            view, buf, size = self._view, self._buf, self._recv_size
            lines = r.fmt == "lines"
            push = r.out.push
            while True:
                if r.out.nbytes >= OUTBOX_HIGH:
                    r.space = trio.Event()
                    await r.space.wait()
                    continue
                sock = r.sock
                if sock is None:
                    return
                got = 0
                eof = False
                for _ in range(PUMP_BATCH):
                    try:
                        n = sock.recv_into(buf, size)
                    except BlockingIOError:
                        break
                    except OSError:
                        n = 0
                    if n == 0:
                        eof = True
                        break
                    got += 1
                    if lines and buf.startswith(b"MSG "):  # the hot path: one copy
                        nul = buf.find(b"\0", 4, n)
                        if nul >= 0:
                            if buf[n - 1] != 10 or n == nul + 1:
                                buf[n] = 10
                                n += 1
                            push(view[nul + 1:n].tobytes())
                            continue
                    self._deliver(r, view[:n])
                    if r.out.nbytes >= OUTBOX_HIGH:
                        break
                if got:
                    r.wake()
                if eof:
                    await self._reader_lost(r)
                    if r.failed:
                        return
                elif got >= PUMP_SMALL:
                    await trio.lowlevel.checkpoint()
                elif got:
                    await trio.sleep(PUMP_COALESCE)
                else:
                    await wait_readable(sock)

    async def _reader_lost(self, r: Reader) -> None:
        if r.sock is not None:
            r.sock.close()
            r.sock = None
        if self.closing:
            r.failed = True
            r.wake()
            return
        log.warning("reader of %s lost the broker at %s; re-subscribing", brief(r.pattern),
                    self.address)
        sock = await self._reopen(r.session, r)
        if sock is None:
            log.error("no broker at %s for %.0f s: readers of %s get EIO", self.address,
                      self.reconnect_timeout, brief(r.pattern))
            r.failed = True
        else:
            r.sock = sock
            log.warning("reader of %s re-subscribed", brief(r.pattern))
        r.wake()

    def close_reader(self, r: Reader) -> None:
        r.close()
        self.readers.discard(r)

    # -- publishing ------------------------------------------------------------------

    def publish_now(self, packet: bytes) -> bool:
        """The common case without a task or a lock: the connection is up and the
        kernel takes the packet at once.  False means: take the slow path (`publish`)."""
        sock = self._publisher
        if sock is None or self._publish_lock.locked():
            return False
        try:
            sock.send(packet)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                raise FUSEError(errno.EMSGSIZE) from None
            return False
        return True

    async def publish(self, packet: bytes) -> None:
        async with self._publish_lock:
            for _ in range(2):
                sock = self._publisher
                if sock is None:
                    sock = await self._reopen(self._publishing, None)
                    if sock is None:
                        log.error("cannot publish: no broker at %s", self.address)
                        raise FUSEError(errno.EIO)
                    self._publisher = sock
                try:
                    await _send(sock, packet)
                    return
                except OSError as exc:
                    if exc.errno == errno.EMSGSIZE:
                        raise FUSEError(errno.EMSGSIZE) from None
                    log.warning("publishing failed (%s); reconnecting", exc.strerror)
                    sock.close()
                    self._publisher = None
            raise FUSEError(errno.EIO)
