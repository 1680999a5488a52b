"""The open tail of a journal as Parquet pieces (`sbus.journal.tail`), without Spark: every
row after the exported segments exactly once, only new rows converted, damaged or
half-written files never read, two readers at once, a reader of another user's journal
writing only its own cache, and pieces removed once their segment is exported."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sbus.journal import tail
from sbus.journal.export import export_journal, split
from sbus.journal.store import JournalWriter, records

NOBODY = 65534


def sealed_and_exported(jdir: Path, rows: int = 600) -> Path:
    with JournalWriter(jdir, fsync=False, segment_bytes=4000) as w:
        for i in range(rows):
            w.append(time.time_ns(), [b"old/%d" % (i % 3)], [b"%d" % i])
            if i % 50 == 49:
                w.flush()
    export_journal(jdir, jdir / "parquet")
    return jdir / "parquet"


def add(w: JournalWriter, n: int) -> None:
    for i in range(n):
        w.append(time.time_ns(), [b"new/%d" % (i % 5), b"\xff/raw"], [b"p%d" % i, b""])
    w.flush()


def rows_of(files: list[Path]) -> list[tuple[int, bytes, bytes]]:
    out = []
    for f in files:
        for r in pq.read_table(f).to_pylist():
            out.append((r["seq"], r["key_bytes"] or r["key"].encode(), r["payload"]))
    return out


def check(jdir: Path, out: Path, cache: Path) -> tail.Tail:
    """One reader's cover, checked against the journal row for row."""
    cut = split(jdir, out)
    got = tail.cover(jdir, cut.rest, cut.seam, cache)
    want = [(s, k, p) for s, _, k, p in records(jdir) if s >= cut.seam]
    assert rows_of(got.files) == want and not got.more
    assert got.end == (want[-1][0] + 1 if want else cut.seam)
    return got


def test_pieces_hold_the_rows_after_the_seam_and_only_new_rows_are_converted(tmp_path):
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    cache = tail.cache_dir(jdir, out)
    assert cache == out / ".tail"  # the caller may write the export directory
    with JournalWriter(jdir, fsync=False) as w:
        add(w, 300)
        first = check(jdir, out, cache)
        assert len(first.files) == 1
        inode = first.files[0].stat().st_ino
        assert check(jdir, out, cache).files == first.files  # nothing new: nothing written
        assert sorted(os.listdir(cache)) == [first.files[0].name]
        add(w, 10)
        second = check(jdir, out, cache)  # the first piece reused, the 20 new rows added
        assert second.files[0] == first.files[0] and second.files[0].stat().st_ino == inode
        assert len(second.files) == 2 and pq.read_metadata(second.files[1]).num_rows == 20
        for _ in range(30):  # merged like a binary counter: a few pieces at most
            add(w, 3)
            assert 1 <= len(check(jdir, out, cache).files) <= tail.MAX_PIECES
        assert first.files[0].exists()  # never rewritten: the new rows never outgrew it


