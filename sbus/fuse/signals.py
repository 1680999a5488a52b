"""Has a caller got a signal waiting?  Read from ``/proc/PID/status``.

pyfuse3 does not pass FUSE interrupt requests on, so a process blocked in ``read(2)``
on the mount sits in uninterruptible sleep until the filesystem answers.  A waiting
operation therefore looks at the caller itself: a signal that is pending (for the
thread, ``SigPnd``, or for the whole process, ``ShdPnd``) and not blocked
(``SigBlk``) will be acted on as soon as the call returns, so the filesystem answers
EINTR.  Ignored signals are discarded by the kernel and never show as pending.

Stop signals left at their default action (``SIGSTOP``, and ``SIGTSTP``/``SIGTTIN``/
``SIGTTOU`` without a handler, i.e. not in ``SigCgt``) do not count: answering EINTR
would stop the process, and after ``fg`` its ``read(2)`` would fail with EINTR
(``cat: Interrupted system call``), because a filesystem cannot ask the kernel to
restart the call.  Such a reader stops when its next message arrives instead.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["unblocked_pending", "pending_from_status", "interrupted", "thread_group",
           "follows"]


STOP_SIGNALS = sum(1 << (s - 1) for s in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN,
                                          signal.SIGTTOU))


def pending_from_status(status: str) -> int:
    """The pending signals that should end a blocked call, from ``/proc/PID/status``."""
    fields = {}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigPnd", "ShdPnd", "SigBlk", "SigCgt"):
            fields[name] = int(value.strip(), 16)
    pending = (fields.get("SigPnd", 0) | fields.get("ShdPnd", 0)) & ~fields.get("SigBlk", 0)
    return pending & ~(STOP_SIGNALS & ~fields.get("SigCgt", 0))


def unblocked_pending(pid: int) -> int | None:
    """Bit ``n-1`` set for each pending, unblocked signal ``n``; None if *pid* is gone or
    a zombie (a thread group's leader that exited before its other threads: its
    pending signals are gone with it)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            status = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if "\nState:\tZ" in status or "\nState:\tX" in status:
        return None
    return pending_from_status(status)


#: The threads of a process whose opener is gone that `interrupted` looks at, at most.
THREADS_ASKED = 64
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


#: Seconds an answer of `_group_killed` is kept: listing a process's threads costs by
#: the thread (~1 ms for 2,400), and a process whose leader exited first can have
#: thousands (the audit of 2026-11-28: 2,400 threads blocked in reads, each read asking
#: 20 times a second, kept the mount at 100 % CPU).
GROUP_TTL = 0.5
#: Answers kept at most (then all are forgotten).
GROUPS_KEPT = 4096
_groups: dict[int, tuple[float, bool]] = {}


def _group_killed(tgid: int) -> bool:
    """Whether the threads of process *tgid* are being killed (``exit_group``, a fatal
    signal: each thread has SIGKILL pending), looking at up to `THREADS_ASKED`; known
    for `GROUP_TTL` seconds once asked."""
    now = time.monotonic()
    known = _groups.get(tgid)
    if known is not None and now - known[0] < GROUP_TTL:
        return known[1]
    killed = False
    try:
        with os.scandir(f"/proc/{tgid}/task") as tids:
            for n, entry in enumerate(tids):
                if n >= THREADS_ASKED:
                    break
                if entry.name.isdigit() and int(entry.name) != tgid:
                    mask = unblocked_pending(int(entry.name))
                    if mask is not None:
                        killed = bool(mask & SIGKILL_BIT)
                        break
    except OSError:
        pass
    if len(_groups) >= GROUPS_KEPT:
        _groups.clear()
    _groups[tgid] = (now, killed)
    return killed


def thread_group(pid: int) -> int:
    """The process (thread group) a thread id belongs to; *pid* itself if unknown."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:  # bytes: half the cost of text
            status = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return pid
    at = status.find(b"\nTgid:")
    try:
        return int(status[at + 6:status.index(b"\n", at + 6)]) if at >= 0 else pid
    except ValueError:
        return pid


def interrupted(pid: int, tgid: int | None = None) -> bool:
    """True if the caller (thread *pid* of process *tgid*) has a signal to act on.

    The thread that opened a file may have exited while another thread of its
    process, or a process that inherited the descriptor, reads on; then the process
    is asked, and if it is gone too, nobody can be asked and the answer is False
    (waiting on is safer than answering EINTR forever)."""
    if pid <= 0:
        return False  # the kernel itself (e.g. writeback): nobody to interrupt
    mask = unblocked_pending(pid)
    group = pid if tgid is None else tgid
    if mask is None and group != pid:
        mask = unblocked_pending(group)
    if mask is None:  # the opener and its process's leader are gone: a thread reading on
        return _group_killed(group)  # dies with its process, or waits on
    return bool(mask)


def follows(pid: int) -> bool:
    """True if process *pid* is ``tail`` following its files (``-f``, ``-F``,
    ``--follow``): it reads to end of file, then waits for the size to grow, so
    the mount gives it end of file instead of a read that blocks."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).split(b"\0")
    except OSError:
        return False
    if not argv or argv[0].rsplit(b"/", 1)[-1] != b"tail":
        return False
    for arg in argv[1:]:
        if arg == b"--":
            break
        if arg.startswith(b"--follow"):
            return True
        if arg.startswith(b"-") and not arg.startswith(b"--"):
            for c in arg[1:]:
                if c in b"fF":
                    return True
                if chr(c).isdigit():
                    break
    return False
