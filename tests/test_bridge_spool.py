"""The bridge's spool of unacknowledged exports (sbus/bridge/spool.py): what a crash leaves
is found again, in order; a torn record is cut off; acknowledged segments go; it is bounded;
damage is said and set right, never a crash.
The crash is a process that ends without closing (as ``kill -9`` does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sbus.bridge.spool import HEADER, MAGIC, RECORD, Spool, StateDir
from sbus.errors import SbusError


def spool(path: Path, **kw) -> Spool:
    s = Spool(path, kw.pop("max_count", 1000), kw.pop("max_bytes", 1 << 20), **kw)
    return s


def test_unacknowledged_records_survive_a_crash_in_order(tmp_path: Path) -> None:
    code = f"""
import os
from pathlib import Path
from sbus.bridge.spool import Spool
s = Spool(Path({str(tmp_path)!r}), 1000, 1 << 20, segment_bytes=200)
assert s.load() == []
seqs = s.append([(b"t/%d" % i, b"p%d" % i) for i in range(30)])
for seq in seqs[:10]:
    s.acked(seq)
s.acked(seqs[12])          # out of order: 10 and 11 are still open
s.flush()
os._exit(0)                # no close: what kill -9 leaves
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    s = spool(tmp_path, segment_bytes=200)
    left = s.load()
    assert [seq for seq, _, _ in left] == list(range(10, 30))   # 12 too: 10 was open
    assert left[0][1:] == (b"t/10", b"p10")
    assert s.next_seq == 30 and len(s) == 20
    assert s.append([(b"t/new", b"x")]) == [30]


def test_a_torn_record_at_the_end_is_cut_off(tmp_path: Path) -> None:
    s = spool(tmp_path)
    s.load()
    s.append([(b"a", b"1"), (b"b", b"2")])
    s.close()
    seg = next(tmp_path.glob("*.spool"))
    with open(seg, "ab") as f:
        f.write(b"\x02\x00\x00")     # the crash came in the middle of a header
    s = spool(tmp_path)
    assert [(t, p) for _, t, p in s.load()] == [(b"a", b"1"), (b"b", b"2")]
    assert len(s.problems) == 1 and "the 3 bytes from there are dropped" in s.problems[0]
    assert s.append([(b"c", b"3")]) == [2]
    s.close()
    assert [(t, p) for _, t, p in spool(tmp_path).load()] == [(b"a", b"1"), (b"b", b"2"),
                                                              (b"c", b"3")]


def test_acknowledged_segments_are_removed(tmp_path: Path) -> None:
    s = spool(tmp_path, segment_bytes=100)
    s.load()
    seqs = [seq for i in range(50) for seq in s.append([(b"topic/%d" % i, b"x" * 20)])]
    assert len(list(tmp_path.glob("*.spool"))) > 5
    for seq in seqs:
        s.acked(seq)
    s.flush()
    assert len(list(tmp_path.glob("*.spool"))) <= 2
    s.close()
    assert spool(tmp_path).load() == []


def test_room_is_bounded_in_count_and_bytes(tmp_path: Path) -> None:
    s = spool(tmp_path, max_count=3, max_bytes=100)
    s.load()
    assert s.room(100) and not s.room(101)
    s.append([(b"a", b"x" * 50)])
    assert s.room(49) and not s.room(50)
    s.append([(b"b", b""), (b"c", b"")])
    assert not s.room(0)            # three held
    s.acked(0)
    assert s.room(0) and s.held_bytes == 2


def test_one_bridge_per_state_directory(tmp_path: Path) -> None:
    first = StateDir(tmp_path / "st")
    with pytest.raises(SbusError, match="another bridge uses the state directory"):
        StateDir(tmp_path / "st")
    first.close()
    StateDir(tmp_path / "st").close()
    (tmp_path / "file").write_text("")
    with pytest.raises(SbusError, match="cannot use the state directory"):
        StateDir(tmp_path / "file" / "st")
    with pytest.raises(SbusError, match="file: it is not a directory"):
        StateDir(tmp_path / "file")
    assert os.path.exists(tmp_path / "st" / "lock")


