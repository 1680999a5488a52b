"""The two ways ``sbus-top`` runs: the live screen, and a one-off snapshot for scripts.

Both are a handful of trio tasks in one nursery around the same pieces: a `Reader`
feeding a `TrafficModel`, a once-a-second `tick_forever`, and — for the live screen —
a keyboard task and a screen task that draws `render(model.snapshot(...))`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import trio
from rich.console import Console
from rich.live import Live

from ..defaults import default_address
from ..errors import SbusError
from .controls import Action, Controls
from .model import Snapshot, TrafficModel, ViewOptions, preview
from .reader import Reader, tick_forever
from .terminal import cbreak, read_keys
from .view import layout, render

__all__ = ["Settings", "run_live", "run_snapshot", "snapshot_json"]


@dataclass
class Settings:
    address: str | None
    patterns: list[bytes]
    options: ViewOptions = field(default_factory=ViewOptions)
    max_keys: int = 10_000
    max_bytes: int = 32 << 20
    interval: float = 0.25  # seconds between redraws
    retry: float = 0.5  # seconds between reconnection attempts
    seconds: float = 3.0  # how long a snapshot counts
    idle: float | None = None  # ... or until this long without a message
    limit: int | None = None  # rows in a JSON snapshot


def _model(settings: Settings) -> TrafficModel:
    return TrafficModel(time.monotonic(), max_keys=settings.max_keys,
                        max_bytes=settings.max_bytes,
                        address=settings.address or default_address())


# -- the live screen ----------------------------------------------------------------------

class _Screen:
    """Draws at a steady pace, or at once when a key changed the view."""

    def __init__(self, live: Live, console: Console, model: TrafficModel,
                 controls: Controls, interval: float) -> None:
        self.live, self.console, self.model = live, console, model
        self.controls, self.interval = controls, interval
        self._wake = trio.Event()

    def wake(self) -> None:
        self._wake.set()

    def draw(self) -> None:
        width, height = self.console.size
        fit = layout(height)
        snap = self.model.snapshot(time.monotonic(), self.controls.options,
                                   limit=fit.rows, recent=fit.recent)
        # scrolling past the end stops at the last page: Up then moves from there
        self.controls.options.scroll = snap.options.scroll
        self.controls.page = fit.rows
        self.live.update(render(snap, width, height, paused=self.controls.paused,
                                editing=self.controls.editing, helping=self.controls.helping),
                         refresh=True)

    async def run(self) -> None:
        while True:
            self.draw()
            while True:
                woken = False
                with trio.move_on_after(self.interval):
                    await self._wake.wait()
                    woken = True
                self._wake = trio.Event()
                # Paused: the numbers stay frozen; only a key press draws again.
                if woken or not self.controls.paused:
                    break


async def _keyboard(fd: int, controls: Controls, model: TrafficModel, screen: _Screen,
                    cancel: trio.CancelScope) -> None:
    while True:
        keys = await read_keys(fd)
        if not keys:  # end of input: nobody can press q any more
            cancel.cancel()
            return
        for key in keys:
            action = controls.press(key)
            if action is Action.QUIT:
                cancel.cancel()
                return
            if action is Action.CLEAR:
                model.clear(time.monotonic())
            if action is not Action.NONE:
                screen.wake()


def run_live(settings: Settings) -> int:
    """The interactive screen; needs a terminal on stdin and stdout."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise SbusError("the live screen needs a terminal on stdin and stdout; "
                        "use --once (a text snapshot) or --json for scripts")
    return _run(_live, settings)


def _run(fn, settings: Settings):
    """`trio.run`, with what escaped the nursery's exception group unwrapped: Ctrl-C is
    exit status 130, an `SbusError` the usual one-line error."""
    interrupted = False
    try:
        return trio.run(fn, settings)
    except* KeyboardInterrupt:
        interrupted = True
    except* SbusError as group:
        raise group.exceptions[0] from None
    if interrupted:
        raise KeyboardInterrupt


