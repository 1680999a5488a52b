"""The two halves of systemd's service protocol that sbus uses, without a C extension:
`notify` (sd_notify(3): a datagram to ``$NOTIFY_SOCKET``, file descriptors attached
with ``SCM_RIGHTS`` for ``FDSTORE=1``) and `listen_fds` (sd_listen_fds(3): descriptors
from 3 on, named by ``LISTEN_FDNAMES``).  Both are documented, stable and small; the
handover of clients across restarts needs fds in notify messages, and a pure-Python
version keeps the core install free of a compiler."""

from __future__ import annotations

import array
import logging
import os
import select
import socket
from collections.abc import Sequence

__all__ = ["notify", "Reporter", "barrier", "listen_fds", "LISTEN_FDS_START", "NOTIFY_WAIT"]

LISTEN_FDS_START = 3


#: The longest a message to the manager may wait for room in its socket (seconds): a
#: manager that has not read in that time is not reading, and a broker handing its
#: clients over at a stop must not wait for it without end.
NOTIFY_WAIT = 5.0


def notify(state: str, fds: Sequence[int] = (), timeout: float = NOTIFY_WAIT) -> bool:
    """Send *state* (``READY=1``, ``STATUS=…``, ``FDSTORE=1\\nFDNAME=x``…) to the service
    manager, with *fds* attached; False when not run by one.  Raises `OSError` when it
    cannot be sent: `TimeoutError` when the manager's socket stays full for *timeout*
    seconds (0: `BlockingIOError` at once)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.connect(path)
        s.settimeout(timeout)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        s.sendmsg([state.encode()], rights if fds else [])
    return True


class Reporter:
    """`notify` for what a service only reports (``READY=1``, ``STATUS=``, ``STOPPING=1``,
    ``WATCHDOG=1``): it must never wait for the manager nor end for it.  A socket nobody
    drains costs the line (counted in `skipped`); a manager gone or never there
    (``NOTIFY_SOCKET`` naming nothing) or no descriptor to send with costs it too.  Each
    such spell is said once on *log*, and serving goes on."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.skipped = 0  # lines not sent
        self._said: type[OSError] | None = None  # the failure of this spell, said

    def __call__(self, state: str) -> bool:
        """Send *state*; False when it was not (no manager, or a failure above)."""
        try:
            sent = notify(state, timeout=0)
        except OSError as exc:
            self.skipped += 1
            if type(exc) is not self._said:
                self._said = type(exc)
                if isinstance(exc, BlockingIOError):
                    self.log.warning("the service manager does not read its notify "
                                     "socket: status lines are skipped until it does")
                else:
                    self.log.warning("cannot notify the service manager at "
                                     "$NOTIFY_SOCKET: %s", exc.strerror or exc)
            return False
        self._said = None
        return sent


def barrier(timeout: float = 5.0) -> bool:
    """Wait until the manager has processed every message sent before (``BARRIER=1``: it
    closes the pipe end we send once it got there); False when not run by one, or when
    it did not answer in *timeout* seconds."""
    r, w = os.pipe()
    try:
        sent = notify("BARRIER=1", [w])
        os.close(w)
        w = -1
        if not sent:
            return False
        return bool(select.select([r], [], [], timeout)[0])
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def listen_fds(unset: bool = True) -> list[tuple[int, str]]:
    """The descriptors passed to this process, with their names (``unknown`` if unnamed),
    marked close-on-exec; [] when none were passed to *this* process."""
    try:
        if int(os.environ.get("LISTEN_PID", "")) != os.getpid():
            return []
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    if unset:
        for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(var, None)
    out = []
    for i in range(count):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        out.append((fd, names[i] if i < len(names) and names[i] else "unknown"))
    return out
