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
import stat
import sys

import trio

from .. import rlimits
from ..defaults import MAX_MESSAGE, default_address, size_arg
from ..errors import SbusError
from ..fuse.framing import FORMATS
from ..fuse.shares import UserShare
from ..sdnotify import Reporter

log = logging.getLogger("sbus.fuse")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing, empty directory")
    p.add_argument("--daemon", action="store_true",
                   help="detach once mounted (logs go to the journal, else syslog, else "
                        "$XDG_STATE_HOME/sbus/mount.log, as it says)")
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
                   help="concurrent filesystem requests (default 1000); with --allow-other "
                        "each user may hold at most half of what the others leave "
                        "free in waiting reads, opens and writes")
    p.add_argument("--user-readers", type=int, default=UserShare.readers, metavar="N",
                   help="files one user may hold open for reading, each a broker "
                        f"connection (default {UserShare.readers}); more fail with EMFILE")
    p.add_argument("--user-queue", type=size_arg, default=UserShare.queued, metavar="BYTES",
                   help="messages waiting in the mount for one user's readers, all "
                        f"together (default {UserShare.queued >> 20}m); beyond, its "
                        "readers stop taking from the broker, whose flood policy applies")
    p.add_argument("--user-inodes", type=int, default=UserShare.inodes, metavar="N",
                   help="names one user's lookups may make the mount hold until the "
                        f"kernel forgets them (default {UserShare.inodes}); more fail "
                        "with EDQUOT")


#: Unmounting waits this long for the files still open to be closed (`BusFS.drain`).
CLOSE_GRACE = 2.0

#: The smallest value each numeric option takes (option, least, unit said after it).
_LEAST = (("remember", 1, ""), ("max_tasks", 2, ""), ("max_message", 16, " bytes"),
          ("user_readers", 1, ""), ("user_inodes", 1, ""), ("user_queue", 1, " byte"))


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _system_log_handler(syslog: str = "/dev/log",
                        journal: str = "/run/systemd/journal/socket") -> logging.Handler:
    """Where a backgrounded mount logs: the journal with structured fields when journald
    runs and the 'systemd' extra (python-systemd) is installed, else syslog's socket
    (which journald also reads), else a file, said on stderr before it is /dev/null."""
    if _is_socket(journal):
        try:
            from systemd.journal import JournalHandler
        except ImportError:
            pass
        else:
            return JournalHandler(SYSLOG_IDENTIFIER="sbus-mount")
    if _is_socket(syslog):
        handler: logging.Handler = logging.handlers.SysLogHandler(syslog)
        handler.setFormatter(logging.Formatter("sbus-mount[%(process)d]: %(message)s"))
        return handler
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    path = os.path.join(state, "sbus", "mount.log")
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        handler = logging.FileHandler(path)
    except OSError as exc:
        raise SbusError(f"--daemon: neither journald nor {syslog} here, and cannot log to "
                        f"{path}: {exc.strerror}") from None
    handler.setFormatter(logging.Formatter("%(asctime)s sbus-mount[%(process)d]: %(message)s"))
    print(f"sbus mount: neither journald nor {syslog} here: logging to {path}",
          file=sys.stderr, flush=True)
    return handler


def _daemonize(handler: logging.Handler) -> None:
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
    root.addHandler(handler)
    if root.level > logging.INFO:
        root.setLevel(logging.INFO)


async def _serve(fs, max_tasks: int) -> None:
    import pyfuse3

    notify = Reporter(log)  # systemd (a ``Type=notify`` unit); a no-op elsewhere
    async with trio.open_nursery() as nursery:
        try:
            await fs.start(nursery)
        except OSError as exc:
            raise SbusError(f"cannot connect to the sbus broker at {fs.address}: "
                            f"{exc.strerror or exc}") from None
        nursery.start_soon(_on_signals, fs, notify)
        log.info("bus at %s mounted (pid %d)", fs.address, os.getpid())
        notify(f"READY=1\nSTATUS=bus at {fs.address} mounted")
        await pyfuse3.main(min_tasks=2, max_tasks=max_tasks)
        log.info("unmounted")
        nursery.cancel_scope.cancel()


async def _on_signals(fs, notify: Reporter) -> None:
    import pyfuse3

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("%s: unmounting", signal.Signals(signum).name)
            notify("STOPPING=1")
            fs.shutdown()
            left = await fs.drain(CLOSE_GRACE)
            if left:
                log.info("%d file(s) still open after %g s: unmounting anyway (their "
                         "close() fails)", left, CLOSE_GRACE)
            pyfuse3.terminate()
            return


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    import pyfuse3  # a missing 'fuse' extra is reported by sbus.cli

    from ..client import Client
    from ..fuse.operations import BusFS

    mountpoint = os.path.abspath(args.mountpoint)
    if not os.path.isdir(mountpoint):
        raise SbusError(f"mount point {args.mountpoint} is not a directory")
    if os.path.ismount(mountpoint) and os.path.realpath(mountpoint) != "/":
        with open("/proc/self/mounts") as f:
            if any(line.split()[1] == mountpoint and "fuse.sbus" in line.split()[2]
                   for line in f):
                raise SbusError(f"{mountpoint} is already an sbus mount")
    for option, least, unit in _LEAST:
        if getattr(args, option) < least:
            raise SbusError(f"--{option.replace('_', '-')} must be at least {least}{unit}")
    if args.reconnect_timeout < 0:
        raise SbusError("--reconnect-timeout cannot be negative")
    address = os.path.abspath(args.address or default_address())
    Client(address, timeout=5).close()  # a clear error before anything is mounted
    fs = BusFS(address, fmt=args.format, remember=args.remember,
               remember_bytes=args.remember_bytes,
               max_message=args.max_message, reconnect_timeout=args.reconnect_timeout,
               mountpoint=mountpoint, max_tasks=args.max_tasks,
               allow_other=args.allow_other,
               share=UserShare(readers=args.user_readers, queued=args.user_queue,
                               inodes=args.user_inodes))
    log_handler = _system_log_handler() if args.daemon else None  # said before mounting
    options = set(pyfuse3.default_options) | {"fsname=sbus", "subtype=sbus"}
    if args.allow_other:
        options.add("allow_other")
    try:
        pyfuse3.init(fs, mountpoint, options)
    except RuntimeError as exc:
        raise SbusError(f"cannot mount on {mountpoint}: {exc} (is /dev/fuse usable? "
                        "is fusermount3 installed?)") from None
    if log_handler is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        _daemonize(log_handler)
    try:
        trio.run(_serve, fs, args.max_tasks)
    finally:
        pyfuse3.close(unmount=True)
    return 0
