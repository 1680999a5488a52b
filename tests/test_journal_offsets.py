"""Offsets and read planning over a real journal, without Spark: any sequence of
admission-limited micro-batches reads every row exactly once; plans survive re-blocking at
seal; rows removed under a planned read are reported exactly."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbus.journal.arrow import DataLoss, RowFilter, read_range  # noqa: E402
from sbus.journal.store import JournalWriter, list_segments  # noqa: E402
from sbus.spark.offsets import START, Offset, advance, gaps, partitions, plan  # noqa: E402
from sbus.spark.source import journal_view  # noqa: E402

TOTAL = 1000


@pytest.fixture(scope="module")
def journal():
    d = Path(tempfile.mkdtemp(prefix="sbus-off-"))
    with JournalWriter(d, segment_bytes=3000, fsync=False, reblock_bytes=0) as w:
        for i in range(TOTAL):
            w.append(10**18 + i, [b"k/%d" % (i % 4)], [b"\0%d" % i])
            if i % 23 == 0 or i % 71 == 0:
                w.flush()
    yield str(d)
    shutil.rmtree(d)


def seqs(journal: str, start: Offset, end: Offset, max_bytes: int) -> list[int]:
    view = journal_view(journal)
    out = []
    for rng in plan(view, start.seq, end.seq, max_bytes):
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
    target = Offset(blocks[0].first_seq)
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
    parts = partitions(view, START.seq, advance(view, START).seq, -(-total // n))
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
    for rng in plan(view, START.seq, end.seq, 1 << 20):
        for batch in read_range(journal, rng, ["key", "seq", "key_bytes"],
                                RowFilter(pattern=b"k/1"), True):
            rows.extend(batch.to_pylist())
    assert [r["seq"] for r in rows] == list(range(2, TOTAL + 1, 4))
    assert {(r["key"], r["key_bytes"]) for r in rows} == {("k/1", None)}


def test_offsets_are_sequence_numbers_and_old_checkpoints_still_resolve(journal):
    view = journal_view(journal)
    seg, blocks = view[1]
    assert Offset.from_dict({"seq": 42}) == Offset(42)
    assert Offset.from_dict({"seq": 42, "lost": 7}).to_dict() == {"seq": 42, "lost": 7}
    old = {"segment": seg, "position": blocks[1].pos, "row": 2}
    assert Offset.from_dict(old, view) == Offset(blocks[1].first_seq + 2)
    with pytest.raises(ValueError, match="not an sbus offset"):
        Offset.from_dict({"segment": 1})


def test_ts_pruning_reads_only_blocks_that_can_match(journal):
    view = journal_view(journal)
    rows = RowFilter(ts_min=(10**18 + 300) // 1000, ts_max=(10**18 + 309) // 1000)
    parts = partitions(view, START.seq, advance(view, START).seq, 1 << 20,
                       lambda b: rows.keeps_block(b.min_ts, b.max_ts))
    got = [s for p in parts for rng in p
           for batch in read_range(journal, rng, ["seq"], rows)
           for s in batch.column("seq").to_pylist()]
    # ts is in microseconds: rows 0..999 ns apart share one microsecond, so all match.
    assert got == list(range(1, TOTAL + 1))
    narrow = RowFilter(ts_min=10**15 + 1)  # after every row
    assert partitions(view, START.seq, TOTAL + 1, 1 << 20,
                      lambda b: narrow.keeps_block(b.min_ts, b.max_ts)) == []


def rows_of(journal, view, start, end, **kw):
    return [s for rng in plan(view, start, end, 1 << 20)
            for batch in read_range(journal, rng, ["seq"], **kw)
            for s in batch.column("seq").to_pylist()]


def test_a_plan_over_the_open_segment_reads_right_after_it_is_re_blocked(tmp_path):
    """Sealing re-writes a segment of small blocks as one large block, so the byte
    positions planned while it was open are wrong afterwards: the reader finds the rows by
    sequence number instead, and coalesces blocks into large record batches."""
    w = JournalWriter(tmp_path, fsync=False)
    for i in range(300):
        w.append(10**18 + i * 10**6, [b"k/%d" % (i % 3)], [b"p%d" % i])
        w.flush()  # one block per record, as a slow trickle recorded makes
    view = journal_view(str(tmp_path))
    (seg, blocks), = view
    assert len(blocks) == 300
    planned = plan(view, 101, 201, 1 << 20)
    w.close()
    (sealed,) = list_segments(tmp_path)
    assert sealed.sealed and len(journal_view(str(tmp_path))[0][1]) == 1
    got = [batch for rng in planned for batch in read_range(str(tmp_path), rng, ["seq"])]
    assert len(got) == 1 and got[0].column("seq").to_pylist() == list(range(101, 201))


def test_rows_removed_under_a_planned_read_are_reported_exactly(tmp_path):
    """The retention race: a read planned over a segment that is then deleted raises
    DataLoss with the count and range (failOnDataLoss=true), or hands them to on_loss."""
    with JournalWriter(tmp_path, segment_bytes=2000, fsync=False) as w:
        for i in range(200):
            w.append(10**18 + i, [b"k"], [b"x" * 20])
            w.flush()
    view = journal_view(str(tmp_path))
    assert len(view) > 3
    end = advance(view, START).seq
    planned = plan(view, 1, end, 1 << 30)
    first = list_segments(tmp_path)[0]
    gone = (view[0][1][0].first_seq, view[0][1][-1].next_seq)
    first.path.unlink()  # retention, after planning
    with pytest.raises(DataLoss, match=f"{gone[1] - gone[0]} rows lost: seq {gone[0]}.."
                                       f"{gone[1] - 1} .*removed"):
        [b for rng in planned for b in read_range(str(tmp_path), rng, ["seq"])]
    lost = []
    got = [s for rng in planned
           for b in read_range(str(tmp_path), rng, ["seq"],
                               on_loss=lambda lo, hi, why: lost.append((lo, hi)))
           for s in b.column("seq").to_pylist()]
    assert lost == [gone] and got == list(range(gone[1], end))
    # Planned afresh, the gap shows from a start before it, never from the beginning.
    now = journal_view(str(tmp_path))
    assert gaps(now, 1, end) == [gone] and gaps(now, START.seq, end) == []


def test_rows_gone_under_a_planned_micro_batch_count_in_the_next_offset(tmp_path):
    """The driver's side of the retention race, failOnDataLoss=false: a micro-batch's
    offsets are planned, retention deletes a segment it reads before its partitions are
    planned (or before it is replayed after a restart).  The rows are skipped and the next
    end offset counts them, in a batch of no rows when there is nothing more to read."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from sbus.journal.arrow import arrow_schema
    from sbus.spark.options import ReadOptions
    from sbus.spark.source import StreamReader

    with JournalWriter(tmp_path, segment_bytes=2000, fsync=False) as w:
        for i in range(200):
            w.append(10**18 + i, [b"k"], [b"x" * 20])
            w.flush()

    def reader(fail: str) -> StreamReader:
        opts = ReadOptions({"path": str(tmp_path), "failOnDataLoss": fail}, True)
        return StreamReader(opts, arrow_schema(["seq"]))

    r = reader("false")
    start = r.initialOffset()
    end = r.latestOffset(start, ReadAllAvailable())
    assert (plain(start), plain(end)) == ({"seq": 1}, {"seq": 201, "from": 1})
    first = list_segments(tmp_path)[0]
    first.path.unlink()  # retention, after the batch was planned
    gone = list_segments(tmp_path)[0].first_seq - 1
    got = [s for p in r.partitions(start, end) for b in r.read(p)
           for s in b.column("seq").to_pylist()]
    assert got == list(range(gone + 1, 201))
    with pytest.raises(DataLoss, match=f"planned micro-batch: {gone} rows lost: seq 1..{gone} "):
        reader("true").partitions(start, end)  # the same batch replayed by a failing query
    nxt = r.latestOffset(end, ReadAllAvailable())
    assert plain(nxt) == {"seq": 201, "from": 201, "lost": gone, "lostAfterPlanning": gone}
    assert r.partitions(end, nxt) == []
    assert r.latestOffset(nxt, ReadAllAvailable()) == nxt  # counted once: no more batches
    r.stop()


