"""`sbus serve`: get a listening socket (from systemd or by binding), run the broker.

Under systemd socket activation the listening socket belongs to systemd and is
passed in ``LISTEN_FDS``; connections that arrive while the broker restarts wait
in its backlog, so clients never see "connection refused".  By hand, a stale
socket file (nobody listening) is replaced, but a live broker is never displaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import logging
import os
import signal
import socket
import stat
import time

import trio
from systemd import daemon

from .broker import Broker
from .limits import Limits

log = logging.getLogger("sbus.server")

DEFAULT_ADDRESS = "/run/sbus.socket"


class ServeError(Exception):
    """A reason the broker cannot start, worded for the person starting it."""


def default_address() -> str:
    return os.environ.get("SBUS_ADDRESS") or DEFAULT_ADDRESS


def systemd_listener() -> socket.socket | None:
    """The socket systemd passed us, checked to be what we need; None when not activated."""
    fds = daemon.listen_fds()
    if not fds:
        return None
    if len(fds) != 1:
        raise ServeError(f"systemd passed {len(fds)} sockets; sbus.socket must define exactly one")
    fd = fds[0]
    if not daemon.is_socket_unix(fd, socket.SOCK_SEQPACKET, 1):
        raise ServeError(f"the socket systemd passed (fd {fd}) is not a listening unix "
                         "SOCK_SEQPACKET socket: use ListenSequentialPacket= in sbus.socket")
    return socket.socket(fileno=fd)


def bind_listener(path: str, mode: int | None) -> socket.socket:
    """Bind and listen on *path*, replacing a stale socket file but never a live broker."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ServeError(f"{path} exists and is not a socket; not touching it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # stale: nobody is listening
        except OSError as exc:
            if exc.errno != errno.EPROTOTYPE:
                raise ServeError(f"cannot check {path}: {exc.strerror}") from exc
            raise ServeError(f"{path} is a socket of another kind in use; not touching it") \
                from exc
        else:
            raise ServeError(f"a broker is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(path)
        if mode is not None:
            os.chmod(path, mode)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {path}: {exc.strerror}") from exc
    return sock


#: Disconnects after which freed memory is handed back to the system.
TRIM_AFTER_DISCONNECTS = 100


def _give_back_memory(broker: Broker) -> None:
    """After many clients left: collect, and ask glibc to return free heap pages.

    Without it the broker's RSS keeps the high-water mark of the busiest moment
    (measured by the soak: 61 -> 79 MB over cycles with the same live objects,
    about 40 MB with the trim)."""
    gc.collect()
    broker.release_buffers()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to ask


def _watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


async def _report(broker: Broker) -> None:
    """Keep systemd's STATUS= current and feed its watchdog, if any."""
    interval = _watchdog_interval()
    period = min(interval, 2.0) if interval else 2.0
    last, last_t = broker.published, time.monotonic()
    trimmed_at = 0
    while True:
        await trio.sleep(period)
        if broker.disconnects - trimmed_at >= TRIM_AFTER_DISCONNECTS:
            trimmed_at = broker.disconnects
            _give_back_memory(broker)
        now = time.monotonic()
        rate = (broker.published - last) / (now - last_t)
        last, last_t = broker.published, now
        try:
            daemon.notify(f"STATUS={broker.status()}, {rate:.0f} msg/s"
                          + ("\nWATCHDOG=1" if interval else ""))
        except OSError as exc:  # e.g. out of descriptors: reporting must not stop the bus
            log.warning("cannot notify systemd: %s", exc)


async def _exit_when_idle(broker: Broker, idle: float, done: trio.CancelScope) -> None:
    """End the broker once no client has been connected for *idle* seconds.  Under socket
    activation systemd keeps the listening socket, and the next client's connect starts
    the broker again (a client arriving while it exits waits in the backlog meanwhile)."""
    while True:
        empty_since = broker.empty_since
        if empty_since is None:
            await trio.sleep(min(idle, 1.0))
            continue
        left = empty_since + idle - time.monotonic()
        if left > 0:
            await trio.sleep(min(left, 1.0))
            continue
        log.info("no client for %s s: exiting (the socket stays with whoever listens)",
                 f"{idle:g}")
        daemon.notify("STOPPING=1")
        done.cancel()
        return


async def run(
    address: str | None = None,
    *,
    mode: int | None = 0o666,
    sep: bytes = b"/",
    max_message: int = 256 * 1024,
    queue_limit: int = 4 * 1024 * 1024,
    limits: Limits | None = None,
    defaults: tuple | None = None,
    exit_idle: float | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until SIGTERM/SIGINT; remove the socket file if we created it."""
    listener = systemd_listener()
    created = None
    if listener is None:
        address = address or default_address()
        listener = bind_listener(address, mode)
        created = os.stat(address).st_ino
        where = address
    else:
        where = "the socket from systemd"
    broker = Broker(sep=sep, max_message=max_message, queue_limit=queue_limit, limits=limits,
                    **({"defaults": defaults} if defaults else {}))
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(broker.serve, listener)
                nursery.start_soon(_report, broker)
                if exit_idle is not None:
                    nursery.start_soon(_exit_when_idle, broker, exit_idle, nursery.cancel_scope)
                log.info("sbus broker listening on %s (pid %d)", where, os.getpid())
                # the modules and objects of start-up live as long as the broker: keep
                # them out of the collector's full passes (a pause of ~10 ms otherwise)
                gc.freeze()
                daemon.notify(f"READY=1\nSTATUS=listening, {broker.status()}")
                task_status.started(broker)
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    daemon.notify("STOPPING=1")
                    nursery.cancel_scope.cancel()
                    break
    finally:
        listener.close()
        if created is not None:
            with contextlib.suppress(OSError):
                if os.stat(address).st_ino == created:
                    os.unlink(address)
