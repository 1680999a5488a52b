"""`sbus gateway`: remote clients publish and subscribe on the bus over TCP or TLS.

A thin trio shell: `codec` turns bytes into frames, `Outbox` bounds what waits
for each client, `Bridge` holds the one shared bus connection and the routing
index of remote subscriptions.  Each remote client is a reader and a writer task
in a cancel scope whose deadline is the idle timeout, pushed forward by every
read and write; anything abnormal cancels that scope and nothing else.

Decisions where the design leaves room (see docs/gateway.md):

* a wrong secret disconnects (and is logged with the peer address), so each
  guess costs a new connection;
* any client may subscribe, but never to a ``!/`` (secret) pattern: those are
  addressed to local processes by credentials, which would be the gateway's; such
  a subscription is logged and disconnects;
* remote clients may not publish to ``!/`` keys either (logged, disconnects):
  a secret key is a private channel between local processes, and a remote
  client could never receive the reply anyway;
* unsubscribing from a topic one is not subscribed to is ignored (harmless);
  subscribing twice to the same topic is one subscription.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import resource
import signal
import ssl
import stat

import trio
from trio.lowlevel import ParkingLot

from ..client import SbusError
from ..keys import Credentials, KeyRefused, KeyRules
from . import codec
from .bridge import Bridge
from .codec import DEFAULT_MAX_FRAME, FrameDecoder, FrameError
from .outbox import Outbox

log = logging.getLogger("sbus.gateway")

__all__ = ["Gateway", "add_arguments", "run", "parse_hostport", "read_secret"]

#: Bytes read from a client at once (also the codec's chunk size).
READ_SIZE = 65536
#: Distinct topics one remote client may hold; more is treated as abuse.
MAX_SUBSCRIPTIONS = 4096
#: How long a closing connection may take to say goodbye (TLS close_notify).
CLOSE_GRACE = 1.0

_RULES = KeyRules(b"/")
_NOBODY = Credentials(0, 0, 0)  # check_pattern needs some; secret patterns never get there


class Disconnect(Exception):
    """Something abnormal: the connection is closed, the reason logged."""


class Remote:
    """One remote client: its stream, subscriptions, outgoing buffer and idle deadline."""

    __slots__ = ("stream", "peer", "outbox", "lot", "scope", "authenticated", "topics",
                 "idle", "reason", "__weakref__")

    def __init__(self, stream: trio.abc.Stream, peer: str, outbox: Outbox, idle: float) -> None:
        self.stream = stream
        self.peer = peer
        self.outbox = outbox
        self.lot = ParkingLot()  # the writer waits here for frames
        self.scope: trio.CancelScope | None = None
        self.authenticated = False
        self.topics: set[bytes] = set()
        self.idle = idle
        self.reason = ""

    def touch(self) -> None:
        """Any read or write resets the idle timeout."""
        if self.scope is not None:
            self.scope.deadline = trio.current_time() + self.idle

    def __repr__(self) -> str:
        return f"remote {self.peer}"


def _peer(stream: trio.abc.Stream) -> str:
    sock_stream = getattr(stream, "transport_stream", stream)
    try:
        host, port = sock_stream.socket.getpeername()[:2]
    except (AttributeError, OSError):
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Gateway:
    def __init__(
        self,
        secret: bytes,
        *,
        address: str | None = None,
        idle_timeout: float = 70.0,
        buffer_messages: int = 100,
        buffer_bytes: int = 1 << 20,
        max_frame: int = DEFAULT_MAX_FRAME,
    ) -> None:
        if not secret:
            raise ValueError("the authentication secret is empty")
        self.secret = secret
        self.idle_timeout = idle_timeout
        self.buffer_messages = buffer_messages
        self.buffer_bytes = buffer_bytes
        self.max_frame = max_frame
        self.bridge = Bridge(address, self._deliver)
        self.clients: set[Remote] = set()
        # counters
        self.accepted = 0
        self.delivered = 0  # frames queued for remote clients
        self.dropped = 0  # frames discarded because a client's buffer was full
        self.refused = 0  # connections closed for abnormal input

    # -- fan-out from the bus ---------------------------------------------------------

    def _deliver(self, targets: tuple[Remote, ...], key: bytes, payload: bytes) -> None:
        frame = codec.publish(key, payload)
        dropped = 0
        for rc in targets:
            queued = rc.outbox.offer(frame)
            if queued == 1:
                rc.lot.unpark()  # only the writer of an empty outbox waits
            elif not queued:
                dropped += 1
        self.delivered += len(targets) - dropped
        self.dropped += dropped

    # -- one remote client --------------------------------------------------------------

    async def handle(self, stream: trio.abc.Stream) -> None:
        """Serve one remote client until it leaves, misbehaves or idles out."""
        rc = Remote(stream, _peer(stream), Outbox(self.buffer_messages, self.buffer_bytes),
                    self.idle_timeout)
        self.accepted += 1
        self.clients.add(rc)
        log.debug("%r connected", rc)
        try:
            with trio.CancelScope(deadline=trio.current_time() + self.idle_timeout) as scope:
                rc.scope = scope
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, rc)
                    await self._reader(rc)
                    nursery.cancel_scope.cancel()
            if scope.cancelled_caught and not rc.reason:
                rc.reason = f"idle for {self.idle_timeout:g} s"
                log.info("disconnecting %r: %s", rc, rc.reason)
        finally:
            self.clients.discard(rc)
            with trio.CancelScope(shield=True):
                await self.bridge.remove_client(rc)
                with trio.move_on_after(CLOSE_GRACE):
                    try:
                        await stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
            if rc.outbox.dropped_total:
                log.info("%r: %d messages were discarded for it (buffer full)",
                         rc, rc.outbox.dropped_total)
            log.debug("%r disconnected: %s", rc, rc.reason or "closed by peer")

    def _close(self, rc: Remote, reason: str, abnormal: bool = False) -> None:
        """End *rc*'s session (from its reader or writer) and say why."""
        if not rc.reason:
            rc.reason = reason
            if abnormal:
                self.refused += 1
                log.warning("disconnecting %r: %s", rc, reason)
            else:
                log.info("%r: %s", rc, reason)
        if rc.scope is not None:
            rc.scope.cancel()

    async def _reader(self, rc: Remote) -> None:
        decoder = FrameDecoder(self.max_frame, read_size=READ_SIZE)
        receive = rc.stream.receive_some
        try:
            while True:
                data = await receive(READ_SIZE)
                if not data:
                    if not decoder.idle:
                        self._close(rc, "closed in the middle of a frame", abnormal=True)
                    return
                rc.touch()
                # frames decoded before a bad one are not acted upon: the stream is bad
                for frame in decoder.feed(data):
                    await self._frame(rc, frame)
        except FrameError as exc:
            self._close(rc, f"malformed input: {exc}", abnormal=True)
        except Disconnect as exc:
            self._close(rc, str(exc), abnormal=True)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._close(rc, f"read failed: {exc.__cause__ or exc}")

    async def _frame(self, rc: Remote, frame: codec.Frame) -> None:
        kind = type(frame)
        if kind is codec.Publish:
            if not rc.authenticated:
                raise Disconnect("publish before authenticating")
            _check_key(frame.topic)
            await self.bridge.publish(frame.topic, frame.body)
        elif kind is codec.KeepAlive:
            rc.outbox.force(codec.KEEPALIVE)
            rc.lot.unpark()
        elif kind is codec.Subscribe:
            _check_pattern(frame.topic)
            if frame.topic not in rc.topics:
                if len(rc.topics) >= MAX_SUBSCRIPTIONS:
                    raise Disconnect(f"more than {MAX_SUBSCRIPTIONS} subscriptions")
                rc.topics.add(frame.topic)
                await self.bridge.subscribe(rc, frame.topic)
        elif kind is codec.Unsubscribe:
            if frame.topic in rc.topics:
                rc.topics.discard(frame.topic)
                await self.bridge.unsubscribe(rc, frame.topic)
        elif kind is codec.Authenticate:
            if not hmac.compare_digest(frame.secret, self.secret):
                raise Disconnect("wrong authentication secret")
            if not rc.authenticated:
                rc.authenticated = True
                log.info("%r authenticated", rc)

    async def _writer(self, rc: Remote) -> None:
        out = rc.outbox
        send_all = rc.stream.send_all
        try:
            while True:
                if not out:
                    await rc.lot.park()
                    continue
                await send_all(out.take())
                rc.touch()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._close(rc, f"write failed: {exc.__cause__ or exc}")

    # -- serving --------------------------------------------------------------------------

    def status(self) -> str:
        b = self.bridge
        return (f"{len(self.clients)} clients, {len(b.patterns)} patterns, "
                f"{b.published} published, {self.delivered} delivered, "
                f"{self.dropped} discarded (buffers full), {b.lost} lost (bus down), "
                f"bus {'up' if b.up else 'DOWN'}")

    async def serve(self, listeners: list[trio.abc.Listener], *,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the bus bridge and accept clients on *listeners* until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.bridge.run)
            await nursery.start(trio.serve_listeners, self.handle, listeners)
            task_status.started()


