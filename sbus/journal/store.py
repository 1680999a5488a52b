"""The journal directory: segment files, the writer that appends and seals them, recovery,
retention, and the readers that list segments and read byte ranges.

Names: ``<first_seq:020d>.sbj`` for a sealed segment, the same plus ``.open`` while it is
being written.  Sealing appends the index, fsyncs, then renames, so a ``.sbj`` file is
always complete; a crash leaves at most one ``.open`` file, which recovery cuts back to
its last whole block and seals.  Byte positions of blocks never change when a segment is
sealed, so offsets taken while it was open stay valid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..defaults import decimal
from ..display import one_line, printable
from ..errors import SbusError
from ..files import NotRegular, open_regular
from . import format as fmt
from . import gaps
from .columns import Columns
from .format import Block, BlockInfo, FormatError
from .retention import SegmentAge, expired

__all__ = ["Segment", "JournalWriter", "JournalError", "UnreadableSegment", "list_segments",
           "segment_blocks", "read_blocks", "read_seq_range", "records", "resolve", "SUFFIX",
           "OPEN_SUFFIX"]

log = logging.getLogger("sbus.journal")

SUFFIX = ".sbj"
OPEN_SUFFIX = ".sbj.open"
TMP_SUFFIX = ".sbj.tmp"  # a re-blocked segment being written
#: Where ``sbus record`` writes each sealed segment as Parquet by default: ``DIR/parquet``.
EXPORT_SUBDIR = "parquet"
#: Re-blocking at seal stops a block at this many rows (Spark's reader coalesces to it too).
REBLOCK_ROWS = 1 << 16
IOV_MAX = os.sysconf("SC_IOV_MAX")


class JournalError(SbusError):
    """A journal directory that cannot be used (locked, unreadable, corrupt sealed segment)."""


class UnreadableSegment(JournalError):
    """A segment the system will not let us read (permissions, a directory): not damage,
    so the recorder stops and says so rather than moving it aside."""


@dataclass(frozen=True, slots=True)
class Segment:
    first_seq: int
    path: Path
    sealed: bool

    @property
    def name(self) -> str:
        return f"{self.first_seq:020d}"


def _name(first_seq: int) -> str:
    return f"{first_seq:020d}"


#: The journal's identity (`journal_id`): made once, by the first writer to open the
#: directory, so that a reader holding an offset (a streaming query's checkpoint) tells
#: a journal removed and recorded anew, numbered from 1 again, from the one it read.
ID_FILE = "journal.id"
#: The largest sequence number a moved-aside segment's note may reserve (`_reserved`):
#: far past any real journal, and far below the format's 2**63.
RESERVED_MAX = 1 << 62


def journal_id(directory: str | os.PathLike) -> str | None:
    """The identity of the journal in *directory* (32 hex digits, `ID_FILE`); None where
    there is none (no journal yet, or one no writer has opened since journals had ids).
    JournalError if the file is there but is not one."""
    path = Path(directory) / ID_FILE
    try:
        with open(open_regular(path), "rb") as f:
            data = f.read(64)
    except FileNotFoundError:
        return None
    except OSError as exc:  # (`NotRegular` too: a FIFO or a directory there)
        raise JournalError(f"cannot read {path}: {exc.strerror or exc}") from None
    text = data.strip().decode("ascii", "replace")
    if len(text) != 32 or any(c not in "0123456789abcdef" for c in text):
        raise JournalError(f"{path} is damaged: not a journal id")
    return text


def list_segments(directory: str | os.PathLike) -> list[Segment]:
    """Segments in journal order (sealed and open)."""
    d = Path(directory)
    if not d.is_dir():
        raise JournalError(f"no journal directory at {d}")
    out = []
    for entry in os.scandir(d):
        name = entry.name
        if name.endswith(OPEN_SUFFIX):
            stem, sealed = name[:-len(OPEN_SUFFIX)], False
        elif name.endswith(SUFFIX):
            stem, sealed = name[:-len(SUFFIX)], True
        else:
            continue
        if decimal(stem):  # what it is is checked where it is opened (`open_segment`)
            out.append(Segment(int(stem), Path(entry.path), sealed))
    out.sort(key=lambda s: (s.first_seq, not s.sealed))
    # A crash between re-blocking's rename and its unlink leaves a sealed file and its open
    # twin, holding the same records: the sealed one is the segment.
    return [s for i, s in enumerate(out) if i == 0 or out[i - 1].first_seq != s.first_seq]


def open_segment(path: Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor on the segment at *path*, which must be a regular file
    (`files.open_regular`: a FIFO put in a segment's place, even between a listing and
    the open, would block a reader for good).  JournalError for another kind of file
    (damage: the recorder moves it aside), UnreadableSegment for a directory or what
    cannot be opened at all."""
    try:
        return open_regular(path, flags)
    except NotRegular as exc:
        if exc.errno == errno.EISDIR:
            raise UnreadableSegment(f"cannot read journal segment {path}: Is a "
                                    "directory") from None
        raise JournalError(f"{path} is named as a segment but is not a regular file") \
            from None
    except FileNotFoundError:
        raise
    except OSError as exc:  # no permission, a symlink loop
        raise UnreadableSegment(f"cannot read journal segment {path}: "
                                f"{exc.strerror or exc}") from None


def resolve(directory: str | os.PathLike, first_seq: int) -> Segment | None:
    """The segment starting at *first_seq*, sealed or open (it may have been sealed since
    it was listed); None if it is gone (retention)."""
    d = Path(directory)
    sealed = d / (_name(first_seq) + SUFFIX)
    if sealed.exists():
        return Segment(first_seq, sealed, True)
    live = d / (_name(first_seq) + OPEN_SUFFIX)
    if live.exists():
        return Segment(first_seq, live, False)
    return Segment(first_seq, sealed, True) if sealed.exists() else None  # sealed meanwhile


