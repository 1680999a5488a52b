"""Drawing ``sbus-top``: a `Snapshot` plus a terminal size in, a rich renderable out.

No I/O and no clock here: the same function draws the live screen, the ``--once``
text snapshot, the docs screenshot and what the tests look at.  Every part has a
fixed height so the screen fills the terminal exactly, from 80×24 up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from ..display import printable
from ..introspect import entry_bytes
from .controls import FOOTER_KEYS, HELP
from .model import CLIENT_SORT, CLIENTS_PANE, Row, Snapshot, SortBy, client_value, preview

__all__ = ["Layout", "layout", "render", "fmt_rate", "fmt_bytes", "fmt_count", "fmt_age",
           "sparkline", "MIN_WIDTH", "MIN_HEIGHT"]

MIN_WIDTH = 60
MIN_HEIGHT = 10
SPARKS = "▁▂▃▄▅▆▇█"
#: header 2 + sparkline 1 + table header 1 + rule 1 + footer 1
CHROME = 6


@dataclass(frozen=True, slots=True)
class Layout:
    """How many table rows and recent messages fit in *height* lines."""

    rows: int
    recent: int


def layout(height: int) -> Layout:
    height = max(height, MIN_HEIGHT)
    room = height - CHROME
    if height < 16:  # no room for the recent pane (nor its title line)
        return Layout(rows=room + 1, recent=0)
    recent = max(2, min(12, room // 4))
    return Layout(rows=room - recent, recent=recent)


# -- number formatting ------------------------------------------------------------------

def _si(value: float, units: tuple[str, ...]) -> str:
    for unit in units[:-1]:
        if abs(value) < 999.5:
            return f"{value:.0f}{unit}" if value >= 99.5 or unit == units[0] else \
                f"{value:.1f}{unit}"
        value /= 1000
    return f"{value:.1f}{units[-1]}"


def fmt_rate(value: float) -> str:
    """Messages per second: ``0``, ``2.5``, ``812``, ``12.3k``, ``1.2M``."""
    if value < 10 and value != int(value):
        return f"{value:.1f}"
    return _si(value, ("", "k", "M", "G"))


def fmt_bytes(value: float) -> str:
    """Bytes in decimal units: ``512 B``, ``12.3 kB``, ``4.5 MB``."""
    return _si(value, (" B", " kB", " MB", " GB", " TB"))


def fmt_count(value: int, width: int = 10) -> str:
    """Exact with thousands separators when it fits *width*, else ``12.3M``."""
    text = f"{value:,}"
    return text if len(text) <= width else _si(value, ("", "k", "M", "G", "T"))


def fmt_age(seconds: float) -> str:
    if seconds < 0.05:
        return "now"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def fmt_uptime(seconds: float) -> str:
    s = int(seconds)
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


def sparkline(values: list[float], width: int) -> str:
    """The last *width* values as block characters, right-aligned (newest at the right);
    scaled to the largest value shown, so a steady rate is a flat full bar."""
    if width <= 0:
        return ""
    shown = values[-width:]
    peak = max(shown, default=0.0)
    out = []
    for v in shown:
        if peak <= 0 or v <= 0:
            out.append(" " if v <= 0 else SPARKS[0])
        else:
            level = math.ceil(v / peak * len(SPARKS)) - 1
            out.append(SPARKS[max(0, min(len(SPARKS) - 1, level))])
    return " " * (width - len(shown)) + "".join(out)


# -- the screen -------------------------------------------------------------------------

def _state_text(state: str) -> Text:
    if state == "connected":
        return Text("● connected", style="bold green")
    if state.startswith("disconnected"):
        return Text(f"✖ {state}", style="bold red")
    return Text(f"… {state}", style="yellow")


def _header(snap: Snapshot, paused: bool) -> list[Text]:
    line1 = Text.assemble(("sbus-top", "bold"), "  ", (snap.address, "cyan"), "  ")
    line1.append_text(_state_text(snap.state))
    line1.append(f"  up {fmt_uptime(snap.uptime)}")
    if paused:
        line1.append("  ")
        line1.append(" PAUSED ", style="bold reverse yellow")
    keys = f"{snap.keys:,}"
    if snap.evicted:
        keys += f" (+{snap.evicted:,} evicted)"
    line2 = Text.assemble(
        (fmt_rate(snap.rate), "bold"), " msg/s  ",
        (fmt_bytes(snap.byte_rate) + "/s", "bold"), "  total ",
        (fmt_count(snap.total, 14), "bold"), f" msgs {fmt_bytes(snap.total_bytes)}",
        "  keys ", (keys, "bold"),
    )
    if snap.dropped:
        line2.append("  dropped by broker ")
        line2.append(f"{snap.dropped:,}", style="bold red")
    return [line1, line2]


def _spark(snap: Snapshot, width: int) -> Text:
    if snap.problem and snap.state.startswith("disconnected"):
        return Text.assemble(("why: ", "bold red"), printable(snap.problem, width))
    peak = max(snap.history, default=0.0)
    label = "msg/s, last minute "
    right = f" peak {fmt_rate(peak)}/s"
    room = max(0, width - len(label) - len(right))
    return Text.assemble((label, "dim"), (sparkline(snap.history, min(room, 60)), "green"),
                         (right, "dim"))


def _columns(width: int, longest: int) -> tuple[int, int]:
    """Widths of the key and payload columns: keys as wide as the longest shown, within
    reason, payloads the rest; the numbers get fixed widths."""
    rest = width - (8 + 11 + 10 + 6)  # number columns (rich counts the 1-space gap in)
    key = max(12, min(longest, 64, rest - 16))
    return key, rest - key


def _table(snap: Snapshot, width: int, nrows: int) -> Table:
    sort = snap.options.sort
    grouped = snap.options.depth > 0
    key_title = f"prefix (depth {snap.options.depth})" if grouped else "key"
    longest = max((len(_name(r, grouped)) for r in snap.rows[:nrows]), default=0)
    key_w, payload_w = _columns(width, max(longest, len(key_title) + 1))

    def head(title: str, col: SortBy) -> Text:
        return _head(title, col is sort, snap.options.reverse)

    table = Table(box=None, padding=(0, 0, 0, 1), pad_edge=False, show_edge=False,
                  header_style="bold", expand=False, collapse_padding=True)
    table.add_column(head(key_title, SortBy.KEY), width=key_w, no_wrap=True,
                     overflow="ellipsis")
    table.add_column(head("msg/s", SortBy.RATE), width=8, justify="right", no_wrap=True)
    table.add_column(head("bytes/s", SortBy.BYTE_RATE), width=11, justify="right",
                     no_wrap=True)
    table.add_column(head("total", SortBy.TOTAL), width=10, justify="right", no_wrap=True)
    table.add_column(head("last", SortBy.LAST), width=6, justify="right", no_wrap=True)
    table.add_column(Text("payload", style="bold"), width=payload_w, no_wrap=True,
                     overflow="ellipsis")
    for row in snap.rows[:nrows]:
        table.add_row(*_cells(row, key_w, payload_w, grouped))
    for _ in range(nrows - min(nrows, len(snap.rows))):
        table.add_row("")
    return table


def _head(title: str, sorted_by: bool, reverse: bool) -> Text:
    """A column title; the sorted column is marked ▼ (▲ reversed)."""
    if not sorted_by:
        return Text(title, style="bold")
    return Text(title + ("▲" if reverse else "▼"), style="bold reverse")


#: The clients pane: (title, field, width); the payload-like last column takes the rest.
_CLIENT_COLUMNS = [("id", "id", 6), ("pid", "pid", 8), ("uid", "uid", 6),
                   ("subs", "subscriptions", 5), ("queued", "queued", 7),
                   ("bytes", "queued_bytes", 9), ("drops", "dropped", 7),
                   ("paused", "publishers_paused", 7), ("flood", None, 14)]


def _number(value: object) -> str:
    return fmt_count(value, 8) if isinstance(value, int) else "?"


def _plain(value: object) -> str:
    """An id: digits as they are, no separators."""
    return str(value) if isinstance(value, int) else "?"


def _client_cells(c: dict) -> list[Text | str]:
    dropped = client_value(c, "dropped")
    flood = "/".join(printable(str(c.get(k, "?")), 10) for k in ("soft", "hard"))
    if c.get("nowait"):
        flood += " nowait"
    patterns = c.get("patterns") if isinstance(c.get("patterns"), list) else []
    shown = ", ".join(printable(entry_bytes(str(p)), 60) or "''" for p in patterns[:8])
    more = (c.get("subscriptions") or 0) - min(len(patterns), 8)
    if isinstance(more, int) and more > 0:
        shown += f" (+{more})"
    if c.get("status"):  # the client's own status line (a bridge's counters), escaped
        shown += f"  [{printable(entry_bytes(str(c['status'])), 120)}]"
    me = "*" if c.get("you") else ""
    return [Text(_plain(c.get("id")) + me, style="cyan"), _plain(c.get("pid")),
            _plain(c.get("uid")), _number(c.get("subscriptions")), _number(c.get("queued")),
            fmt_bytes(c["queued_bytes"]) if isinstance(c.get("queued_bytes"), int) else "?",
            Text(_number(dropped), style="bold red" if _number(dropped) not in ("0", "?") else ""),
            _number(c.get("publishers_paused")), flood,
            Text(shown)]


def _clients_table(snap: Snapshot, width: int, nrows: int) -> Table:
    sorted_field = CLIENT_SORT[snap.options.sort.name]
    table = Table(box=None, padding=(0, 0, 0, 1), pad_edge=False, show_edge=False,
                  header_style="bold", expand=False, collapse_padding=True)
    rest = width
    for title, name, w in _CLIENT_COLUMNS:
        table.add_column(_head(title, name == sorted_field, snap.options.reverse), width=w,
                         justify="left" if name is None else "right", no_wrap=True,
                         overflow="ellipsis")
        rest -= w + 1
    table.add_column(Text("patterns", style="bold"), width=max(10, rest), no_wrap=True,
                     overflow="ellipsis")
    rows = snap.clients[:nrows]
    for c in rows:
        table.add_row(*_client_cells(c))
    if snap.clients_note and len(rows) < nrows:  # (why none, or that pages were left)
        table.add_row(*[""] * len(_CLIENT_COLUMNS), Text(snap.clients_note.strip(),
                                                          style="dim"))
        rows = [*rows, {}]
    for _ in range(nrows - len(rows)):
        table.add_row("")
    return table


def _help(nrows: int, width: int) -> list[Text]:
    lines = [Text("keys (any key closes this help)", style="bold")]
    for key, what in HELP:
        lines.append(Text.assemble((f" {key:<10}", "bold"), " ", what))
    lines = lines[:nrows + 1]
    return lines + [Text("")] * (nrows + 1 - len(lines))


#: Bytes of a key escaped for its cell at most (the column is at most 64 wide): a client's
#: 256 KB key of invalid UTF-8 must not cost every redraw a second per row.
NAME_BYTES = 256


def _name(row: Row, grouped: bool) -> str:
    name = printable(row.name, NAME_BYTES)
    return f"{name} ({row.keys})" if grouped and row.keys > 1 else name


def _cells(row: Row, key_w: int, payload_w: int, grouped: bool) -> list[Text | str]:
    name = _name(row, grouped)
    if len(name) > key_w:
        name = name[: key_w - 1] + "…"
    rate_style = "bold" if row.rate > 0 else "dim"
    return [
        Text(name, style="cyan"),
        Text(fmt_rate(row.rate), style=rate_style),
        Text(fmt_bytes(row.byte_rate), style=rate_style),
        fmt_count(row.count, 9),
        fmt_age(row.age),
        Text(preview(row.payload, payload_w - 1)),
    ]


def _recent(snap: Snapshot, width: int, count: int, wall: float) -> list[Text]:
    lines = []
    key_w = max(12, min(40, width // 3))
    for msg in snap.recent[-count:] if count else []:
        stamp = time.strftime("%H:%M:%S", time.localtime(wall - (snap.now - msg.at)))
        key = printable(msg.key, 4 * key_w)
        if len(key) > key_w:
            key = key[: key_w - 1] + "…"
        room = width - len(stamp) - key_w - 2
        lines.append(Text.assemble((stamp, "dim"), " ", (key.ljust(key_w), "cyan"), " ",
                                   preview(msg.payload, room)))
    lines += [Text("")] * (count - len(lines))
    return lines


def _footer(snap: Snapshot, editing: bool, width: int) -> Text:
    opts = snap.options
    if editing:
        return Text.assemble((" filter: ", "bold reverse"), opts.filter, ("█", "blink"),
                             ("  Enter keep · Esc cancel · * or trailing / = pattern", "dim"))
    info = {"s": f"sort:{opts.sort.value}" + (" rev" if opts.reverse else ""),
            "/": f"filter:{opts.filter}" if opts.filter else "filter",
            "g": f"group:{opts.depth}" if opts.depth else "group"}
    out = Text()
    for key, what in FOOTER_KEYS:
        out.append(key, style="bold reverse")
        out.append(f" {info.get(key, what)} ")
    shown, count = ((len(snap.clients), snap.client_count) if opts.pane == CLIENTS_PANE
                    else (len(snap.rows), snap.row_count))
    if count > shown:
        where = f"{opts.scroll + 1}-{opts.scroll + shown}" if opts.scroll else f"{shown}"
        out.append(f" {where}/{count}", style="dim")
    out.truncate(width, overflow="ellipsis")
    return out


def render(snap: Snapshot, width: int, height: int, *, paused: bool = False,
           editing: bool = False, helping: bool = False,
           wall: float | None = None) -> RenderableType:
    """The whole screen for a *width*×*height* terminal (snap should hold `layout(height)`
    rows and recent messages; extra ones are cut, missing ones leave blank lines)."""
    width = max(width, MIN_WIDTH)
    fit = layout(height)
    wall = time.time() if wall is None else wall
    parts: list[RenderableType] = [*_header(snap, paused), _spark(snap, width)]
    if helping:
        parts.extend(_help(fit.rows, width))
    elif snap.options.pane == CLIENTS_PANE:
        parts.append(_clients_table(snap, width, fit.rows))
    else:
        parts.append(_table(snap, width, fit.rows))
    if fit.recent:
        parts.append(Rule("recent messages", style="dim", align="left"))
        parts.extend(_recent(snap, width, fit.recent, wall))
    parts.append(_footer(snap, editing, width))
    for part in parts:
        if isinstance(part, Text):
            part.no_wrap = True
            part.overflow = "ellipsis"
    return Group(*parts)