def _check_common(topic: bytes, what: str) -> None:
    if b"\0" in topic:
        raise Disconnect(f"{what} {topic[:64]!r} contains NUL, which sbus keys cannot")
    if _RULES.is_secret(topic):
        raise Disconnect(f"{what} {topic[:64]!r} is a secret (!/) key, "
                         "which remote clients may not use")


def _check_pattern(topic: bytes) -> None:
    _check_common(topic, "subscription to")
    try:
        _RULES.check_pattern(topic, _NOBODY)
    except KeyRefused as exc:
        raise Disconnect(f"subscription refused: {exc}") from None


def _check_key(topic: bytes) -> None:
    _check_common(topic, "publish to")
    try:
        _RULES.check_key(topic)
    except KeyRefused as exc:
        raise Disconnect(f"publish refused: {exc}") from None


# -- command line -----------------------------------------------------------------------------

def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise SbusError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if int(port) > 65535:
        raise SbusError(f"port {port} is out of range")
    return host, int(port)


def read_secret(path: str) -> bytes:
    """The shared secret: the file's bytes without a trailing newline."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            secret = f.read(65536)
    except OSError as exc:
        raise SbusError(f"cannot read the auth key file {path}: {exc.strerror}") from None
    secret = secret.rstrip(b"\r\n")
    if not secret:
        raise SbusError(f"the auth key file {path} is empty")
    if st.st_mode & stat.S_IROTH:
        log.warning("the auth key file %s is readable by everyone; chmod 600 it", path)
    return secret


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where remote clients connect ([::]:PORT for IPv6)")
    p.add_argument("--tls-cert", metavar="FILE", help="certificate chain (PEM): serve TLS")
    p.add_argument("--tls-key", metavar="FILE", help="private key (PEM) for --tls-cert")
    p.add_argument("--auth-key-file", required=True, metavar="FILE",
                   help="file holding the secret publishers authenticate with")
    p.add_argument("--idle-timeout", type=float, default=70.0, metavar="SECONDS",
                   help="disconnect clients that neither read nor write for this long "
                        "(default 70)")
    p.add_argument("--buffer-messages", type=int, default=100, metavar="N",
                   help="outgoing messages buffered per client before new ones are "
                        "discarded (default 100)")
    p.add_argument("--buffer-bytes", type=_size, default=1 << 20, metavar="BYTES",
                   help="outgoing bytes buffered per client (default 1m)")
    p.add_argument("--max-frame", type=_size, default=DEFAULT_MAX_FRAME, metavar="BYTES",
                   help=f"largest topic+body accepted (default {DEFAULT_MAX_FRAME}); "
                        "larger frames disconnect")
    p.add_argument("--https-listen", metavar="HOST:PORT",
                   help="also accept HTTPS POST publishes here (needs --tls-cert)")


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SbusError(f"cannot load the TLS certificate {cert} / key {key}: {exc}") from None
    return ctx


def _bound(listener: trio.abc.Listener) -> str:
    """The address a listener really has (the port chosen for port 0, too)."""
    inner = getattr(listener, "transport_listener", listener)
    host, port = inner.socket.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _raise_nofile() -> None:
    """Every client is a file descriptor: use all the kernel lets us."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _report(gw: Gateway) -> None:
    from systemd import daemon

    while True:
        await trio.sleep(5)
        daemon.notify(f"STATUS={gw.status()}")


