"""Hostile or damaged journals: every read either returns exactly the recorded rows or
raises one clear error naming the file and the position; never a crash, a hang, a huge
allocation or a wrong row.  The recorder moves a damaged sealed segment aside instead
of failing at every start."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from conftest import SBUS, raw, sync
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbus.journal import format as fmt
from sbus.journal import gaps
from sbus.journal.format import FormatError
from sbus.journal.read import read_gaps
from sbus.journal.store import (
    JournalError,
    JournalWriter,
    Segment,
    UnreadableSegment,
    list_segments,
    records,
)

ROWS = [(b"k/%d" % (i % 7), b"payload %d " % i + bytes(range(i % 50))) for i in range(60)]


def sealed_journal(directory: Path) -> Path:
    """A journal of three blocks (not re-blocked) in one sealed segment; returns the
    segment's path."""
    with JournalWriter(directory, block_bytes=1 << 20, fsync=False, reblock_bytes=0) as w:
        for n in range(3):
            part = ROWS[n * 20:(n + 1) * 20]
            w.append(1_000_000 + n, [k for k, _ in part], [p for _, p in part])
            w.flush()
        w.seal()
    (seg,) = list_segments(directory)
    assert seg.sealed
    return seg.path


def open_journal(directory: Path, blocks: int) -> tuple[JournalWriter, Segment]:
    """A writer left open with *blocks* blocks of ten rows written: its unsealed segment
    (close ``w._lock`` to let another writer recover it, as after a crash)."""
    w = JournalWriter(directory, fsync=False)
    for n in range(blocks):
        w.append(1 + n, [b"a"] * 10, [b"x"] * 10)
        w.flush()
    (seg,) = list_segments(directory)
    assert not seg.sealed
    return w, seg


def read_all(directory: Path) -> list[tuple[bytes, bytes]]:
    return [(key, payload) for _, _, key, payload in records(directory)]


def test_every_flipped_bit_is_the_right_rows_or_a_clear_error(tmp_path):
    path = sealed_journal(tmp_path)
    original = path.read_bytes()
    assert read_all(tmp_path) == ROWS
    errors = 0
    for byte in range(len(original)):
        damaged = bytearray(original)
        damaged[byte] ^= 1 << (byte % 8)
        path.write_bytes(damaged)
        try:
            rows = read_all(tmp_path)
        except JournalError as exc:
            assert str(path) in str(exc), exc
            errors += 1
            continue
        assert rows == ROWS, f"byte {byte}: wrong rows, no error"
    path.write_bytes(original)
    assert errors > len(original) * 0.9  # only the file head is not read for a sealed file


def crafted(tmp_path: Path, **head) -> Path:
    """A sealed segment whose first block head is rewritten with *head* fields."""
    path = sealed_journal(tmp_path)
    data = bytearray(path.read_bytes())
    at = fmt.FILE_HEAD.size
    magic, count, first_seq, klen, plen, crc, zero = fmt.BLOCK_HEAD.unpack_from(data, at)
    fields = dict(count=count, klen=klen, plen=plen) | head
    struct.pack_into("<4sIqIIII", data, at, magic, fields["count"], first_seq,
                     fields["klen"], fields["plen"], crc, zero)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("head", [dict(count=2**32 - 1), dict(klen=2**32 - 1),
                                  dict(plen=2**31), dict(count=2**31, klen=2**31)])