def test_a_failed_write_leaves_the_spool_as_it_was(tmp_path: Path) -> None:
    """A full disk (RLIMIT_FSIZE makes the write fail for real): the batch is refused
    with OSError, nothing torn stays behind, later batches go on."""
    code = f"""
import resource, signal
from pathlib import Path
from sbus.bridge.spool import Spool
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
s = Spool(Path({str(tmp_path)!r}), 1000, 1 << 20)
s.load()
s.append([(b"a", b"1")])
resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
try:
    s.append([(b"b", b"x" * 500)])
except OSError:
    pass
else:
    raise SystemExit("the write should have failed")
assert s.append([(b"c", b"3")]) == [1] and len(s) == 2
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
    assert [(t, p) for _, t, p in spool(tmp_path).load()] == [(b"a", b"1"), (b"c", b"3")]


def recorded(tmp_path: Path, n: int, acked: int = 0) -> None:
    """A spool holding records 0 .. n-1, the first *acked* of them acknowledged."""
    s = spool(tmp_path)
    s.load()
    for seq in s.append([(b"t/%d" % i, b"p%d" % i) for i in range(n)])[:acked]:
        s.acked(seq)
    s.close()


@pytest.mark.parametrize("acked", [b"\xff" * 8 + b"\x01\x02\x03\x04",     # a number past any
                                   b"\x05" + bytes(7) + b"abcd" + b"zzzz",  # a failed check
                                   b"garbage"])                             # a wrong size
def test_a_damaged_acked_file_sends_everything_again_and_says_so(tmp_path: Path,
                                                                  acked: bytes) -> None:
    """The bridge once crashed on such a file at every start (a number past 2^64 to
    write back); now every record left is sent again, numbered in a new epoch."""
    recorded(tmp_path, 10, acked=4)
    before = spool(tmp_path)
    before.load()
    epoch = before.epoch
    before.close()
    (tmp_path / "acked").write_bytes(acked)
    s = spool(tmp_path)
    left = s.load()
    assert [seq for seq, _, _ in left] == list(range(10))
    assert len(s.problems) == 1 and "acked is damaged" in s.problems[0]
    assert s.epoch != epoch and s.next_seq == 10
    assert s.append([(b"t/new", b"x")]) == [10]
    s.close()
    again = spool(tmp_path)  # and the file is whole again
    assert [seq for seq, _, _ in again.load()] == list(range(11)) and again.problems == []


def test_an_older_acked_file_without_its_check_is_read(tmp_path: Path) -> None:
    recorded(tmp_path, 6, acked=2)
    raw = (tmp_path / "acked").read_bytes()
    (tmp_path / "acked").write_bytes(raw[:12])  # as bridges before the check wrote it
    s = spool(tmp_path)
    assert [seq for seq, _, _ in s.load()] == [2, 3, 4, 5] and s.problems == []


def test_a_damaged_record_ends_its_segment_and_is_said(tmp_path: Path) -> None:
    """A header whose number is not the next one (or whose lengths run past the file)
    keeps the records before it; the bytes from it are dropped, and the line says so."""
    recorded(tmp_path, 5)
    seg = next(tmp_path.glob("*.spool"))
    data = bytearray(seg.read_bytes())
    second = len(MAGIC) + RECORD.size + 3 + 2  # the header, "t/0", "p0"
    data[second:second + 8] = (2**64 - 1).to_bytes(8, "little")
    seg.write_bytes(data)
    s = spool(tmp_path)
    assert [seq for seq, _, _ in s.load()] == [0]
    assert len(s.problems) == 1 and f"at byte {second}" in s.problems[0]
    assert f"{len(data) - second} bytes" in s.problems[0]
    assert s.append([(b"t/n", b"x")]) == [1]  # numbering goes on from the whole records


def test_a_segment_named_past_any_number_is_set_aside(tmp_path: Path) -> None:
    recorded(tmp_path, 3)
    bad = tmp_path / f"{2**64 - 1:020d}.spool"
    bad.write_bytes(b"")
    s = spool(tmp_path)
    assert [seq for seq, _, _ in s.load()] == [0, 1, 2]
    assert not bad.exists() and bad.with_name(bad.name + ".damaged").exists()
    assert len(s.problems) == 1 and "set aside" in s.problems[0]


def test_records_sent_again_stay_on_disk_until_acknowledged(tmp_path: Path) -> None:
    """Two crashes in a row: the records the first restart sends again must still be on
    disk for the second (the first restart once removed the one segment holding them,
    so a second crash lost them, and the next exports took their numbers)."""
    recorded(tmp_path, 10, acked=4)
    first = spool(tmp_path)
    assert [seq for seq, _, _ in first.load()] == list(range(4, 10))
    del first  # the crash again, before any of them is acknowledged: no close
    second = spool(tmp_path)
    assert [seq for seq, _, _ in second.load()] == list(range(4, 10))
    assert second.next_seq == 10 and second.append([(b"t/n", b"x")]) == [10]


@pytest.mark.parametrize("damage", ["emptied", "removed"])
def test_records_missing_from_the_spool_are_said_counted_and_not_numbered_again(
        tmp_path: Path, damage: str) -> None:
    """A segment emptied or removed (by hand, or lost with the page cache) took records
    no acknowledgement had ended.  The numbers the last bridge gave (``state.json``'s
    ``spooled``) show it: the loss is said and counted, and new records do not take the
    lost numbers (receivers would drop them as copies of what they had)."""
    recorded(tmp_path, 10, acked=3)
    seg = next(tmp_path.glob("*.spool"))
    if damage == "emptied":
        seg.write_bytes(b"")
    else:
        seg.unlink()
    s = spool(tmp_path)
    assert s.load(given=10) == []
    assert s.lost == 7 and len(s.problems) == 1
    assert "7 records numbered 3 to 9 are missing" in s.problems[0]
    assert s.append([(b"t/new", b"x")]) == [10]
    s.close()
    again = spool(tmp_path)  # said once: the next start finds the spool whole
    assert [seq for seq, _, _ in again.load(given=11)] == [10] and again.problems == []


def test_a_damaged_state_file_is_said_and_a_failed_save_too(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    assert state.load_state() == ({}, "")
    assert state.save_state({"spooled": 3}) == ""
    assert state.load_state() == ({"spooled": 3}, "")
    (tmp_path / "state.json").write_text("{not json")
    assert state.load_state()[1].endswith("state.json cannot be read (not JSON)")
    (tmp_path / "state.json").write_text("[1, 2]")
    assert "is not what the bridge saves" in state.load_state()[1]
    # nested deep enough to end the parser (before: a RecursionError, the bridge ended)
    (tmp_path / "state.json").write_text("[" * 200_000)
    assert state.load_state()[1].endswith("cannot be read (nested too deep)")
    (tmp_path / "state.json").write_bytes(b'{"a": "\xff"}')
    assert state.load_state()[1].endswith("cannot be read (not JSON)")
    (tmp_path / "state.json").unlink()
    os.mkfifo(tmp_path / "state.json")  # before: the open waited for a writer, for good
    assert state.load_state()[1].endswith("cannot be read (not a regular file)")
    (tmp_path / "state.json").unlink()
    (tmp_path / "state.json").mkdir()
    assert "cannot be read" in state.load_state()[1]
    assert state.save_state({"spooled": 4}).startswith(f"cannot save {tmp_path}/state.json")
    state.close()


def test_damaged_files_beside_the_segments_are_said_not_waited_for(tmp_path: Path) -> None:
    """An ``epochs`` nested too deep or a FIFO, and a FIFO with a segment's name: said,
    the records left still loaded, nothing blocks (before: a traceback, and a start that
    waited for a writer without a word)."""
    recorded(tmp_path, 3)
    (tmp_path / "epochs").write_text("[" * 200_000)
    s = spool(tmp_path)
    assert [seq for seq, _, _ in s.load()] == [0, 1, 2]
    assert "epochs is damaged" in s.problems[0]
    s.close()
    (tmp_path / "epochs").unlink()
    os.mkfifo(tmp_path / "epochs")
    os.mkfifo(tmp_path / f"{7:020d}.spool")
    s = spool(tmp_path)
    assert [seq for seq, _, _ in s.load()] == [0, 1, 2]
    assert any("epochs is damaged" in p for p in s.problems), s.problems
    assert any("not a regular file; set aside as" in p for p in s.problems), s.problems
    assert (tmp_path / f"{7:020d}.spool.damaged").exists()
    s.close()


def test_each_run_stamps_in_its_own_epoch_and_records_keep_theirs(tmp_path: Path) -> None:
    """A new epoch per run (a spool that went back would otherwise give its numbers again
    under the epoch receivers had seen them in); records left by an earlier run keep the
    epoch they were first sent in, over restarts in a row, until acknowledged."""
    first = spool(tmp_path)
    first.load()
    first.append([(b"t/%d" % i, b"p") for i in range(5)])
    for seq in (0, 1):
        first.acked(seq)
    first.flush()
    e1 = first.epoch
    second = spool(tmp_path)  # a crash: no close
    assert [seq for seq, _, _ in second.load()] == [2, 3, 4]
    e2 = second.epoch
    assert e2 != e1 and [second.epoch_of(n) for n in (2, 4)] == [e1, e1]
    assert second.append([(b"t/5", b"p"), (b"t/6", b"p")]) == [5, 6]
    third = spool(tmp_path)  # another crash
    assert [seq for seq, _, _ in third.load()] == [2, 3, 4, 5, 6]
    assert [third.epoch_of(n) for n in (2, 5, 6, 7)] == [e1, e2, e2, third.epoch]
    for seq in range(2, 5):
        third.acked(seq)
    third.close()
    fourth = spool(tmp_path)
    assert [seq for seq, _, _ in fourth.load()] == [5, 6]
    assert fourth.epochs == [(5, e2), (7, fourth.epoch)]  # run 1's is forgotten
    fourth.close()
    (tmp_path / "epochs").write_text("[[5, 1]]")
    damaged = spool(tmp_path)
    assert [seq for seq, _, _ in damaged.load()] == [5, 6]
    assert damaged.epoch_of(5) == damaged.epoch and "epochs is damaged" in damaged.problems[0]
    damaged.close()
    (tmp_path / "epochs").unlink()  # as spools before runs had epochs: the one in acked
    older = spool(tmp_path)
    older.load()
    assert older.epoch_of(5) == damaged.epoch != older.epoch


def test_a_segment_overlapping_the_one_before_is_set_aside(tmp_path: Path) -> None:
    """Two records under one number would both be sent: a segment whose numbers another
    one holds is damage (not something the bridge writes), set aside and said."""
    recorded(tmp_path, 6)
    seg = next(tmp_path.glob("*.spool"))
    data = seg.read_bytes()
    start = len(MAGIC) + 3 * (RECORD.size + 3 + 2)  # records 3 .. 5, as a segment of its own
    extra = tmp_path / f"{3:020d}.spool"
    extra.write_bytes(MAGIC + data[start:])
    s = spool(tmp_path)
    assert [seq for seq, _, _ in s.load()] == list(range(6))
    assert extra.with_name(extra.name + ".damaged").exists()
    assert len(s.problems) == 1 and "overlap the segment before it" in s.problems[0]


def test_a_record_changed_on_disk_is_dropped_and_said_not_sent(tmp_path: Path) -> None:
    """A byte changed in a record's payload was sent as it was, to every receiver.  Each
    record carries a CRC-32 now: the damaged one is dropped, counted as lost and said,
    and the records after it (whole, checked) are kept."""
    recorded(tmp_path, 5)
    seg = next(tmp_path.glob("*.spool"))
    data = bytearray(seg.read_bytes())
    third = len(MAGIC) + 2 * (RECORD.size + 3 + 2)
    data[third + RECORD.size + 4] ^= 1  # "p2" becomes "p3"
    seg.write_bytes(data)
    s = spool(tmp_path)
    assert [(seq, p) for seq, _, p in s.load()] == [(0, b"p0"), (1, b"p1"), (3, b"p3"),
                                                    (4, b"p4")]
    assert s.lost == 1 and len(s.problems) == 1
    assert f"record 2 at byte {third} fails its check" in s.problems[0]
    assert s.append([(b"t/n", b"x")]) == [5]  # its number is not given again


def test_a_record_whose_lengths_changed_ends_its_segment(tmp_path: Path) -> None:
    """A changed length makes the records after it unfindable: the segment is cut there."""
    recorded(tmp_path, 5)
    seg = next(tmp_path.glob("*.spool"))
    data = bytearray(seg.read_bytes())
    third = len(MAGIC) + 2 * (RECORD.size + 3 + 2)
    data[third + 10] -= 1  # the topic length: 3 becomes 2
    seg.write_bytes(data)
    s = spool(tmp_path)
    assert [seq for seq, _, _ in s.load()] == [0, 1]
    assert len(s.problems) == 1 and f"at byte {third} is cut short or damaged" in s.problems[0]


def test_a_segment_of_an_older_bridge_is_read_without_checks(tmp_path: Path) -> None:
    """Segments written before records had checks (no magic, 14-byte headers) are read;
    what is appended after them goes into a new segment, with checks."""
    recorded(tmp_path, 1)
    seg = next(tmp_path.glob("*.spool"))
    seg.unlink()
    (tmp_path / f"{0:020d}.spool").write_bytes(b"".join(
        HEADER.pack(i, 3, 2) + b"t/%d" % i + b"p%d" % i for i in range(3)))
    s = spool(tmp_path)
    assert [(seq, p) for seq, _, p in s.load()] == [(0, b"p0"), (1, b"p1"), (2, b"p2")]
    assert s.problems == [] and s.append([(b"t/3", b"p3")]) == [3]
    s.close()
    assert (tmp_path / f"{3:020d}.spool").read_bytes().startswith(MAGIC)
    assert [seq for seq, _, _ in spool(tmp_path).load()] == [0, 1, 2, 3]