async def serve(args: argparse.Namespace, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    from systemd import daemon

    if bool(args.tls_cert) != bool(args.tls_key):
        raise SbusError("--tls-cert and --tls-key go together")
    ctx = _tls_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    if args.https_listen and ctx is None:
        raise SbusError("--https-listen needs --tls-cert and --tls-key "
                        "(the authentication key must not travel in clear)")
    secret = read_secret(args.auth_key_file)
    host, port = parse_hostport(args.listen)
    for name, value in (("--buffer-messages", args.buffer_messages),
                        ("--buffer-bytes", args.buffer_bytes),
                        ("--idle-timeout", args.idle_timeout), ("--max-frame", args.max_frame)):
        if value <= 0:
            raise SbusError(f"{name} must be positive")
    gw = Gateway(secret, address=args.address, idle_timeout=args.idle_timeout,
                 buffer_messages=args.buffer_messages, buffer_bytes=args.buffer_bytes,
                 max_frame=args.max_frame)
    try:
        listeners: list[trio.abc.Listener] = await trio.open_tcp_listeners(
            port, host=host or None, backlog=4096)
    except OSError as exc:
        raise SbusError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    if ctx is not None:
        listeners = [trio.SSLListener(lst, ctx, https_compatible=False) for lst in listeners]
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(gw.serve, listeners)
            where = [", ".join(_bound(lst) for lst in listeners)
                     + (" (TLS)" if ctx else " (plain TCP)")]
            if args.https_listen:
                from .https import serve_https

                https_host, https_port = parse_hostport(args.https_listen)
                await nursery.start(serve_https, gw, https_host, https_port, ctx)
                where.append(f"HTTPS {args.https_listen}")
            nursery.start_soon(_report, gw)
            log.info("sbus gateway listening on %s, bus %s", ", ".join(where),
                     gw.bridge.address or "default")
            daemon.notify(f"READY=1\nSTATUS=listening, {gw.status()}")
            task_status.started(gw)
            async for signum in signals:
                log.info("%s: shutting down (%s)", signal.Signals(signum).name, gw.status())
                daemon.notify("STOPPING=1")
                nursery.cancel_scope.cancel()
                break


def _first(group: BaseExceptionGroup, kind: type[BaseException]) -> BaseException | None:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = _first(exc, kind)
            if found is not None:
                return found
        elif isinstance(exc, kind):
            return exc
    return None


def run(args: argparse.Namespace) -> int:
    _raise_nofile()
    try:
        trio.run(serve, args)
    except BaseExceptionGroup as group:
        # a startup failure inside the nursery (e.g. no broker): one line, not a traceback
        error = _first(group, SbusError)
        if error is None:
            raise
        raise error from None
    return 0