#: A block or index up to this size is read without asking whether the file holds it.
SPARSE_CHECK = 1 << 20


def held(fd: int, start: int, end: int) -> int:
    """Bytes of ``[start, end)`` the file holds as data, not holes (``SEEK_DATA`` /
    ``SEEK_HOLE``), counted up to half the range: a sparse file's size (``st_size``) says
    nothing of what is in it, and reading a hole yields zeros for free, so a 4 KB file
    can claim a 1 GiB block.  A file system without hole support is taken at its size."""
    want = (end - start + 1) // 2
    total, at = 0, start
    here = os.lseek(fd, 0, os.SEEK_CUR)  # put back after: a buffered file reads on from it
    try:
        while at < end and total < want:
            try:
                data = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but a hole up to the file's end
                    break
                return end - start  # no SEEK_DATA here
            if data >= end:
                break
            hole = os.lseek(fd, data, os.SEEK_HOLE)
            total += min(hole, end) - data
            at = hole
    finally:
        os.lseek(fd, here, os.SEEK_SET)
    return total


def check_held(fd: int, pos: int, size: int, what: str) -> None:
    """FormatError unless the file holds at least half of the *size* bytes at *pos* as
    data (always true of what the writer wrote; zero runs a file system stores as holes
    stay well inside the half), so a reader allocates at most twice what it can read."""
    if size > SPARSE_CHECK and held(fd, pos, pos + size) * 2 < size:
        raise FormatError(f"{what} claims {size} bytes at byte {pos}, but the file holds "
                          "less than half of them (a sparse file)")


def _sealed_blocks(f, path: Path) -> list[BlockInfo]:
    size = os.fstat(f.fileno()).st_size
    if size < fmt.FILE_HEAD.size + fmt.TRAILER.size:
        raise FormatError("segment too short")
    f.seek(size - fmt.TRAILER.size)
    index_pos, nblocks, crc = fmt.decode_trailer(f.read(fmt.TRAILER.size))
    if not fmt.FILE_HEAD.size <= index_pos <= size - fmt.TRAILER.size or \
            index_pos + nblocks * fmt.INDEX_ENTRY.size != size - fmt.TRAILER.size:
        raise FormatError("trailer points outside the segment")
    check_held(f.fileno(), index_pos, nblocks * fmt.INDEX_ENTRY.size, "the index")
    f.seek(index_pos)
    return fmt.decode_index(f.read(nblocks * fmt.INDEX_ENTRY.size), nblocks, crc, index_pos)


def scan_blocks(f, start: int = fmt.FILE_HEAD.size, verify: bool = True) -> list[BlockInfo]:
    """Walk whole blocks from *start* (an open or torn segment); stops at the first torn or
    corrupt one.  Each block is read, to check its CRC."""
    out = []
    pos = start
    f.seek(pos)
    file_size = os.fstat(f.fileno()).st_size
    while True:
        head = f.read(fmt.BLOCK_HEAD.size)
        try:
            count, first_seq, klen, plen, _ = fmt.decode_block_head(head)
        except FormatError:
            break
        size = fmt.block_size(count, klen, plen)
        if pos + size > file_size:  # torn, or a head claiming more than there is
            break
        try:
            check_held(f.fileno(), pos, size, "a block")
        except FormatError:
            break
        data = bytearray(size)  # one copy: the head, then the rest read into place
        data[:fmt.BLOCK_HEAD.size] = head
        if f.readinto(memoryview(data)[fmt.BLOCK_HEAD.size:]) != size - fmt.BLOCK_HEAD.size:
            break
        try:
            block, _ = fmt.decode_block(data, 0, verify)
        except FormatError:
            break
        ts = block.ts.cast("q")
        out.append(BlockInfo(pos, first_seq, count, min(ts), max(ts), size))
        pos += size
    return out


def segment_blocks(segment: Segment, start: int = fmt.FILE_HEAD.size) -> list[BlockInfo]:
    """The blocks of a segment at or after byte *start*: from the index if sealed, by a
    verified scan if open."""
    try:
        with open(open_segment(segment.path), "rb") as f:
            if segment.sealed:
                try:
                    _check_header(f.read(fmt.FILE_HEAD.size), segment.first_seq)
                    return [b for b in _sealed_blocks(f, segment.path) if b.pos >= start]
                except FormatError as exc:
                    raise JournalError(f"sealed segment {segment.path} is corrupt: {exc}") from None
            try:
                _check_header(f.read(fmt.FILE_HEAD.size), segment.first_seq)
            except FormatError as exc:
                raise JournalError(f"unsealed segment {segment.path} is damaged: "
                                   f"{exc}") from None
            return scan_blocks(f, max(start, fmt.FILE_HEAD.size))
    except FileNotFoundError:
        if not segment.sealed:  # sealed since it was listed: read its index instead
            moved = segment.path.with_name(segment.name + SUFFIX)
            if moved.exists():
                return segment_blocks(Segment(segment.first_seq, moved, True), start)
        raise
    except OSError as exc:  # unreadable: a read error
        raise UnreadableSegment(f"cannot read journal segment {segment.path}: "
                                f"{exc.strerror or exc}") from None


def read_blocks(directory: str | os.PathLike, first_seq: int, start: int, end: int,
                verify: bool | None = None) -> Iterator[Block]:
    """Decoded blocks whose positions lie in ``[start, end)`` of the segment starting at
    *first_seq*; *start* must be a block boundary.  FileNotFoundError if it is gone.

    *verify* checks each block's CRC (the default: a flipped bit in a key or payload is
    an error, not a wrong row); False skips it for speed on journals you trust.  Counts,
    sizes and offsets are checked always.  A damaged block raises JournalError naming
    the file and the block's byte position."""
    seg, fd = _open(directory, first_seq)
    try:
        yield from _blocks_from(fd, seg.path, start, end, verify is not False)
    finally:
        os.close(fd)


