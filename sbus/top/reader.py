"""Reading the bus for ``sbus-top``: one trio task that feeds the model, reconnecting forever.

Reading comes first: the client's socket is drained in batches of raw packets
(``AsyncClient.receive_packets``: no event object per message) and each packet is
counted with a few dict updates; the task yields to the scheduler once per batch so
the screen gets drawn — the screen never makes the reader wait longer than one redraw.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import trio

from ..client import AsyncClient, SbusError
from ..protocol import WHOAMI
from .model import TrafficModel

__all__ = ["Reader", "tick_forever", "CONNECTED", "RETRYING"]

CONNECTED = "connected"
RETRYING = "disconnected — retrying"
BATCH = 4096


class Reader:
    """Subscribes *patterns* at *address* and counts everything into *model*.

    `run` never returns: when the broker goes away the model's state says so and the
    reader tries again every *retry* seconds, subscribing afresh once it is back."""

    def __init__(self, model: TrafficModel, address: str | None, patterns: Sequence[bytes],
                 *, retry: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.address = address
        self.patterns = list(patterns)
        self.retry = retry
        self.clock = clock
        self.connects = 0

    async def connect(self) -> AsyncClient:
        """One attempt: connect, subscribe, and ask whoami, whose answer (seen by the
        pump) says the subscriptions are in place.  Raises `SbusError`."""
        bus = await AsyncClient.connect(self.address)
        try:
            for pattern in self.patterns:
                await bus.subscribe(pattern)
            await bus.control(WHOAMI)
        except BaseException:
            await bus.aclose()
            raise
        self.connects += 1
        self.model.state = CONNECTED
        return bus

    async def run(self, bus: AsyncClient | None = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read forever, starting with *bus* if given (a `connect` result).  Reports
        started (``nursery.start``) once the first subscriptions are in place."""
        started = False
        while True:
            if bus is None:
                try:
                    bus = await self.connect()
                except SbusError:  # includes ConnectError
                    self.model.state = RETRYING
                    await trio.sleep(self.retry)
                    continue
            def subscribed() -> None:
                nonlocal started
                if not started:
                    started = True
                    task_status.started()

            try:
                await self._pump(bus, subscribed)
            except SbusError:
                self.model.state = RETRYING
            finally:
                await bus.aclose()
                bus = None

    async def _pump(self, bus: AsyncClient, subscribed: Callable[[], None]) -> None:
        """Drain the socket in batches into the model; calls *subscribed* when the broker
        answers whoami."""
        feed, clock = self.model.feed_packets, self.clock
        while True:
            for ev in feed(await bus.receive_packets(BATCH), clock()):
                if ev.key == WHOAMI:
                    subscribed()


async def tick_forever(model: TrafficModel, interval: float = 1.0,
                       clock: Callable[[], float] = time.monotonic) -> None:
    """Turn counts into rates every *interval* seconds, on a steady beat."""
    next_at = trio.current_time() + interval
    while True:
        await trio.sleep_until(next_at)
        next_at += interval
        model.tick(clock())

