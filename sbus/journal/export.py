"""Sealed journal segments as Parquet files, for every tool that reads Parquet (DuckDB,
pandas, Polars, Spark without this package).

One file per sealed segment, ``<first_seq:020d>.parquet``, with the columns of the Spark
source (``seq, ts, key, key_bytes, payload``; ``ts`` in microseconds UTC, ``key_bytes``
only for keys that are not UTF-8), zstd-compressed, a CRC in every page, row groups of
`ROW_GROUP` rows with min/max statistics, so a reader skips row groups by ``seq`` or
``ts`` as it would blocks.  A file is written under a temporary name and renamed, so a
file that exists is complete.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..files import open_regular
from .store import (
    JournalError,
    JournalWriter,
    Segment,
    list_segments,
    read_blocks,
    segment_blocks,
)

log = logging.getLogger(__name__)
#: The four bytes a Parquet file begins and ends with (its format's magic).
PARQUET_MAGIC = b"PAR1"

__all__ = ["COLUMNS", "ROW_GROUP", "Exported", "Split", "export_segment", "export_journal",
           "parquet_schema", "split", "write_parquet", "ExportingWriter"]

COLUMNS = ["seq", "ts", "key", "key_bytes", "payload"]
ROW_GROUP = 1 << 16


def parquet_schema() -> pa.Schema:
    """The export's Arrow schema (``key_bytes`` is the one column with nulls)."""
    from .arrow import arrow_schema

    return arrow_schema(COLUMNS, {"seq", "ts", "key", "payload"})


def write_parquet(table: pa.Table, where) -> None:
    """*table* as Parquet with the export's settings (module docstring): one place for
    the sealed segments' files and the open tail's pieces alike.  Each page carries a
    CRC (Parquet's page checksum), which `sbus.spark.read_journal` has Spark verify: a
    flipped bit otherwise read as other rows, a seq twice and one missing (the audit of
    2026-11-28: 275 of 300 single-bit flips read without an error)."""
    pq.write_table(table, where, compression="zstd", row_group_size=ROW_GROUP,
                   write_statistics=True, write_page_checksum=True)


@dataclass(frozen=True, slots=True)
class Exported:
    segment: str
    rows: int
    journal_bytes: int
    parquet_bytes: int


def export_segment(directory: str | os.PathLike, seg: Segment, out: Path) -> Exported:
    """Write *seg* (sealed) as ``out/<name>.parquet``."""
    from .arrow import block_batch

    schema = parquet_schema()
    blocks = segment_blocks(seg)
    batches = [block_batch(b, schema) for b in
               (read_blocks(directory, seg.first_seq, blocks[0].pos, blocks[-1].end)
                if blocks else ())]
    table = pa.Table.from_batches([b for b in batches if b is not None], schema)
    target = out / f"{seg.name}.parquet"
    tmp = out / f".{seg.name}.parquet.tmp"
    write_parquet(table, tmp)
    os.replace(tmp, target)
    return Exported(seg.name, table.num_rows, seg.path.stat().st_size, target.stat().st_size)


def export_journal(directory: str | os.PathLike, out: str | os.PathLike, *,
                   force: bool = False, progress=None,
                   damaged: list[JournalError] | None = None) -> list[Exported]:
    """Export every sealed segment not exported yet (all with *force*); the open segment
    is left to the ``sbus`` source (read it from the seq after the last exported one).
    A damaged segment raises JournalError; with a *damaged* list, it is appended there
    and the later segments are exported."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for seg in list_segments(directory):
        if not seg.sealed or (not force and (out / f"{seg.name}.parquet").exists()):
            continue
        try:
            done.append(export_segment(directory, seg, out))
        except JournalError as exc:
            if damaged is None:
                raise
            damaged.append(exc)
            continue
        if progress is not None:
            progress(done[-1])
    return done


@dataclass(frozen=True, slots=True)
class Split:
    """A journal cut into its exported Parquet files and the rows after them (*tail*)."""

    files: list[Path]  # the Parquet files of the journal's first sealed segments, in order
    seam: int  # the first sequence number not in *files*: where the tail starts
    rest: list[Segment]  # the segments after those of *files*

    @property
    def tail(self) -> bool:
        """Whether any row is recorded at or after *seam* (now): reads the open segment."""
        return any(segment_blocks(s) for s in self.rest)


def split(directory: str | os.PathLike, out: str | os.PathLike) -> Split:
    """Which rows to read from Parquet and which from the journal, without reading rows:
    the longest run of sealed segments from the journal's first one that have a Parquet
    file and follow each other without a break in their sequence numbers (files of
    segments retention has removed are not used; a segment missing between two, moved
    aside as damaged or deleted, ends the run there, so the reader after the seam, the
    ``sbus`` source, finds the rows lost and says so), and the seam after it, from the
    files' names and row counts (their footers)."""
    segments = list_segments(directory)
    out = Path(out)
    files: list[Path] = []
    seam = 0
    for seg in segments:
        f = out / f"{seg.name}.parquet"
        if not seg.sealed or not f.is_file() or (files and seg.first_seq != seam):
            break
        if not _whole_parquet(f):  # its rows are read from the segment: none lost
            log.warning("%s is damaged (cut short or empty): its segment is read from the "
                        "journal instead; 'sbus journal export --force' writes it again", f)
            break
        files.append(f)
        seam = seg.first_seq + pq.read_metadata(f).num_rows
    return Split(files, seam, segments[len(files):])


def _whole_parquet(path: Path) -> bool:
    """Does *path* begin and end with Parquet's magic?  A file a crash emptied or cut
    short does not, and Spark would skip an empty one without a word (rows lost)."""
    try:
        with open(open_regular(path), "rb") as f:  # (a FIFO put there: no wait)
            head = f.read(4)
            f.seek(-4, os.SEEK_END)
            return head == PARQUET_MAGIC and f.read(4) == PARQUET_MAGIC
    except OSError:  # shorter than the magic, or unreadable
        return False


class ExportingWriter(JournalWriter):
    """A `JournalWriter` that writes each segment it seals as Parquet into its
    ``export_dir`` (in a thread of its own): what ``sbus record`` runs by default."""

    def export_segment(self, seg: Segment, out: Path) -> None:
        export_segment(self.dir, seg, out)