def plain(offset: dict) -> dict:
    """*offset* without the journal's identity (each journal made here has its own)."""
    assert isinstance(offset.get("journal", ""), str)
    return {k: v for k, v in offset.items() if k != "journal"}


def _reader(path, fail: str, **more):
    from sbus.journal.arrow import arrow_schema
    from sbus.spark.options import ReadOptions
    from sbus.spark.source import StreamReader

    opts = ReadOptions({"path": str(path), "failOnDataLoss": fail, **more}, True)
    return StreamReader(opts, arrow_schema(["seq"]))


def _journal_of_segments(path) -> None:
    with JournalWriter(path, segment_bytes=2000, fsync=False) as w:
        for i in range(200):
            w.append(10**18 + i, [b"k"], [b"x" * 20])
            w.flush()


def test_batch_0_replayed_after_retention_reads_from_where_it_was_planned(tmp_path):
    """Spark logs batch 0's end offset, not its start, and asks the initial offset again
    when it replays batch 0 after a restart: by then retention may have moved the
    journal's first row.  The end offset names where the batch started ("from"), so the
    rows removed are an error or counted, never silently skipped."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    _journal_of_segments(tmp_path)
    r = _reader(tmp_path, "true")
    start = r.initialOffset()
    end = r.latestOffset(start, ReadAllAvailable())  # logged by Spark; then kill -9
    assert plain(end) == {"seq": 201, "from": 1}
    list_segments(tmp_path)[0].path.unlink()  # retention while the query is down
    gone = list_segments(tmp_path)[0].first_seq - 1
    again = _reader(tmp_path, "true")  # the restarted query
    assert plain(again.initialOffset()) == {"seq": gone + 1}  # where the journal begins now
    with pytest.raises(DataLoss, match=f"planned micro-batch: {gone} rows lost: seq 1..{gone} "):
        again.partitions(again.initialOffset(), end)
    skip = _reader(tmp_path, "false")
    parts = skip.partitions(skip.initialOffset(), end)
    got = [s for p in parts for b in skip.read(p) for s in b.column("seq").to_pylist()]
    assert got == list(range(gone + 1, 201))
    assert plain(skip.latestOffset(end, ReadAllAvailable())) == \
        {"seq": 201, "from": 201, "lost": gone, "lostAfterPlanning": gone}
    skip.stop()


def test_rows_a_task_finds_gone_count_in_the_next_offset(tmp_path):
    """Retention deletes a segment after the batch's partitions were planned and before
    its task opens it: the task reports the range, the next end offset counts it."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

    _journal_of_segments(tmp_path)
    r = _reader(tmp_path, "false")
    start = r.initialOffset()
    end = r.latestOffset(start, ReadMaxRows(100))
    parts = r.partitions(start, end)
    first = list_segments(tmp_path)[0]
    gone = list_segments(tmp_path)[1].first_seq - 1
    first.path.unlink()  # after planning, before reading
    got = [s for p in parts for b in r.read(p) for s in b.column("seq").to_pylist()]
    assert got == list(range(gone + 1, 101))
    nxt = r.latestOffset(end, ReadAllAvailable())
    assert plain(nxt) == {"seq": 201, "from": 101, "lost": gone, "lostAfterPlanning": gone}
    parts = r.partitions(end, nxt)
    assert [s for p in parts for b in r.read(p) for s in b.column("seq").to_pylist()] == \
        list(range(101, 201))
    assert r.latestOffset(nxt, ReadAllAvailable()) == nxt  # each row counted once
    r.stop()