async def _live(settings: Settings) -> int:
    model = _model(settings)
    controls = Controls(settings.options)
    reader = Reader(model, settings.address, settings.patterns, retry=settings.retry)
    bus = await reader.connect()  # no broker at the start: say why and exit, not retry
    console = Console()
    fd = sys.stdin.fileno()
    with cbreak(fd), Live(console=console, screen=True, auto_refresh=False,
                          redirect_stdout=False, redirect_stderr=False) as live:
        screen = _Screen(live, console, model, controls, settings.interval)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run, bus)
            nursery.start_soon(reader.ask_status_forever)
            nursery.start_soon(tick_forever, model)
            nursery.start_soon(screen.run)
            nursery.start_soon(_keyboard, fd, controls, model, screen, nursery.cancel_scope)
    return 0


# -- snapshots for scripts ---------------------------------------------------------------

async def count_for(settings: Settings) -> tuple[TrafficModel, float]:
    """Connect (a failure is an error, not a retry), count for ``settings.seconds``;
    returns the model and the seconds actually counted."""
    model = _model(settings)
    reader = Reader(model, settings.address, settings.patterns, retry=settings.retry)
    bus = await reader.connect()  # here a wrong address is an error, not a retry
    async with trio.open_nursery() as nursery:
        await nursery.start(reader.run, bus)
        print(f"sbus top: counting {settings.seconds:g} s of traffic at {model.address}",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        model.clear(start)
        nursery.start_soon(tick_forever, model)
        with trio.move_on_after(settings.seconds):
            if settings.idle is not None:
                await _until_idle(model, settings.idle)
            else:
                await trio.sleep_forever()
        nursery.cancel_scope.cancel()
    if not model.history:  # a window shorter than a tick: its rates are the window's own
        model.tick(time.monotonic())
    return model, time.monotonic() - start


async def _until_idle(model: TrafficModel, idle: float) -> None:
    """Return once *idle* seconds passed without a message, counting from the first."""
    seen, since = 0, time.monotonic()
    while not (seen and time.monotonic() - since >= idle):
        await trio.sleep(min(0.05, idle / 4))
        if model.total != seen:
            seen, since = model.total, time.monotonic()


def snapshot_json(snap: Snapshot, seconds: float) -> dict:
    """A snapshot as plain data; keys and payload previews as text (invalid UTF-8 escaped)."""
    def text(b: bytes) -> str:
        return b.decode("utf-8", "backslashreplace")

    return {
        "address": snap.address, "state": snap.state, "seconds": round(seconds, 3),
        "total": snap.total, "total_bytes": snap.total_bytes,
        "mean_rate": round(snap.total / seconds, 1) if seconds > 0 else 0.0,
        "rate": round(snap.rate, 1), "byte_rate": round(snap.byte_rate, 1),
        "keys": snap.keys, "evicted": snap.evicted, "dropped_by_broker": snap.dropped,
        "history": [round(v, 1) for v in snap.history],
        "sort": snap.options.sort.name.lower(), "filter": snap.options.filter,
        "depth": snap.options.depth,
        "rows": [{"key": text(r.name), "keys": r.keys, "rate": round(r.rate, 1),
                  "byte_rate": round(r.byte_rate, 1), "total": r.count,
                  "age": round(r.age, 3), "preview": preview(r.payload, 80)}
                 for r in snap.rows],
        "recent": [{"key": text(m.key) + (f"…(+{m.cut} bytes)" if m.cut else ""),
                    "age": round(snap.now - m.at, 3),
                    "preview": preview(m.payload, 80)} for m in snap.recent],
    }


def run_snapshot(settings: Settings, as_json: bool, svg: str | None = None) -> int:
    """Count for a while, then print one snapshot: the screen as text (also saved as an
    SVG picture if *svg* names a file), or JSON."""
    model, seconds = _run(count_for, settings)
    now = time.monotonic()
    if as_json:
        snap = model.snapshot(now, settings.options, limit=settings.limit, recent=10)
        # ASCII: a key's C1 controls and bidi overrides are valid JSON text, but a terminal
        # showing the snapshot would obey them; \uXXXX escapes reach it instead
        print(json.dumps(snapshot_json(snap, seconds)))
        return 0
    console = Console(record=svg is not None)
    width, height = console.size
    fit = layout(height)
    snap = model.snapshot(now, settings.options, limit=fit.rows, recent=fit.recent)
    console.print(render(snap, width, height))
    if svg is not None:
        try:
            console.save_svg(svg, title="sbus-top")
        except OSError as exc:
            raise SbusError(f"cannot write {svg}: {exc.strerror or exc}") from None
    return 0