def test_a_half_written_or_damaged_piece_is_never_read(tmp_path, monkeypatch):
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    cache = tail.cache_dir(jdir, out)
    with JournalWriter(jdir, fsync=False) as w:
        add(w, 200)
        (piece,) = check(jdir, out, cache).files
        data = piece.read_bytes()
        half = cache / f".{piece.name}.123.456.tmp"  # a writer that died mid-file
        half.write_bytes(data[:len(data) // 2])
        piece.write_bytes(data[:len(data) // 2])  # and a damaged piece under its name
        add(w, 5)
        again = check(jdir, out, cache)  # converted again from the journal
        assert half not in again.files and pq.read_metadata(again.files[0]).num_rows >= 400
        assert half.exists()  # a writer may still be at it
        monkeypatch.setattr(tail, "GRACE", 0.0)
        check(jdir, out, cache)
        assert not half.exists()  # dead for longer than GRACE: removed


def test_pieces_go_once_their_segment_is_exported_and_the_cache_is_bounded(tmp_path,
                                                                            monkeypatch):
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    cache = tail.cache_dir(jdir, out)
    with JournalWriter(jdir, fsync=False) as w:
        add(w, 100)
        old = check(jdir, out, cache).files
        for _ in range(6):  # merging leaves pieces no reader needs any more
            add(w, 7)
            check(jdir, out, cache)
        unused = set(cache.iterdir()) - set(check(jdir, out, cache).files)
        assert unused, "merging left no superseded piece"
        monkeypatch.setattr(tail, "CACHE_BYTES", 0)  # over the bound: unused ones go now
        kept = check(jdir, out, cache).files
        assert set(cache.iterdir()) == set(kept)
        monkeypatch.setattr(tail, "CACHE_BYTES", 1 << 30)
    export_journal(jdir, out)  # the writer sealed the segment: its real export appears
    cut = split(jdir, out)
    assert not cut.rest and cut.files[-1].stem == old[0].name[:20]
    assert tail.cover(jdir, [], cut.seam, cache).files == []
    assert set(cache.iterdir()) == set(kept)  # still within GRACE of their last use
    monkeypatch.setattr(tail, "GRACE", 0.0)
    tail.cover(jdir, [], cut.seam, cache)
    assert list(cache.iterdir()) == []


def test_a_recreated_journal_does_not_meet_the_old_ones_pieces(tmp_path):
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    cache = tail.cache_dir(jdir, out)
    with JournalWriter(jdir, fsync=False) as w:
        add(w, 50)
        check(jdir, out, cache)
    for f in jdir.iterdir():  # the same path, recorded again from seq 1 (same names)
        if f.name != "parquet":
            f.unlink()
    for f in out.glob("*.parquet"):
        f.unlink()
    time.sleep(0.01)
    sealed_and_exported(jdir)
    with JournalWriter(jdir, fsync=False) as w:
        for i in range(50):
            w.append(time.time_ns(), [b"other"], [b"q%d" % i])
        w.flush()
        got = check(jdir, out, cache)  # rows of this journal, not the old pieces'
        assert rows_of(got.files)[0][1] == b"other"


READER = """
import sys, time
from pathlib import Path
from sbus.journal import tail
from sbus.journal.export import split
import pyarrow.parquet as pq
jdir, out = Path(sys.argv[1]), Path(sys.argv[2])
cache = tail.cache_dir(jdir, out)
print(cache, flush=True)
for _ in range(int(sys.argv[3])):
    cut = split(jdir, out)
    got = tail.cover(jdir, cut.rest, cut.seam, cache)
    seqs = [s for f in got.files for s in pq.read_table(f, columns=["seq"])["seq"].to_pylist()]
    assert seqs == list(range(cut.seam, got.end)), (cut.seam, got.end, len(seqs))
print("ok", flush=True)
"""


def reader(jdir: Path, out: Path, rounds: int, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen([sys.executable, "-c", READER, str(jdir), str(out), str(rounds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env | kw.pop("env", {}), **kw)


def test_two_readers_at_once_while_recording(tmp_path):
    """Two processes cover the same growing tail in the same directory: each sees every
    row once every time (same-named pieces written twice are the same rows)."""
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    with JournalWriter(jdir, fsync=False) as w:
        add(w, 100)
        procs = [reader(jdir, out, 40) for _ in range(2)]
        while any(p.poll() is None for p in procs):
            add(w, 20)
            time.sleep(0.005)
        for p in procs:
            stdout, stderr = p.communicate(timeout=60)
            assert p.returncode == 0, stderr
            assert stdout.split() == [str(out / ".tail"), "ok"]


def read_as_nobody(pipe, jdir: Path, out: Path, home: Path) -> None:
    os.environ["HOME"] = str(home)
    os.environ.pop("XDG_CACHE_HOME", None)
    try:
        cache = tail.cache_dir(jdir, out)
        cut = split(jdir, out)
        got = tail.cover(jdir, cut.rest, cut.seam, cache)
        chosen = tail.cache_dir(jdir, out, home / "chosen")  # read_journal's tail_cache
        pipe.send((str(cache), [s for s, *_ in rows_of(got.files)], cut.seam, got.end,
                   str(chosen)))
    except Exception as exc:  # noqa: BLE001 - told to the test, which fails on it
        pipe.send(repr(exc))


def test_a_reader_of_another_users_journal_writes_only_its_own_cache(tmp_path):
    """The journal and its export belong to root (0755); *nobody* reads it: the pieces
    go to nobody's own cache, nothing is written into the journal or the export."""
    from faultkit import as_user

    base = Path(tempfile.mkdtemp(prefix="sbus-tail-", dir="/tmp"))
    try:
        base.chmod(0o755)
        jdir = base / "j"
        out = sealed_and_exported(jdir)
        home = base / "home"
        home.mkdir()
        os.chown(home, NOBODY, NOBODY)
        with JournalWriter(jdir, fsync=False) as w:
            add(w, 150)
            before = sorted(jdir.rglob("*"))
            proc, pipe = as_user(NOBODY, read_as_nobody, jdir, out, home)
            assert pipe.poll(60), "the reader running as nobody said nothing"
            answer = pipe.recv()
            proc.join(10)
            after = sorted(jdir.rglob("*"))
        assert isinstance(answer, tuple), answer
        cache, seqs, seam, end, chosen = answer
        assert Path(chosen).parent == home / "chosen" and Path(chosen).name == Path(cache).name
        assert seqs == list(range(seam, end)) and end - seam == 300
        assert Path(cache).is_relative_to(home / ".cache" / "sbus" / "tail")
        assert [f.stat().st_uid for f in Path(cache).iterdir()] == [NOBODY]
        assert after == before  # no .tail, nothing of nobody's
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("budget", [0, 1])
def test_what_is_over_the_budget_is_left_to_the_source(tmp_path, budget):
    """A sealed segment not exported yet and the open one: with room for neither, no
    piece; with room for the first only, the pieces end where the open segment starts."""
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    split(jdir, out).files[-1].unlink()  # its segment: sealed, not exported
    with JournalWriter(jdir, fsync=False) as w:
        add(w, 100)
        cut = split(jdir, out)
        size = sum(s.path.stat().st_size for s in cut.rest[:1])
        got = tail.cover(jdir, cut.rest, cut.seam, tail.cache_dir(jdir, out),
                         budget=budget * size)
        assert got.more
        assert got.end == (cut.seam if budget == 0 else cut.rest[1].first_seq)
        assert [s for s, *_ in rows_of(got.files)] == list(range(cut.seam, got.end))


def test_a_segment_sealed_and_reblocked_after_it_was_listed_leaves_no_gap(tmp_path):
    """A reader lists the open segment, the recorder seals it meanwhile (re-blocking its
    small blocks into one, so byte positions change): the rows after the last piece are
    found by sequence number in the sealed segment, not at the open one's position."""
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    cache = tail.cache_dir(jdir, out)
    w = JournalWriter(jdir, fsync=False)
    for _ in range(20):  # small blocks: sealing re-blocks them
        add(w, 5)
    check(jdir, out, cache)
    add(w, 30)
    listed = split(jdir, out)  # the reader's listing: the segment is open
    assert not listed.rest[-1].sealed
    w.close()  # sealed (re-blocked) before the reader goes on
    got = tail.cover(jdir, listed.rest, listed.seam, cache)
    want = [(s, k, p) for s, _, k, p in records(jdir) if s >= listed.seam]
    assert rows_of(got.files) == want and got.end == want[-1][0] + 1


def test_a_segment_gone_or_damaged_is_left_to_the_source(tmp_path):
    """Pieces stop where a segment vanished after it was listed (retention) or has a
    damaged header: the rest is the source's to read or report, never skipped."""
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    files = split(jdir, out).files
    files[-1].unlink()
    files[-2].unlink()  # two sealed segments not exported
    cut = split(jdir, out)
    assert len(cut.rest) == 2
    cut.rest[0].path.unlink()  # gone after the listing
    got = tail.cover(jdir, cut.rest, cut.seam, tail.cache_dir(jdir, out))
    assert got.more and got.end == cut.seam and got.files == []
    cut = split(jdir, out)
    with open(cut.rest[-1].path, "r+b") as f:
        f.write(b"NOTSBUS!")
    got = tail.cover(jdir, cut.rest, cut.seam, tail.cache_dir(jdir, out))
    assert got.more and got.end == cut.seam and got.files == []


def test_a_fifo_in_a_segments_place_is_left_to_the_source_not_waited_on(tmp_path):
    """Another user's FIFO named as a segment after the exported ones hung
    `sbus.spark.read_journal` for good in its first step (the re-audit of 2026-11-27):
    its open waited for a writer.  It is opened without waiting and left to the source,
    which names it."""
    import threading

    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    fifo = jdir / f"{10**9:020d}.sbj"
    os.mkfifo(fifo)
    cut = split(jdir, out)
    assert [s.path for s in cut.rest] == [fifo]
    got: list[tail.Tail] = []
    worker = threading.Thread(target=lambda: got.append(
        tail.cover(jdir, cut.rest, cut.seam, tail.cache_dir(jdir, out))), daemon=True)
    worker.start()
    worker.join(10)
    assert got and got[0].more and got[0].end == cut.seam and got[0].files == []


def test_a_reader_converting_rows_another_has_converted_keeps_that_piece(tmp_path):
    """Two readers that both missed the other's piece write the same name: the second
    keeps the first's file (a query planned on it has its size), and no temporary."""
    jdir = tmp_path / "j"
    out = sealed_and_exported(jdir)
    cache = tail.cache_dir(jdir, out)
    with JournalWriter(jdir, fsync=False) as w:
        add(w, 100)
        cut = split(jdir, out)
        (first,) = check(jdir, out, cache).files
        inode = first.stat().st_ino
        seg = cut.rest[0]
        blocks = tail._blocks_after(seg, cut.seam, None)  # as a reader that listed before
        (again,) = tail._convert(jdir, cache, seg, tail._created(seg), cut.seam, blocks, [])
        assert again.path == first and first.stat().st_ino == inode
        assert sorted(cache.iterdir()) == [first]


def test_a_symlinked_pieces_directory_is_not_followed(tmp_path):
    """``EXPORT/.tail`` made a symlink (to a directory another user chose): the reader
    keeps its pieces in its own cache instead, and writes nothing through the link."""
    out, elsewhere = tmp_path / "pq", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / tail.TAIL_SUBDIR).symlink_to(elsewhere)
    cache = tail.cache_dir(tmp_path / "j", out, tmp_path / "own")
    assert cache is not None and cache.parent == tmp_path / "own"
    assert list(elsewhere.iterdir()) == []
