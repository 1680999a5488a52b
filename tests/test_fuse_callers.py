"""`sbus.fuse.callers`: the waiting callers asked about their signals together."""

from __future__ import annotations

import trio
import trio.testing

from sbus.fuse.callers import Callers


def test_a_caller_is_asked_once_a_round_however_many_of_its_operations_wait():
    """400 waiting reads of one caller (threads reading files one thread opened): one
    question per round, not 400 (the audit of 2026-11-28: 9,000 a second kept the mount
    at 100 % CPU); a signal wakes them all, and once it was acted on, new ones wait."""
    asked: list[tuple[int, int | None]] = []
    signalled: set[int] = set()

    def ask(pid: int, tgid: int | None) -> bool:
        asked.append((pid, tgid))
        return pid in signalled

    async def main() -> None:
        callers = Callers(ask, poll=0.05)
        lot = trio.lowlevel.ParkingLot()
        woke: list[bool] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(callers.run)
            await trio.sleep(1)  # nobody waits: nothing is asked
            assert not asked

            came = []

            async def read(pid: int) -> None:  # as the mount's read waits
                with callers.waiting(pid, 7) as caller:
                    while not (came or caller.hit):
                        await caller.park(lot)
                    woke.append(caller.hit)

            for _ in range(400):
                nursery.start_soon(read, 100)
            nursery.start_soon(read, 200)
            await trio.sleep(0.52)  # ten rounds
            assert len(callers) == 2 and 16 <= len(asked) <= 22, len(asked)
            assert not woke
            signalled.add(100)
            await trio.sleep(0.06)
            assert woke == [True] * 400 and len(callers) == 1  # 200 waits on
            came.append(True)  # what it waited for came
            lot.unpark_all()
            await trio.sleep(0.01)
            assert woke == [True] * 400 + [False] and not len(callers)
            signalled.clear()
            with callers.waiting(100, 7) as caller:  # a fresh caller: not hit
                assert not caller.hit
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_hit_caller_is_cleared_once_its_signal_was_acted_on():
    """A handled signal is no longer pending: what the caller waits in from then on
    waits, instead of answering EINTR again."""
    pending = [True]

    async def main() -> None:
        callers = Callers(lambda pid, tgid: pending[0], poll=0.05)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(callers.run)
            with callers.waiting(1) as first:
                await trio.sleep(0.06)
                assert first.hit
                with callers.waiting(1) as second:  # the same caller, still hit
                    assert second is first and second.hit
                    pending[0] = False
                    await trio.sleep(0.05)
                    assert not second.hit
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
