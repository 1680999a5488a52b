"""Remote client library for the gateway: `Client` (trio or asyncio, through anyio) and
`BlockingClient` (threads).

The gateway keeps no state across connections and returns no errors, so the
client keeps it: the topics it is subscribed to and the secret.  A background
task owns the connection; when it breaks (or the gateway goes silent for
``dead_after`` seconds, although it echoes every keep-alive) the task reconnects
with the session's `Backoff` (1 s doubling to 60 s by default, with jitter),
authenticates again and subscribes to every topic again.  Messages published
while disconnected wait for the next connection; one that was being written
when the connection broke is not retried (as in the design).

What the client misses is said: it subscribes to the gateway's notices
(`notices.TOPIC`, unless ``notices=False``) and logs each as a warning, counting
the messages they say were lost in `missed`; a reconnect (whose gap nobody can
count) is logged as a warning too and counted in `gaps`.  The notices reach the
program as messages only if it subscribes to `notices.TOPIC` itself.

    async with Client("bus.example.net", 7070, auth_key=b"...") as c:
        await c.subscribe(b"sensors/*/temp")
        async for msg in c:
            print(msg.topic, msg.body)
"""

from __future__ import annotations

import logging
import math
import ssl
import threading
from contextlib import AsyncExitStack

import anyio
import trio
from anyio.abc import ByteStream

from ..display import brief
from ..session import Backoff
from . import codec, notices
from .codec import FrameDecoder, FrameError

log = logging.getLogger("sbus.gateway.client")

__all__ = ["Client", "BlockingClient", "Message"]

#: A message from the gateway: ``.topic`` and ``.body`` (bytes).
Message = codec.Publish

#: A connection that lasted this long resets the backoff.
STABLE_AFTER = 10.0

_BROKEN = (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream,
           FrameError, TimeoutError)


