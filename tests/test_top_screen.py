"""sbus-top's screen against a real broker with real traffic, drawn at fixed sizes through
rich's recording console; also reconnection when the broker goes away and comes back."""

from __future__ import annotations

import io
import re
import shutil
import time

import pytest
import trio
from conftest import BrokerProcess
from rich.console import Console

from sbus.client import AsyncClient
from sbus.top.model import SortBy, TrafficModel, ViewOptions
from sbus.top.reader import CONNECTED, RETRYING, Reader
from sbus.top.view import layout, render

#: key -> (messages per second, payload)
PLAN = {
    b"sensors/kitchen/temp": (200, b"21.5 C"),
    b"sensors/hall/temp": (50, b"19.0 C"),
    b"blobs/raw": (20, bytes([0xDE, 0xAD, 0xBE, 0xEF]) * 8),
}
TICKS_PER_SECOND = 20


async def publish_paced(address: str, plan: dict, seconds: float,
                        each_second=None) -> dict[bytes, int]:
    """Publish *plan* at its rates for *seconds*, on an absolute schedule (no drift);
    ``await each_second(sent)`` at every whole second, counting from 0."""
    sent = dict.fromkeys(plan, 0)
    async with await AsyncClient.connect(address) as bus:
        start = trio.current_time()
        for tick in range(int(seconds * TICKS_PER_SECOND)):
            await trio.sleep_until(start + tick / TICKS_PER_SECOND)
            for key, (rate, payload) in plan.items():
                due = rate * (tick + 1) // TICKS_PER_SECOND
                while sent[key] < due:
                    await bus.publish(key, payload)
                    sent[key] += 1
            if each_second is not None and tick % TICKS_PER_SECOND == 0:
                await each_second(sum(sent.values()))
    return sent


def screen(model: TrafficModel, width: int, height: int, **view) -> str:
    fit = layout(height)
    snap = model.snapshot(time.monotonic(), ViewOptions(**view), limit=fit.rows,
                          recent=fit.recent)
    console = Console(record=True, width=width, height=height, file=io.StringIO(),
                      color_system=None)
    console.print(render(snap, width, height))
    text = console.export_text()
    lines = text.splitlines()
    assert len(lines) == height and max(map(len, lines)) <= width
    return text


def row(text: str, key: str) -> list[str]:
    """The cells of the table line for *key*: name, msg/s, bytes/s (2 words), total, last, …"""
    for line in text.splitlines():
        if line.startswith(key + " "):
            return line.split()
    raise AssertionError(f"{key} not on screen:\n{text}")


@pytest.fixture(scope="module")
def watched(tmp_path_factory) -> tuple[TrafficModel, dict[bytes, int], str]:
    """2.6 s of PLAN traffic watched by the real reader, shared by the rendering tests;
    rates are those of the second from 1 s to 2 s."""
    import tempfile
    d = tempfile.mkdtemp(prefix="sbtop-", dir="/tmp")
    broker = BrokerProcess(f"{d}/bus.sock").start()

    async def main():
        model = TrafficModel(time.monotonic(), address=broker.address)
        reader = Reader(model, broker.address, [b""])

        async def each_second(sent: int) -> None:
            # The ticks follow the publisher's seconds, once the reader has counted what
            # was sent so far: a loaded machine then moves rates by its timing jitter
            # only, never by a whole second's worth of messages.
            with trio.fail_after(5):
                while model.total < sent:
                    await trio.sleep(0.002)
            model.tick(time.monotonic())

        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)
            sent = await publish_paced(broker.address, PLAN, 2.6, each_second)
            with trio.fail_after(5):  # the last ones may still be on their way
                while model.total < sum(sent.values()):
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        return model, sent

    try:
        model, sent = trio.run(main)
    finally:
        broker.stop()
        shutil.rmtree(d, ignore_errors=True)
    return model, sent, broker.address


@pytest.mark.parametrize("width,height", [(80, 24), (120, 40)])
def test_screen_shows_rates_keys_and_payloads(watched, width, height):
    model, sent, address = watched
    text = screen(model, width, height)
    assert model.total == sum(sent.values())  # nothing lost
    lines = text.splitlines()
    assert "sbus-top" in lines[0] and "● connected" in lines[0] and address in lines[0]
    total = sum(rate for rate, _ in PLAN.values())
    head = re.match(r"(\S+) msg/s", lines[1])
    assert head and float(head.group(1)) == pytest.approx(total, rel=0.25)
    assert f"total {model.total:,} msgs" in lines[1] and "keys 3" in lines[1]
    assert re.search(r"[▁▂▃▄▅▆▇█]{2}", lines[2]), "sparkline"
    for key, (rate, _payload) in PLAN.items():
        cells = row(text, key.decode())
        assert float(cells[1]) == pytest.approx(rate, rel=0.25), cells
        assert int(cells[4].replace(",", "")) == sent[key]
    assert row(text, "sensors/kitchen/temp")[-2:] == ["21.5", "C"]
    assert "de ad be ef de ad" in " ".join(row(text, "blobs/raw"))
    # default sort: busiest first
    order = [line.split()[0] for line in lines[4:7]]
    assert order == ["sensors/kitchen/temp", "sensors/hall/temp", "blobs/raw"]
    # the recent pane has the latest messages, previews included
    recent = lines[lines.index(next(x for x in lines if x.startswith("recent messages"))) + 1:]
    shown = {"sensors/kitchen/temp": "21.5 C", "sensors/hall/temp": "19.0 C",
             "blobs/raw": "de ad be ef de ad be ef"}
    assert len(recent) == layout(height).recent + 1
    for line in recent[:-1]:  # then the footer
        assert re.match(r"\d\d:\d\d:\d\d ", line), line
        key = line.split()[1]
        assert shown[key] in line, line


