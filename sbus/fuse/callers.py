"""The callers that wait in the mount, asked about their signals together.

pyfuse3 does not pass FUSE interrupts on (`sbus.fuse.signals`), so an operation that
waits looks at its caller's pending signals itself.  Each waiting read used to look
every `SIGNAL_POLL` on its own: a few hundred threads of one process reading files
that one thread had opened cost the mount most of its CPU, reading ``/proc`` for
each of them 20 times a second, and another user's ``open`` took up to 24 s (the audit
of 2026-11-28).  Here a caller (the thread that opened a file, and its process) is
asked about once per `SIGNAL_POLL` however many of its operations wait; what waits
parks, and is woken when its caller has a signal to act on.  The callers that can wait
are bounded by the users' shares (open files, waiting requests), and the asking is
done in pieces of `ASK_TURN` seconds, other tasks running between them.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator

import trio

from .signals import interrupted

__all__ = ["SIGNAL_POLL", "Caller", "Callers"]

#: How often a waiting caller is asked about its pending signals (seconds).
SIGNAL_POLL = 0.05
#: Seconds of asking before the other tasks get a turn.
ASK_TURN = 0.002


class Caller:
    """One caller's waiting operations: *hit* once it has a signal to act on (they
    answer EINTR), until it has none again."""

    __slots__ = ("waiting", "hit", "_lots", "_event")

    def __init__(self) -> None:
        self.waiting = 0
        self.hit = False
        self._lots: Counter[trio.lowlevel.ParkingLot] = Counter()
        self._event = trio.Event()

    async def park(self, lot: trio.lowlevel.ParkingLot) -> None:
        """Park in *lot* until it is unparked or this caller is hit."""
        if self.hit:
            return
        self._lots[lot] += 1
        try:
            await lot.park()
        finally:
            self._lots[lot] -= 1
            if not self._lots[lot]:
                del self._lots[lot]

    async def wait_hit(self) -> None:
        await self._event.wait()

    def _hit(self) -> None:
        self.hit = True
        self._event.set()
        for lot in list(self._lots):
            lot.unpark_all()

    def _clear(self) -> None:
        self.hit = False
        self._event = trio.Event()


class Callers:
    """The waiting callers, by (thread, process); `run` asks about them."""

    def __init__(self, ask: Callable[[int, int | None], bool] = interrupted,
                 poll: float = SIGNAL_POLL) -> None:
        self._ask = ask
        self.poll = poll
        self._callers: dict[tuple[int, int | None], Caller] = {}
        self._some = trio.Event()  # set while any caller waits: an idle mount sleeps

    def __len__(self) -> int:
        return len(self._callers)

    @contextlib.contextmanager
    def waiting(self, pid: int, tgid: int | None = None) -> Iterator[Caller]:
        """The caller thread *pid* of process *tgid*, while an operation of its waits."""
        key = (pid, tgid)
        caller = self._callers.get(key)
        if caller is None:
            caller = self._callers[key] = Caller()
            self._some.set()
        caller.waiting += 1
        try:
            yield caller
        finally:
            caller.waiting -= 1
            if not caller.waiting:
                del self._callers[key]

    async def run(self) -> None:
        """Ask about every waiting caller each `poll` seconds, for the mount's life."""
        clock = time.perf_counter
        while True:
            if not self._callers:
                self._some = trio.Event()
                await self._some.wait()
            await trio.sleep(self.poll)
            turn = clock()
            for key, caller in list(self._callers.items()):
                if not caller.waiting:
                    continue  # (gone meanwhile)
                if self._ask(*key):
                    if not caller.hit:
                        caller._hit()
                elif caller.hit:  # acted on: what waits from now on waits on
                    caller._clear()
                if clock() - turn > ASK_TURN:
                    await trio.lowlevel.checkpoint()
                    turn = clock()
