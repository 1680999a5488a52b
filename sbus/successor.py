"""Make-before-break restarts: the next broker starts, imports and gets ready while this
one still serves; only then does this one stop reading and hand its clients over.

An ordinary restart (SIGUSR2's re-exec, ``systemctl restart``) stops serving first and
then waits for the new process to import Python (~80 ms on this machine kind) before
anyone is served again.  SIGHUP (``systemctl reload sbus.service``) moves that wait to
before the pause:

1. the broker spawns its successor with the listener and one end of a socket pair, and
   goes on serving;
2. the successor builds its broker, then writes one byte ("ready") on the pair and waits
   for the hand-over on it;
3. the pair's readable end wakes the old broker's loop (it is watched like the signal
   wake-up descriptor); between two rounds the old broker hands over (sbus/handover.py)
   and sends the snapshot and the carrier of client sockets over the pair;
4. under systemd the old broker names the successor the service's main process
   (``MAINPID=``, confirmed with ``BARRIER=1``) and exits; the successor serves.

If the successor fails before it is ready, the old broker says so and serves on.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys

from . import sdnotify

log = logging.getLogger("sbus.server")

__all__ = ["Successor", "inherited_listener", "await_hand_over", "READY_SIGNAL"]

#: Environment names that tell a starting broker it is a successor, and where its fds are.
HANDOVER_FD_ENV = "SBUS_SUCCESSOR_PAIR_FD"
LISTENER_FD_ENV = "SBUS_SUCCESSOR_LISTENER_FD"
PARENT_ENV = "SBUS_SUCCESSOR_PARENT"
#: The signal by which a successor wakes its predecessor's loop when it is ready.
READY_SIGNAL = signal.SIGUSR1
#: Seconds the successor waits for the hand-over after saying it is ready.
HAND_OVER_TIMEOUT = 30.0
#: Bytes of the message that carries the hand-over's descriptors and their names.
_NAMES_BYTES = 4096


class Successor:
    """The next broker, started while this one serves (step 1 of the module docstring)."""

    def __init__(self, listener: socket.socket, env: dict[str, str],
                 signals: tuple[signal.Signals, ...] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pair = ours
        lfd = listener.fileno()
        child_env = {**os.environ, **env, HANDOVER_FD_ENV: str(theirs.fileno()),
                     LISTENER_FD_ENV: str(lfd), PARENT_ENV: str(os.getpid())}
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            child_env.pop(name, None)
        # started with the broker's signals blocked (the mask is inherited; its `run`
        # unblocks them once its handlers are in place): a SIGTERM or SIGHUP meeting it
        # before then ended it with the default action, and the clients with it
        held = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            self.proc = subprocess.Popen([sys.executable, *sys.orig_argv[1:]],
                                         pass_fds=(theirs.fileno(), lfd), env=child_env,
                                         stdin=subprocess.DEVNULL)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            theirs.close()
        self.pair.setblocking(False)
        log.info("reload: started the next broker (pid %d); serving until it is ready",
                 self.proc.pid)

    def fileno(self) -> int:
        return self.pair.fileno()

    def gone(self) -> bool:
        """Whether it ended before saying it is ready (then said, and reaped): a dead
        successor must not hold off every later reload."""
        if self.proc.poll() is None:
            return False
        self._ended(self.proc.returncode)
        return True

    def _ended(self, code: int) -> None:
        log.warning("reload: the next broker exited (status %s) before it was ready; "
                    "serving on", code)
        self.pair.close()

    def ready(self) -> bool:
        """Whether the successor said it is ready (False: it failed, and was reaped)."""
        try:
            said = self.pair.recv(1)
        except BlockingIOError:
            return False
        except OSError:
            said = b""
        if said == b"r":
            return True
        self._ended(self.proc.wait())
        return False

    def hand_over(self, passed: list[tuple[str, int]]) -> None:
        """Send the hand-over (``(name, fd)``, closed here after)."""
        names = ":".join(name for name, _ in passed).encode()
        try:
            self.pair.setblocking(True)
            socket.send_fds(self.pair, [names], [fd for _, fd in passed])
        finally:
            for _, fd in passed:
                os.close(fd)
            self.pair.close()

    def name_main_process(self) -> None:
        """Under systemd, make the successor the service's main process (sent before the
        hand-over, so its own notifications come after; `confirm` before exiting)."""
        sdnotify.notify(f"MAINPID={self.proc.pid}")

    @staticmethod
    def confirm() -> None:
        """Wait until systemd took `name_main_process` in, so this process's exit is not
        taken for the service's end."""
        sdnotify.barrier()

    def abandon(self) -> None:
        """End a successor that is not wanted any more (this broker is stopping).  It
        serves nobody yet, and holds its signals until it would (`run`): a SIGTERM would
        wait out its wait for the hand-over, so it is killed."""
        self.proc.kill()
        self.proc.wait()
        self.pair.close()


def inherited_listener() -> socket.socket | None:
    """In a successor: the listener its predecessor passed; None in any other broker."""
    lfd = os.environ.pop(LISTENER_FD_ENV, None)
    if lfd is None or HANDOVER_FD_ENV not in os.environ:
        return None
    os.set_inheritable(int(lfd), False)
    return socket.socket(fileno=int(lfd))


def await_hand_over() -> dict[str, int]:
    """In a successor whose broker is built (step 2): say "ready", wake the predecessor,
    and return its hand-over by name.  An empty one (the predecessor died first, or sent
    something damaged: said in the log) leaves this broker to serve the listener alone."""
    pair_fd = int(os.environ.pop(HANDOVER_FD_ENV))
    parent = int(os.environ.pop(PARENT_ENV, "0"))
    os.set_inheritable(pair_fd, False)
    with socket.socket(fileno=pair_fd) as pair:
        pair.send(b"r")
        if parent and os.getppid() == parent:  # never signal whoever adopted us
            os.kill(parent, READY_SIGNAL)
        # poll, not select: the pair's number is the predecessor's, above 1023 with a
        # thousand clients (select raised, after the predecessor had handed over)
        poller = select.poll()
        poller.register(pair, select.POLLIN)
        if not poller.poll(HAND_OVER_TIMEOUT * 1000):
            log.warning("reload: no hand-over from the previous broker in %g s; serving "
                        "its listener alone", HAND_OVER_TIMEOUT)
            return {}
        try:
            msg, fds, _, _ = socket.recv_fds(pair, _NAMES_BYTES, 2, socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            log.warning("reload: the hand-over failed (%s); serving alone", exc)
            return {}
    names = msg.decode("ascii", "replace").split(":") if msg else []
    if len(names) != len(fds):
        for fd in fds:
            os.close(fd)
        log.warning("reload: a damaged hand-over (%d names for %d descriptors); serving "
                    "alone", len(names), len(fds))
        return {}
    return dict(zip(names, fds, strict=True))