def read_seq_range(directory: str | os.PathLike, first_seq: int, start: int, end: int,
                   lo: int, hi: int, verify: bool | None = None,
                   merge: tuple[int, int] | None = None) -> Iterator[Block]:
    """Decoded blocks holding rows ``lo <= seq < hi`` of the segment starting at
    *first_seq*, planned as the blocks at byte positions ``[start, end)``.  With *merge*
    ``(rows, nbytes)``, consecutive blocks come merged into one `Block` of at least *rows*
    rows or *nbytes* of keys and payloads (`_merged_from`).

    Positions are a plan made while the segment may still have been open; sealing may
    have re-blocked it since.  So a segment that is sealed now is read by sequence number
    through its own index (read from the same open file), an open one at the planned
    positions (blocks never move while a segment is open).  FileNotFoundError if gone."""
    seg, fd = _open(directory, first_seq)
    try:
        verify = verify is not False
        by_pos = None
        if seg.sealed:
            with open(fd, "rb", closefd=False) as f:
                try:
                    index = _sealed_blocks(f, seg.path)
                except FormatError as exc:
                    raise JournalError(f"sealed segment {seg.path} is corrupt: {exc}") from None
            wanted = [b for b in index if b.next_seq > lo and b.first_seq < hi]  # a run
            if not wanted:
                return
            start, end = wanted[0].pos, wanted[-1].end
            by_pos = {b.pos: b for b in wanted}
        if merge is None:
            yield from _blocks_from(fd, seg.path, start, end, verify, by_pos)
        else:
            yield from _merged_from(fd, seg.path, start, end, verify, *merge, by_pos)
    finally:
        os.close(fd)


def _open(directory: str | os.PathLike, first_seq: int) -> tuple[Segment, int]:
    """The segment starting at *first_seq* and a file descriptor on it; an open segment
    sealed (renamed) between the lookup and the open is opened under its sealed name."""
    for _ in range(3):
        seg = resolve(directory, first_seq)
        if seg is None:
            break
        try:
            return seg, open_segment(seg.path)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"journal segment {_name(first_seq)} no longer exists "
                            f"in {directory} (removed by retention?)")


def _check_header(data: bytes, first_seq: int) -> None:
    """FormatError unless *data* is a segment header naming *first_seq* (a segment copied
    under another name would repeat the rows of the one it came from)."""
    named = fmt.decode_header(data)[0]
    if named != first_seq:
        raise FormatError(f"its header says it starts at seq {named}, its name at {first_seq}")


def _after(path: Path) -> int:
    """The first sequence number a segment's name gives: no block of it starts before."""
    return int(path.name.split(".", 1)[0])


def _as_indexed(index: dict[int, BlockInfo] | None, pos: int, first_seq: int,
                count: int) -> None:
    """FormatError unless the block at *pos* says what the sealed segment's index (which
    its CRC guards) says of it: a number moved forward in a head would read as a gap."""
    if index is None:
        return
    info = index.get(pos)
    if info is None or (info.first_seq, info.count) != (first_seq, count):
        said = "no block" if info is None else f"seq {info.first_seq} ({info.count} rows)"
        raise FormatError(f"its head says seq {first_seq} ({count} rows), the index {said}")


def _in_turn(first_seq: int, count: int, after: int, exact: bool = True) -> int:
    """The number after a block of *count* rows from *first_seq*, which must start at
    *after* (the end of the block before it, or the segment's first number; only not
    before it for the first block of a read that starts inside a segment, not *exact*):
    a writer numbers a segment's blocks in turn, so a number going back is damage that
    would repeat rows, and one going forward damage that would read as a gap."""
    if first_seq < after or (exact and first_seq != after):
        where = "before" if first_seq < after else "after"
        raise FormatError(f"it starts at seq {first_seq}, {where} seq {after}, where the "
                          "rows before it end")
    return first_seq + count


def _blocks_from(fd: int, path: Path, start: int, end: int, verify: bool,
                 index: dict[int, BlockInfo] | None = None) -> Iterator[Block]:
    file_end = os.fstat(fd).st_size
    pos = start
    after, exact = _after(path), start == fmt.FILE_HEAD.size
    while pos < end:
        size = _block_head(fd, path, pos, file_end)[5]  # checked before the allocation
        try:
            # One copy, straight into the buffer the block's Arrow arrays will wrap.
            data = bytearray(size)
            if os.preadv(fd, [data], pos) != size:
                raise FormatError("truncated block")
            block, _ = fmt.decode_block(data, 0, verify)
            _as_indexed(index, pos, block.first_seq, block.count)
            after, exact = _in_turn(block.first_seq, block.count, after, exact), True
        except FormatError as exc:
            raise JournalError(f"damaged journal segment {path}: block at byte "
                               f"{pos}: {exc}") from None
        yield block
        pos += size


def _block_head(fd: int, path: Path, pos: int, file_end: int) -> tuple[int, int, int, int,
                                                                      int, int]:
    """``(count, first_seq, klen, plen, crc, size)`` of the block at *pos*, checked to fit."""
    try:
        count, first_seq, klen, plen, crc = fmt.decode_block_head(
            os.pread(fd, fmt.BLOCK_HEAD.size, pos))
        size = fmt.block_size(count, klen, plen)
        if pos + size > file_end:
            raise FormatError(f"block claims {size} bytes, the file has {file_end - pos} left")
        check_held(fd, pos, size, "the block")
    except FormatError as exc:
        raise JournalError(f"damaged journal segment {path}: block at byte {pos}: "
                           f"{exc}") from None
    return count, first_seq, klen, plen, crc, size


