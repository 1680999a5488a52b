"""``sbus mount MOUNTPOINT``: show the bus as files (see docs/fuse.md).

Runs in the foreground until SIGTERM/SIGINT/SIGHUP or ``fusermount3 -u``, and
unmounts on the way out.  ``--daemon`` mounts, then detaches: the command returns
once the mount is usable.
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import signal
import sys

import trio

from .. import rlimits
from ..defaults import MAX_MESSAGE, default_address, size_arg
from ..errors import SbusError
from ..sdnotify import notify
from .framing import FORMATS

log = logging.getLogger("sbus.fuse")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing, empty directory")
    p.add_argument("--daemon", action="store_true",
                   help="detach once mounted (logs go to the journal)")
    p.add_argument("--format", choices=FORMATS, default="lines",
                   help="what reading a file gives: payloads each ending in a newline "
                        "(lines, default), payloads verbatim one per read (raw), or one "
                        "JSON object per message with key, payload and time (jsonl)")
    p.add_argument("--remember", type=int, default=10000, metavar="N",
                   help="live keys remembered for directory listings (default 10000)")
    p.add_argument("--remember-bytes", type=size_arg, default=16 << 20, metavar="BYTES",
                   help="memory for remembered keys at most (default 16m); the least "
                        "recently seen are forgotten first")
    p.add_argument("--max-message", type=size_arg, default=MAX_MESSAGE, metavar="BYTES",
                   help="the broker's packet limit: larger writes fail with EMSGSIZE "
                        "(default 256k, as 'sbus serve')")
    p.add_argument("--reconnect-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long to keep re-subscribing after losing the broker before "
                        "readers get EIO (default 30)")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users use the mount (FUSE allow_other; non-root needs "
                        "user_allow_other in /etc/fuse.conf)")
    p.add_argument("--max-tasks", type=int, default=1000, metavar="N",
                   help="concurrent filesystem requests, i.e. blocked readers plus one "
                        "(default 1000)")


def _system_log_handler(syslog: str = "/dev/log") -> logging.Handler:
    """Where a backgrounded mount logs: the journal with structured fields when the
    'systemd' extra (python-systemd) is installed, else syslog's socket, which journald
    also reads on a systemd machine; stderr is /dev/null by then."""
    try:
        from systemd.journal import JournalHandler
    except ImportError:
        pass
    else:
        return JournalHandler(SYSLOG_IDENTIFIER="sbus-mount")
    if os.path.exists(syslog):
        handler = logging.handlers.SysLogHandler(syslog)
        handler.setFormatter(logging.Formatter("sbus-mount[%(process)d]: %(message)s"))
        return handler
    return logging.NullHandler()


def _daemonize() -> None:
    """Detach from the terminal; the parent returns once the mount exists."""
    pid = os.fork()
    if pid:
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    os.chdir("/")  # do not keep the caller's directory busy
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(_system_log_handler())
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)


def _notify(state: str) -> None:
    """Tell systemd (a ``Type=notify`` unit) how the mount is doing; no-op elsewhere."""
    try:
        notify(state)
    except OSError as exc:
        log.warning("cannot notify systemd: %s", exc)


async def _serve(fs, max_tasks: int) -> None:
    import pyfuse3

    async with trio.open_nursery() as nursery:
        try:
            await fs.start(nursery)
        except OSError as exc:
            raise SbusError(f"cannot connect to the sbus broker at {fs.address}: "
                            f"{exc.strerror or exc}") from None
        nursery.start_soon(_on_signals, fs)
        log.info("bus at %s mounted (pid %d)", fs.address, os.getpid())
        _notify(f"READY=1\nSTATUS=bus at {fs.address} mounted")
        await pyfuse3.main(min_tasks=2, max_tasks=max_tasks)
        log.info("unmounted")
        nursery.cancel_scope.cancel()


async def _on_signals(fs) -> None:
    import pyfuse3

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            _notify("STOPPING=1")
            fs.shutdown()
            pyfuse3.terminate()
            return


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    import pyfuse3  # a missing 'fuse' extra is reported by sbus.cli

    from ..client import Client
    from .operations import BusFS

    mountpoint = os.path.abspath(args.mountpoint)
    if not os.path.isdir(mountpoint):
        raise SbusError(f"mount point {args.mountpoint} is not a directory")
    if os.path.ismount(mountpoint) and os.path.realpath(mountpoint) != "/":
        with open("/proc/self/mounts") as f:
            if any(line.split()[1] == mountpoint and "fuse.sbus" in line.split()[2]
                   for line in f):
                raise SbusError(f"{mountpoint} is already an sbus mount")
    if args.remember < 1:
        raise SbusError("--remember must be at least 1")
    if args.max_tasks < 2:
        raise SbusError("--max-tasks must be at least 2")
    if args.max_message < 16:
        raise SbusError("--max-message must be at least 16 bytes")
    if args.reconnect_timeout < 0:
        raise SbusError("--reconnect-timeout cannot be negative")
    address = os.path.abspath(args.address or default_address())
    Client(address, timeout=5).close()  # a clear error before anything is mounted
    fs = BusFS(address, fmt=args.format, remember=args.remember,
               remember_bytes=args.remember_bytes,
               max_message=args.max_message, reconnect_timeout=args.reconnect_timeout,
               mountpoint=mountpoint)
    options = set(pyfuse3.default_options) | {"fsname=sbus", "subtype=sbus"}
    if args.allow_other:
        options.add("allow_other")
    try:
        pyfuse3.init(fs, mountpoint, options)
    except RuntimeError as exc:
        raise SbusError(f"cannot mount on {mountpoint}: {exc} (is /dev/fuse usable? "
                        "is fusermount3 installed?)") from None
    if args.daemon:
        sys.stdout.flush()
        sys.stderr.flush()
        _daemonize()
    try:
        trio.run(_serve, fs, args.max_tasks)
    finally:
        pyfuse3.close(unmount=True)
    return 0