def _b(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Client:
    """A self-healing connection to a gateway, for trio or asyncio.  Use as ``async with``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        auth_key: bytes | str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        keepalive: float = 20.0,
        dead_after: float | None = None,
        backoff_first: float = 1.0,
        backoff_max: float = 60.0,
        connect_timeout: float = 10.0,
        queue: int = 1000,
        max_frame: int = codec.DEFAULT_MAX_FRAME,
        notices: bool = True,
    ) -> None:
        self.host, self.port = host, port
        self.auth_key = None if auth_key is None else _b(auth_key)
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname or host
        self.keepalive = keepalive
        self.dead_after = 3 * keepalive if dead_after is None else dead_after
        self.backoff_first, self.backoff_max = backoff_first, backoff_max
        self.connect_timeout = connect_timeout
        self.max_frame = max_frame
        self.topics: set[bytes] = set()
        self.notices = notices
        #: Connections made so far (1 after the first, more after reconnects).
        self.connections = 0
        #: Messages the gateway said this client missed (`notices`: discarded for it,
        #: dropped by the broker for the gateway), and gaps nobody could count (a
        #: reconnect, the bus away).
        self.missed = 0
        self.gaps = 0
        self._lost_at: float | None = None  # when the last connection ended
        self._send_in, self._receive_out = anyio.create_memory_object_stream[Message](queue)
        self._stream: ByteStream | None = None
        self._connected = anyio.Event()
        self._lock = anyio.Lock()
        self._last_sent = 0.0
        self._stack: AsyncExitStack | None = None

    # -- lifecycle ----------------------------------------------------------------

    async def __aenter__(self) -> Client:
        stack = AsyncExitStack()
        tasks = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(tasks.cancel_scope.cancel)  # runs first on exit
        tasks.start_soon(self._run)
        self._stack = stack
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._stack is not None
        await self._stack.aclose()

    @property
    def connected(self) -> bool:
        return self._stream is not None

    async def wait_connected(self) -> None:
        """Until a connection is up (authenticated and subscribed)."""
        while self._stream is None:
            await self._connected.wait()

    # -- requests -------------------------------------------------------------------

    async def subscribe(self, topic: bytes | str) -> None:
        """Subscribe now and after every reconnect (an sbus pattern)."""
        topic = _b(topic)
        self.topics.add(topic)
        await self._send_now(codec.subscribe(topic))

    async def unsubscribe(self, topic: bytes | str) -> None:
        topic = _b(topic)
        self.topics.discard(topic)
        await self._send_now(codec.unsubscribe(topic))

    async def publish(self, topic: bytes | str, body: bytes | str = b"") -> bool:
        """Send a message, waiting for a connection if there is none; False if the
        connection broke while it was written (it is not retried)."""
        frame = codec.publish(_b(topic), _b(body))
        while True:
            await self.wait_connected()
            stream = self._stream
            if stream is not None:
                return await self._send(stream, frame)

    async def _send_now(self, frame: bytes) -> None:
        """Send if connected; otherwise the next connection sends the current state."""
        stream = self._stream
        if stream is not None:
            await self._send(stream, frame)

    async def _send(self, stream: ByteStream, data: bytes) -> bool:
        async with self._lock:
            if stream is not self._stream:
                return False
            try:
                await stream.send(data)
            except _BROKEN as exc:
                log.debug("send to %s:%d failed: %s", self.host, self.port, exc)
                return False
            self._last_sent = anyio.current_time()
            return True

    async def receive(self) -> Message:
        return await self._receive_out.receive()

    def __aiter__(self) -> Client:
        return self

    async def __anext__(self) -> Message:
        return await self._receive_out.receive()

    # -- the connection -----------------------------------------------------------------

    async def _open(self) -> ByteStream:
        with anyio.fail_after(self.connect_timeout):
            if self.ssl_context is None:
                return await anyio.connect_tcp(self.host, self.port)
            return await anyio.connect_tcp(self.host, self.port, ssl_context=self.ssl_context,
                                           tls_hostname=self.server_hostname,
                                           tls_standard_compatible=False)

    def _hello(self) -> bytes:
        """What a fresh connection sends first: the secret, then every subscription."""
        parts = [] if self.auth_key is None else [codec.authenticate(self.auth_key)]
        parts += [codec.subscribe(t) for t in sorted(self.topics)]
        if self.notices and notices.TOPIC not in self.topics:
            parts.append(codec.subscribe(notices.TOPIC))
        return b"".join(parts)

    async def _run(self) -> None:
        backoff = Backoff(self.backoff_first, self.backoff_max)
        while True:
            began = anyio.current_time()
            try:
                stream = await self._open()
            except _BROKEN as exc:
                log.info("cannot connect to %s:%d: %s", self.host, self.port, exc)
            else:
                try:
                    await self._session(stream)
                finally:
                    if self._stream is not None:
                        self._lost_at = anyio.current_time()
                    self._stream = None
                    self._connected = anyio.Event()
                    with anyio.CancelScope(shield=True):
                        await anyio.aclose_forcefully(stream)
            if anyio.current_time() - began >= STABLE_AFTER:
                backoff.reset()
            delay = backoff.next()
            log.info("reconnecting to %s:%d in %.1f s", self.host, self.port, delay)
            await anyio.sleep(delay)

    async def _session(self, stream: ByteStream) -> None:
        async with self._lock:
            try:
                hello = self._hello()
                if hello:
                    await stream.send(hello)
            except _BROKEN as exc:
                log.info("connection to %s:%d failed at once: %s", self.host, self.port, exc)
                return
            self._last_sent = anyio.current_time()
            self._stream = stream
        self.connections += 1
        self._connected.set()
        log.info("connected to %s:%d (%d topics)", self.host, self.port, len(self.topics))
        if self._lost_at is not None and self.topics:
            self.gaps += 1
            log.warning("reconnected to %s:%d after %.1f s: what was published meanwhile "
                        "was not received", self.host, self.port,
                        anyio.current_time() - self._lost_at)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._keepalives, stream, tasks.cancel_scope)
            await self._reader(stream)
            tasks.cancel_scope.cancel()

    async def _keepalives(self, stream: ByteStream, scope: anyio.CancelScope) -> None:
        while True:
            await anyio.sleep_until(self._last_sent + self.keepalive)
            if anyio.current_time() >= self._last_sent + self.keepalive:
                if not await self._send(stream, codec.KEEPALIVE):
                    scope.cancel()
                    return

    async def _reader(self, stream: ByteStream) -> None:
        decoder = FrameDecoder(self.max_frame)
        try:
            while True:
                with anyio.move_on_after(self.dead_after) as timer:
                    data = await stream.receive(65536)
                if timer.cancelled_caught:
                    log.warning("%s:%d silent for %g s: reconnecting", self.host, self.port,
                                self.dead_after)
                    return
                for frame in decoder.feed(data):
                    if type(frame) is not codec.Publish:
                        continue
                    if frame.topic == notices.TOPIC:
                        self._notice(frame.body)
                        if notices.TOPIC not in self.topics:
                            continue
                    await self._send_in.send(frame)
        except anyio.EndOfStream:
            log.info("%s:%d closed the connection", self.host, self.port)
        except _BROKEN as exc:
            log.info("connection to %s:%d lost: %s", self.host, self.port, exc)

    def _notice(self, body: bytes) -> None:
        """Say what the gateway's notice tells (`notices`), and count it."""
        where = f"{self.host}:{self.port}"
        try:
            notice = notices.parse(body)
        except ValueError:
            log.warning("%s sent a notice that is not one: %s", where, brief(body, 80))
            return
        event, count = notice["event"], notice.get("count")
        if event in ("discarded", "bus-dropped") and isinstance(count, int) and count > 0:
            self.missed += count
            why = ("discarded for this client (it did not read fast enough)"
                   if event == "discarded" else
                   "dropped by the bus for the gateway (it fell behind)")
            log.warning("%s: %d messages were %s", where, count, why)
        elif event == "bus-away":
            self.gaps += 1
            log.warning("%s lost its bus: what is published meanwhile is not received",
                        where)
        elif event == "bus-back":
            log.warning("%s has its bus back: what was published while it was away was not "
                        "received", where)
        else:
            log.warning("%s sent an unknown notice: %s", where, brief(body, 80))


class BlockingClient:
    """`Client` for threaded code: a trio thread owns the connection.

    >>> with BlockingClient("localhost", 7070) as c:         # doctest: +SKIP
    ...     c.subscribe(b"news/")
    ...     print(c.receive(timeout=5))
    """

    def __init__(self, host: str, port: int, **options) -> None:
        self._client = Client(host, port, **options)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._thread_main, name="sbus-gateway-client",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the constructor's caller
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with self._client:
            self._ready.set()
            await self._stop.wait()

    def _call(self, fn, *args):
        if self._token is None or not self._thread.is_alive():
            raise RuntimeError("this client is closed")
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    @property
    def client(self) -> Client:
        return self._client

    @property
    def connected(self) -> bool:
        return self._client.connected

    def wait_connected(self, timeout: float | None = None) -> bool:
        async def wait() -> bool:
            with trio.move_on_after(math.inf if timeout is None else timeout):
                await self._client.wait_connected()
                return True
            return False
        return self._call(wait)

    def subscribe(self, topic: bytes | str) -> None:
        self._call(self._client.subscribe, topic)

    def unsubscribe(self, topic: bytes | str) -> None:
        self._call(self._client.unsubscribe, topic)

    def publish(self, topic: bytes | str, body: bytes | str = b"") -> bool:
        return self._call(self._client.publish, topic, body)

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; ``TimeoutError`` after *timeout* seconds."""
        async def get() -> Message:
            with trio.fail_after(math.inf if timeout is None else timeout):
                return await self._client.receive()
        try:
            return self._call(get)
        except trio.TooSlowError:
            raise TimeoutError(f"no message within {timeout} s") from None

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join()

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