def _merged_from(fd: int, path: Path, start: int, end: int, verify: bool, rows: int,
                 nbytes: int, index: dict[int, BlockInfo] | None = None) -> Iterator[Block]:
    """The blocks in ``[start, end)`` merged into Blocks of at least *rows* rows or *nbytes*
    of keys and payloads (the last may be smaller; a gap in the sequence numbers ends one
    early), so a reader gets large batches without concatenating: each block's columns
    are read (``preadv``) straight into their place in the merged columns, its CRC chained
    over those parts, and its offsets checked and then shifted by what precedes it.  The
    merged columns stay below 2 GiB each, as Arrow's int32 offsets need."""
    file_end = os.fstat(fd).st_size
    pos = start
    after, exact = _after(path), start == fmt.FILE_HEAD.size
    while pos < end:
        heads = []
        n = klen = plen = 0
        at = pos
        while at < end and n < rows and klen + plen < nbytes:
            head = _block_head(fd, path, at, file_end)
            if heads and (head[1] != heads[0][2] + n or
                          max(klen + head[2], plen + head[3]) > fmt.MAX_COLUMN_BYTES):
                break
            try:
                _as_indexed(index, at, head[1], head[0])
                after, exact = _in_turn(head[1], head[0], after, exact), True
            except FormatError as exc:
                raise JournalError(f"damaged journal segment {path}: block at byte {at}: "
                                   f"{exc}") from None
            heads.append((at, *head))
            n, klen, plen = n + head[0], klen + head[2], plen + head[3]
            at += head[5]
        ts = np.empty(8 * n, np.uint8)
        koff = np.empty(n + 1, "<i4")
        poff = np.empty(n + 1, "<i4")
        keys = np.empty(klen, np.uint8)
        payloads = np.empty(plen, np.uint8)
        row = kat = pat = 0
        for bpos, count, _, bk, bp, crc, size in heads:
            body = 16 * count + 8 + bk + bp
            parts = [memoryview(ts[8 * row:8 * (row + count)]),
                     memoryview(koff[row:row + count + 1]).cast("B"),
                     memoryview(poff[row:row + count + 1]).cast("B"),
                     memoryview(keys[kat:kat + bk]), memoryview(payloads[pat:pat + bp]),
                     bytearray(size - fmt.BLOCK_HEAD.size - body)]
            try:
                if os.preadv(fd, parts, bpos + fmt.BLOCK_HEAD.size) != \
                        size - fmt.BLOCK_HEAD.size:
                    raise FormatError("truncated block")
                if verify:
                    c = 0
                    for part in parts:
                        c = fmt.crc32(part, c)
                    if c != crc:
                        raise FormatError("block checksum mismatch")
                fmt.check_offsets(parts[1], bk, "key")
                fmt.check_offsets(parts[2], bp, "payload")
            except FormatError as exc:
                raise JournalError(f"damaged journal segment {path}: block at byte "
                                   f"{bpos}: {exc}") from None
            koff[row:row + count + 1] += kat
            poff[row:row + count + 1] += pat
            row, kat, pat = row + count, kat + bk, pat + bp
        yield Block(heads[0][2], n, memoryview(ts), memoryview(koff).cast("B"),
                    memoryview(poff).cast("B"), memoryview(keys), memoryview(payloads))
        pos = at


