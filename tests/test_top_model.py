"""sbus-top's pure parts: counting, rates, LRU, grouping, sorting, filtering, previews,
keys and the screen layout — driven with made-up times, no broker needed."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from sbus.protocol import Control, Publish
from sbus.top.controls import Action, Controls, split_keys
from sbus.top.model import (
    SortBy,
    TrafficModel,
    ViewOptions,
    compile_filter,
    group_key,
    preview,
)
from sbus.top.view import fmt_bytes, fmt_count, fmt_rate, layout, render, sparkline


def msgs(key: str, n: int, payload: bytes = b"x") -> list[Publish]:
    return [Publish(key.encode(), payload)] * n


def test_rates_come_from_counts_between_ticks():
    m = TrafficModel(0.0)
    m.feed(msgs("a/b", 300, b"12345"), 0.5)
    m.feed(msgs("a/c", 30), 0.7)
    m.tick(1.0)
    m.feed(msgs("a/b", 100, b"12345"), 1.5)
    m.tick(2.0)
    snap = m.snapshot(2.0)
    rows = {r.name: r for r in snap.rows}
    assert rows[b"a/b"].rate == 100 and rows[b"a/b"].byte_rate == 500
    assert rows[b"a/b"].count == 400
    assert rows[b"a/c"].rate == 0 and rows[b"a/c"].count == 30  # went quiet
    assert snap.rate == 100 and snap.total == 430 and snap.total_bytes == 400 * 5 + 30
    assert snap.history == [330.0, 100.0]
    m.tick(4.0)  # a two-second gap: the rate is per second, not per tick
    assert m.snapshot(4.0).history[-1] == 0


def test_history_keeps_one_minute():
    m = TrafficModel(0.0)
    for t in range(1, 100):
        m.feed(msgs("k", t), t - 0.5)
        m.tick(float(t))
    assert len(m.history) == 60 and m.history[-1] == 99 and m.history[0] == 40


def test_lru_bounds_memory_and_keeps_the_recent_keys():
    m = TrafficModel(0.0, max_keys=100)
    m.feed([Publish(b"hot", b"1")], 0.1)
    for i in range(5000):
        m.feed([Publish(f"cold/{i}".encode(), b"")], 0.2)
        if i % 50 == 0:
            m.feed([Publish(b"hot", b"1")], 0.2)  # touched: stays
    assert len(m.keys) == 100
    assert b"hot" in m.keys and b"cold/4999" in m.keys and b"cold/0" not in m.keys
    assert m.evicted == 5001 - 100
    assert m.total == 5000 + 101  # evicted keys still count in the totals
    assert m.snapshot(1.0).keys == 100


def test_recent_messages_are_the_last_ones_in_order():
    m = TrafficModel(0.0, recent=5)
    m.feed([Publish(f"k{i}".encode(), str(i).encode()) for i in range(1000)], 1.0)
    assert [x.payload for x in m.recent] == [b"995", b"996", b"997", b"998", b"999"]
    assert m.snapshot(1.0, recent=2).recent[-1].key == b"k999"


def test_broker_drop_reports_are_counted_and_other_controls_returned():
    m = TrafficModel(0.0)
    other = m.feed([Control(b"blocking/dropped", b"17"), Control(b"!/cred/whoami", b"!/cred/0/0/1"),
                    Control(b"blocking/dropped", b"3")], 1.0)
    assert m.dropped == 20 and m.total == 0
    assert other == [Control(b"!/cred/whoami", b"!/cred/0/0/1")]


def test_packets_the_broker_never_sends_are_not_counted():
    m = TrafficModel(0.0)
    assert m.feed_packets([b"MSG no-nul", b"", b"HELLO", b"SUB x", b"MSG k\0ok"], 1.0) == []
    assert m.total == 1 and list(m.keys) == [b"k"]


def test_clear_forgets_counts():
    m = TrafficModel(0.0)
    m.feed(msgs("a", 10) + [Control(b"blocking/dropped", b"2")], 0.5)
    m.tick(1.0)
    m.clear(1.5)
    snap = m.snapshot(2.0)
    assert (snap.total, snap.keys, snap.dropped, snap.rate, snap.rows, snap.recent) == \
        (0, 0, 0, 0, [], [])
    assert snap.uptime == 2.0


def test_group_key():
    assert group_key(b"a/b/c", 0) == b"a/b/c"
    assert group_key(b"a/b/c", 1) == b"a/"
    assert group_key(b"a/b/c", 2) == b"a/b/"
    assert group_key(b"a/b/c", 3) == b"a/b/c"
    assert group_key(b"a/b/c", 9) == b"a/b/c"
    assert group_key(b"plain", 1) == b"plain"


def test_grouping_sums_rows_and_keeps_the_newest_payload():
    m = TrafficModel(0.0)
    m.feed(msgs("s/kitchen/t", 10, b"old"), 0.2)
    m.feed(msgs("s/hall/t", 5, b"new"), 0.6)
    m.feed(msgs("x/y", 1), 0.6)
    m.tick(1.0)
    snap = m.snapshot(1.0, ViewOptions(depth=1))
    rows = {r.name: r for r in snap.rows}
    assert set(rows) == {b"s/", b"x/"}
    assert rows[b"s/"].count == 15 and rows[b"s/"].rate == 15 and rows[b"s/"].keys == 2
    assert rows[b"s/"].payload == b"new"
    assert rows[b"s/"].age == pytest.approx(0.4)


def test_sorting():
    m = TrafficModel(0.0)
    m.feed(msgs("b", 10, b"1"), 0.1)
    m.feed(msgs("a", 5, b"1234567890"), 0.2)
    m.feed(msgs("c", 1), 0.9)
    m.tick(1.0)
    names = {s: [r.name for r in m.snapshot(1.0, ViewOptions(sort=s)).rows] for s in SortBy}
    assert names[SortBy.RATE] == [b"b", b"a", b"c"]
    assert names[SortBy.BYTE_RATE] == [b"a", b"b", b"c"]
    assert names[SortBy.TOTAL] == [b"b", b"a", b"c"]
    assert names[SortBy.LAST] == [b"c", b"a", b"b"]
    assert names[SortBy.KEY] == [b"a", b"b", b"c"]
    limited = m.snapshot(1.0, ViewOptions(sort=SortBy.TOTAL), limit=2)
    assert [r.name for r in limited.rows] == [b"b", b"a"] and limited.row_count == 3
    assert TrafficModel(0.0).snapshot(1.0, limit=5).rows == []


def test_filter_substring_and_pattern():
    assert compile_filter("")(b"anything")
    sub = compile_filter("kit")
    assert sub(b"s/kitchen/t") and not sub(b"s/hall/t")
    pat = compile_filter("s/*/t")
    assert pat(b"s/kitchen/t") and not pat(b"s/kitchen/t/x") and not pat(b"xs/kitchen/t")
    tail = compile_filter("s/")
    assert tail(b"s/a/b") and not tail(b"sx/a")
    m = TrafficModel(0.0)
    m.feed(msgs("s/kitchen/t", 2) + msgs("s/hall/t", 1), 0.5)
    snap = m.snapshot(1.0, ViewOptions(filter="hall"))
    assert [r.name for r in snap.rows] == [b"s/hall/t"]
    assert {x.key for x in snap.recent} == {b"s/hall/t"}


@pytest.mark.parametrize("payload,limit,shown", [
    (b"21.5 C", 20, "21.5 C"),
    (b"hello world", 6, "hello\u2026"),
    (b"line1\nline2\tx", 20, "line1\u21b5line2 x"),
    ("gr\u00fc\u00dfe".encode(), 10, "gr\u00fc\u00dfe"),
    (b"\xde\xad\xbe\xef", 20, "de ad be ef"),
    (b"\xde\xad\xbe\xef", 11, "de ad be ef"),
    (b"\xde\xad\xbe\xef", 8, "de ad\u2026"),
    (b"\x00\x01text", 40, "00 01 74 65 78 74"),
    (b"", 10, ""),
    (b"abc", 0, ""),
])
def test_preview(payload, limit, shown):
    assert preview(payload, limit) == shown
    assert len(preview(payload, limit)) <= limit


def test_preview_of_long_text_cut_inside_a_character():
    text = ("\u00e9" * 100).encode()  # 2 bytes each: our byte cut splits one
    out = preview(text, 10)
    assert out == "\u00e9" * 9 + "\u2026"


def test_controls_keys():
    c = Controls()
    assert c.press("s") is Action.REDRAW and c.options.sort is SortBy.BYTE_RATE
    for _ in range(len(SortBy) - 1):
        c.press("s")
    assert c.options.sort is SortBy.RATE
    assert c.press("p") is Action.REDRAW and c.paused
    c.press("p")
    assert not c.paused
    c.press("g")
    assert c.options.depth == 1
    c.press("+")
    c.press("+")
    assert c.options.depth == 3
    c.press("-")
    assert c.options.depth == 2
    c.press("g")
    assert c.options.depth == 0
    c.press("-")
    assert c.options.depth == 0
    assert c.press("c") is Action.CLEAR
    assert c.press("x") is Action.NONE
    assert c.press("q") is Action.QUIT


def test_filter_typing_enter_and_escape():
    c = Controls(ViewOptions(filter="old"))
    c.press("/")
    assert c.editing
    for k in "abq":  # q types, it does not quit while editing
        assert c.press(k) is Action.REDRAW
    assert c.options.filter == "oldabq"
    c.press("\x7f")
    c.press("\r")
    assert not c.editing and c.options.filter == "oldab"
    c.press("/")
    c.press("z")
    c.press("\x1b")
    assert c.options.filter == "oldab" and not c.editing
    c.press("/")
    for _ in range(10):
        c.press("\x7f")
    c.press("\n")
    assert c.options.filter == ""


def test_split_keys():
    assert split_keys("sq") == ["s", "q"]
    assert split_keys("\x1b[A/x\x1b") == ["\x1b[A", "/", "x", "\x1b"]
    assert split_keys("\x1b[15~g") == ["\x1b[15~", "g"]


def test_number_formats():
    assert [fmt_rate(v) for v in (0, 2.5, 7, 812, 12345, 1_500_000)] == \
        ["0", "2.5", "7", "812", "12.3k", "1.5M"]
    assert fmt_bytes(512) == "512 B" and fmt_bytes(12345) == "12.3 kB"
    assert fmt_bytes(4_500_000) == "4.5 MB"
    assert fmt_count(123456) == "123,456" and fmt_count(12_345_678_901, 10) == "12.3G"


def test_sparkline():
    assert sparkline([], 5) == "     "
    assert sparkline([1, 2, 4, 8], 4) == "\u2581\u2582\u2584\u2588"
    assert sparkline([100, 99, 50], 3) == "\u2588\u2588\u2584"
    assert sparkline([0, 5], 4) == "   \u2588"
    assert sparkline(list(range(100)), 10)[-1] == "\u2588"
    assert len(sparkline(list(range(100)), 10)) == 10


@pytest.mark.parametrize("width,height", [(80, 24), (100, 30), (132, 50), (60, 10)])
def test_screen_fills_the_terminal_exactly(width, height):
    m = TrafficModel(0.0, address="/run/sbus.socket")
    m.feed([Publish(f"k/{i}".encode(), b"v" * i) for i in range(200)], 0.5)
    m.tick(1.0)
    fit = layout(height)
    snap = m.snapshot(1.0, limit=fit.rows, recent=fit.recent)
    console = Console(record=True, width=width, height=height, file=io.StringIO(),
                      color_system=None)
    console.print(render(snap, width, height, wall=0))
    lines = console.export_text().splitlines()
    assert len(lines) == height
    assert max(len(line) for line in lines) <= width
    assert lines[-1].startswith("q quit")
    assert lines[-1].endswith(f" {fit.rows}/200") or width < 80


def test_what_a_publisher_makes_the_viewer_hold_is_bounded_in_bytes():
    """Many long keys with large payloads: the model stays within max_bytes by its own
    count, and that count covers what tracemalloc sees it allocate."""
    import gc
    import tracemalloc

    from sbus.top.model import PREVIEW_BYTES

    model = TrafficModel(0.0, max_keys=10_000, max_bytes=4 << 20)
    payload = b"p" * 200_000
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(400):
            key = b"k/%d/" % i + b"x" * (i * 100)
            model.feed_packets([b"MSG " + key + b"\0" + payload], float(i))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert model.held <= 4 << 20 and model.evicted > 0
    assert used <= model.held + (1 << 20)  # recent messages and history besides
    newest = model.keys[next(reversed(model.keys))]
    assert len(newest.last_payload) == PREVIEW_BYTES and newest.nbytes == len(payload)


def test_reverse_and_scroll_pick_the_rows_shown():
    m = TrafficModel(0.0)
    for i in range(10):
        m.feed(msgs(f"k{i}", 1), 0.1)
    def names(**view) -> list[bytes]:
        return [r.name for r in m.snapshot(1.0, ViewOptions(sort=SortBy.KEY, **view),
                                           limit=3).rows]
    assert names() == [b"k0", b"k1", b"k2"]
    assert names(reverse=True) == [b"k9", b"k8", b"k7"]
    assert names(scroll=4) == [b"k4", b"k5", b"k6"]
    assert names(scroll=4, reverse=True) == [b"k5", b"k4", b"k3"]
    assert names(scroll=1000) == [b"k7", b"k8", b"k9"]  # past the end: the last page
    snap = m.snapshot(1.0, ViewOptions(sort=SortBy.KEY, scroll=1000), limit=3)
    assert snap.options.scroll == 7  # the screen puts this back into the controls


def test_keys_for_scrolling_reverse_help_and_the_clients_pane():
    c = Controls(ViewOptions(scroll=0))
    c.page = 5
    assert c.press("\x1b[B") is Action.REDRAW and c.options.scroll == 1
    c.press("\x1b[6~")
    assert c.options.scroll == 6
    c.press("\x1b[A")
    c.press("\x1b[5~")
    assert c.options.scroll == 0  # never above the top
    c.press("\x1b[F")
    assert c.options.scroll > 1000  # the end (the model clamps it)
    c.press("r")
    assert c.options.reverse and c.options.scroll == 0
    assert c.press("\t") is Action.REDRAW and c.options.pane == "clients"
    assert c.press("?") is Action.REDRAW and c.helping
    assert c.press("s") is Action.REDRAW and not c.helping  # any key closes the help...
    assert c.options.sort is SortBy.RATE  # ... and does nothing else
    c.press("?")
    assert c.press("q") is Action.QUIT


def test_clients_pane_from_the_broker_answer():
    m = TrafficModel(0.0)
    m.take_status(b'{"broker": {"you": 2}, "clients": [{"id": 1, "queued_bytes": 10, '
                  b'"patterns": ["a/\\u001b"], "subscriptions": 3}, {"id": 2, "queued_bytes": 50,'
                  b' "patterns": [""], "subscriptions": 1}, "junk"], "more": false}')
    snap = m.snapshot(1.0, ViewOptions(pane="clients"), limit=5)
    assert [c["id"] for c in snap.clients] == [2, 1]  # most queued first
    assert snap.clients[0]["you"] and not snap.clients[1]["you"]
    text = Console(width=100, height=24, file=io.StringIO(), record=True)
    text.print(render(snap, 100, 24))
    screen = text.export_text()
    assert "a/\\x1b (+2)" in screen and "2*" in screen and "\x1b" not in screen
    head = next(line for line in screen.splitlines() if "patterns" in line)
    assert head.split() == ["id", "pid", "uid", "subs", "queued", "bytes▼", "drops", "paused",
                            "flood", "patterns"]
    m.take_status(b"not json")
    snap = m.snapshot(1.0, ViewOptions(pane="clients"), limit=5)
    assert snap.clients == [] and snap.clients_note == "the broker's status answer was not JSON"


def test_the_clients_pane_takes_every_page_of_the_answer():
    """A client of many strange patterns fills a page alone: the pane showed the first
    page only, so one user could hide every later client from root."""
    m = TrafficModel(0.0)
    assert m.status_round()
    first = {"broker": {"you": 3}, "clients": [{"id": 1}], "more": True, "next": {"after": 1}}
    assert m.take_status(json.dumps(first).encode()) == b'{"after": 1}'
    assert not m.status_round()  # not while the pages are coming
    last = {"broker": {"you": 3}, "clients": [{"id": 2}, {"id": 3}], "more": False}
    assert m.take_status(json.dumps(last).encode()) is None
    snap = m.snapshot(1.0, ViewOptions(pane="clients"), limit=5)
    assert sorted(c["id"] for c in snap.clients) == [1, 2, 3] and snap.clients_note == ""
    assert m.status_round()
    for i in range(100):  # an endless answer: cut, and said
        page = {"clients": [{"id": i}], "more": True, "next": {"after": i}}
        if m.take_status(json.dumps(page).encode()) is None:
            break
    snap = m.snapshot(1.0, ViewOptions(pane="clients"), limit=100)
    assert snap.client_count == 32 and "first 32 pages" in snap.clients_note
    text = Console(width=100, height=60, file=io.StringIO(), record=True)
    text.print(render(snap, 100, 60))
    assert "(the first 32 pages" in text.export_text()  # said, under the rows
    assert m.status_round()
    m.take_status(json.dumps(first).encode())  # a page, then the connection lost
    assert not any(m.status_round() for _ in range(5)) and m.status_round()
