"""`sbus gateway`: the launcher of the network gateway (`sbus.gateway.server.Gateway`).

Everything that belongs to the process rather than to the gateway lives here: the
command line, the secret file, the TLS context, the listening sockets, the
descriptor limit, systemd notifications and signals.  The component receives plain
typed arguments (dbus-broker's launcher / broker split).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import ssl
import stat

import trio

from .. import rlimits
from ..defaults import size_arg
from ..errors import SbusError
from ..files import SECRET_BYTES, must_be_regular, read_small
from ..gateway.bridge import BUS_SUBSCRIPTION_BYTES, BUS_WAIT
from ..gateway.codec import DEFAULT_MAX_FRAME
from ..gateway.server import (
    BUFFER_BYTES_PER_ADDRESS,
    BUFFER_POOL,
    HANDSHAKE_BYTES,
    HANDSHAKES_PER_ADDRESS,
    MAX_CLIENTS,
    MAX_CLIENTS_PER_ADDRESS,
    REFUSAL_DELAY,
    ROUTE_CACHE,
    SUBSCRIPTION_BYTES,
    SUBSCRIPTION_POOL,
    TLS_HANDSHAKE_TIMEOUT,
    Gateway,
)
from ..linger import LINGER, linger_arg
from ..sdnotify import Reporter

log = logging.getLogger("sbus.gateway")

__all__ = ["add_arguments", "run", "parse_hostport", "read_secret"]


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
        secret = read_small(path, SECRET_BYTES).rstrip(b"\r\n")
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise SbusError(f"cannot read the auth key file {path}: {exc.strerror}") from None
    if not secret:
        raise SbusError(f"the auth key file {path} is empty")
    if mode & stat.S_IROTH:
        log.warning("the auth key file %s is readable by everyone; chmod 600 it", path)
    return secret


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where remote clients connect ([::]:PORT for IPv6)")
    p.add_argument("--tls-cert", metavar="FILE", help="certificate chain (PEM): serve TLS")
    p.add_argument("--tls-key", metavar="FILE", help="private key (PEM) for --tls-cert")
    p.add_argument("--tls-handshake-timeout", type=float, default=TLS_HANDSHAKE_TIMEOUT,
                   metavar="SECONDS", help="a TLS handshake not done this long after it "
                   f"began is dropped (default {TLS_HANDSHAKE_TIMEOUT:g}); "
                   f"{HANDSHAKES_PER_ADDRESS} of one address are made at once, the others "
                   f"wait; one may send {HANDSHAKE_BYTES // 1024} KiB")
    p.add_argument("--auth-key-file", required=True, metavar="FILE",
                   help="file holding the secret publishers authenticate with")
    p.add_argument("--idle-timeout", type=float, default=70.0, metavar="SECONDS",
                   help="disconnect clients that neither read nor write for this long "
                        "(default 70)")
    p.add_argument("--linger", type=linger_arg, default=LINGER, metavar="DURATION",
                   help="when a plain-TCP client publishes so fast that waiting this long "
                        "gathers two or more messages, wait that long before reading it "
                        "again (or until 2 KiB wait): its publishes go to the bus in runs, "
                        "each at most this much later (default 1ms; 0: off; at most 100ms)")
    p.add_argument("--buffer-messages", type=int, default=100, metavar="N",
                   help="outgoing messages buffered per client before new ones are "
                        "discarded (default 100)")
    p.add_argument("--buffer-bytes", type=size_arg, default=1 << 20, metavar="BYTES",
                   help="outgoing bytes buffered per client (default 1m)")
    p.add_argument("--max-frame", type=size_arg, default=DEFAULT_MAX_FRAME, metavar="BYTES",
                   help=f"largest topic+body accepted (default {DEFAULT_MAX_FRAME}); "
                        "larger frames disconnect")
    p.add_argument("--https-listen", metavar="HOST:PORT",
                   help="also accept HTTPS POST publishes here (needs --tls-cert)")
    p.add_argument("--max-clients", type=int, default=MAX_CLIENTS, metavar="N",
                   help=f"connections served at once, HTTPS included (default {MAX_CLIENTS}); "
                        "more are held unread for --refusal-delay, then closed")
    p.add_argument("--max-clients-per-address", type=int, default=MAX_CLIENTS_PER_ADDRESS,
                   metavar="N", help="connections from one peer address at once "
                   f"(default {MAX_CLIENTS_PER_ADDRESS})")
    p.add_argument("--buffer-pool", type=size_arg, default=BUFFER_POOL, metavar="BYTES",
                   help="outgoing bytes buffered for all clients together (default 256m)")
    p.add_argument("--subscription-bytes", type=size_arg, default=SUBSCRIPTION_BYTES,
                   metavar="BYTES", help="what one client's subscriptions may cost "
                   "(default 256k; a pattern costs 400 + 2 x its length + 400 per segment)")
    p.add_argument("--subscription-pool", type=size_arg, default=SUBSCRIPTION_POOL,
                   metavar="BYTES", help="the same for all clients together (default 64m)")
    p.add_argument("--subscription-bytes-per-address", type=size_arg,
                   metavar="BYTES", help="what all subscriptions of one peer address may "
                   "cost (default 1/16 of --bus-subscription-bytes)")
    p.add_argument("--buffer-bytes-per-address", type=size_arg,
                   default=BUFFER_BYTES_PER_ADDRESS, metavar="BYTES",
                   help="outgoing bytes queued for one peer address's clients together "
                        "(default 32m)")
    p.add_argument("--bus-subscription-bytes", type=size_arg, default=BUS_SUBSCRIPTION_BYTES,
                   metavar="BYTES", help="what the gateway's distinct patterns may cost the "
                   "broker (default 12m: 3/4 of the broker's default per-user budget; keep "
                   "it below the broker's budget for the gateway's user)")
    p.add_argument("--route-cache", type=size_arg, default=ROUTE_CACHE, metavar="BYTES",
                   help="bytes of the cache of routing answers (default 4m)")
    p.add_argument("--bus-wait", type=float, default=BUS_WAIT, metavar="SECONDS",
                   help="while the bus is away (a broker restart), remote publishers are "
                        "not read (TCP holds their sends back) for up to this long after it "
                        "went; then their publishes are dropped, counted and logged, and "
                        f"they are disconnected (default {BUS_WAIT:g})")
    p.add_argument("--refusal-delay", type=float, default=REFUSAL_DELAY, metavar="SECONDS",
                   help="a connection turned away (wrong key, malformed input, TLS failure, "
                        "over the caps, HTTPS 4xx) is held unread this long before "
                        f"closing (default {REFUSAL_DELAY:g})")


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    # a TLS 1.2 renegotiation's ClientHello comes encrypted, past what the gateway checks
    # of a handshake before OpenSSL makes room for it (`server.HandshakeGuard`)
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    try:
        must_be_regular(cert, key)
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SbusError(f"cannot load the TLS certificate {cert} / key {key}: {exc}") from None
    return ctx


def _bound(listener: trio.SocketListener) -> str:
    """The address a listener really has (the port chosen for port 0, too)."""
    host, port = listener.socket.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _report(gw: Gateway, notify: Reporter) -> None:
    while True:
        await trio.sleep(5)
        notify(f"STATUS={gw.status()}")


async def serve(args: argparse.Namespace, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
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
                        ("--idle-timeout", args.idle_timeout), ("--max-frame", args.max_frame),
                        ("--tls-handshake-timeout", args.tls_handshake_timeout),
                        ("--max-clients", args.max_clients),
                        ("--max-clients-per-address", args.max_clients_per_address),
                        ("--buffer-pool", args.buffer_pool),
                        ("--subscription-bytes", args.subscription_bytes),
                        ("--subscription-pool", args.subscription_pool),
                        ("--route-cache", args.route_cache),
                        ("--subscription-bytes-per-address",
                         1 if args.subscription_bytes_per_address is None
                         else args.subscription_bytes_per_address),
                        ("--buffer-bytes-per-address", args.buffer_bytes_per_address),
                        ("--bus-subscription-bytes", args.bus_subscription_bytes)):
        if value <= 0:
            raise SbusError(f"{name} must be positive")
    if args.refusal_delay < 0:
        raise SbusError("--refusal-delay must not be negative")
    if args.bus_wait < 0:
        raise SbusError("--bus-wait must not be negative")
    if args.https_listen:  # needs the 'gateway' extra (h11): say so before serving anyone
        from ..gateway.https import serve_https
    gw = Gateway(secret, address=args.address, idle_timeout=args.idle_timeout,
                 buffer_messages=args.buffer_messages, buffer_bytes=args.buffer_bytes,
                 buffer_pool=args.buffer_pool, max_frame=args.max_frame,
                 max_clients=args.max_clients,
                 max_clients_per_address=args.max_clients_per_address,
                 subscription_bytes=args.subscription_bytes,
                 subscription_pool=args.subscription_pool, route_cache=args.route_cache,
                 refusal_delay=args.refusal_delay,
                 subscription_bytes_per_address=args.subscription_bytes_per_address,
                 buffer_bytes_per_address=args.buffer_bytes_per_address,
                 bus_subscription_bytes=args.bus_subscription_bytes, linger=args.linger,
                 bus_wait=args.bus_wait, tls_handshake_timeout=args.tls_handshake_timeout)
    try:
        listeners: list[trio.SocketListener] = await trio.open_tcp_listeners(
            port, host=host or None, backlog=4096)
    except OSError as exc:
        raise SbusError(f"cannot listen on {args.listen}: {exc.strerror or exc}") from None
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(gw.serve, listeners, ctx)
            where = [", ".join(_bound(lst) for lst in listeners)
                     + (" (TLS)" if ctx else " (plain TCP)")]
            if args.https_listen:
                https_host, https_port = parse_hostport(args.https_listen)
                https = await nursery.start(serve_https, gw, https_host, https_port, ctx)
                where.append("HTTPS " + ", ".join(_bound(lst) for lst in https))
            notify = Reporter(log)
            nursery.start_soon(_report, gw, notify)
            log.info("sbus gateway listening on %s, bus %s", ", ".join(where),
                     gw.bridge.address or "default")
            notify(f"READY=1\nSTATUS=listening, {gw.status()}")
            task_status.started(gw)
            async for signum in signals:
                log.info("%s: shutting down (%s)", signal.Signals(signum).name, gw.status())
                notify("STOPPING=1")
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
    if not args.verbose:
        # a service: where it listens (the real port, also for port 0), refusals and
        # bus changes are worth a line; per-peer lines are rationed (Gateway.say)
        log.setLevel(logging.INFO)
    rlimits.raise_descriptor_limit()  # every client is a file descriptor
    try:
        trio.run(serve, args)
    except BaseExceptionGroup as group:
        # a startup failure inside the nursery (e.g. no broker): one line, not a traceback
        error = _first(group, SbusError)
        if error is None:
            raise
        raise error from None
    return 0