class JournalWriter:
    """Appends messages to the journal in *directory*: buffered into blocks, rotated by size
    and age, sealed atomically, with retention applied after each seal.

    One writer per directory (an exclusive ``flock`` on ``.lock``).  Opening recovers what
    a previous writer left behind and resumes the sequence numbers after its last record.
    """

    def __init__(self, directory: str | os.PathLike, *, segment_bytes: int = 64 << 20,
                 segment_seconds: float = 3600.0, block_bytes: int = 1 << 20,
                 keep_seconds: float | None = None, keep_bytes: int | None = None,
                 fsync: bool = True, reblock_bytes: int = 4 << 20,
                 export_dir: str | os.PathLike | None = None) -> None:
        self.dir = Path(directory)
        self.reblock_bytes = reblock_bytes
        self.export_dir = export_dir
        if export_dir is not None and type(self).export_segment is JournalWriter.export_segment:
            raise JournalError("export_dir needs a writer that exports "
                               "(sbus.journal.export.ExportingWriter)")
        self._exporter = None  # a thread exporting sealed segments as Parquet, if asked
        self.export_failures = 0  # segments whose export failed (logged; recording goes on)
        self.segment_bytes = segment_bytes
        self.segment_seconds = segment_seconds
        self.block_bytes = block_bytes
        self.keep_seconds = keep_seconds
        self.keep_bytes = keep_bytes
        self.fsync = fsync
        lock = self.dir / ".lock"
        #: a writer had this journal before (its lock file is there), even if it wrote
        #: nothing (killed before its first flush): what came meanwhile is not in it
        self.resumed = lock.exists()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise JournalError(f"cannot use journal directory {self.dir}: "
                               f"{exc.strerror or exc}") from None
        try:  # not followed if a link, not waited on if a FIFO: a regular file or an error
            self._lock = os.fdopen(open_regular(
                lock, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW), "a")
        except OSError as exc:  # a directory, a link, a FIFO, another user's file…
            why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or exc
            raise JournalError(f"cannot open the journal's lock file {lock}: {why}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise JournalError(f"journal {self.dir} is in use by another recorder") from None
        try:
            self.id = self._identity()
        except JournalError:
            self._lock.close()  # (the lock goes with the refusal)
            raise
        self._fd: int | None = None
        self._seg_first = 0
        self._seg_size = 0
        self._seg_opened = 0.0
        self._blocks: list[BlockInfo] = []
        self._chunks: list[tuple[int, Columns]] = []  # (receive time, records) to write
        self._pending = 0
        self._pending_bytes = 0
        self._gap_notes: dict[str, gaps.Gap] = {}  # by kind, written at the next flush
        self._gaps_fd: int | None = None
        self.last_ts: int | None = None  # receive time of the last record written
        self._repair_gaps()  # (first: a segment moved aside is noted there)
        self.next_seq = self._recover()
        self.written = 0  # records written to files since opening
        self.apply_retention()
        self._export_missing()

    # -- recovery ------------------------------------------------------------------

    def _recover(self) -> int:
        """Seal any ``.open`` segment at its last whole block; return the next sequence
        number."""
        next_seq = 1
        self._remove_leftovers()
        segments = list_segments(self.dir)
        for i, seg in enumerate(segments):
            try:
                blocks = segment_blocks(seg) if seg.sealed else self._recover_open(seg)
            except UnreadableSegment:
                raise
            except JournalError as exc:
                resume = segments[i + 1].first_seq if i + 1 < len(segments) else None
                next_seq = max(next_seq, self._quarantine(seg, exc, resume))
                continue
            if blocks:
                next_seq = max(next_seq, blocks[-1].next_seq)
                self.last_ts = blocks[-1].max_ts
            else:
                next_seq = max(next_seq, seg.first_seq)
        return max(next_seq, self._reserved())

    def _reserved(self) -> int:
        """The numbers a segment moved aside could have held stay taken after that start
        too (its `gaps.DAMAGED` note says where they end): the next writer would number
        its first records from the last segment left otherwise, and a second moved-aside
        segment of that name replaced the first (the re-audit of 2026-11-28).  Only the
        ``damaged`` lines are decoded (a gaps file of 48 MB took 2.7 s otherwise); a line
        that does not decode is skipped, the others still count; a note past
        `RESERVED_MAX` (no segment holds that many records: written by hand) is said and
        left out, so it cannot number the journal past what its format holds."""
        try:
            fd = open_regular(self.dir / gaps.FILE)
        except FileNotFoundError:
            return 1
        except OSError as exc:
            log.warning("cannot read %s: %s; numbers a damaged segment held may not be "
                        "known", gaps.FILE, exc.strerror or exc)
            return 1
        reserved, bad = 1, 0
        with os.fdopen(fd, "rb") as f:  # (lines read at most a gap's length at a time)
            for line in iter(lambda: f.readline(gaps.LINE_BYTES + 1), b""):
                if b'"damaged"' not in line:
                    continue
                try:
                    gap = gaps.decode(line)
                except FormatError:
                    bad += 1
                    continue
                if gap.kind != gaps.DAMAGED:
                    continue
                if gap.before > RESERVED_MAX:
                    log.warning("%s: a damaged segment's note ends at seq %d, past any "
                                "journal's numbers: left out", gaps.FILE, gap.before)
                    continue
                reserved = max(reserved, gap.before)
        if bad:
            log.warning("%s: %d line(s) naming a damaged segment do not read: the numbers "
                        "those segments held may not be known", gaps.FILE, bad)
        return reserved

    def _identity(self) -> str:
        """The journal's id (`journal_id`), made if it has none, written whole under a
        temporary name, then renamed.  One that cannot be read is the writer's error: a
        new one would make every streaming query that read this journal take it for
        another (the audit of 2026-11-28: rows delivered again)."""
        try:
            found = journal_id(self.dir)
        except JournalError as exc:
            raise JournalError(f"{exc}; fix it, or remove it to give the journal a new "
                               "identity (streaming queries that read it then take it for "
                               "another journal)") from None
        if found is not None:
            return found
        made = os.urandom(16).hex()
        tmp = self.dir / (ID_FILE + TMP_SUFFIX)
        try:
            fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                              0o644)
            try:
                _write_all(fd, [memoryview(made.encode() + b"\n")])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.dir / ID_FILE)
        except OSError as exc:
            raise JournalError(f"cannot write the journal's identity {self.dir / ID_FILE}: "
                               f"{exc.strerror or exc}") from None
        self._fsync_dir()
        return made

    def _remove_leftovers(self) -> None:
        """A re-blocking cut short: its temporary file goes, and so does an open segment
        whose re-blocked (sealed) twin was already renamed into place."""
        for entry in os.scandir(self.dir):
            name = entry.name
            twin = name.endswith(OPEN_SUFFIX) and \
                (self.dir / (name[:-len(OPEN_SUFFIX)] + SUFFIX)).exists()
            if name.endswith(TMP_SUFFIX) or twin:
                log.warning("removing %s left by an interrupted seal", name)
                os.unlink(entry.path)

    def _quarantine(self, seg: Segment, exc: JournalError, resume: int | None) -> int:
        """Move a segment whose index or header is damaged aside (``.corrupt``: kept for
        inspection, skipped by readers) instead of failing at every start, and return a
        sequence number beyond any record it can hold, so none is ever reused.  The loss
        is noted in ``gaps.jsonl`` first (`gaps.DAMAGED`, up to *resume*, the next
        segment's first record), made durable before the rename: never moved unsaid."""
        size = seg.path.stat().st_size
        smallest_record = 16  # ts (8) and two offsets (4 + 4)
        beyond = seg.first_seq + size // smallest_record + 1
        self._gap_notes[gaps.DAMAGED] = gaps.Gap(
            seg.first_seq - 1, beyond if resume is None else resume, gaps.DAMAGED, None,
            None, time.time_ns())
        self._write_gaps()
        os.fsync(self._gaps_fd)
        aside = seg.path.with_name(seg.path.name + ".corrupt")
        n = 1
        while aside.exists():  # one set aside before under this name: both kept
            aside = seg.path.with_name(f"{seg.path.name}.corrupt.{n}")
            n += 1
        os.rename(seg.path, aside)
        self._fsync_dir()
        log.error("%s; moved aside to %s, its records are skipped (noted in %s)",
                  one_line(str(exc)), printable(aside.name), gaps.FILE)
        return beyond

    def _recover_open(self, seg: Segment) -> list[BlockInfo]:
        with open(open_segment(seg.path, os.O_RDWR), "r+b") as f:
            try:
                fmt.decode_header(f.read(fmt.FILE_HEAD.size))
                blocks = scan_blocks(f)
            except FormatError as exc:
                if os.fstat(f.fileno()).st_size > fmt.FILE_HEAD.size:  # data: keep it
                    raise JournalError(f"unsealed segment {seg.path} has a damaged "
                                       f"header: {exc}") from None
                blocks = []
            if not blocks:
                data = os.fstat(f.fileno()).st_size - fmt.FILE_HEAD.size
                if data > 0:  # a first block torn or damaged: kept aside, never deleted
                    raise JournalError(f"unsealed segment {seg.path} holds {data} bytes "
                                       "after its header but no whole block")
                log.warning("removing empty unsealed segment %s", seg.path)
                seg.path.unlink()
                return []
            after = seg.first_seq
            for b in blocks:  # whole blocks, each with its CRC, but numbered out of turn
                try:
                    after = _in_turn(b.first_seq, b.count, after)
                except FormatError as exc:
                    raise JournalError(f"unsealed segment {seg.path}: block at byte "
                                       f"{b.pos}: {exc}") from None
            end = blocks[-1].end
            lost = os.fstat(f.fileno()).st_size - end
            if lost:
                log.warning("recovered %s: cut %d bytes of torn tail", seg.path.name, lost)
            f.truncate(end)
            f.seek(end)
            f.write(fmt.encode_index(blocks, end))
            f.flush()
            os.fsync(f.fileno())
        os.rename(seg.path, seg.path.with_name(seg.name + SUFFIX))
        self._fsync_dir()
        return blocks

    def _repair_gaps(self) -> None:
        """A gap line torn by a crash (no newline) is cut away, so the next line starts
        whole; a last line longer than any gap (damage) is ended instead, for readers to
        name."""
        try:
            fd = open_regular(self.dir / gaps.FILE, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise JournalError(f"cannot open {self.dir / gaps.FILE}: "
                               f"{exc.strerror or exc}") from None
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - gaps.LINE_BYTES - 1)
            tail = os.pread(fd, size - start, start)
            if tail.endswith(b"\n") or not size:
                return
            if b"\n" in tail or not start:  # a torn line: the whole lines before it stay
                log.warning("cut a torn line from the end of %s", gaps.FILE)
                os.ftruncate(fd, start + tail.rfind(b"\n") + 1)
            else:
                os.pwrite(fd, b"\n", size)
        finally:
            os.close(fd)

    # -- writing -------------------------------------------------------------------

    @property
    def position(self) -> int:
        """The sequence number the next record appended gets."""
        return self.next_seq + self._pending

    def note_gap(self, kind: str, after: int | None = None, lost: int | None = None,
                 from_ns: int | None = None) -> None:
        """Messages of *kind* (`gaps.KINDS`) missing between record *after* (by default the
        last appended) and the next one appended; written to ``gaps.jsonl`` at the next
        flush, one line per kind and flush (notes of one kind meanwhile are summed)."""
        gap = gaps.Gap(self.position - 1 if after is None else after, self.position, kind,
                       lost, from_ns, time.time_ns())
        noted = self._gap_notes.get(kind)
        self._gap_notes[kind] = gap if noted is None else noted.merged(gap)

    def append(self, ts_ns: int, keys: list[bytes], payloads: list[bytes]) -> None:
        """Buffer records received at *ts_ns*; writes a block once enough is buffered."""
        if keys:
            self.append_columns(ts_ns, Columns.of(keys, payloads))

    def append_columns(self, ts_ns: int, records: Columns) -> None:
        """`append` for records already in columns (the recorder's batches)."""
        self._chunks.append((ts_ns, records))
        self._pending += records.count
        self._pending_bytes += len(records.keys) + len(records.payloads) + 16 * records.count
        if self._pending_bytes >= self.block_bytes:
            self.flush()

    @property
    def pending(self) -> int:
        """Records buffered in memory, not yet written (what a kill -9 would lose)."""
        return self._pending

    def flush(self) -> None:
        """Write the buffered records as one block, then the gaps noted (to the OS; fsync
        only on seal)."""
        if self._pending:
            self._write_block()
        if self._gap_notes:
            self._write_gaps()

    def _write_gaps(self) -> None:
        notes = sorted(self._gap_notes.values(), key=lambda g: (g.after, g.before))
        if self._gaps_fd is None:
            self._gaps_fd = open_regular(self.dir / gaps.FILE, os.O_WRONLY | os.O_APPEND
                                         | os.O_CREAT | os.O_NOFOLLOW)
        _write_all(self._gaps_fd, [memoryview(b"".join(map(gaps.encode, notes)))])
        self._gap_notes = {}

    def _write_block(self) -> None:
        if self._fd is None:
            self._open_segment()
        chunks = self._chunks
        times = [t for t, _ in chunks]
        parts = [c for _, c in chunks]
        data = fmt.block_parts(
            self.next_seq,
            np.repeat(np.array(times, np.int64), [c.count for c in parts]),
            _offsets([c.key_lengths for c in parts], self._pending),
            [c.keys for c in parts],
            _offsets([c.payload_lengths for c in parts], self._pending),
            [c.payloads for c in parts])
        size = sum(map(len, data))
        info = BlockInfo(self._seg_size, self.next_seq, self._pending, min(times), max(times),
                         size)
        try:
            _write_all(self._fd, data)
        except OSError:
            self._cut_back()  # no torn block left behind for the index to point past
            raise
        self._blocks.append(info)
        self._seg_size += size
        self.last_ts = info.max_ts
        self.next_seq += info.count
        self.written += info.count
        self._chunks, self._pending, self._pending_bytes = [], 0, 0
        if self._seg_size >= self.segment_bytes:
            self.seal()

    def _cut_back(self) -> None:
        """Truncate the open segment to its last whole block after a failed write."""
        try:
            os.ftruncate(self._fd, self._seg_size)
            os.lseek(self._fd, self._seg_size, os.SEEK_SET)
        except OSError:
            pass  # recovery cuts the torn tail instead

    def tick(self, now: float | None = None) -> None:
        """Time-based rotation: seal the open segment once it is old enough."""
        now = time.monotonic() if now is None else now
        if self._fd is not None and now - self._seg_opened >= self.segment_seconds:
            self.flush()
            if self._fd is not None:
                self.seal()

    def _open_segment(self) -> None:
        self._seg_first = self.next_seq
        name = _name(self._seg_first)
        # The header is written under the temporary name and the file appears under its
        # .open name whole: a reader listing the journal meanwhile never meets a segment
        # shorter than its header (and took it for a damaged one).
        tmp = self.dir / (name + TMP_SUFFIX)
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        header = fmt.encode_header(self._seg_first, time.time_ns())
        os.write(self._fd, header)
        os.link(tmp, self.dir / (name + OPEN_SUFFIX))  # EEXIST rather than replace one
        os.unlink(tmp)
        self._seg_size = len(header)
        self._seg_opened = time.monotonic()
        self._blocks = []

    def seal(self) -> None:
        """Append the index, fsync, and rename the open segment to its final name; a
        segment of many small blocks is re-blocked instead (`_reblock`)."""
        if self._fd is None:
            return
        name = _name(self._seg_first)
        if self._reblock_worth_it():
            try:
                self._reblock(name)
            except OSError as exc:  # disk full, say: seal it as it is
                log.warning("re-blocking %s failed (%s); sealed as written", name, exc)
                (self.dir / (name + TMP_SUFFIX)).unlink(missing_ok=True)
            else:
                fd, self._fd = self._fd, None
                os.close(fd)
                if self.fsync:
                    self._fsync_dir()
                self._sealed(name)
                return
        try:
            index = memoryview(fmt.encode_index(self._blocks, self._seg_size))
            while index:
                index = index[os.write(self._fd, index):]
            if self.fsync:
                os.fsync(self._fd)
        except OSError:
            self._cut_back()  # stays .open: recovery seals it on the next start
            raise
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)
        os.rename(self.dir / (name + OPEN_SUFFIX), self.dir / (name + SUFFIX))
        if self.fsync:
            self._fsync_dir()
        self._sealed(name)

    def _sealed(self, name: str) -> None:
        """After a seal: retention, and the Parquet export (``export_dir``) in a thread of
        its own, off the recording path."""
        if self.fsync and self._gaps_fd is not None:  # the gaps of what was just made durable
            os.fsync(self._gaps_fd)
        self._submit_export(int(name))
        self.apply_retention()

    def _export_missing(self) -> None:
        """At start: export the sealed segments that have no Parquet file yet (sealed by
        recovery, or while export was off), so the exported files stay one run."""
        if self.export_dir is None:
            return
        for seg in list_segments(self.dir):
            if seg.sealed and not (Path(self.export_dir) / f"{seg.name}.parquet").exists():
                self._submit_export(seg.first_seq)

    def _submit_export(self, first_seq: int) -> None:
        if self.export_dir is None:
            return
        if self._exporter is None:
            from concurrent.futures import ThreadPoolExecutor

            self._exporter = ThreadPoolExecutor(1, thread_name_prefix="sbus-export")
        self._exporter.submit(self._export, first_seq)

    def export_segment(self, seg: Segment, out: Path) -> None:
        """Write *seg* as Parquet into *out*: what `sbus.journal.export.ExportingWriter`
        does (the journal's layout knows nothing of Parquet)."""
        raise JournalError("this writer does not export: use journal.export.ExportingWriter")

    def _export(self, first_seq: int) -> None:
        """Export one sealed segment; a failure is counted and logged, never raised: the
        recording goes on, and readers fall back to the journal for that segment."""
        seg = resolve(self.dir, first_seq)
        out = Path(self.export_dir)
        try:
            if seg is not None and seg.sealed:
                out.mkdir(parents=True, exist_ok=True)
                self.export_segment(seg, out)
        except FileNotFoundError:
            pass  # removed by retention first (or while it was written: below)
        except Exception as exc:  # noqa: BLE001 - the recording goes on; say why once
            self.export_failures += 1
            log.error("exporting %s as Parquet into %s failed: %s", _name(first_seq), out, exc)
        if seg is not None and not seg.path.exists():  # retention removed it meanwhile
            with contextlib.suppress(OSError):  # (out may be no directory: counted above)
                (out / f"{seg.name}.parquet").unlink(missing_ok=True)

    def _reblock_worth_it(self) -> bool:
        """Blocks flushed by the clock at a modest rate are small (a few hundred rows), and
        every block costs a reader a record batch; blocks written because they were full are
        left as they are (re-writing them would cost a fast recorder time for nothing)."""
        n = len(self._blocks)
        return bool(self.reblock_bytes) and n > 1 and \
            (self._seg_size - fmt.FILE_HEAD.size) / n < self.block_bytes / 2

    def _reblock(self, name: str) -> None:
        """Seal by re-writing the open segment as few large blocks (up to `reblock_bytes`
        and `REBLOCK_ROWS`) into a temporary file, which is fsynced and renamed into place
        before the open segment is removed.  Readers planned over the open segment keep
        working: they read a sealed segment by sequence number (`read_seq_range`)."""
        groups: list[list[BlockInfo]] = []
        rows = size = 0
        for b in self._blocks:
            if not groups or rows + b.count > REBLOCK_ROWS or size + b.size > self.reblock_bytes:
                groups.append([])
                rows = size = 0
            groups[-1].append(b)
            rows += b.count
            size += b.size
        src = self.dir / (name + OPEN_SUFFIX)
        tmp = self.dir / (name + TMP_SUFFIX)
        rfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _, created = fmt.decode_header(os.pread(rfd, fmt.FILE_HEAD.size, 0))
            pos = os.write(out, fmt.encode_header(self._seg_first, created))
            infos = []
            for group in groups:
                blocks = list(_blocks_from(rfd, src, group[0].pos, group[-1].end, False))
                count = sum(b.count for b in blocks)
                data = fmt.block_parts(
                    group[0].first_seq,
                    np.concatenate([np.frombuffer(b.ts, "<i8") for b in blocks]),
                    _offsets([np.diff(np.frombuffer(b.key_offsets, "<i4")) for b in blocks],
                             count),
                    [b.keys for b in blocks],
                    _offsets([np.diff(np.frombuffer(b.payload_offsets, "<i4"))
                              for b in blocks], count),
                    [b.payloads for b in blocks])
                _write_all(out, data)
                n = sum(map(len, data))
                infos.append(BlockInfo(pos, group[0].first_seq, count,
                                       min(b.min_ts for b in group),
                                       max(b.max_ts for b in group), n))
                pos += n
            _write_all(out, [memoryview(fmt.encode_index(infos, pos))])
            if self.fsync:
                os.fsync(out)
        finally:
            os.close(rfd)
            os.close(out)
        os.rename(tmp, self.dir / (name + SUFFIX))
        src.unlink()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- retention -----------------------------------------------------------------

    def apply_retention(self, now_ns: int | None = None) -> list[str]:
        """Delete sealed segments beyond ``keep_seconds`` / ``keep_bytes``; their names."""
        if self.keep_seconds is None and self.keep_bytes is None:
            return []
        ages = []
        for seg in list_segments(self.dir):
            if not seg.sealed:
                continue
            blocks = segment_blocks(seg)
            last = max((b.max_ts for b in blocks), default=0)
            ages.append(SegmentAge(seg.path.name, seg.path.stat().st_size, last))
        doomed = expired(ages, time.time_ns() if now_ns is None else now_ns,
                         self.keep_seconds, self.keep_bytes,
                         self._seg_size if self._fd is not None else 0)
        for name in doomed:
            (self.dir / name).unlink(missing_ok=True)
            if self.export_dir is not None:  # its Parquet file goes with it
                (Path(self.export_dir) / (name[:-len(SUFFIX)] + ".parquet")).unlink(
                    missing_ok=True)
            log.info("retention: removed %s", name)
        if doomed:
            self._prune_gaps()
        return doomed

    def _prune_gaps(self) -> None:
        """Gap lines wholly before the journal's first record go with its segments (the
        file is bounded as the journal is); lines that do not parse are left for readers to
        name."""
        path = self.dir / gaps.FILE
        first = next((seg.first_seq for seg in list_segments(self.dir)), self.next_seq)
        try:
            with os.fdopen(open_regular(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                lines = f.readlines()
        except FileNotFoundError:
            return
        kept = []
        for line in lines:
            try:
                if gaps.decode(line).before < first:
                    continue
            except FormatError:
                pass
            kept.append(line)
        if len(kept) == len(lines):
            return
        tmp = path.with_name(gaps.FILE + ".tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o644), "wb") as f:
            f.writelines(kept)
            if self.fsync:
                os.fsync(f.fileno())
        os.rename(tmp, path)
        if self._gaps_fd is not None:  # the next line goes to the new file
            os.close(self._gaps_fd)
            self._gaps_fd = None

    def close(self) -> None:
        """Flush and seal; the journal is then complete and the directory unlocked."""
        try:
            try:
                self.flush()
            finally:
                self.seal()  # even if the last flush failed: the blocks before it are whole
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._gaps_fd is not None:
                os.close(self._gaps_fd)
                self._gaps_fd = None
            if self._exporter is not None:
                self._exporter.shutdown(wait=True)  # every sealed segment exported
            self._lock.close()

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_all(fd: int, buffers: list) -> None:
    """``os.writev`` until all *buffers* (memoryviews of bytes) are written; a short write
    continues where it ended."""
    i = 0
    while i < len(buffers):
        done = os.writev(fd, buffers[i:i + IOV_MAX])
        while i < len(buffers) and done >= len(buffers[i]):
            done -= len(buffers[i])
            i += 1
        if done:
            buffers[i] = buffers[i][done:]


def _offsets(lengths: list[np.ndarray], count: int) -> np.ndarray:
    """int32 offsets ``[0, l0, l0+l1, ...]`` of a column whose values have these lengths."""
    out = np.zeros(count + 1, np.int64)
    np.cumsum(np.concatenate(lengths), dtype=np.int64, out=out[1:])
    if out[-1] > fmt.MAX_COLUMN_BYTES:
        raise ValueError("block too large")
    return out.astype(np.int32)


def records(directory: str | os.PathLike) -> Iterator[tuple[int, int, bytes, bytes]]:
    """Every ``(seq, ts_ns, key, payload)`` in the journal, in order (slow path, for tools
    and tests; Spark reads blocks column-wise instead)."""
    for seg in list_segments(directory):
        blocks = segment_blocks(seg)
        if blocks:
            # by sequence number: the segment may be sealed and re-blocked meanwhile
            try:
                for block in read_seq_range(directory, seg.first_seq, blocks[0].pos,
                                            blocks[-1].end, 0, 1 << 63):
                    yield from block.records()
            except FileNotFoundError:  # deleted by retention since it was listed
                continue