def test_screen_sorted_grouped_and_filtered(watched):
    model, sent, _ = watched
    by_key = screen(model, 80, 24, sort=SortBy.KEY).splitlines()
    assert [x.split()[0] for x in by_key[4:7]] == \
        ["blobs/raw", "sensors/hall/temp", "sensors/kitchen/temp"]
    assert "key▼" in by_key[3]
    by_bytes = screen(model, 80, 24, sort=SortBy.BYTE_RATE).splitlines()
    assert by_bytes[4].startswith("sensors/kitchen/temp")  # 200×6 B/s > 20×32 B/s
    assert by_bytes[5].startswith("blobs/raw")
    grouped = screen(model, 80, 24, depth=1)
    assert "prefix (depth 1)" in grouped
    cells = row(grouped, "sensors/")
    assert cells[1] == "(2)"
    assert float(cells[2]) == pytest.approx(250, rel=0.25)
    filtered = screen(model, 80, 24, filter="hall")
    assert "sensors/hall/temp" in filtered and "kitchen" not in filtered
    assert "filter:hall" in filtered.splitlines()[-1]


def test_reconnects_when_the_broker_comes_back(short_tmp):
    address = str(short_tmp / "bus.sock")
    broker = BrokerProcess(address).start()

    async def wait_state(model: TrafficModel, state: str) -> None:
        with trio.fail_after(10):
            while not model.state.startswith(state):
                await trio.sleep(0.02)

    async def main():
        nonlocal broker
        model = TrafficModel(time.monotonic(), address=address)
        reader = Reader(model, address, [b"a/"], retry=0.1)
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)
            async with await AsyncClient.connect(address) as pub:
                for _ in range(5):
                    await pub.publish(b"a/one", b"before")
            with trio.fail_after(5):
                while model.total < 5:
                    await trio.sleep(0.01)
            await trio.to_thread.run_sync(broker.stop)
            await wait_state(model, RETRYING)
            text = screen(model, 80, 24)
            assert "✖ disconnected — retrying" in text.splitlines()[0]
            assert text.splitlines()[2] in (  # the socket file stays: refused
                "why: the broker closed the connection",
                "why: cannot connect to the sbus broker: Connection refused",
                "why: cannot connect to the sbus broker: No such file or directory")
            assert "total 5 msgs" in text  # the counts survive
            broker = await trio.to_thread.run_sync(BrokerProcess(address).start)
            await wait_state(model, CONNECTED)
            # connected again, and subscribed again: new traffic counts
            with trio.fail_after(10):
                async with await AsyncClient.connect(address) as pub:
                    while model.total < 8:
                        await pub.publish(b"a/two", b"after")
                        await trio.sleep(0.05)
            assert reader.connects >= 2  # (one more if it caught the old one closing)
            assert "● connected" in screen(model, 80, 24).splitlines()[0]
            assert "after" in screen(model, 80, 24)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        broker.stop()


def test_a_reader_started_before_its_broker_waits_for_it(short_tmp):
    """No broker yet: the reader says it is retrying (the client's reconnect driver waits
    for the first connection too), and counts once the broker comes."""
    address = str(short_tmp / "bus.sock")
    broker = None

    async def main():
        nonlocal broker
        model = TrafficModel(time.monotonic(), address=address)
        reader = Reader(model, address, [b"a/"], retry=0.1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            with trio.fail_after(10):
                while not model.state.startswith(RETRYING):
                    await trio.sleep(0.02)
            broker = await trio.to_thread.run_sync(BrokerProcess(address).start)
            with trio.fail_after(10):
                while not model.state.startswith(CONNECTED):
                    await trio.sleep(0.02)
                async with await AsyncClient.connect(address) as pub:
                    while model.total < 3:
                        await pub.publish(b"a/late", b"x")
                        await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        if broker is not None:
            broker.stop()


def test_many_keys_stay_bounded(broker):
    """10 000 distinct keys through a real broker into a 500-key LRU."""
    async def main():
        model = TrafficModel(time.monotonic(), address=broker.address, max_keys=500)
        reader = Reader(model, broker.address, [b"many/"])
        async with trio.open_nursery() as nursery:
            await nursery.start(reader.run)
            async with await AsyncClient.connect(broker.address) as pub:
                for i in range(10_000):
                    await pub.publish(b"many/%d" % i, b"v")
            with trio.fail_after(20):
                while model.total < 10_000:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        return model

    model = trio.run(main)
    assert len(model.keys) == 500 and model.evicted == 9_500
    assert b"many/9999" in model.keys and b"many/0" not in model.keys
    text = screen(model, 80, 24)
    assert "keys 500 (+9,500 evicted)" in text


def test_keys_that_would_drive_the_terminal_are_shown_escaped():
    model = TrafficModel(time.monotonic())
    evil = b"a\x1b]0;owned\x07\x1b[2Jb\n"
    model.feed_packets([b"MSG " + evil + b"\0\x1b[31mred"], time.monotonic())
    model.tick(time.monotonic() + 1)
    text = screen(model, 120, 30)
    assert "\x1b" not in text and "\x07" not in text
    assert "a\\x1b]0;owned\\x07\\x1b[2Jb\\n" in text
