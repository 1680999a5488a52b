"""Offsets and read planning over a real journal, without Spark: any sequence of
admission-limited micro-batches reads every row exactly once."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbus.journal.store import JournalWriter  # noqa: E402
from sbus.spark.arrow import read_range  # noqa: E402
from sbus.spark.offsets import START, Offset, advance, partitions, plan  # noqa: E402
from sbus.spark.source import journal_view  # noqa: E402

TOTAL = 1000


@pytest.fixture(scope="module")
def journal():
    d = Path(tempfile.mkdtemp(prefix="sbus-off-"))
    with JournalWriter(d, segment_bytes=3000, fsync=False) as w:
        for i in range(TOTAL):
            w.append(10**18 + i, [b"k/%d" % (i % 4)], [b"\0%d" % i])
            if i % 23 == 0 or i % 71 == 0:
                w.flush()
    yield str(d)
    shutil.rmtree(d)


def seqs(journal: str, start: Offset, end: Offset, max_bytes: int) -> list[int]:
    view = journal_view(journal)
    out = []
    for rng in plan(view, start, end, max_bytes):
        for batch in read_range(journal, rng, ["seq"]):
            out.extend(batch.column("seq").to_pylist())
    return out


def test_whole_journal_in_order(journal):
    view = journal_view(journal)
    assert len(view) > 5
    end = advance(view, START)
    assert seqs(journal, START, end, 1 << 20) == list(range(1, TOTAL + 1))
    assert advance(view, end) == end  # nothing new
    assert seqs(journal, end, end, 100) == []


@settings(max_examples=40, deadline=None)
@given(limits=st.lists(st.integers(1, 180), min_size=1, max_size=40),
       max_bytes=st.integers(1, 4000))
def test_limited_batches_cover_every_row_once(journal, limits, max_bytes):
    view = journal_view(journal)
    got: list[int] = []
    pos = START
    i = 0
    while True:
        limit = limits[i % len(limits)]
        end = advance(view, pos, limit)
        if end == pos:
            break
        batch = seqs(journal, pos, end, max_bytes)
        assert 0 < len(batch) <= limit
        got.extend(batch)
        pos = Offset.from_dict(end.to_dict())  # offsets survive the JSON checkpoint
        i += 1
    assert got == list(range(1, TOTAL + 1))


def test_target_caps_available_now(journal):
    """Rows recorded after prepareForTriggerAvailableNow's target are not read."""
    view = journal_view(journal)
    seg, blocks = view[2]
    target = Offset(seg, blocks[0].pos)
    end = advance(view, START, None, target)
    assert end <= target
    assert seqs(journal, START, end, 1 << 20) == list(range(1, blocks[0].first_seq))
    assert advance(view, end, None, target) == end
    limited = advance(view, START, 5, target)
    assert seqs(journal, START, limited, 1 << 20) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_partitions_split_evenly_across_segments(journal, n):
    """Asked for n equal shares, planning gives n partitions of nearly equal bytes, spanning
    segment boundaries, in journal order and covering every block once."""
    view = journal_view(journal)
    blocks = [(seg, b) for seg, bs in view for b in bs]
    total = sum(b.size for _, b in blocks)
    parts = partitions(view, START, advance(view, START), -(-total // n))
    assert len(parts) == n
    assert any(len({r.segment for r in p}) > 1 for p in parts)

    def inside(p):
        return [(seg, b) for seg, b in blocks
                if any(r.segment == seg and r.start <= b.pos < r.end for r in p)]

    assert [x for p in parts for x in inside(p)] == blocks
    biggest = max(b.size for _, b in blocks)
    for p in parts[:-1]:
        assert total / n <= sum(b.size for _, b in inside(p)) < total / n + biggest


def test_pattern_filter_in_reader(journal):
    view = journal_view(journal)
    end = advance(view, START)
    rows = []
    for rng in plan(view, START, end, 1 << 20):
        for batch in read_range(journal, rng, ["key", "seq", "key_bytes"], b"k/1", True):
            rows.extend(batch.to_pylist())
    assert [r["seq"] for r in rows] == list(range(2, TOTAL + 1, 4))
    assert {(r["key"], r["key_bytes"]) for r in rows} == {("k/1", None)}
