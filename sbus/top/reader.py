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

from ..client import AsyncClient, SbusError, default_address
from ..protocol import REFUSED, STATUS, WHOAMI
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
        self.bus: AsyncClient | None = None  # while connected

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
        self.model.state, self.model.problem = CONNECTED, ""
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
                except SbusError as exc:  # includes ConnectError
                    self.model.state = RETRYING
                    self.model.problem = _reason(exc, self.address)
                    await trio.sleep(self.retry)
                    continue
            def subscribed() -> None:
                nonlocal started
                if not started:
                    started = True
                    task_status.started()

            try:
                self.bus = bus
                await self._pump(bus, subscribed)
            except SbusError as exc:
                self.model.state, self.model.problem = RETRYING, _reason(exc, self.address)
            finally:
                self.bus = None
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
                elif ev.key == STATUS:
                    self.model.take_status(ev.payload)
                elif ev.key == REFUSED + b"/cmsg" and STATUS in (ev.payload or b""):
                    self.model.clients_note = "this broker does not answer broker/status"

    async def ask_status_forever(self, interval: float = 1.0) -> None:
        """Ask the broker about its clients every *interval* seconds while connected (the
        answer comes back through `_pump`, in order with the traffic)."""
        while True:
            bus = self.bus
            if bus is not None:
                try:
                    await bus.control(STATUS)
                except SbusError:
                    pass  # the pump sees the connection end and reconnects
            await trio.sleep(interval)


def _reason(exc: SbusError, address: str | None) -> str:
    """The first sentence of an error, without the address (the screen shows it)."""
    return str(exc).split(". ")[0].replace(f" at {address or default_address()}", "")


async def tick_forever(model: TrafficModel, interval: float = 1.0,
                       clock: Callable[[], float] = time.monotonic) -> None:
    """Turn counts into rates every *interval* seconds, on a steady beat."""
    next_at = trio.current_time() + interval
    while True:
        await trio.sleep_until(next_at)
        next_at += interval
        model.tick(clock())

