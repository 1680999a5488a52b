"""Where the journal misses messages (``gaps.jsonl``): the codec, the writer's notes, the
readers.  The recorder's own notes against a real broker are in test_journal.py (a
restart, kill -9, a queue overrun) and test_attacks_outputs.py (another user's flood,
oversized messages)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SBUS
from faultkit import PipeLines

from sbus.journal import gaps
from sbus.journal.format import FormatError
from sbus.journal.gaps import Gap
from sbus.journal.read import read_gaps
from sbus.journal.store import JournalError, JournalWriter, list_segments


def test_a_gap_round_trips_and_merges_into_the_span_of_both():
    a = Gap(3, 4, gaps.DROPPED, 10, None, 100)
    assert gaps.decode(gaps.encode(a)) == a
    b = Gap(7, 9, gaps.DROPPED, 5, 90, 200)
    assert a.merged(b) == Gap(3, 9, gaps.DROPPED, 15, 90, 200)


@pytest.mark.parametrize("line", [
    b"", b"nonsense", b"[]", b"\xff\xfe", b"[" * 100_000,
    b'{"after": 1, "before": 2, "kind": "away", "lost": null, "from": null}',  # one missing
    b'{"after": 2, "before": 2, "kind": "away", "lost": null, "from": null, "to": 1}',
    b'{"after": -1, "before": 2, "kind": "away", "lost": null, "from": null, "to": 1}',
    b'{"after": 1, "before": 2, "kind": "\\u001b[2J", "lost": null, "from": null, "to": 1}',
    b'{"after": 1, "before": 2, "kind": "away", "lost": true, "from": null, "to": 1}',
    b'{"after": 1, "before": 2, "kind": "away", "lost": 1.5, "from": null, "to": 1}',
    b'{"after": 1, "before": 1e999, "kind": "away", "lost": null, "from": null, "to": 1}',
    b'{"after": 1, "before": 2, "kind": "dropped", "lost": null, "from": null, "to": 1}',
    b'{"after": 1, "before": 2, "kind": "away", "lost": 3, "from": null, "to": 1}',
    b'{"after": 1, "before": 2, "kind": "away", "lost": null, "from": null, "to": 1, '
    b'"x": "' + b"y" * 600 + b'"}',
])
def test_anything_but_a_gap_line_is_a_format_error(line: bytes):
    with pytest.raises(FormatError):
        gaps.decode(line)


def _lines(directory: Path) -> list[tuple]:
    return [(g.kind, g.after, g.before, g.lost) for g in read_gaps(directory)]


def test_notes_of_a_kind_within_a_flush_are_one_line_placed_between_records(tmp_path: Path):
    w = JournalWriter(tmp_path, fsync=False)
    w.append(1, [b"k"] * 3, [b"p"] * 3)
    w.note_gap(gaps.DROPPED, lost=2)        # after record 3 (buffered, not yet written)
    w.append(2, [b"k"] * 2, [b"p"] * 2)
    w.note_gap(gaps.DROPPED, after=4, lost=5)
    w.note_gap(gaps.AWAY, from_ns=7)
    assert _lines(tmp_path) == []           # written with the records, at the flush
    w.flush()
    assert _lines(tmp_path) == [(gaps.DROPPED, 3, 6, 7), (gaps.AWAY, 5, 6, None)]
    w.note_gap(gaps.OVERSIZED, lost=1)      # nothing buffered: written at the next flush
    w.close()
    assert _lines(tmp_path)[-1] == (gaps.OVERSIZED, 5, 6, 1)


def test_a_torn_last_line_is_not_read_and_the_next_writer_cuts_it(tmp_path: Path):
    with JournalWriter(tmp_path, fsync=False) as w:
        w.note_gap(gaps.AWAY)  # before the first record
        w.append(1, [b"k"], [b"p"])
    path = tmp_path / gaps.FILE
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"after": 1, "bef')  # a crash in the middle of a write
    assert _lines(tmp_path) == [(gaps.AWAY, 0, 1, None)]
    with JournalWriter(tmp_path, fsync=False) as w:
        assert w.resumed
        w.note_gap(gaps.STOPPED, from_ns=w.last_ts)
    assert path.read_bytes().startswith(whole)
    assert _lines(tmp_path) == [(gaps.AWAY, 0, 1, None), (gaps.STOPPED, 1, 2, None)]
    assert list(read_gaps(tmp_path))[-1].from_ns == 1  # the last record's receive time


def test_a_damaged_line_is_one_error_naming_it(tmp_path: Path):
    with JournalWriter(tmp_path, fsync=False) as w:
        w.append(1, [b"k"], [b"p"])
    (tmp_path / gaps.FILE).write_bytes(
        gaps.encode(Gap(0, 1, gaps.AWAY, None, None, 1)) + b'{"evil": "\\u001b[2J"}\n')
    with pytest.raises(JournalError, match=r"gaps.jsonl, line 2: not a gap record"):
        list(read_gaps(tmp_path))
    out = subprocess.run([*SBUS, "journal", "gaps", str(tmp_path)], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 1 and "line 2" in out.stderr and "\x1b" not in out.stderr
    assert len(out.stderr.splitlines()) == 1
    (tmp_path / gaps.FILE).unlink()
    (tmp_path / gaps.FILE).mkdir()  # not a regular file: an error, not a hang or a trace
    with pytest.raises(JournalError, match="cannot read"):
        list(read_gaps(tmp_path))


def test_retention_takes_the_gap_lines_of_the_segments_it_removes(tmp_path: Path):
    now = time.time_ns()
    with JournalWriter(tmp_path, segment_bytes=2048, fsync=False) as w:
        for i in range(40):
            w.append(now, [b"k"] * 10, [b"%d" % i] * 10)
            w.note_gap(gaps.DROPPED, lost=1)
            w.flush()
    assert len(_lines(tmp_path)) == 40
    w = JournalWriter(tmp_path, fsync=False, keep_bytes=6000)
    first = list_segments(tmp_path)[0].first_seq
    assert first > 1
    kept = list(read_gaps(tmp_path))
    assert kept and all(g.before >= first for g in kept)
    assert len(kept) == sum(10 * i + 11 >= first for i in range(40))  # none else went
    w.note_gap(gaps.AWAY)
    w.close()  # the writer appends to the file retention wrote
    assert list(read_gaps(tmp_path))[:-1] == kept and _lines(tmp_path)[-1][0] == gaps.AWAY


def test_journal_gaps_and_cat_tell_where_messages_are_missing(tmp_path: Path):
    with JournalWriter(tmp_path, fsync=False) as w:
        w.append(10**18, [b"a"] * 2, [b"1", b"2"])
        w.note_gap(gaps.DROPPED, lost=7)
        w.append(10**18, [b"a"], [b"3"])
    gaps_out = subprocess.run([*SBUS, "journal", "gaps", str(tmp_path)], capture_output=True,
                              text=True, timeout=30)
    assert gaps_out.returncode == 0, gaps_out.stderr
    assert "between seq 2 and 3: 7 message(s) dropped by the broker" in gaps_out.stdout
    as_json = subprocess.run([*SBUS, "journal", "gaps", "--json", str(tmp_path)],
                             capture_output=True, text=True, timeout=30).stdout
    assert [json.loads(line)["lost"] for line in as_json.splitlines()] == [7]
    cat = subprocess.run([*SBUS, "journal", "cat", str(tmp_path)], capture_output=True,
                         text=True, timeout=30)
    assert cat.returncode == 0 and len(cat.stdout.splitlines()) == 3
    assert "may miss messages at 1 place(s) (7 counted lost)" in cat.stderr
    tail = subprocess.run([*SBUS, "journal", "tail", "-n", "1", str(tmp_path)],
                          capture_output=True, text=True, timeout=30)
    assert tail.returncode == 0 and tail.stderr == ""  # record 3 alone: no gap among it


def test_the_analyze_report_says_where_the_recorder_missed_messages(tmp_path: Path):
    from sbus.spark.analyze import journal_facts, render_report

    with JournalWriter(tmp_path, fsync=False) as w:
        w.append(10**18, [b"a"], [b"1"])
        w.note_gap(gaps.DROPPED, lost=7)
        w.note_gap(gaps.AWAY, from_ns=10**18)
        w.append(10**18, [b"a"], [b"2"])
    summary = dict(journal="/j", messages=2, bytes=2, keys=1, prefixes=1, first="a", last="b")
    text = render_report(summary, [], [], "1 minute", None,
                         missed=journal_facts(str(tmp_path))["missed"])
    assert "Where the recorder missed messages (7 counted lost, 1 time(s) nothing was " \
           "recorded;" in text
    assert "between seq 1 and 2: 7 message(s) dropped by the broker" in text
    assert "between seq 1 and 2: the broker was away from" in text
    (tmp_path / gaps.FILE).write_bytes(b"\x1b[2J\n")
    text = render_report(summary, [], [], "1 minute", None,
                         missed=journal_facts(str(tmp_path))["missed"])
    assert "Where the recorder missed messages is not known:" in text and "\x1b" not in text
    assert "The recorder noted no message missed" in render_report(
        summary, [], [], "1 minute", None, missed=[])


def test_a_damaged_last_line_longer_than_a_gap_is_ended_not_cut(tmp_path: Path):
    """A last line without its newline but longer than any gap line is not one torn by a
    crash: it is ended, so the next line starts whole and readers name the damage."""
    JournalWriter(tmp_path, fsync=False).close()
    path = tmp_path / gaps.FILE
    path.write_bytes(b"x" * 2000)
    with JournalWriter(tmp_path, fsync=False) as w:
        w.note_gap(gaps.AWAY)
    assert path.read_bytes().startswith(b"x" * 2000 + b"\n{")
    with pytest.raises(JournalError, match="line 1: a line of"):
        list(read_gaps(tmp_path))


def test_tail_follow_tells_gaps_as_they_are_noted(tmp_path: Path):
    """``sbus journal tail -f`` prints records as they come, and on stderr each gap noted
    meanwhile (not those noted before it started)."""
    w = JournalWriter(tmp_path, fsync=False)
    w.append(time.time_ns(), [b"a"], [b"1"])
    w.note_gap(gaps.DROPPED, lost=3)  # before the tail: summed up, not told one by one
    w.flush()
    tail = subprocess.Popen([*SBUS, "journal", "tail", "-f", "-n", "5", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert tail.stdout.readline().split()[1:] == [b"1", b"a", b"1"]
        w.note_gap(gaps.AWAY, from_ns=time.time_ns())
        w.append(time.time_ns(), [b"a"], [b"2"])
        w.flush()
        assert tail.stdout.readline().split()[1:] == [b"2", b"a", b"2"]
        (line,) = PipeLines(tail.stderr).next(1)  # (the only one: not the gap from before)
    finally:
        tail.kill()
        tail.wait()
        w.close()
    assert b"between seq 1 and 2: the broker was away from" in line, line
