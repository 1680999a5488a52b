"""Descriptor limits of long-running processes: every client is a file descriptor.

A process started from a login shell keeps the soft ``RLIMIT_NOFILE`` of 1024 although
the hard limit is usually far higher; the broker's default per-user connection limit
was 1024 too, so one user could take every descriptor it had.  Each long-running
command calls `raise_descriptor_limit` first thing, and the broker's default per-user
connection limit is a share of the result (`connections_per_user_for`): it takes
`USER_SHARE` users together to leave none for anyone else, and root is exempt.
"""

from __future__ import annotations

import resource

from .limits import Limits

__all__ = ["raise_descriptor_limit", "connections_per_user_for", "RESERVED_DESCRIPTORS",
           "USER_SHARE"]

#: Descriptors a long-running process keeps for itself beyond its clients' (listener,
#: epoll, signal wake-up, the spare for refusals, log and journal files, a hand-over).
RESERVED_DESCRIPTORS = 64
#: One user's connections may hold at most 1/USER_SHARE of the descriptors by default:
#: it takes that many users together to leave none for anyone else.
USER_SHARE = 8
#: Descriptors assumed where the limit is "unlimited" (Linux's default ``fs.nr_open``).
KERNEL_CAP = 1 << 20


def raise_descriptor_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (every client is a descriptor,
    and a shell's soft 1024 is one user's share at most); returns the soft limit now.
    Every long-running command calls it first thing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = KERNEL_CAP  # what the kernel lets any process have (fs.nr_open's default)
    if soft == resource.RLIM_INFINITY:
        return KERNEL_CAP
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # above what the kernel allows: keep the soft one
            pass
    return soft

def connections_per_user_for(descriptors: int) -> int:
    """The default per-user connection limit of a process with *descriptors*: a
    `USER_SHARE` of what is left after `RESERVED_DESCRIPTORS`, and never more than
    `Limits.connections_per_user` (the per-user memory budget counts on it)."""
    share = (descriptors - RESERVED_DESCRIPTORS) // USER_SHARE
    return max(1, min(Limits.connections_per_user, share))