def test_a_crafted_block_head_allocates_nothing_large(tmp_path, head):
    crafted(tmp_path, **head)
    tracemalloc.start()
    try:
        with pytest.raises(JournalError, match="block at byte 32"):
            read_all(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


GIB = 1 << 30


def sparse_segment(directory: Path, sealed: bool) -> Path:
    """A segment of a few KB of data whose one block claims a GiB: the file's apparent
    size (``st_size``) covers it, its holes hold nothing."""
    directory.mkdir()
    size = fmt.block_size(1, GIB, 0)
    path = directory / (f"{1:020d}.sbj" + ("" if sealed else ".open"))
    with open(path, "wb") as f:
        f.write(fmt.encode_header(1, 10**18))
        f.write(fmt.BLOCK_HEAD.pack(fmt.BLOCK_MAGIC, 1, 1, GIB, 0, 0, 0))
        f.write(b"\0" * 4096)
        index_pos = fmt.FILE_HEAD.size + size
        if sealed:
            f.seek(index_pos)
            f.write(fmt.encode_index([fmt.BlockInfo(fmt.FILE_HEAD.size, 1, 1, 0, 0)],
                                     index_pos))
        else:
            f.truncate(index_pos + 4096)
    st = path.stat()
    assert st.st_size > GIB and st.st_blocks * 512 < 1 << 20  # really sparse
    return path


@pytest.mark.parametrize("sealed", [True, False])
def test_a_sparse_segment_claiming_a_gib_costs_no_gib(tmp_path, sealed):
    """`sbus journal cat` of a 4 KB sparse segment whose block claims 1 GiB: the sizes are
    checked against what the file holds, not its apparent size, so the reader allocates
    nothing near the claim (measured as the child's peak resident memory)."""
    jdir = tmp_path / "j"
    path = sparse_segment(jdir, sealed)
    # Measured through a small parent: a child forked from this (large) test process
    # would report this process's peak as its own (Linux keeps it across exec).
    measure = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode, "
               "file=sys.stderr)")
    child = subprocess.run([sys.executable, "-c", measure, *SBUS, "journal", "cat", str(jdir)],
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    *lines, figures = child.stderr.decode().strip().splitlines()
    peak_kib, returncode = map(int, figures.split())
    out = child.stdout
    assert peak_kib < 200 << 10, f"peak RSS {peak_kib} KiB"
    assert out == b""
    if sealed:  # one clear line naming the file
        assert returncode == 1
        assert len(lines) == 1 and str(path) in lines[0] and "sparse" in lines[0], lines
    else:  # an unsealed segment's tail that is not a whole block is a torn write
        assert returncode == 0 and not lines, lines


def test_rows_numbered_again_are_damage_not_copies(tmp_path):
    """A block head whose first number goes back, a segment copied under another name,
    a sealed segment's header: each would have given rows under numbers already read
    (``journal cat`` printed them twice, Spark counted them); a number moved forward a
    gap that is not one (the sealed index says otherwise); now each is a clear error."""
    path = sealed_journal(tmp_path)
    original = bytes(path.read_bytes())
    at = fmt.FILE_HEAD.size
    count, first, klen, plen, _ = fmt.decode_block_head(original, at)
    second = at + fmt.block_size(count, klen, plen)
    damaged = bytearray(original)
    struct.pack_into("<q", damaged, second + 8, first)  # the second block starts over
    path.write_bytes(damaged)
    with pytest.raises(JournalError, match=f"{path}: block at byte {second}: its head says "
                                           f"seq {first} .*, the index seq {first + count}"):
        read_all(tmp_path)
    damaged = bytearray(original)
    struct.pack_into("<q", damaged, second + 8, first + count + 5)  # forward: a "gap"
    path.write_bytes(damaged)
    with pytest.raises(JournalError, match=f"block at byte {second}: its head says seq "
                                           f"{first + count + 5} .*, the index seq "
                                           f"{first + count}"):
        read_all(tmp_path)
    damaged = bytearray(original)
    damaged[0] ^= 0xFF  # the header's magic, never read for a sealed segment before
    path.write_bytes(damaged)
    with pytest.raises(JournalError, match="bad magic"):
        read_all(tmp_path)
    path.write_bytes(original)
    copy = path.with_name(f"{first + 1000:020d}.sbj")
    copy.write_bytes(original)
    with pytest.raises(JournalError, match=f"{copy}.*header says it starts at seq {first}"):
        read_all(tmp_path)
    copy.unlink()
    assert read_all(tmp_path) == ROWS
    done = subprocess.run([*SBUS, "journal", "cat", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    struct.pack_into("<q", damaged := bytearray(original), second + 8, first)
    path.write_bytes(damaged)
    done = subprocess.run([*SBUS, "journal", "cat", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "its head says" in done.stderr


def test_cat_and_export_go_past_a_damaged_segment_and_say_what_they_left_out(tmp_path):
    """A damaged segment in the middle of a journal: ``journal cat`` prints every row it
    can read, the later segments' too, and ends with one line naming the damage and
    saying rows were left out (it used to stop at the damage with no word that later
    segments were never read); ``journal export`` writes the other segments' files."""
    with JournalWriter(tmp_path, block_bytes=1 << 20, fsync=False, reblock_bytes=0) as w:
        for seg in range(3):
            for n in range(2):
                w.append(1_000_000, [b"s%d/b%d" % (seg, n)] * 5, [b"%d" % i for i in range(5)])
                w.flush()
            w.seal()
    first, middle, last = list_segments(tmp_path)
    data = bytearray(middle.path.read_bytes())
    at = fmt.FILE_HEAD.size
    count, seq, klen, plen, _ = fmt.decode_block_head(data, at)
    struct.pack_into("<q", data, at + fmt.block_size(count, klen, plen) + 8, seq)
    middle.path.write_bytes(data)  # its second block numbered as its first
    done = subprocess.run([*SBUS, "journal", "cat", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    keys = [line.split()[2] for line in done.stdout.splitlines()]
    assert keys == ["s0/b0"] * 5 + ["s0/b1"] * 5 + ["s1/b0"] * 5 + ["s2/b0"] * 5 + \
        ["s2/b1"] * 5, done.stdout
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert str(middle.path) in done.stderr and "were not printed" in done.stderr
    out = tmp_path / "parquet"
    done = subprocess.run([*SBUS, "journal", "export", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"{first.name}.parquet",
                                                      f"{last.name}.parquet"]
    assert "2 segment(s), 20 rows" in done.stderr
    assert done.stderr.splitlines()[-1].endswith("the other segments were"), done.stderr
    assert str(middle.path) in done.stderr.splitlines()[-1]


@pytest.mark.parametrize("moved", [-10, 5])
def test_an_open_segments_block_numbered_out_of_turn_is_a_clear_error(tmp_path, moved):
    """An open segment has no index: a block whose first number goes back, or forward
    (it read as a gap), is caught by the order of the numbers themselves, and a recorder
    starting on it sets the segment aside rather than sealing the damage in."""
    w, seg = open_journal(tmp_path, 3)
    data = bytearray(seg.path.read_bytes())
    count, first, klen, plen, _ = fmt.decode_block_head(data, fmt.FILE_HEAD.size)
    second = fmt.FILE_HEAD.size + fmt.block_size(count, klen, plen)
    struct.pack_into("<q", data, second + 8, first + count + moved)
    seg.path.write_bytes(data)
    where = "before" if moved < 0 else "after"
    with pytest.raises(JournalError, match=f"block at byte {second}: it starts at seq "
                                           f"{first + count + moved}, {where} seq "
                                           f"{first + count}"):
        read_all(tmp_path)
    w._lock.close()  # as if the recorder had died: a new one recovers
    with JournalWriter(tmp_path, fsync=False) as again:
        assert again.next_seq > 3 * count + moved
    assert (tmp_path / (seg.path.name + ".corrupt")).read_bytes() == bytes(data)


@pytest.mark.parametrize("kind", ["fifo", "symlink loop"])
def test_a_fifo_named_as_a_segment_is_a_clear_error_not_a_hang(tmp_path, kind):
    """A FIFO or a symlink loop named as a segment is that segment's error: the other
    segments' rows are still printed (it was the listing's error: no row at all)."""
    sealed_journal(tmp_path)
    odd = tmp_path / f"{10**6:020d}.sbj"
    if kind == "fifo":
        os.mkfifo(odd)
        said = f"{odd} is named as a segment but is not a regular file"
    else:
        odd.symlink_to(odd.name)
        said = f"cannot read journal segment {odd}: Too many levels of symbolic links"
    with pytest.raises(JournalError, match=said):
        read_all(tmp_path)
    done = subprocess.run([*SBUS, "journal", "cat", str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert said in done.stderr and len(done.stdout.splitlines()) == len(ROWS)


def test_a_fifo_put_in_a_segments_place_after_the_listing_blocks_no_reader(tmp_path):
    """A segment swapped for a FIFO between the listing and the open (another user's
    race: 4 of 40 ``journal cat`` hung for good in the audit) is opened without waiting
    and refused on what the descriptor is."""
    import threading

    from sbus.journal.store import read_seq_range, segment_blocks

    path = sealed_journal(tmp_path)
    (seg,) = list_segments(tmp_path)
    path.unlink()
    os.mkfifo(path)
    outcomes: list[BaseException] = []

    def read(call) -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - what the reader got is the result
            outcomes.append(exc)

    calls = (lambda: segment_blocks(seg),
             lambda: list(read_seq_range(tmp_path, seg.first_seq, 0, 1 << 20, 0, 1 << 20)))
    for call in calls:
        reader = threading.Thread(target=read, args=(call,), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "a reader blocked in open on the FIFO"
    assert [str(e) for e in outcomes] == \
        [f"{path} is named as a segment but is not a regular file"] * 2


def test_an_unreadable_segment_is_a_journal_error_and_not_moved_aside(tmp_path):
    """The Python API says JournalError for what it cannot read (it raised the raw
    IsADirectoryError); the recorder stops on it with that line rather than taking it
    for damage and moving it aside."""
    sealed_journal(tmp_path)
    odd = tmp_path / f"{10**6:020d}.sbj"
    odd.mkdir()
    with pytest.raises(UnreadableSegment, match=f"cannot read journal segment {odd}: Is a "
                                                "directory"):
        read_all(tmp_path)
    with pytest.raises(UnreadableSegment):
        JournalWriter(tmp_path, fsync=False)
    assert odd.is_dir() and not list(tmp_path.glob("*.corrupt"))


def test_a_lock_file_that_cannot_be_opened_is_named(tmp_path):
    """A directory named ``.lock`` was reported as the journal directory itself."""
    (tmp_path / ".lock").mkdir()
    with pytest.raises(JournalError, match=f"cannot open the journal's lock file "
                                           f"{tmp_path / '.lock'}: Is a directory"):
        JournalWriter(tmp_path, fsync=False)


def test_a_lock_file_that_is_a_fifo_or_a_link_is_named_not_waited_on(tmp_path):
    """A FIFO named ``.lock`` made the recorder wait for a reader without a word, and a
    symbolic link was followed (root made the file it named): both are one line now."""
    os.mkfifo(tmp_path / ".lock")
    with pytest.raises(JournalError, match="lock file .*: not a regular file"):
        JournalWriter(tmp_path, fsync=False)
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").symlink_to(tmp_path / "made")
    with pytest.raises(JournalError, match="lock file .*: a symbolic link"):
        JournalWriter(tmp_path, fsync=False)
    assert not (tmp_path / "made").exists()


@pytest.mark.parametrize("name", ["\u00b2.sbj", "\u0661\u0660\u0660.sbj"],
                         ids=["superscript", "arabic-indic"])
def test_a_segment_named_with_other_digits_is_not_a_segment(tmp_path, name):
    """``².sbj`` passed `str.isdigit` and then failed `int` (a traceback from every reader
    and the recorder); ``١٠٠.sbj`` was read as segment 100.  Names of ASCII digits only."""
    sealed_journal(tmp_path)
    (tmp_path / name).write_bytes(b"junk")
    assert len(read_all(tmp_path)) == len(ROWS)
    done = subprocess.run([*SBUS, "journal", "cat", str(tmp_path)], capture_output=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.count(b"\n") == len(ROWS), done.stderr
    JournalWriter(tmp_path, fsync=False).close()
    assert (tmp_path / name).read_bytes() == b"junk"


def test_a_truncated_segment_is_a_clear_error(tmp_path):
    path = sealed_journal(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 40):
        path.write_bytes(data[:cut])
        with pytest.raises(JournalError, match=str(path)):
            read_all(tmp_path)


def test_offsets_pointing_outside_the_block_are_refused_without_a_crc(tmp_path):
    """With verification off (trusted journals), the structure is still checked: offsets
    that would make Arrow read outside the block are an error, not a crash."""
    from sbus.journal.store import read_blocks, segment_blocks

    path = sealed_journal(tmp_path)
    data = bytearray(path.read_bytes())
    at = fmt.FILE_HEAD.size + fmt.BLOCK_HEAD.size + 8 * 20 + 4 * 5  # a key offset
    struct.pack_into("<i", data, at, 10**6)
    path.write_bytes(data)
    (seg,) = list_segments(tmp_path)
    blocks = segment_blocks(seg)
    with pytest.raises(JournalError, match="corrupt key offsets"):
        list(read_blocks(tmp_path, seg.first_seq, blocks[0].pos, blocks[-1].end,
                         verify=False))


def test_a_damaged_block_inside_a_merged_read_is_named(tmp_path):
    """Blocks read merged (`read_seq_range` with *merge*, the Spark reader's way) are each
    still checked: a flipped payload bit fails the CRC of the middle block, offsets beyond
    the block fail even without the CRC, and the error names the block's position."""
    from sbus.journal.store import read_seq_range, segment_blocks

    path = sealed_journal(tmp_path)
    clean = path.read_bytes()
    (seg,) = list_segments(tmp_path)
    middle = segment_blocks(seg)[1].pos
    data = bytearray(clean)
    data[middle + 100] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(JournalError, match=f"{path}: block at byte {middle}: .*checksum"):
        list(read_seq_range(tmp_path, seg.first_seq, 0, 0, 1, 10**6, merge=(1000, 1 << 20)))
    data = bytearray(clean)
    struct.pack_into("<i", data, middle + fmt.BLOCK_HEAD.size + 8 * 20 + 4 * 5, 10**6)
    path.write_bytes(data)
    with pytest.raises(JournalError, match=f"block at byte {middle}: corrupt key offsets"):
        list(read_seq_range(tmp_path, seg.first_seq, 0, 0, 1, 10**6, verify=False,
                            merge=(1000, 1 << 20)))


def test_the_recorder_moves_a_damaged_segment_aside_and_records_on(broker, tmp_path):
    journal = tmp_path / "journal"
    path = sealed_journal(journal)
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF  # the trailer: the index cannot be found
    path.write_bytes(data)
    rec = subprocess.Popen([*SBUS, "record", "rec/", "--dir", str(journal), "--address",
                            broker.address], stderr=subprocess.PIPE, text=True,
                           stdin=subprocess.DEVNULL)
    try:
        with raw(broker.address) as pub:
            for _ in range(300):  # until the recorder has started and recorded one
                pub.send(b"MSG rec/after\0hello")
                sync(pub)
                if any(k == b"rec/after" for _, _, k, _ in _safe_records(journal)):
                    break
                time.sleep(0.1)
        assert rec.poll() is None, rec.stderr.read()
    finally:
        rec.terminate()
        _, err = rec.communicate(timeout=20)
    assert os.path.exists(str(path) + ".corrupt")
    lines = [line for line in err.splitlines() if "moved aside" in line]
    assert len(lines) == 1 and "Traceback" not in err
    seqs = [seq for seq, _, key, _ in records(journal) if key == b"rec/after"]
    assert seqs and min(seqs) > 60  # never reuses a sequence number the damaged file held
    # and the loss is said where every reader looks (the audit of 2026-11-28: `journal
    # cat` and `journal gaps` said nothing, and the sequence jumped)
    (gap,) = [g for g in read_gaps(journal) if g.kind == "damaged"]
    assert gap.after == 0 and gap.before == min(seqs) and gap.lost is None
    shown = subprocess.run([*SBUS, "journal", "gaps", str(journal)], capture_output=True,
                           text=True, timeout=60)
    assert f"between seq 0 and {min(seqs)}" in shown.stdout
    assert "00000000000000000001, damaged, were moved aside" in shown.stdout
    cat = subprocess.run([*SBUS, "journal", "cat", str(journal)], capture_output=True,
                         text=True, timeout=60)
    assert cat.returncode == 0 and "gap" in cat.stderr and "sbus journal gaps" in cat.stderr


def test_numbers_a_last_segment_moved_aside_held_are_never_used_again(tmp_path):
    """The last segment damaged and moved aside: its numbers stay taken at every later
    start, not only the first (the re-audit of 2026-11-28: a recorder that recorded
    nothing in between numbered from the last segment left, reused them beside the
    ``.corrupt`` file, and a second damage there replaced the first file); ``journal
    cat`` says the records after its last one are missing."""
    with JournalWriter(tmp_path, fsync=False, segment_bytes=2000) as w:
        for i in range(300):
            w.append(1_000_000 + i, [b"k"], [b"%d" % i])
            if i % 20 == 19:
                w.flush()
        w.seal()
    *_, last = list_segments(tmp_path)
    data = bytearray(last.path.read_bytes())
    data[-20] ^= 0xFF  # the trailer: its index cannot be found
    last.path.write_bytes(data)
    with JournalWriter(tmp_path, fsync=False) as w:
        reserved = w.next_seq
    assert reserved > 300
    with JournalWriter(tmp_path, fsync=False) as w:  # nothing recorded in between
        assert w.next_seq == reserved
        w.append(2_000_000, [b"k"], [b"after"])
    assert list(records(tmp_path))[-1][0] == reserved
    (gap,) = [g for g in read_gaps(tmp_path) if g.kind == "damaged"]
    assert (gap.after, gap.before) == (last.first_seq - 1, reserved)
    # a segment of that name damaged again (one put there by hand): both files kept
    twin = bytes(data)
    last.path.write_bytes(twin)
    with JournalWriter(tmp_path, fsync=False):
        pass
    kept = sorted(p.name for p in tmp_path.glob(last.path.name + ".corrupt*"))
    assert kept == [last.path.name + ".corrupt", last.path.name + ".corrupt.1"]
    cat = subprocess.run([*SBUS, "journal", "cat", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert cat.returncode == 0 and "damaged segment(s) moved aside" in cat.stderr


def _safe_records(journal: Path):
    try:
        return list(records(journal))
    except (JournalError, FileNotFoundError):
        return []


def test_the_analyze_report_keeps_hostile_keys_inside_their_cells():
    """Keys are client input: in report.md they must not drive a terminal that shows the
    file, split a table row, end their code span or start a new line."""
    from sbus.spark.analyze import render_report

    evil = ["a|b", "x`y``z", "line\nbreak | # heading", "\x1b]0;owned\x07\x1b[2J", "`", ""]
    row = dict(messages=1, bytes=2, msg_per_s=0.5, p50_size=1, p90_size=1, p99_size=1,
               max_size=1)
    summary = dict(journal="/j", messages=1, bytes=2, keys=1, prefixes=1, first="a", last="b")
    text = render_report(summary, [dict(key=k, **row) for k in evil],
                         [dict(prefix=k, **row) for k in evil], "1 minute", None)
    assert "\x1b" not in text and "\x07" not in text
    table = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 2 + 2 * len(evil)  # one line per row: nothing broke out
    for line in table:
        cells = [c for c in line.replace("\\|", "").split("|")[1:-1]]
        assert len(cells) == 8, line  # no pipe split a row


def test_an_unsealed_segment_with_a_damaged_header_is_kept_aside_not_deleted(tmp_path):
    w = JournalWriter(tmp_path, fsync=False)
    w.append(1, [b"a"] * 10, [b"x"] * 10)
    w.flush()
    (seg,) = list_segments(tmp_path)
    assert not seg.sealed
    data = bytearray(seg.path.read_bytes())
    data[0] ^= 0xFF  # the file magic
    seg.path.write_bytes(data)
    w._lock.close()  # as if the recorder had died: a new one recovers
    with JournalWriter(tmp_path, fsync=False) as again:
        assert again.next_seq > 10
    assert (tmp_path / (seg.path.name + ".corrupt")).read_bytes() == bytes(data)


def test_an_unsealed_segment_whose_first_block_is_damaged_is_kept_aside_not_deleted(
        tmp_path):
    """No whole block after the header, but bytes: a first block torn or damaged (all
    the blocks after it with it).  It was deleted as "empty"; now it is moved aside and
    the numbering goes on past anything it could hold (no number used twice)."""
    w, seg = open_journal(tmp_path, 3)
    data = bytearray(seg.path.read_bytes())
    data[fmt.FILE_HEAD.size + fmt.BLOCK_HEAD.size + 2] ^= 0xFF  # the first block's body
    seg.path.write_bytes(data)
    w._lock.close()  # as if the recorder had died: a new one recovers
    with JournalWriter(tmp_path, fsync=False) as again:
        assert again.next_seq > 30
    assert (tmp_path / (seg.path.name + ".corrupt")).read_bytes() == bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600), st.integers(0, 5), st.integers(0, 2**32 - 1),
       st.integers(0, 700), st.booleans())
def test_journal_parsing_of_any_bytes_raises_only_the_journals_errors(data, nblocks, crc,
                                                                      index_pos, verify):
    """Every decoder of the on-disk format, given arbitrary bytes, returns or raises
    FormatError; every reader of a directory holding arbitrary bytes (as a sealed or an
    unsealed segment, whole or behind a valid header) returns or raises JournalError."""
    for call in (lambda: fmt.decode_block(data, 0, verify), lambda: fmt.decode_header(data),
                 lambda: fmt.decode_block_head(data),
                 lambda: fmt.decode_trailer(data[:fmt.TRAILER.size]),
                 lambda: fmt.decode_index(data, nblocks, crc, index_pos)):
        try:
            call()
        except FormatError:
            pass
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name, content in ((f"{1:020d}.sbj", data),
                              (f"{1:020d}.sbj", fmt.encode_header(1, 0) + data),
                              (f"{1:020d}.sbj.open", fmt.encode_header(1, 0) + data),
                              (f"{1:020d}.sbj.open", data)):
            path = Path(d) / name
            path.write_bytes(content)
            try:
                list(records(d))
            except JournalError:
                pass
            path.unlink()


def test_damaged_notes_and_ids_are_named_and_never_crash_the_recorder(tmp_path, caplog):
    """Notes in gaps.jsonl and the journal's identity are read, not trusted (the audit of
    2026-11-28): a ``damaged`` note ending past any journal's numbers (written by hand)
    is said and left out (it numbered the journal past its format's range, and every
    flush then failed); a line that does not read does not cancel the others'
    reservations; a ``journal.id`` that cannot be read stops the writer with one line
    (a new identity would make streaming queries read the journal again), a FIFO
    there included, without waiting on it."""
    with JournalWriter(tmp_path, fsync=False) as w:
        w.append(1, [b"k"] * 3, [b"a"] * 3)

    def note(before: int) -> bytes:
        return gaps.encode(gaps.Gap(3, before, gaps.DAMAGED, None, None, 1))

    with open(tmp_path / gaps.FILE, "ab") as f:
        f.write(note(2**63 - 1) + note(100) + b'{"kind": "damaged", garbage\n')
    with JournalWriter(tmp_path, fsync=False) as w:
        assert w.next_seq == 100
        w.append(2, [b"k"], [b"b"])
    assert [r[0] for r in records(tmp_path)] == [1, 2, 3, 100]
    assert "past any journal's numbers: left out" in caplog.text
    assert "1 line(s) naming a damaged segment do not read" in caplog.text
    ident = tmp_path / "journal.id"
    kept = ident.read_text()
    ident.write_text("garbage\n")
    with pytest.raises(JournalError, match="journal.id is damaged: not a journal id; fix "
                                           "it, or remove it"):
        JournalWriter(tmp_path, fsync=False)
    ident.unlink()
    os.mkfifo(ident)
    with pytest.raises(JournalError, match="cannot read .*journal.id"):
        JournalWriter(tmp_path, fsync=False)
    ident.unlink()
    ident.write_text(kept)
    with JournalWriter(tmp_path, fsync=False) as w:
        assert w.id == kept.strip()
