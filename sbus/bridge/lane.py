"""Turns between the bridge's trio thread and its lanes.

Woken for one export at 1,000 msg/s, the bridge spent 15–25 µs in trio's turn before
its own code ran (docs/performance.md, "The floor of a Python hop"): trio's epoll
returns, the task is rescheduled, its cancel scopes and checkpoints run.  A thread
blocked in ``poll`` on a socket is woken by the kernel directly.  So the bridge reads
the bus in such a thread, its *export lane* (`BridgeShell._lane`), and MQTT in another,
its *import lane* (`BridgeShell._mqtt_lane`), and runs those turns there.

`Turns` keeps these threads from ever running the bridge's code at once, so that its
state needs no other lock and reads as single-threaded code: a lock the trio thread
holds at all times except while trio waits for I/O (a trio `Instrument` lets go of it
before each wait with a timeout and takes it back after), and that the lane holds for
each of its turns.  trio therefore waits for a lane turn to end before it runs anything,
and the lane waits for trio to be idle.  The lock alone is not fair: a lane flooded with
work took 4,640 turns in a second while trio, waiting for the lock after each of its
waits, got 2.  So a lane does not take a turn while trio waits for one: trio waits for
one lane turn at most.  What the lane cannot do in a turn (wait for room, reconnect,
wake a trio task) it hands back to trio.
"""

from __future__ import annotations

import threading

import trio

__all__ = ["Turns"]


class Turns(trio.abc.Instrument):
    """Whose turn it is to run the bridge's code: the trio thread's, except while it
    waits for I/O; then a lane's, one ``with turns:`` block at a time (module docstring).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trio_holds = False
        self._queue = threading.Condition(threading.Lock())  # guards `_trio_waits`
        self._trio_waits = False  # trio wants the turn back: no lane takes one first

    def start(self) -> None:
        """From the trio thread, inside the run: trio holds the turn from now on."""
        self._lock.acquire()
        self._trio_holds = True
        trio.lowlevel.add_instrument(self)

    def end(self) -> None:
        """From the trio thread, before the run ends: nobody holds the turn for trio any
        more (a lane still waiting for one gets it, and should find it must stop)."""
        trio.lowlevel.remove_instrument(self)
        if self._trio_holds:
            self._trio_holds = False
            self._lock.release()

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0 and self._trio_holds:  # (0: a poll between runnable tasks)
            self._trio_holds = False
            self._lock.release()

    def after_io_wait(self, timeout: float) -> None:
        if timeout > 0 and not self._trio_holds:
            with self._queue:
                self._trio_waits = True
            self._lock.acquire()  # after the lane's turn, if one is under way
            self._trio_holds = True
            with self._queue:
                self._trio_waits = False
                self._queue.notify_all()

    def __enter__(self) -> Turns:
        if self._trio_waits:  # (read without the lock first: a flag, under the GIL)
            with self._queue:
                while self._trio_waits:  # trio's turn first (module docstring)
                    self._queue.wait()
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
