"""Client library: a blocking `Client` and an async `AsyncClient` (trio or asyncio, via anyio).

Both are I/O shells around one `sbus.session.Session`, which checks every request with
the broker's own rules (`InvalidRequest`, nothing sent), remembers what to restore after
a reconnect and turns packets into events.  Messages arrive as `Publish` (``.key``,
``.payload``); the broker's drop reports as `Dropped` (also counted in ``dropped`` and
passed to *on_drop*); other control messages as `Control`.  A refusal from the broker
(``CMSG refused/VERB``) raises `Refused` where it is noticed: `sync`, `subscribe` (which
waits for the broker by default), `receive` or iteration.  Keys, patterns and payloads
are bytes; `str` is accepted and encoded as UTF-8.

With ``reconnect=True`` a lost broker is waited for (`Backoff`) and the new connection
gets the flood policy and every subscription again; messages published meanwhile are
lost, as on any pubsub bus.  *on_connection(up, line)* hears of each change of state
(else it is logged).  A program that would rather hear of refusals than catch them
passes *on_refusal* (a `Refusal` event each, nothing raised).
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

import anyio

from . import protocol
from .defaults import MAX_MESSAGE, RECV_BUFFER, SEND_BUFFER, default_address
from .errors import ConnectError, ConnectionLost, InvalidRequest, SbusError
from .keys import Credentials
from .protocol import Control, Publish
from .session import Backoff, Dropped, Event, Refusal, Session, Whoami

__all__ = ["Client", "AsyncClient", "SbusError", "ConnectError", "ConnectionLost",
           "default_address", "wait_for_broker", "Publish", "Control", "Dropped",
           "RECV_BUFFER"]

log = logging.getLogger("sbus.client")

#: Errors of a send or receive that mean the connection is gone.
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNREFUSED, errno.EBADF)

Received = Publish | Dropped | Control


def wait_for_broker(address: str | None = None, timeout: float = 10.0,
                    alive: Callable[[], bool] | None = None) -> None:
    """Wait until a broker accepts connections at *address*: for scripts and tests that
    start one.  *alive* (e.g. a child process's liveness) ends the wait early."""
    address = address or default_address()
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(address)
            return
        except OSError:
            if alive is not None and not alive():
                raise SbusError(f"the broker for {address} exited before it listened") from None
            if time.monotonic() > deadline:
                raise SbusError(f"no broker on {address} after {timeout} s") from None
            time.sleep(0.02)
        finally:
            s.close()


def connect_socket(address: str) -> socket.socket:
    """A connected SEQPACKET socket (blocking) to the broker at *address*; `ConnectError`
    with advice if there is none."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        sock.connect(address)
    except OSError as exc:
        sock.close()
        raise ConnectError(
            f"cannot connect to the sbus broker at {address}: {exc.strerror or exc}. "
            f"Start one with 'sbus serve --address {address}' "
            "(or 'systemctl start sbus.socket'), or set SBUS_ADDRESS."
        ) from None
    return sock


class _Shell:
    """What `Client` and `AsyncClient` share: the session and the handling of its events."""

    def __init__(self, address: str | None, reconnect: bool,
                 on_drop: Callable[[int], None] | None,
                 on_connection: Callable[[bool, str], None] | None, max_message: int,
                 backoff: Backoff | None,
                 on_refusal: Callable[[Refusal], None] | None = None) -> None:
        self.address = address or default_address()
        self.session = Session(max_message=max_message)
        self.reconnect = reconnect
        self.on_drop = on_drop
        self.on_connection = on_connection
        self.on_refusal = on_refusal
        self.backoff = backoff or Backoff()
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._pending: deque[Received] = deque()
        self._refusals: list[Refusal] = []

    @property
    def dropped(self) -> int:
        """Messages the broker reported dropping for this client, in total."""
        return self.session.dropped

    def _say(self, up: bool, line: str) -> None:
        if self.on_connection is not None:
            self.on_connection(up, line)
        else:
            log.warning("%s", line)

    def _lost(self, why: str) -> ConnectionLost:
        return ConnectionLost(f"the broker at {self.address} {why}")

    def _sent_error(self, exc: OSError) -> SbusError:
        if exc.errno == errno.EMSGSIZE:
            return InvalidRequest(f"the packet is too large for the connection to "
                                  f"{self.address}: {exc.strerror}")
        return self._lost(f"failed: {exc.strerror or exc}")

    def _event(self, packet: bytes) -> Event:
        try:
            return self.session.receive(packet)
        except protocol.ProtocolError as exc:
            raise SbusError(f"the broker at {self.address} sent a malformed packet: "
                            f"{exc}") from None

    def _take(self, event: Event) -> Received | None:
        """What `receive` returns for *event*; None for what it consumes (whoami answers)."""
        if type(event) is Publish:
            return event
        if type(event) is Dropped:
            if self.on_drop is not None:
                self.on_drop(event.count)
            else:  # never silent: a program that did not ask still gets a log line
                log.warning("the broker at %s dropped %d messages for this client",
                            self.address, event.count)
            return event
        if type(event) is Whoami:
            return None
        if type(event) is Refusal:
            if self.on_refusal is not None:
                self.on_refusal(event)
                return None
            raise event.error()
        return event  # type: ignore[return-value]

    def _settle(self, event: Event) -> None:
        """During `sync`: keep what `receive` should return later, collect refusals."""
        if type(event) is Refusal and self.on_refusal is None:
            self._refusals.append(event)
            return
        taken = self._take(event)
        if taken is not None:
            self._pending.append(taken)

    def _absorb(self, packets: list[bytes]) -> None:
        """Events of *packets* into the pending queue; then any refusal among them raised
        (the events stay queued)."""
        for packet in packets:
            self._settle(self._event(packet))
        self._refused()

    def _refused(self) -> None:
        if self._refusals:
            first, more = self._refusals[0], len(self._refusals) - 1
            self._refusals.clear()
            error = first.error()
            if more:
                error.args = (f"{error.args[0]} (and {more} more refusals)",)
            raise error

    def _whoami(self) -> bytes:
        return self.session.whoami or b""


class Client(_Shell):
    """A blocking connection to the broker.

    >>> with Client() as bus:                      # doctest: +SKIP
    ...     bus.subscribe("sensors/*/temp")
    ...     for msg in bus:
    ...         print(msg.key, msg.payload)
    """

    def __init__(self, address: str | None = None, *, timeout: float | None = None,
                 reconnect: bool = False, on_drop: Callable[[int], None] | None = None,
                 on_connection: Callable[[bool, str], None] | None = None,
                 max_message: int = MAX_MESSAGE, backoff: Backoff | None = None,
                 on_refusal: Callable[[Refusal], None] | None = None) -> None:
        super().__init__(address, reconnect, on_drop, on_connection, max_message, backoff,
                         on_refusal)
        self._timeout = timeout
        self.sock = connect_socket(self.address)  # the first connection must work
        self.sock.settimeout(timeout)
        self.session.connected()

    def _reconnect(self, why: str) -> None:
        """Replace the lost connection: wait for the broker (`Backoff`), send the session's
        opening and wait for its barrier, so the subscriptions are in force on return."""
        self.sock.close()
        self._say(False, f"the broker at {self.address} {why}; reconnecting")
        while True:
            try:
                self.sock = connect_socket(self.address)
                self.sock.settimeout(self._timeout)
                for packet in self.session.connected():
                    self.sock.send(packet)
                while self.session.asked:
                    n = self.sock.recv_into(self._buf)
                    if not n:
                        raise ConnectionResetError(errno.ECONNRESET, "closed at once")
                    self._settle(self._event(self._view[:n].tobytes()))
                break
            except (ConnectError, OSError):
                self.sock.close()
                time.sleep(self.backoff.next())
        self.backoff.reset()
        self._say(True, f"reconnected to the broker at {self.address}")

    # -- sending ---------------------------------------------------------------

    def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one packet (``send(2)`` flags passed through); with *reconnect*, a lost
        broker is waited for and the packet sent on the new connection."""
        while True:
            try:
                self.sock.send(packet, flags)
                return
            except (BlockingIOError, TimeoutError):
                raise
            except OSError as exc:
                if not (self.reconnect and exc.errno in _GONE):
                    raise self._sent_error(exc) from None
                self._reconnect(f"failed: {exc.strerror or exc}")

    def subscribe(self, pattern: bytes | str, flags: int = 0, *, wait: bool = True) -> None:
        """Subscribe; with *wait* (the default), return once the broker has the
        subscription in force, raising `Refused` if it refused it."""
        self.send_packet(self.session.subscribe(pattern), flags)
        if wait:
            self.sync()

    def unsubscribe(self, pattern: bytes | str, flags: int = 0) -> None:
        self.send_packet(self.session.unsubscribe(pattern), flags)

    def publish(self, key: bytes | str, payload: bytes | str = b"", flags: int = 0) -> None:
        self.send_packet(self.session.publish(key, payload), flags)

    def control(self, key: bytes | str, payload: bytes | str | None = None,
                flags: int = 0) -> None:
        self.send_packet(self.session.control(key, payload), flags)

    def set_flood(self, soft: str | None = None, hard: str | None = None,
                  order: str | None = None) -> None:
        """Choose the broker's flood policy for this client (docs/protocol.md)."""
        for packet in self.session.set_flood(soft, hard, order):
            self.send_packet(packet)

    def sync(self, timeout: float | None = 5.0) -> None:
        """Return once the broker has acted on everything sent before (a whoami round
        trip); raises `Refused` if it refused any of it.  Messages meanwhile are kept.
        *timeout* None waits as long as it takes (a publisher the broker paused)."""
        self.send_packet(self.session.ask())
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.session.asked:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._readable(left):
                    raise TimeoutError(f"the broker at {self.address} did not answer "
                                       f"within {timeout} s")
            self._settle(self._event(self.recv_packet()))
        self._refused()

    # -- receiving ---------------------------------------------------------------

    def _readable(self, timeout: float) -> bool:
        return bool(select.select([self.sock], [], [], timeout)[0])

    def recv_packet(self, flags: int = 0) -> bytes:
        """One raw packet.  End of the connection raises `ConnectionLost`, or with
        *reconnect* waits for the broker and reads from the new connection."""
        while True:
            try:
                n = self.sock.recv_into(self._buf, 0, flags)
            except (BlockingIOError, TimeoutError):
                raise
            except OSError as exc:
                if not (self.reconnect and exc.errno in _GONE):
                    raise self._lost(f"failed: {exc.strerror or exc}") from None
                self._reconnect(f"failed: {exc.strerror or exc}")
                continue
            if n:
                return self._view[:n].tobytes()
            if not self.reconnect:
                raise self._lost("closed the connection")
            self._reconnect("closed the connection")

    def receive(self, timeout: float | None = None, flags: int = 0) -> Received:
        """The next message, drop report or control message; ``TimeoutError`` after
        *timeout* seconds; `Refused` if the broker refused something sent before."""
        self._refused()
        if self._pending:
            return self._pending.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None and not self._readable(max(0.0, deadline -
                                                               time.monotonic())):
                raise TimeoutError(f"no message from the broker at {self.address} "
                                   f"within {timeout} s")
            taken = self._take(self._event(self.recv_packet(flags)))
            if taken is not None:
                return taken

    def receive_ready(self, limit: int = 1024) -> list[Received]:
        """Everything that can be read without blocking (up to *limit*): for fast consumers."""
        packets = []
        while len(packets) + len(self._pending) < limit:
            try:
                packets.append(self.recv_packet(socket.MSG_DONTWAIT))
            except BlockingIOError:
                break
        self._absorb(packets)
        out = list(self._pending)
        self._pending.clear()
        return out

    def __iter__(self) -> Iterator[Publish]:
        """Messages, forever; drop reports (counted, *on_drop*) and control messages
        are skipped."""
        while True:
            event = self.receive()
            if type(event) is Publish:
                yield event

    def whoami(self, timeout: float = 5.0) -> bytes:
        """This connection's credentials path, e.g. ``b'!/cred/100/1000/1111'``, asked of the
        broker; messages arriving meanwhile are kept for `receive`."""
        if self.session.whoami is None:
            self.sync(timeout)
        return self._whoami()

    def request(self, key: bytes | str, payload: bytes | str = b"",
                timeout: float = 5.0) -> bytes:
        """Publish a request on *key* and return the first reply's payload, received on a
        private inbox (`sbus.request`); ``TimeoutError`` after *timeout* seconds."""
        from .request import request

        return request(self, key, payload, timeout, keep=self._pending.append)

    def credentials(self, timeout: float = 5.0) -> Credentials:
        return Credentials.parse(self.whoami(timeout))

    # -- plumbing ---------------------------------------------------------------

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Shell):
    """The async twin of `Client`, for trio or asyncio (readiness through anyio).

    ``async with AsyncClient(address) as bus:`` connects on entry (or ``bus = await
    AsyncClient.connect(address)``).  One task may send and one may receive at a time
    (waiting on the same socket from two tasks is an error under trio); tasks that
    share a client serialise their sends with a lock.
    """

    def __init__(self, address: str | None = None, *, reconnect: bool = False,
                 on_drop: Callable[[int], None] | None = None,
                 on_connection: Callable[[bool, str], None] | None = None,
                 max_message: int = MAX_MESSAGE, backoff: Backoff | None = None,
                 on_refusal: Callable[[Refusal], None] | None = None) -> None:
        super().__init__(address, reconnect, on_drop, on_connection, max_message, backoff,
                         on_refusal)
        self.sock: socket.socket | None = None

    @classmethod
    async def connect(cls, address: str | None = None, **options) -> AsyncClient:
        bus = cls(address, **options)
        await bus.open()
        return bus

    async def open(self) -> None:
        """Connect (the first connection must work: `ConnectError` otherwise)."""
        sock = connect_socket(self.address)
        sock.setblocking(False)
        self.sock = sock
        self.session.connected()

    async def _reconnect(self, why: str) -> socket.socket:
        """`Client._reconnect`: the subscriptions are in force again on return."""
        if self.sock is not None:
            self.sock.close()
        self._say(False, f"the broker at {self.address} {why}; reconnecting")
        while True:
            sock = None
            try:
                sock = connect_socket(self.address)
                sock.setblocking(False)
                for packet in self.session.connected():
                    sock.send(packet)
                while self.session.asked:
                    try:
                        n = sock.recv_into(self._buf)
                    except BlockingIOError:
                        await anyio.wait_readable(sock)
                        continue
                    if not n:
                        raise ConnectionResetError(errno.ECONNRESET, "closed at once")
                    self._settle(self._event(self._view[:n].tobytes()))
                break
            except (ConnectError, OSError):
                if sock is not None:
                    sock.close()
                await anyio.sleep(self.backoff.next())
        self.sock = sock
        self.backoff.reset()
        self._say(True, f"reconnected to the broker at {self.address}")
        return sock

    def _socket(self) -> socket.socket:
        if self.sock is None:
            raise SbusError("this AsyncClient is not connected: use 'async with' or "
                            "AsyncClient.connect()")
        return self.sock

    async def send_packet(self, packet: bytes, flags: int = 0) -> None:
        sock = self._socket()
        while True:
            try:
                sock.send(packet, flags)
                return
            except BlockingIOError:
                await anyio.wait_writable(sock)
            except OSError as exc:
                if not (self.reconnect and exc.errno in _GONE):
                    raise self._sent_error(exc) from None
                sock = await self._reconnect(f"failed: {exc.strerror or exc}")

    async def subscribe(self, pattern: bytes | str, *, wait: bool = True) -> None:
        """Subscribe; with *wait*, return once it is in force (`Refused` if refused)."""
        await self.send_packet(self.session.subscribe(pattern))
        if wait:
            await self.sync()

    async def unsubscribe(self, pattern: bytes | str) -> None:
        await self.send_packet(self.session.unsubscribe(pattern))

    async def publish(self, key: bytes | str, payload: bytes | str = b"") -> None:
        await self.send_packet(self.session.publish(key, payload))

    async def control(self, key: bytes | str, payload: bytes | str | None = None) -> None:
        await self.send_packet(self.session.control(key, payload))

    async def set_flood(self, soft: str | None = None, hard: str | None = None,
                        order: str | None = None) -> None:
        for packet in self.session.set_flood(soft, hard, order):
            await self.send_packet(packet)

    async def sync(self, timeout: float | None = 5.0) -> None:
        """`Client.sync`: the broker has acted on everything sent before, or `Refused`."""
        await self.send_packet(self.session.ask())
        with anyio.fail_after(timeout):
            while self.session.asked:
                for packet in await self.receive_packets():
                    self._settle(self._event(packet))
        self._refused()

    async def recv_packet(self) -> bytes:
        """One raw packet; see `receive_packets`."""
        return (await self.receive_packets(1))[0]

    async def receive(self) -> Received:
        """The next message, drop report or control message; `Refused` if the broker
        refused something sent before."""
        self._refused()
        while not self._pending:
            self._absorb(await self.receive_packets())
        return self._pending.popleft()

    async def receive_packets(self, limit: int = 1024) -> list[bytes]:
        """At least one raw packet, plus whatever else is ready (up to *limit*).

        The cheapest way to keep up with a busy bus: no event objects, one wait per
        batch.  End of connection raises `ConnectionLost` once the packets before it are
        taken (with *reconnect*: reconnects and goes on reading).
        """
        sock = self._socket()
        recv_into, buf, view = sock.recv_into, self._buf, self._view
        out: list[bytes] = []
        while True:
            gone = None
            while len(out) < limit:
                try:
                    n = recv_into(buf)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if not (self.reconnect and exc.errno in _GONE):
                        raise self._lost(f"failed: {exc.strerror or exc}") from None
                    gone = f"failed: {exc.strerror or exc}"
                    break
                if n == 0:
                    gone = "closed the connection"
                    break
                out.append(view[:n].tobytes())
            if out:
                await anyio.lowlevel.checkpoint()  # a busy bus must not starve other tasks
                return out
            if gone is not None:
                if not self.reconnect:
                    raise self._lost("closed the connection")
                sock = await self._reconnect(gone)
                recv_into = sock.recv_into
                continue
            await anyio.wait_readable(sock)

    async def receive_batch(self, limit: int = 1024) -> list[Received]:
        """At least one event, plus whatever else is ready (up to *limit*)."""
        while not self._pending:
            self._absorb(await self.receive_packets(limit))
        out = list(self._pending)
        self._pending.clear()
        return out

    def __aiter__(self) -> AsyncIterator[Publish]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Publish]:
        while True:
            event = await self.receive()
            if type(event) is Publish:
                yield event

    async def whoami(self, timeout: float = 5.0) -> bytes:
        if self.session.whoami is None:
            await self.sync(timeout)
        return self._whoami()

    async def credentials(self, timeout: float = 5.0) -> Credentials:
        return Credentials.parse(await self.whoami(timeout))

    async def request(self, key: bytes | str, payload: bytes | str = b"",
                      timeout: float = 5.0) -> bytes:
        """`Client.request` for async code; ``TimeoutError`` after *timeout* seconds."""
        from .request import request_async

        return await request_async(self, key, payload, timeout, keep=self._pending.append)

    def fileno(self) -> int:
        return self._socket().fileno()

    async def aclose(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    async def __aenter__(self) -> AsyncClient:
        if self.sock is None:
            await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
