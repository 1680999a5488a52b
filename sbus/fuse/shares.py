"""What each local user may make the mount hold, and fair shares of its request pool.
Pure.

`UserShare` is the one place for the per-user bounds (docs/fuse.md, "Limits"); the
rest of this module shares the request pool.

pyfuse3 serves every request in one of at most ``--max-tasks`` tasks and answers a
request only when its handler returns, so a handler that waits (a ``read`` until a
message comes, an ``open`` until the broker confirms its subscription, a ``write``
while the broker pushes back) holds a task.  Without shares, one user's blocked reads
take every task and nobody else's ``open`` or ``write`` is even read from
``/dev/fuse``.

A waiting request takes a *slot* first.  A few tasks (`reserve`) never wait, so
requests that answer at once always find one; of the rest, a user may hold at most
half of what the *other* users leave free.  One user alone gets half the pool, two
get a third each and leave a third, and so on: however many users block, each new
one still finds room.  A request that finds no slot fails at once with EAGAIN
("Resource temporarily unavailable") instead of waiting.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Shares", "UserShare", "Account", "Accounts"]


@dataclass(frozen=True)
class UserShare:
    """What one local user (UID) may make the mount hold.  With ``--allow-other`` the
    mount carries every user over its own broker connections, charged by the broker
    to the mount's UID (root is exempt from the broker's per-user limits), so the
    mount itself must keep each user to a share."""

    #: Files open at all (about 500 bytes each).  Beyond: EMFILE at open.
    files: int = 4096
    #: Files open for reading: each is a broker connection with one subscription
    #: (its pattern at most PATH_MAX bytes).  Beyond: EMFILE at open.
    readers: int = 32
    #: Bytes of messages waiting in the mount for a user's readers, all together.
    #: Beyond, its readers stop taking messages from the broker, whose flood policy
    #: then applies (the drops are logged); each reader may overshoot by one packet.
    queued: int = 16 << 20
    #: Bytes written to files not yet closed (published at close).  Beyond: ENOBUFS.
    pending: int = 32 << 20
    #: Bytes of directories made with mkdir (by `mapping.key_cost`).  Beyond: EDQUOT.
    dirs: int = 1 << 20
    #: Bytes of keys remembered because the user created them (``: > key``) rather
    #: than because they were seen on the bus; beyond, its own oldest are forgotten.
    created: int = 2 << 20
    #: Entries of directory listings held for the user's open directories (each
    #: ``opendir`` keeps its listing, about 70 bytes an entry, until closed).
    #: Beyond: EMFILE at opendir.
    listed: int = 1 << 18
    #: Inodes (names the kernel holds) the user's lookups made, until the kernel
    #: forgets them.  Beyond: EDQUOT for a new name.
    inodes: int = 1 << 16
    #: Bytes those inodes hold here (`operations.inode_cost`: about 500 each, and 8
    #: more per name in the path, so a walk down ``*/*/…`` pays for its depth).
    #: Beyond: EDQUOT for a new name.
    inode_bytes: int = 32 << 20
    #: Threads reading the user's callers' open calls and command lines in /proc at
    #: once (each may be stuck for good in a caller's memory, see `BusFS._ask_caller`).
    intent_threads: int = 2


@dataclass(eq=False)
class Account:
    """What one user holds now, against its `UserShare`."""

    readers: int = 0
    queued: int = 0
    paused: set = field(default_factory=set)  # its readers waiting for room


class Accounts:
    """Per-user `Account`s, dropped once they hold nothing."""

    def __init__(self, share: UserShare) -> None:
        self.share = share
        self._of: dict[int, Account] = {}

    def __getitem__(self, uid: int) -> Account:
        a = self._of.get(uid)
        if a is None:
            a = self._of[uid] = Account()
        return a

    def tidy(self, uid: int) -> None:
        a = self._of.get(uid)
        if a is not None and not (a.readers or a.queued or a.paused):
            del self._of[uid]

    def room(self, uid: int) -> int:
        """Bytes the user's readers may still take from the broker."""
        a = self._of.get(uid)
        return self.share.queued - (a.queued if a else 0)


class Shares:
    """Slots for waiting requests: *tasks* in all, per user at most half of what
    the others leave.  With *fair* False (a mount only its owner can use), one
    user may take every slot but the reserve."""

    def __init__(self, tasks: int, fair: bool = True) -> None:
        self.reserve = max(1, tasks // 10)
        self.limit = max(1, tasks - self.reserve)
        self.fair = fair
        self.held: Counter[int] = Counter()
        self.total = 0

    def room(self, uid: int) -> int:
        """How many more slots *uid* may take now."""
        mine = self.held[uid]
        free = self.limit - self.total
        if not self.fair:
            return free
        others_leave = self.limit - (self.total - mine)
        return max(0, min(free, max(1, others_leave // 2) - mine))

    def take(self, uid: int) -> bool:
        if self.room(uid) <= 0:
            return False
        self.held[uid] += 1
        self.total += 1
        return True

    def give(self, uid: int) -> None:
        self.held[uid] -= 1
        self.total -= 1
        if self.held[uid] <= 0:
            del self.held[uid]