def test_merged_reads_give_the_blocks_rows_in_large_blocks(tmp_path):
    """Consecutive blocks come merged (one copy each, offsets shifted, CRC checked per
    block): the same rows as block by block, in blocks of at least the asked rows or bytes,
    never across a gap in the sequence numbers."""
    from sbus.journal.store import read_blocks, read_seq_range, segment_blocks

    with JournalWriter(tmp_path, fsync=False, reblock_bytes=0) as w:
        for i in range(120):
            w.append(10**18 + i, [b"k/%d" % (i % 5)] * 3, [b"p" * (i % 17)] * 3)
            w.flush()
    (seg,) = list_segments(tmp_path)
    blocks = segment_blocks(seg)

    def rows(bs):
        return [r for b in bs for r in b.records()]

    every = rows(read_blocks(tmp_path, seg.first_seq, blocks[0].pos, blocks[-1].end))
    for merge in ((10, 1 << 20), (1000, 1 << 20), (1 << 20, 50)):
        got = list(read_seq_range(tmp_path, seg.first_seq, 0, 0, 1, 361, merge=merge))
        assert rows(got) == every
        assert all(b.count >= merge[0] or len(b.keys) + len(b.payloads) >= merge[1]
                   for b in got[:-1])
    assert len(list(read_seq_range(tmp_path, seg.first_seq, 0, 0, 1, 361,
                                   merge=(1000, 1 << 20)))) == 1
    # only the blocks holding rows 100..199 are read, from the index of the sealed segment
    got = list(read_seq_range(tmp_path, seg.first_seq, 0, 0, 100, 200, merge=(10**6, 10**9)))
    assert got[0].first_seq == 100 - 100 % 3 + 1 and got[0].count == 102


