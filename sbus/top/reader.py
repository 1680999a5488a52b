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

from ..client import AsyncClient
from ..defaults import default_address
from ..protocol import REFUSED, STATUS
from ..session import Backoff
from .model import TrafficModel

__all__ = ["Reader", "tick_forever", "CONNECTED", "RETRYING"]

CONNECTED = "connected"
RETRYING = "disconnected — retrying"
BATCH = 4096


class Reader:
    """Subscribes *patterns* at *address* and counts everything into *model*.

    `run` never returns: when the broker goes away the model's state says so and the
    client reconnects (the session's `Backoff`, at most *retry* seconds apart) and
    subscribes afresh once it is back."""

    def __init__(self, model: TrafficModel, address: str | None, patterns: Sequence[bytes],
                 *, retry: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.address = address
        self.patterns = list(patterns)
        self.retry = retry
        self.clock = clock
        self.connects = 0
        self.bus: AsyncClient | None = None  # while connected

    def _backoff(self) -> Backoff:
        return Backoff(first=min(0.05, self.retry), maximum=self.retry)

    def _connection(self, up: bool, line: str) -> None:
        if up:
            self.connects += 1
            self.model.state, self.model.problem = CONNECTED, ""
        else:
            self.model.state = RETRYING
            self.model.problem = _reason(line.split("; ")[0], self.address)

    async def connect(self, retry: bool = False) -> AsyncClient:
        """Connect and subscribe; the subscriptions are in force on return (a refused one
        raises `Refused`).  Raises `SbusError`, or with *retry* waits for a broker that is
        not there yet (the client's reconnect driver; the model says so meanwhile)."""
        bus = AsyncClient(self.address, reconnect=True, on_connection=self._connection,
                          backoff=self._backoff())
        await bus.open(retry=retry)
        try:
            for pattern in self.patterns:
                await bus.subscribe(pattern, wait=False)
            await bus.sync()
        except BaseException:
            await bus.aclose()
            raise
        self._connection(True, "connected")
        return bus

    async def run(self, bus: AsyncClient | None = None, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read forever, starting with *bus* if given (a `connect` result).  Reports
        started (``nursery.start``) once the first subscriptions are in place."""
        if bus is None:
            bus = await self.connect(retry=True)
        task_status.started()
        self.bus = bus
        try:
            feed, clock, model = self.model.feed_packets, self.clock, self.model
            while True:  # reconnects inside receive_packets
                for ev in feed(await bus.receive_packets(BATCH), clock()):
                    if ev.key == STATUS:
                        page = model.take_status(ev.payload)
                        if page is not None:  # the next page of the answer
                            bus.control_nowait(STATUS, page)
                    elif ev.key == REFUSED + b"/cmsg" and STATUS in (ev.payload or b""):
                        model.clients_note = "this broker does not answer broker/status"
        finally:
            self.bus = None
            await bus.aclose()

    async def ask_status_forever(self, interval: float = 1.0) -> None:
        """Ask the broker about its clients every *interval* seconds while connected (the
        answer comes back through `run`, in order with the traffic).  A plain send that
        never waits: a lost connection is the reading task's to notice and restore."""
        while True:
            bus = self.bus
            if bus is not None and self.model.status_round():
                bus.control_nowait(STATUS)
            await trio.sleep(interval)


def _reason(text: str, address: str | None) -> str:
    """The first sentence of an error, without the address (the screen shows it)."""
    return text.split(". ")[0].replace(f" at {address or default_address()}", "")


async def tick_forever(model: TrafficModel, interval: float = 1.0,
                       clock: Callable[[], float] = time.monotonic) -> None:
    """Turn counts into rates every *interval* seconds, on a steady beat."""
    next_at = trio.current_time() + interval
    while True:
        await trio.sleep_until(next_at)
        next_at += interval
        model.tick(clock())

