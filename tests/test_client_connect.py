"""Connecting to a broker that does not accept (its accept backlog full: stopped, or its
loop busy) never freezes an `AsyncClient`'s event loop, and never hangs a `Client`.

Each test meets a real listening socket with ``listen(0)`` and a full backlog
(`faultkit.FullBacklog`).  A ticker task shows the loop runs while the connect waits;
a timer thread unsticks a connect that blocks the whole loop (the bug), so that a
regression fails its assertions instead of hanging.
"""

from __future__ import annotations

import os
import threading
import time

import anyio
import pytest
from faultkit import FullBacklog

from sbus import AsyncClient, Client, ConnectError, Publish
from sbus import client as client_module

TICK = 0.01


async def _ticker(ticks: list[float]) -> None:
    while True:
        ticks.append(time.monotonic())
        await anyio.sleep(TICK)


def _during(ticks: list[float], start: float, end: float) -> int:
    return sum(start <= t <= end for t in ticks)


@pytest.fixture
def full(short_tmp):
    backlog = FullBacklog(str(short_tmp / "full.sock"))
    yield backlog
    backlog.close()


def _later(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_async_open_waits_for_room_without_stopping_other_tasks(full, backend):
    """open() against a full backlog: the ticker goes on; once the listener makes room,
    open() connects, and what it sends arrives."""
    async def main() -> tuple[int, float, bytes]:
        ticks: list[float] = []
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_ticker, ticks)
            await anyio.sleep(TICK)
            start = time.monotonic()
            room = _later(0.4, full.make_room)
            bus = AsyncClient(full.address)
            with anyio.fail_after(10):
                await bus.open()
            end = time.monotonic()
            room.join()
            tasks.cancel_scope.cancel()
        await bus.publish(b"k", b"v")
        conn = full.make_room()  # ours, queued behind the filler taken before
        conn.settimeout(5)
        got = conn.recv(100)
        await bus.aclose()
        return _during(ticks, start, end), end - start, got

    ticked, waited, got = anyio.run(main, backend=backend)
    assert waited >= 0.35  # it did wait for the room
    assert ticked >= 10, f"the loop stood still: {ticked} ticks in {waited:.2f} s"
    assert got == b"MSG k\0v"


def test_async_open_to_a_backlog_that_stays_full_is_a_connect_error(full, monkeypatch):
    monkeypatch.setattr(client_module, "CONNECT_TIMEOUT", 0.3)
    unstick = _later(3, full.make_room)  # only a connect that blocks needs it

    async def main() -> tuple[str, int, float]:
        ticks: list[float] = []
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(_ticker, ticks)
            await anyio.sleep(TICK)
            start = time.monotonic()
            try:
                await AsyncClient.connect(full.address)
                error = "connected"
            except ConnectError as exc:
                error = str(exc)
            end = time.monotonic()
            tasks.cancel_scope.cancel()
        return error, _during(ticks, start, end), end - start

    try:
        error, ticked, waited = anyio.run(main, backend="trio")
    finally:
        unstick.cancel()
    assert error.startswith(f"cannot connect to the sbus broker at {full.address}: it has "
                            "not accepted the connection in 0.3 s (its accept backlog is "
                            "full: is it stopped or overloaded?)"), error
    assert "\n" not in error and "sbus serve" not in error  # there is a broker
    assert 0.25 <= waited < 2
    assert ticked >= 8, f"the loop stood still: {ticked} ticks in {waited:.2f} s"


def test_blocking_client_gives_up_on_a_full_backlog_or_connects_once_there_is_room(
        full, monkeypatch):
    monkeypatch.setattr(client_module, "CONNECT_TIMEOUT", 0.3)
    unstick = _later(3, full.make_room)
    start = time.monotonic()
    try:
        with pytest.raises(ConnectError, match="has not accepted the connection in 0.3 s"):
            Client(full.address)
    finally:
        unstick.cancel()
    assert time.monotonic() - start < 2
    with pytest.raises(ConnectError, match="in 0.1 s"):  # its own timeout, if shorter
        Client(full.address, timeout=0.1)

    monkeypatch.setattr(client_module, "CONNECT_TIMEOUT", 5.0)
    room = _later(0.2, full.make_room)
    with Client(full.address, timeout=5) as bus:
        room.join()
        bus.publish(b"k", b"blocking")
        conn = full.make_room()
        conn.settimeout(5)
        assert conn.recv(100) == b"MSG k\0blocking"


def test_async_reconnect_facing_a_full_backlog_lets_other_tasks_run(broker):
    """The broker goes; its address is held by a listener that never accepts.  The
    reconnect counts each try as a failed attempt and backs off, the loop runs on; once
    a broker is back, the client reconnects with its subscription in force."""
    lines: list[str] = []
    held: list[FullBacklog] = []

    def release() -> float:
        at = time.monotonic()
        held[0].close()
        broker.start()
        return at

    async def main() -> tuple[int, float, list[Publish], int]:
        async with AsyncClient(broker.address, reconnect=True,
                               on_connection=lambda up, line: lines.append(line)) as bus:
            await bus.subscribe(b"k")
            os.unlink(broker.address)  # the broker's connections live on ...
            held.append(FullBacklog(broker.address))  # ... its address is a full backlog
            broker.stop()
            released: list[float] = []
            ticks: list[float] = []
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_ticker, ticks)
                await anyio.sleep(TICK)
                start = time.monotonic()
                back = _later(0.5, lambda: released.append(release()))
                with anyio.fail_after(20):
                    await bus.sync()  # notices the loss, reconnects
                back.join()
                tasks.cancel_scope.cancel()
            with Client(broker.address) as pub:
                pub.publish(b"k", b"after")
            with anyio.fail_after(10):
                got = await bus.receive_batch()
            return (_during(ticks, start, released[0]), released[0] - start, got,
                    bus.connections)

    ticked, waited, got, connections = anyio.run(main, backend="trio")
    assert ticked >= 10, f"the loop stood still: {ticked} ticks in {waited:.2f} s"
    assert got == [Publish(b"k", b"after")]
    assert connections == 2
    assert any("reconnecting" in line for line in lines)
    assert lines[-1].startswith(f"reconnected to the broker at {broker.address} (messages")