def test_a_journal_that_went_back_under_a_query_is_an_error_or_counted(tmp_path):
    """The recorder lost its last rows (a power loss: the open segment is fsynced only
    at its seal; or a journal put back from an older copy) and numbers new rows from its
    end again, below the offset a query had reached: the query skipped them without a
    word (300 in the audit).  Now that is an error, or counted once."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    _journal_of_segments(tmp_path)
    r = _reader(tmp_path, "true")
    end = r.latestOffset(r.initialOffset(), ReadAllAvailable())
    assert plain(end) == {"seq": 201, "from": 1}
    last = list_segments(tmp_path)[-1]
    last.path.unlink()  # the rows the machine lost
    with JournalWriter(tmp_path, segment_bytes=2000, fsync=False) as w:
        for i in range(5):  # numbered from the journal's end again
            w.append(2 * 10**18 + i, [b"k"], [b"new"])
    back = last.first_seq + 5
    with pytest.raises(DataLoss, match=f"the journal ends at seq {back}, before this "
                                       f"query's offset 201: .* skips {201 - back} new rows"):
        _reader(tmp_path, "true").latestOffset(end, ReadAllAvailable())
    skip = _reader(tmp_path, "false")
    nxt = skip.latestOffset(end, ReadAllAvailable())
    assert plain(nxt) == {"seq": 201, "from": 201, "lost": 201 - back}
    assert skip.latestOffset(nxt, ReadAllAvailable()) == nxt  # counted once
    skip.stop()
    fresh = _reader(tmp_path, "true", startingOffsets='{"seq": 300}')  # a start not yet
    assert fresh.latestOffset({"seq": 300}, ReadAllAvailable()) == {"seq": 300}  # recorded


def test_a_journal_removed_and_recorded_anew_under_a_query_is_an_error_or_read_whole(
        tmp_path):
    """The journal is removed and recorded again from seq 1 under a query's checkpoint
    (its identity, `journal.id`, changes): the offset means nothing in the new one.  An
    error naming it; with failOnDataLoss=false the next batch reads the new journal from
    its first row.  Before, the query skipped the new rows up to its old offset, counting
    only those past the new journal's end (the audit of 2026-11-28: 3,000 skipped, 2,000
    counted)."""
    import shutil

    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from sbus.journal.store import journal_id

    _journal_of_segments(tmp_path)
    old = journal_id(tmp_path)
    r = _reader(tmp_path, "false")
    end = r.latestOffset(r.initialOffset(), ReadAllAvailable())
    assert end == {"seq": 201, "from": 1, "journal": old}
    shutil.rmtree(tmp_path)
    with JournalWriter(tmp_path, segment_bytes=2000, fsync=False) as w:
        for i in range(150):  # numbered from 1 again: below the query's offset
            w.append(2 * 10**18 + i, [b"k"], [b"new"])
            w.flush()
    new = journal_id(tmp_path)
    assert new is not None and new != old
    with pytest.raises(DataLoss, match=f"another one than the one this query's offsets are "
                                       f"of \\(its id was {old}, it is {new}"):
        _reader(tmp_path, "true").latestOffset(end, ReadAllAvailable())
    nxt = r.latestOffset(end, ReadAllAvailable())  # the same reader: its cache too
    assert nxt == {"seq": 151, "from": 1, "journal": new}
    got = [s for p in r.partitions(end, nxt) for b in r.read(p)
           for s in b.column("seq").to_pylist()]
    assert got == list(range(1, 151))
    assert r.latestOffset(nxt, ReadAllAvailable()) == nxt  # then on as usual
    r.stop()
    with JournalWriter(tmp_path, fsync=False) as w:  # the id stays with the journal
        assert w.id == new
