"""Client library: a blocking `Client` and an async `AsyncClient` (trio or asyncio, via anyio).

Both are thin: a connected SOCK_SEQPACKET socket, `protocol.encode` on the way
out and `protocol.parse` on the way in.  Messages arrive as `protocol.Publish`
events (``.key``, ``.payload``), the broker's control messages as
`protocol.Control`.  Keys, patterns and payloads are bytes; `str` is accepted
and encoded as UTF-8 for convenience.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator

import anyio

from . import protocol
from .keys import Credentials
from .protocol import WHOAMI, Control, Publish

__all__ = ["Client", "AsyncClient", "SbusError", "ConnectError", "default_address",
           "wait_for_broker",
           "Publish", "Control"]

DEFAULT_ADDRESS = "/run/sbus.socket"
#: Receive buffer: larger than the broker's default message limit (256 KiB).
RECV_BUFFER = 1024 * 1024
#: Send buffer asked of the kernel, so packets up to the broker's limit can be sent.
SEND_BUFFER = 512 * 1024


class SbusError(Exception):
    """Something went wrong talking to the broker; the message names the address."""


class ConnectError(SbusError):
    pass


def default_address() -> str:
    """``$SBUS_ADDRESS``, else ``/run/sbus.socket``."""
    return os.environ.get("SBUS_ADDRESS") or DEFAULT_ADDRESS


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


def _b(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _connect(address: str | None) -> tuple[str, socket.socket]:
    address = address or default_address()
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
    return address, sock


def _failed(doing: str, address: str, exc: OSError) -> SbusError:
    return SbusError(f"{doing} the broker at {address} failed: {exc.strerror or exc}")


def _closed(address: str) -> SbusError:
    return SbusError(f"the broker at {address} closed the connection")


def _event(packet: bytes, address: str) -> Publish | Control:
    try:
        event = protocol.parse(packet)
    except protocol.ProtocolError as exc:
        raise SbusError(f"broker at {address} sent a malformed packet: {exc}") from None
    if not isinstance(event, Publish | Control):
        raise SbusError(f"broker at {address} sent a client-only packet: {event!r}")
    return event


def _flood_packets(soft, hard, order) -> list[bytes]:
    out = []
    for name, value in (("blocking/soft", soft), ("blocking/hard", hard), ("order", order)):
        if value is not None:
            out.append(protocol.encode(Control(f"{name}/{value}".encode(), None)))
    return out


class Client:
    """A blocking connection to the broker.

    >>> with Client() as bus:                      # doctest: +SKIP
    ...     bus.subscribe("sensors/*/temp")
    ...     for msg in bus:
    ...         print(msg.key, msg.payload)
    """

    def __init__(self, address: str | None = None, *, timeout: float | None = None) -> None:
        self.address, self.sock = _connect(address)
        self.sock.settimeout(timeout)
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._pending: deque[Publish | Control] = deque()
        self._cred: bytes | None = None

    # -- sending ---------------------------------------------------------------

    def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one raw packet (``send(2)`` flags passed through)."""
        try:
            self.sock.send(packet, flags)
        except OSError as exc:
            raise _failed("sending to", self.address, exc) from None

    def subscribe(self, pattern: bytes | str, flags: int = 0) -> None:
        self.send_packet(protocol.encode(protocol.Subscribe(_b(pattern))), flags)

    def unsubscribe(self, pattern: bytes | str, flags: int = 0) -> None:
        self.send_packet(protocol.encode(protocol.Unsubscribe(_b(pattern))), flags)

    def publish(self, key: bytes | str, payload: bytes | str = b"", flags: int = 0) -> None:
        self.send_packet(protocol.encode(Publish(_b(key), _b(payload))), flags)

    def control(self, key: bytes | str, payload: bytes | str | None = None,
                flags: int = 0) -> None:
        data = None if payload is None else _b(payload)
        self.send_packet(protocol.encode(Control(_b(key), data)), flags)

    def set_flood(self, soft: str | None = None, hard: str | None = None,
                  order: str | None = None) -> None:
        """Choose the broker's flood policy for this client (see `sbus.flood`)."""
        for packet in _flood_packets(soft, hard, order):
            self.send_packet(packet)

    # -- receiving ---------------------------------------------------------------

    def recv_packet(self, flags: int = 0) -> bytes:
        """One raw packet; raises `SbusError` when the broker closed the connection."""
        try:
            n = self.sock.recv_into(self._buf, 0, flags)
        except (BlockingIOError, TimeoutError):
            raise
        except OSError as exc:
            raise _failed("receiving from", self.address, exc) from None
        if n == 0:
            raise _closed(self.address)
        return self._view[:n].tobytes()

    def receive(self, timeout: float | None = None, flags: int = 0) -> Publish | Control:
        """The next message or control message; ``TimeoutError`` after *timeout* seconds."""
        if self._pending:
            return self._pending.popleft()
        if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
            raise TimeoutError(f"no message from the broker at {self.address} "
                               f"within {timeout} s")
        return _event(self.recv_packet(flags), self.address)

    def receive_ready(self, limit: int = 1024) -> list[Publish | Control]:
        """Everything that can be read without blocking (up to *limit*): for fast consumers."""
        out = list(self._pending)
        self._pending.clear()
        recv_into, buf, view = self.sock.recv_into, self._buf, self._view
        while len(out) < limit:
            try:
                n = recv_into(buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if n == 0:
                if out:
                    break
                raise _closed(self.address)
            out.append(_event(view[:n].tobytes(), self.address))
        return out

    def __iter__(self) -> Iterator[Publish]:
        """Messages, forever; control messages from the broker are skipped."""
        while True:
            event = self.receive()
            if isinstance(event, Publish):
                yield event

    def whoami(self, timeout: float = 5.0) -> bytes:
        """This connection's credentials path, e.g. ``b'!/cred/100/1000/1111'``, asked of the
        broker; messages arriving meanwhile are kept for `receive`."""
        if self._cred is None:
            self.control(WHOAMI)
            skipped: list[Publish | Control] = []
            while True:
                event = self.receive(timeout=timeout)
                if isinstance(event, Control) and event.key == WHOAMI:
                    break
                skipped.append(event)
            self._pending.extend(skipped)
            self._cred = event.payload or b""
        return self._cred

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


class AsyncClient:
    """The async twin of `Client`, for trio or asyncio (readiness through anyio).

    Use ``async with await AsyncClient.connect(address) as bus:``.  One task may send
    and one may receive at a time (waiting on the same socket from two tasks is an
    error under trio); tasks that share a client serialise their sends with a lock.
    """

    def __init__(self, address: str, sock: socket.socket) -> None:
        self.address = address
        self.sock = sock
        sock.setblocking(False)
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._pending: deque[Publish | Control] = deque()
        self._cred: bytes | None = None

    @classmethod
    async def connect(cls, address: str | None = None) -> AsyncClient:
        address, sock = _connect(address)
        return cls(address, sock)

    async def send_packet(self, packet: bytes, flags: int = 0) -> None:
        while True:
            try:
                self.sock.send(packet, flags)
                return
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
            except OSError as exc:
                raise _failed("sending to", self.address, exc) from None

    async def subscribe(self, pattern: bytes | str) -> None:
        await self.send_packet(protocol.encode(protocol.Subscribe(_b(pattern))))

    async def unsubscribe(self, pattern: bytes | str) -> None:
        await self.send_packet(protocol.encode(protocol.Unsubscribe(_b(pattern))))

    async def publish(self, key: bytes | str, payload: bytes | str = b"") -> None:
        await self.send_packet(protocol.encode(Publish(_b(key), _b(payload))))

    async def control(self, key: bytes | str, payload: bytes | str | None = None) -> None:
        data = None if payload is None else _b(payload)
        await self.send_packet(protocol.encode(Control(_b(key), data)))

    async def set_flood(self, soft: str | None = None, hard: str | None = None,
                        order: str | None = None) -> None:
        for packet in _flood_packets(soft, hard, order):
            await self.send_packet(packet)

    async def recv_packet(self) -> bytes:
        """One raw packet; raises `SbusError` when the broker closed the connection."""
        return (await self.receive_packets(1))[0]

    async def receive(self) -> Publish | Control:
        if self._pending:
            return self._pending.popleft()
        return _event(await self.recv_packet(), self.address)

    async def receive_packets(self, limit: int = 1024) -> list[bytes]:
        """At least one raw packet, plus whatever else is ready (up to *limit*).

        The cheapest way to keep up with a busy bus: no event objects, one wait per
        batch.  End of connection raises `SbusError` once the packets before it are taken.
        """
        recv_into, buf, view = self.sock.recv_into, self._buf, self._view
        out: list[bytes] = []
        while True:
            while len(out) < limit:
                try:
                    n = recv_into(buf)
                except BlockingIOError:
                    break
                except OSError as exc:
                    raise _failed("receiving from", self.address, exc) from None
                if n == 0:
                    if out:
                        return out
                    raise _closed(self.address)
                out.append(view[:n].tobytes())
            if out:
                await anyio.lowlevel.checkpoint()  # a busy bus must not starve other tasks
                return out
            await anyio.wait_readable(self.sock)

    async def receive_batch(self, limit: int = 1024) -> list[Publish | Control]:
        """At least one event, plus whatever else is ready (up to *limit*)."""
        if self._pending:
            out = list(self._pending)
            self._pending.clear()
            return out
        return [_event(p, self.address) for p in await self.receive_packets(limit)]

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        while True:
            event = await self.receive()
            if isinstance(event, Publish):
                yield event

    async def whoami(self) -> bytes:
        if self._cred is None:
            await self.control(WHOAMI)
            skipped: list[Publish | Control] = []
            while True:
                event = await self.receive()
                if isinstance(event, Control) and event.key == WHOAMI:
                    break
                skipped.append(event)
            self._pending.extend(skipped)
            self._cred = event.payload or b""
        return self._cred

    async def request(self, key: bytes | str, payload: bytes | str = b"",
                      timeout: float = 5.0) -> bytes:
        """`Client.request` for async code; ``TimeoutError`` after *timeout* seconds."""
        from .request import request_async

        return await request_async(self, key, payload, timeout, keep=self._pending.append)

    def fileno(self) -> int:
        return self.sock.fileno()

    async def aclose(self) -> None:
        self.sock.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
