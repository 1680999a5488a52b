"""The bridge's spool of unacknowledged exports (sbus/bridge/spool.py): what a crash leaves
is found again, in order; a torn record is cut off; acknowledged segments go; it is bounded.
The crash is a process that ends without closing (as ``kill -9`` does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sbus.bridge.spool import Spool, StateDir
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
