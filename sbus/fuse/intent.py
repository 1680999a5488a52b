"""Which open call is an unknown name looked up for?  Asked of ``/proc``.

The kernel looks a path up one component at a time without saying whether the name is
the last one, and the answer fixes its type.  To let ``echo hi > MNT/a/b/c`` publish
and ``cat MNT/a/*/c`` subscribe on a fresh bus, a lookup miss asks the caller itself:
while the kernel waits for the answer, the calling thread (the request's pid is its
thread id) sits in its system call, so ``/proc/TID/syscall`` names the call and its
arguments and ``/proc/TID/mem`` holds the path.  If the call is an open (``creat``,
``open``, ``openat``, ``openat2``) whose path leads through the name, the caller
(`sbus.fuse.operations`) answers: a directory when the path goes on below it (an
implicit ``mkdir -p``), the file itself when it is the last name of an open for
reading (a subscription).

Everything else (another call, ``..`` in the path, a path outside the mount as we see
it, an unreadable ``/proc`` entry: reading another process's syscall and memory needs
ptrace rights) answers "no", which leaves the name unknown (ENOENT).

The parsing and the decision are pure (`parse_syscall`, `absolute`, `names_below`);
`opening` is the thin I/O shell, reading the path a page at a time and never a byte
past its NUL (the next page could be one that never arrives).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

__all__ = ["Call", "SYSCALLS", "parse_syscall", "absolute", "components", "continues_below",
           "creating", "opening", "Opening", "names_below", "PATH_MAX"]

PATH_MAX = 4096
PAGE = os.sysconf("SC_PAGE_SIZE")
AT_FDCWD = -100
#: System call numbers of the calls that can create a file, per machine.
SYSCALLS: dict[str, dict[int, str]] = {
    "x86_64": {2: "open", 85: "creat", 257: "openat", 437: "openat2"},
    "aarch64": {56: "openat", 437: "openat2"},
}


@dataclass(frozen=True)
class Call:
    """An open call in progress.  *flags* is None for ``openat2`` (they live in its
    ``struct open_how`` at *how*); *dirfd* is None for the current directory."""

    path: int  # address of the path string in the caller's memory
    dirfd: int | None
    flags: int | None
    how: int = 0


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value & 0x80000000 else value


def parse_syscall(line: str, machine: str | None = None) -> Call | None:
    """The open call in a ``/proc/TID/syscall`` line, or None if it is not one.

    The line is ``NR ARG1 … ARG6 SP PC`` (arguments in hex) while the thread is in a
    call, ``-1 SP PC`` outside one, or ``running``."""
    fields = line.split()
    names = SYSCALLS.get(machine or platform.machine(), {})
    try:
        name = names.get(int(fields[0]))
        if name is None or len(fields) < 7:
            return None
        args = [int(a, 16) for a in fields[1:7]]
    except (ValueError, IndexError):
        return None
    if name == "creat":
        return Call(args[0], None, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
    if name == "open":
        return Call(args[0], None, args[1])
    dirfd = _signed32(args[0])
    dirfd_or_cwd = None if dirfd == AT_FDCWD else dirfd
    if name == "openat":
        return Call(args[1], dirfd_or_cwd, args[2])
    return Call(args[1], dirfd_or_cwd, None, how=args[2])  # openat2


def absolute(path: bytes, base: bytes, root: bytes = b"/") -> bytes:
    """*path* as seen from here: relative ones below *base* (the caller's current or
    ``dirfd`` directory), absolute ones below the caller's *root*."""
    if path.startswith(b"/"):
        return root.rstrip(b"/") + path
    return base.rstrip(b"/") + b"/" + path


def components(path: bytes) -> tuple[bytes, ...] | None:
    """The names of an absolute path, or None if ``..`` makes it ambiguous (it may
    climb out of a symlink)."""
    names = tuple(n for n in path.split(b"/") if n not in (b"", b"."))
    return None if b".." in names else names


def continues_below(path: bytes, mountpoints: tuple[bytes, ...], parent: tuple[bytes, ...],
                    name: bytes) -> bool:
    """True if the absolute *path* leads through ``parent/name`` of the mount (at one of
    its *mountpoints*, as given and resolved) to something below it."""
    return (names_below(path, mountpoints, parent, name) or 0) > 0


def names_below(path: bytes, mountpoints: tuple[bytes, ...], parent: tuple[bytes, ...],
                name: bytes) -> int | None:
    """How many names the absolute *path* goes on with after ``parent/name`` of the
    mount (0: the name is the last one), or None if it does not lead through it."""
    names = components(path)
    if names is None:
        return None
    here = parent + (name,)
    for mp in mountpoints:
        mount = components(mp)
        if mount is None or names[:len(mount)] != mount:
            continue
        rel = names[len(mount):]
        if len(rel) >= len(here) and rel[:len(here)] == here:
            return len(rel) - len(here)
    return None


def _read(path: str, size: int = 512) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read(size)


def _read_mem(tid: int, address: int, size: int) -> bytes:
    fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY)
    try:
        return os.pread(fd, size, address)
    finally:
        os.close(fd)


def _read_string(tid: int, address: int, limit: int = PATH_MAX) -> bytes | None:
    """The NUL-terminated string at *address*, read a page at a time so that not one
    byte past its end is touched: the page after it may be one that never arrives (a
    file mapped from a slow or dead filesystem) and would pin the reading thread."""
    fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY)
    try:
        got = b""
        while len(got) < limit:
            chunk = os.pread(fd, PAGE - (address % PAGE), address)
            if not chunk:
                return None
            end = chunk.find(b"\0")
            if end >= 0:
                got += chunk[:end]
                return got if 0 < len(got) <= limit else None
            got += chunk
            address += len(chunk)
        return None  # longer than PATH_MAX
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Opening:
    """An open call in progress: the absolute path (as seen here) and its flags."""

    path: bytes
    flags: int


def opening(tid: int) -> Opening | None:
    """The open call thread *tid* is blocked in on us right now, or None: not an open
    call, or unreadable.

    Blocking: reading another process's memory takes its memory-map lock, which a
    sibling thread could hold while waiting on this very mount; call this from a
    worker thread with a time limit."""
    if tid <= 0:
        return None  # the kernel itself, or a caller outside our pid namespace
    try:
        call = parse_syscall(_read(f"/proc/{tid}/syscall").decode("ascii", "replace"))
        if call is None:
            return None
        flags = call.flags
        if flags is None:  # openat2: struct open_how begins with u64 flags
            raw = _read_mem(tid, call.how, 8)
            if len(raw) < 8:
                return None
            flags = int.from_bytes(raw, sys.byteorder)
        path = _read_string(tid, call.path)
        if path is None:
            return None  # empty, unreadable or longer than PATH_MAX
        if path.startswith(b"/"):
            full = absolute(path, b"", os.fsencode(os.readlink(f"/proc/{tid}/root")))
        else:
            where = "cwd" if call.dirfd is None else f"fd/{call.dirfd}"
            full = absolute(path, os.fsencode(os.readlink(f"/proc/{tid}/{where}")))
        return Opening(full, flags)
    except (OSError, ValueError, OverflowError):
        return None


def creating(tid: int) -> bytes | None:
    """The absolute path of the file thread *tid* is creating (an open call with
    ``O_CREAT``) right now, or None."""
    found = opening(tid)
    return found.path if found is not None and found.flags & os.O_CREAT else None
