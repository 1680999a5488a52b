"""The rows after a journal's last exported segment as small Parquet files ("pieces"), so
a reader plans ONE Parquet scan over the exports plus the pieces instead of a Parquet scan
joined to the ``sbus`` source, whose fixed cost per query (a Python worker plans and reads
it) is what kept a live journal under Parquet's speed.

A piece holds the journal's rows ``lo <= seq < hi`` of one segment; its name says which
segment (its first sequence number and creation time, so a journal re-created from seq 1
never meets the old journal's pieces), the range, and, for an open segment, the byte
position after its last block, where the next reader scans on for new rows (blocks never
move while a segment is open).  A reader reuses the pieces that continue its seam,
converts only the rows after them into one new piece, merged with the last pieces no
larger than it (a binary counter: each row is rewritten a few times at most, and a
segment has at most `MAX_PIECES` pieces).

Pieces live in ``EXPORT/.tail`` when the caller may write the export directory (a dot
directory: Spark, pyarrow and DuckDB globs listing ``EXPORT`` skip it), else in a cache of
the caller's own (``$XDG_CACHE_HOME/sbus/tail/<journal hash>``): a reader of another
user's journal needs no write access to it.  A piece is written under a temporary name
and linked into place, so a piece that exists is whole; of two readers converting the
same rows, the second keeps the first one's piece (a query may be planned on it).  Pieces
no reader needs any more (their segment exported, or superseded by a longer piece) are
removed once no reader has planned on them for `GRACE` seconds (a DataFrame reads its
files when an action runs, not when it is made), or sooner, oldest first, when the
directory holds more than `CACHE_BYTES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import format as fmt
from .store import (
    JournalError,
    Segment,
    open_segment,
    read_seq_range,
    scan_blocks,
    segment_blocks,
)

__all__ = ["TAIL_SUBDIR", "Piece", "Tail", "cache_dir", "cover"]

#: The pieces' directory inside a writable export directory.
TAIL_SUBDIR = ".tail"
#: Pieces of one segment at most (the newest are merged to keep it).
MAX_PIECES = 4
#: Bytes a reader plans on in pieces at most (the files it reuses, the journal blocks it
#: converts); rows after them are left to the ``sbus`` source (a recorder that exports
#: holds about one open segment here: 64 MiB at most by default).
TAIL_BYTES = 256 << 20
#: What a pieces directory holds at most before unused pieces go regardless of `GRACE`.
CACHE_BYTES = 1 << 30
#: Seconds an unused piece (or a temporary file) is kept after a reader last planned on it.
GRACE = 600.0

_NAME = re.compile(r"^(\d{20})\.(\d+)\.(\d+)-(\d+)\.(\d+)\.parquet$")


@dataclass(frozen=True, slots=True)
class Piece:
    path: Path
    segment: int
    created: int  # the segment header's creation time (ns): which journal it belongs to
    lo: int
    hi: int
    pos: int  # byte position after the piece's last block in the open segment
    size: int
    mtime: float

    @staticmethod
    def name(segment: int, created: int, lo: int, hi: int, pos: int) -> str:
        return f"{segment:020d}.{created}.{lo}-{hi}.{pos}.parquet"


@dataclass(frozen=True, slots=True)
class Tail:
    files: list[Path]  # pieces to read after the exported files, in seq order
    end: int  # the first seq not in *files*: where a reader of the rest starts
    more: bool  # rows at or after *end* were left out (over `TAIL_BYTES`)


def cache_dir(journal: str | os.PathLike, export_dir: str | os.PathLike,
              own: str | os.PathLike | None = None) -> Path | None:
    """Where this process keeps its pieces for *journal*: ``EXPORT/.tail`` if it may write
    there, else a directory of its own for this journal under *own* (by default
    ``$XDG_CACHE_HOME/sbus/tail``); None if it can write neither (read the tail otherwise)."""
    shared = Path(export_dir) / TAIL_SUBDIR
    if os.access(shared if shared.is_dir() else export_dir, os.W_OK | os.X_OK):
        with contextlib.suppress(OSError):
            shared.mkdir(exist_ok=True)
            if shared.is_dir() and not shared.is_symlink():
                return shared
    if own is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                  ".cache")
        own = os.path.join(base, "sbus", "tail")
    tag = hashlib.sha256(os.fsencode(os.path.realpath(journal))).hexdigest()[:16]
    mine = Path(own) / tag
    try:
        mine.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError:
        return None
    return mine if os.access(mine, os.W_OK | os.X_OK) else None


def cover(journal: str | os.PathLike, segments: list[Segment], seam: int, cache: Path,
          budget: int | None = None) -> Tail:
    """Pieces holding every row at or after *seam* of *segments* (the journal's segments
    after its exported ones, in order), writing into *cache* what no piece holds yet, up
    to *budget* bytes of journal (`TAIL_BYTES`); removes the pieces no reader needs."""
    budget = TAIL_BYTES if budget is None else budget
    pieces, stale = _listing(cache)
    chosen: list[Piece] = []
    at, spent, more = seam, 0, False
    for seg in segments:
        created = _created(seg)
        if created is None or seg.first_seq > at:  # gone or damaged, or one before it
            more = True  # is (a break in the numbers): the source reads or reports from here
            break
        lo = max(at, seg.first_seq)
        mine = [p for p in pieces if p.segment == seg.first_seq and p.created == created]
        chain = _chain(mine, lo)
        lo = chain[-1].hi if chain else lo
        spent += sum(p.size for p in chain)
        try:
            new = _blocks_after(seg, lo, chain[-1].pos if chain and not seg.sealed else None)
            size = sum(b.size for b in new)
            more = bool(new) and spent + size > budget
            if new and not more:
                chain = _convert(journal, cache, seg, created, lo, new, chain)
                spent += size
        except FileNotFoundError:  # removed (retention) while we read it
            more = True
        chosen += chain
        at = chain[-1].hi if chain else lo
        if more:  # over the budget, or gone: the source reads (or reports) from here
            break
    _touch(chosen)
    _clean(cache, pieces, stale, {p.path for p in chosen})
    return Tail([p.path for p in chosen], at, more)


def _listing(cache: Path) -> tuple[list[Piece], list[Path]]:
    """The pieces in *cache*, and its temporary files (a writer's, or one that died)."""
    pieces, stale = [], []
    with os.scandir(cache) as entries:
        for e in entries:
            m = _NAME.match(e.name)
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if m and e.is_file(follow_symlinks=False):
                seg, created, lo, hi, pos = map(int, m.groups())
                if lo < hi:
                    pieces.append(Piece(Path(e.path), seg, created, lo, hi, pos, st.st_size,
                                        st.st_mtime))
            elif e.name.endswith(".tmp") and time.time() - st.st_mtime > GRACE:
                stale.append(Path(e.path))
    return pieces, stale


def _created(seg: Segment) -> int | None:
    try:
        with open(open_segment(seg.path), "rb") as f:
            return fmt.decode_header(f.read(fmt.FILE_HEAD.size))[1]
    except FileNotFoundError:
        if not seg.sealed:  # sealed since it was listed
            return _created(Segment(seg.first_seq, seg.path.with_suffix(""), True))
        return None
    except (fmt.FormatError, JournalError):  # (a FIFO in its place, say)
        return None  # the reader of the rest names the damage


def _chain(mine: list[Piece], lo: int) -> list[Piece]:
    """The run of whole pieces from *lo* on, each the longest one continuing the last."""
    chain: list[Piece] = []
    while True:
        nxt = sorted((p for p in mine if p.lo == lo), key=lambda p: -p.hi)
        nxt = next((p for p in nxt if _whole(p)), None)
        if nxt is None:
            return chain
        chain.append(nxt)
        lo = nxt.hi


def _whole(p: Piece) -> bool:
    """Whether the piece's footer reads and fits its name (a damaged file is skipped and
    its rows converted again)."""
    try:
        meta = pq.read_metadata(p.path)
    except (OSError, pa.ArrowException):
        with contextlib.suppress(OSError):
            p.path.unlink()
        return False
    return 0 < meta.num_rows <= p.hi - p.lo


def _blocks_after(seg: Segment, lo: int, pos: int | None) -> list:
    """The segment's blocks holding rows at or after *lo*: an open segment scanned from
    *pos* (where the last piece ended; blocks never move while it is open), a sealed one
    (or one sealed since it was listed, maybe re-blocked) read from its index.
    FileNotFoundError if it is gone."""
    if pos is not None:
        try:
            with open(open_segment(seg.path), "rb") as f:  # still open: what it holds now
                return [b for b in scan_blocks(f, pos) if b.next_seq > lo]
        except FileNotFoundError:
            seg = Segment(seg.first_seq, seg.path.with_suffix(""), True)
    return [b for b in segment_blocks(seg) if b.next_seq > lo]


def _convert(journal, cache: Path, seg: Segment, created: int, lo: int, blocks: list,
             chain: list[Piece]) -> list[Piece]:
    """Rows from *lo* to the end of *blocks* as a new piece, holding the rows of the
    chain's last pieces too while they are no larger: the chain a reader uses from now on."""
    from .arrow import block_batch
    from .export import parquet_schema, write_parquet

    schema = parquet_schema()
    hi = blocks[-1].next_seq
    batches = []
    for block in read_seq_range(journal, seg.first_seq, blocks[0].pos, blocks[-1].end, lo, hi):
        a, b = max(lo - block.first_seq, 0), min(hi - block.first_seq, block.count)
        if a < b:
            batch = block_batch(block, schema, None, a, b)
            if batch is not None:
                batches.append(batch)
    if not batches:
        return chain
    tables = [pa.Table.from_batches(batches, schema)]
    merged, chain = chain, list(chain)
    rows = hi - lo
    while chain and (chain[-1].hi - chain[-1].lo <= rows or len(chain) >= MAX_PIECES):
        rows += chain[-1].hi - chain[-1].lo
        chain.pop()
    merged = merged[len(chain):]  # the last pieces, rewritten with the new rows
    if merged:
        tables = [pq.read_table(p.path, schema=schema) for p in merged] + tables
        lo = merged[0].lo
    table = pa.concat_tables(tables)
    name = Piece.name(seg.first_seq, created, lo, hi, blocks[-1].end)
    target = cache / name
    tmp = cache / f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    # A new file of its own (never through a link someone put there), readable by all
    # who may read the directory, as the export's files are.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        with open(fd, "wb") as f:
            write_parquet(table, f)
        piece = Piece(target, seg.first_seq, created, lo, hi, blocks[-1].end,
                      tmp.stat().st_size, time.time())
        try:
            # Never replace a piece another reader wrote meanwhile (the same rows): a
            # query planned on it has its size; only a damaged one is replaced.
            os.link(tmp, target)
        except FileExistsError:
            if not _whole(piece):
                os.replace(tmp, target)
        except OSError:  # a file system without hard links
            os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return [*chain, piece]


def _touch(chosen: list[Piece]) -> None:
    """Mark the pieces as just planned on (no other reader removes them for `GRACE`)."""
    now = time.time()
    for p in chosen:
        if now - p.mtime > GRACE / 4:
            with contextlib.suppress(OSError):  # another user's piece: theirs to keep
                os.utime(p.path)


def _clean(cache: Path, pieces: list[Piece], stale: list[Path], keep: set[Path]) -> None:
    """Remove dead temporary files and the pieces not planned on for `GRACE`, and more,
    oldest first, while the directory holds over `CACHE_BYTES`."""
    now = time.time()
    unused = sorted((p for p in pieces if p.path not in keep), key=lambda p: p.mtime)
    total = sum(p.size for p in pieces)
    for p in unused:
        if now - p.mtime <= GRACE and total <= CACHE_BYTES:
            break
        with contextlib.suppress(OSError):
            p.path.unlink()
            total -= p.size
    for path in stale:
        with contextlib.suppress(OSError):
            path.unlink()
