"""Fair shares of the mount's request pool, per user.  Pure.

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

__all__ = ["Shares"]


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
