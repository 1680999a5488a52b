"""The ``sbus`` Spark data source: batch and streaming reads of a journal, and a streaming
sink that publishes onto a bus.

Read options are in `sbus.spark.options` (and docs/spark.md's table); filters on ``seq``,
``ts`` and ``key`` that Spark pushes are applied here (`pushFilters`): ``seq`` and ``ts``
ranges skip whole blocks by the segment index, and every pushed filter is applied exactly
inside the reader, so Spark does not evaluate it again.
Sink options: see `sbus.spark.sink`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from datetime import datetime

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
    StringStartsWith,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import (
    BinaryType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..defaults import decimal
from ..display import printable
from ..journal.arrow import (
    COLUMNS,
    DEFAULT_SCHEMA,
    NULLABLE,
    DataLoss,
    Range,
    RowFilter,
    arrow_schema,
    lost_message,
    read_range,
)
from ..journal.format import FILE_HEAD, BlockInfo
from ..journal.store import (
    JournalError,
    journal_id,
    list_segments,
    read_seq_range,
    segment_blocks,
)
from .offsets import START, Offset, View, advance, first_seq, gaps, partitions
from .options import Position, ReadOptions

try:  # Trigger.AvailableNow for Python sources arrived in Spark 4.2
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - older Spark
    SupportsTriggerAvailableNow = object  # type: ignore[misc,assignment]

__all__ = ["SbusDataSource"]

log = logging.getLogger("sbus.spark")


class RangePartition(InputPartition):
    """One Spark task's share: byte ranges of consecutive segments; *report* is the
    directory where a streaming query's task leaves the ranges it found gone
    (`LossReports`), so that they reach the query's offsets."""

    def __init__(self, ranges: list[Range], report: str | None = None) -> None:
        super().__init__(ranges)
        self.ranges = tuple(ranges)
        self.report = report


class LossReports:
    """Rows a streaming query's tasks found gone while reading (retention deleted their
    segment between the planning of the batch's partitions and the task opening it), from
    the tasks to the driver: a task leaves an empty file named ``LO-HI`` per missing range
    in a directory the stream reader made, the reader counts them when it plans the next
    micro-batch (after the batch that found them has completed) and puts the count in that
    batch's end offset.  A range is named by its rows, so a retried task counts once.
    The directory is on the driver's machine: tasks on other machines (a cluster) cannot
    reach it and only log the loss (docs/spark.md, "Lost rows")."""

    def __init__(self) -> None:
        self._dir: str | None = None  # made when the first batch is planned: PySpark also
        # makes stream readers that only serve to ship `read` to the tasks

    @property
    def dir(self) -> str:
        if self._dir is None:
            self._dir = _reports_dir()
        return self._dir

    @staticmethod
    def leave(directory: str, lo: int, hi: int) -> bool:
        """In a task: report rows ``[lo, hi)`` gone; False if the driver cannot hear it."""
        try:
            with open(os.path.join(directory, f"{lo}-{hi}"), "x"):
                pass
        except FileExistsError:
            pass
        except OSError:
            return False
        return True

    def take(self) -> int:
        """Rows reported since the last call (each row once)."""
        if self._dir is None:
            return 0
        spans = []
        for name in os.listdir(self._dir):
            lo, _, hi = name.partition("-")
            if decimal(lo) and decimal(hi):
                spans.append((int(lo), int(hi)))
            os.unlink(os.path.join(self._dir, name))
        count, at = 0, -1
        for lo, hi in sorted(spans):
            lo = max(lo, at)
            if hi > lo:
                count += hi - lo
                at = hi
        return count

    def close(self) -> None:
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _columns(schema: StructType) -> pa.Schema:
    """The Arrow schema for the query's *schema* (default or user-given), checked."""
    names = [f.name for f in schema.fields]
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        raise ValueError(f"the sbus source has no column(s) {unknown}; it has {list(COLUMNS)}")
    offered = StructType([StructField("key", StringType()), StructField("payload", BinaryType()),
                          StructField("ts", TimestampType()), StructField("seq", LongType()),
                          StructField("key_bytes", BinaryType())])  # DEFAULT_SCHEMA
    wrong = [(f, offered[f.name].dataType) for f in schema.fields
             if f.dataType != offered[f.name].dataType]
    if wrong:
        said = ", ".join(f"{f.name} is {t.simpleString()}, the schema says "
                         f"{f.dataType.simpleString()}" for f, t in wrong)
        offers = ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in offered.fields)
        raise ValueError(f"the sbus source cannot give the schema asked for: {said}; it "
                         f"offers {offers} (any subset, in any order; cast afterwards)")
    not_null = {f.name for f in schema.fields if not f.nullable}
    if not_null & NULLABLE:
        raise ValueError(f"column(s) {sorted(not_null & NULLABLE)} have nulls: they cannot be "
                         "NOT NULL")
    return arrow_schema(names, not_null)


def _reports_dir() -> str:
    """A fresh directory for one stream reader's `LossReports`, named by its process, in
    this user's own ``sbus-lost-UID`` under the temporary directory; directories of
    processes that are gone (PySpark may end the reader's process without `stop`) are
    removed first.  If that parent is not this user's private directory, a private one of
    its own (nobody else may plant reports)."""
    import shutil
    import stat
    import tempfile

    base = os.path.join(tempfile.gettempdir(), f"sbus-lost-{os.getuid()}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return tempfile.mkdtemp(prefix="sbus-lost-")
    for name in os.listdir(base):
        pid = name.partition("-")[0]
        if decimal(pid) and not _alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=base)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(opts: ReadOptions, rows: RowFilter, partition: InputPartition,
          columns: pa.Schema) -> Iterator:
    report = getattr(partition, "report", None)

    def lost(lo: int, hi: int, reason: str) -> None:
        if opts.fail_on_data_loss:
            raise DataLoss(lost_message(lo, hi, reason) + _HINT)
        if report is not None and LossReports.leave(report, lo, hi):
            log.warning("%s; skipped (failOnDataLoss=false), counted in the query's next "
                        "end offset", lost_message(lo, hi, reason))
        else:
            log.warning("%s; skipped (failOnDataLoss=false); this task cannot report it to "
                        "the query", lost_message(lo, hi, reason))

    for rng in getattr(partition, "ranges", ()):  # none: Spark's stand-in for no partitions
        yield from read_range(opts.path, rng, columns, rows, opts.verify, lost)


_HINT = "; set option failOnDataLoss=false to skip lost rows and go on"


def journal_view(directory: str, cache: dict | None = None) -> View:
    """Every segment's block list, reusing *cache* (segment -> (sealed, blocks)) so an open
    segment is only scanned from where the last look ended."""
    view: View = []
    seen = set()
    for seg in list_segments(directory):
        seen.add(seg.first_seq)
        known = cache.get(seg.first_seq) if cache is not None else None
        if known is not None and known[0]:
            blocks = known[1]
        elif known is not None and not seg.sealed:
            old: list[BlockInfo] = known[1]
            start = old[-1].end if old else FILE_HEAD.size
            blocks = old + segment_blocks(seg, start)
        else:
            blocks = segment_blocks(seg)
        if cache is not None:
            cache[seg.first_seq] = (seg.sealed, blocks)
        view.append((seg.first_seq, blocks))
    if cache is not None:
        for gone in set(cache) - seen:
            del cache[gone]
    return view


def split_size(view: View, opts: ReadOptions, start: int, end: int,
               rows: RowFilter | None = None) -> int:
    """Bytes per partition: the range's share of minPartitions, at most maxPartitionBytes
    (Python tasks have a fixed start-up cost, so fewer, larger partitions are faster, but
    every core should get one, and equal ones, so that none waits for a straggler)."""
    total = sum(b.size for _, blocks in view for b in blocks
                if b.next_seq > start and b.first_seq < end
                and (rows is None or rows.keeps_block(b.min_ts, b.max_ts)))
    return max(1, min(opts.max_bytes, -(-total // opts.min_partitions)))


def seq_at(directory: str, view: View, pos: Position) -> int:
    """The sequence number a start or end `Position` names, in the journal as it is now."""
    if pos.kind == "seq":
        return pos.value
    if pos.kind == "earliest":
        return START.seq
    if pos.kind == "latest":
        return advance(view, START).seq
    for seg, blocks in view:  # "time": the first row received at or after it
        for b in blocks:
            if b.max_ts >= pos.value:
                for block in read_seq_range(directory, seg, b.pos, b.end, b.first_seq,
                                            b.next_seq):
                    ts = np.frombuffer(block.ts, "<i8")
                    return block.first_seq + int(np.argmax(ts >= pos.value))
    return advance(view, START).seq


def _pushed_value(f: Filter):
    """A pushed filter's literal as the reader compares it (``ts``: microseconds)."""
    if f.attribute == ("ts",):
        if not isinstance(f.value, datetime):
            return None
        return TimestampType().toInternal(f.value)
    if f.attribute == ("seq",):
        return f.value if isinstance(f.value, int) and not isinstance(f.value, bool) else None
    return f.value if isinstance(f.value, str) else None


#: Options only a write has: the same data source object serves reads and writes.
_SINK_ONLY = frozenset({"address", "state", "checkpointlocation"})


class SbusDataSource(DataSource):
    """``spark.read.format("sbus").load(DIR)`` / ``readStream`` / ``writeStream``."""

    def __init__(self, options) -> None:
        super().__init__(options)
        # At load(): options are checked here, so a wrong one fails load() itself, not the
        # first action; and the journal's extent is pinned, because PySpark keeps this
        # object (pickled) for every query on the DataFrame, and each query that pushes
        # filters plans its read again: without a pin, successive queries on one
        # DataFrame would count different snapshots of a live journal.
        self.pinned: tuple[int, int] | None = None  # (first row, next seq) at load()
        names = {k.lower() for k in options}
        if "path" not in names or names & _SINK_ONLY:
            return  # a write (the sink's options are checked by the sink)
        opts = ReadOptions(options, True)
        try:
            view = journal_view(opts.path)
        except JournalError:
            return  # no journal (yet): a batch read says so when planned
        end = advance(view, START).seq
        self.pinned = (first_seq(view) or end, end)

    @classmethod
    def name(cls) -> str:
        return "sbus"

    def schema(self) -> str:
        return DEFAULT_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(ReadOptions(self.options, False), _columns(schema),
                           getattr(self, "pinned", None))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(ReadOptions(self.options, True), _columns(schema))

    def writer(self, schema: StructType, overwrite: bool):
        from .sink import BusBatchWriter

        return BusBatchWriter(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool):
        from .sink import BusStreamWriter

        return BusStreamWriter(self.options, schema)


class BatchReader(DataSourceReader):
    """A batch read of the journal as it was when the DataFrame was loaded (*pinned*:
    its first row and next sequence number then), whatever is recorded or removed since:
    rows of that extent removed since are lost (`failOnDataLoss`), rows recorded since
    are not read (``load()`` again to see them)."""

    def __init__(self, opts: ReadOptions, columns: pa.Schema,
                 pinned: tuple[int, int] | None = None) -> None:
        self.opts = opts
        self.pinned = pinned
        self.columns = columns
        self.rows = RowFilter(pattern=opts.pattern)
        self.seq_lo, self.seq_hi = 0, 2**63 - 1  # from pushed seq filters: lo <= seq < hi

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        """Take ``seq`` and ``ts`` comparisons and ``key`` =, IN and LIKE 'prefix%'; give
        back the rest.  Each taken filter is applied exactly by the reader.  Without the
        ``pushdown`` option every filter is given back and the reader stays as it was, so
        the read PySpark 4.3 shares between all scans of a DataFrame is right for each."""
        if not self.opts.pushdown:
            yield from filters
            return
        rows = self.rows
        for f in filters:
            if isinstance(f, In) and f.attribute == ("key",) and \
                    all(isinstance(v, str) for v in f.value):
                rows.key_sets += (frozenset(f.value),)
                continue
            if isinstance(f, StringStartsWith) and f.attribute == ("key",):
                rows.key_prefixes += (f.value,)
                continue
            if not isinstance(f, EqualTo | EqualNullSafe | GreaterThan | GreaterThanOrEqual |
                              LessThan | LessThanOrEqual) or \
                    f.attribute not in (("key",), ("ts",), ("seq",)):
                yield f
                continue
            v = _pushed_value(f)
            if v is None:
                yield f
                continue
            if f.attribute == ("key",):
                if not isinstance(f, EqualTo | EqualNullSafe):
                    yield f
                    continue
                rows.key_sets += (frozenset([v]),)
                continue
            lo = v + 1 if isinstance(f, GreaterThan) else \
                v if isinstance(f, GreaterThanOrEqual | EqualTo | EqualNullSafe) else None
            hi = v - 1 if isinstance(f, LessThan) else \
                v if isinstance(f, LessThanOrEqual | EqualTo | EqualNullSafe) else None
            if f.attribute == ("ts",):
                if lo is not None:
                    rows.ts_min = lo if rows.ts_min is None else max(rows.ts_min, lo)
                if hi is not None:
                    rows.ts_max = hi if rows.ts_max is None else min(rows.ts_max, hi)
            else:
                if lo is not None:
                    self.seq_lo = max(self.seq_lo, lo)
                if hi is not None:
                    self.seq_hi = min(self.seq_hi, hi + 1)

    def partitions(self) -> list[InputPartition]:
        try:
            view = journal_view(self.opts.path)
        except JournalError as exc:
            raise ValueError(str(exc)) from None
        now_end = advance(view, START).seq
        starting, ending = self.opts.starting, self.opts.ending
        pin_first, pin_end = self.pinned or (None, None)
        if starting.kind == "earliest" and pin_first is not None:
            first = pin_first
        else:
            first = seq_at(self.opts.path, view, starting)
        if ending.kind == "latest" and pin_end is not None:
            last = pin_end
        else:
            last = seq_at(self.opts.path, view, ending)
        if ending.kind == "seq" and last > now_end:
            raise ValueError(f"the read's end (seq {last}) is past the journal's end: "
                             f"seq {now_end}..{last - 1} have not been recorded (yet), "
                             f"so a batch read cannot read them; give an end of at most "
                             f"{now_end}, or "
                             "none for everything recorded")
        start = max(first, self.seq_lo)
        end = min(last, self.seq_hi, now_end)
        if start >= end:
            return []
        # Rows missing from where the read starts are lost; a seq filter only selects.
        missing = [(max(lo, start), hi) for lo, hi in gaps(view, first, end) if hi > start]
        _check_loss(missing, self.opts.fail_on_data_loss, "")
        rows = self.rows

        def keep(b: BlockInfo) -> bool:
            return rows.keeps_block(b.min_ts, b.max_ts)

        size = split_size(view, self.opts, start, end, rows)
        return [RangePartition(p) for p in partitions(view, start, end, size, keep)]

    def read(self, partition: InputPartition) -> Iterator:
        return _read(self.opts, self.rows, partition, self.columns)


def _check_loss(missing: list[tuple[int, int]], fail: bool, context: str) -> int:
    """Fail the query on rows the journal no longer has, or log them; their count."""
    count = sum(hi - lo for lo, hi in missing)
    if not count:
        return 0
    text = "; ".join(lost_message(lo, hi, "removed by retention or moved aside as damaged")
                     for lo, hi in missing[:3]) + (" ..." if len(missing) > 3 else "")
    if fail:
        raise DataLoss(f"{context}{text}{_HINT}")
    log.warning("%s%s; skipped (failOnDataLoss=false)", context, text)
    return count


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over the journal; offsets are sequence numbers (`sbus.spark.offsets`).
    Every row a micro-batch was planned to read and did not is either an error
    (``failOnDataLoss=true``) or counted in an end offset's ``lost`` field, shown in the
    query's progress: gaps when a batch is planned, in its own end offset; rows of a
    planned batch found gone when its partitions are planned (also when it is replayed
    after a restart, batch 0 included: its end offset names where it started), or by its
    tasks while they read (`LossReports`), in the next one (a batch of no rows if there
    is no next, so the count is never only in a log)."""

    def __init__(self, opts: ReadOptions, columns: pa.Schema) -> None:
        self.opts = opts
        self.columns = columns
        self.rows = RowFilter(pattern=opts.pattern)
        self._cache: dict = {}
        self._target: Offset | None = None
        # Rows found gone after a batch was planned, by that batch's end offset
        # (`Offset.key`): the batch that starts there counts them.
        self._late: dict[tuple[int, int, int], int] = {}
        self._reports = LossReports() if not opts.fail_on_data_loss else None
        self._consumed: int | None = None  # the last end offset planned (for the lag)
        self._back: int | None = None  # an offset found past the journal's end (counted)

    def _view(self) -> View:
        try:
            return journal_view(self.opts.path, self._cache)
        except JournalError:
            return []  # no journal yet: nothing to read until the recorder creates it

    def _journal(self) -> str | None:
        """The journal's identity now (None: none yet, or unreadable: not compared)."""
        try:
            return journal_id(self.opts.path)
        except JournalError as exc:
            log.warning("streaming query: %s", exc)
            return None

    def _advance(self, view: View, start: Offset, limit: ReadLimit) -> Offset:
        """The end of a micro-batch from *start*: as far as *limit*, the query's ending
        and an availableNow target allow."""
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        targets = [t for t in (self._target, self._end(view)) if t is not None]
        return advance(view, start, max_rows, min(targets) if targets else None)

    def _end(self, view: View) -> Offset | None:
        if self.opts.ending.kind == "latest":
            return None
        return Offset(seq_at(self.opts.path, view, self.opts.ending))

    def initialOffset(self) -> dict:
        view = self._view()
        seq = seq_at(self.opts.path, view, self.opts.starting)
        if seq == START.seq:  # earliest: the first row there is, so that rows of the first
            seq = first_seq(view) or START.seq  # batch removed under it count as lost
        return Offset(seq, journal=self._journal()).to_dict()

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_rows is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_rows)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        view = self._view()
        s = Offset.from_dict(start, view)
        journal = self._journal()
        if s.journal is not None and journal is not None and journal != s.journal:
            return self._replaced(s, journal, limit)
        journal = journal or s.journal
        if self._reports is not None:  # rows the last batch's tasks found gone
            found = self._reports.take()
            if found:
                self._late[s.key()] = self._late.get(s.key(), 0) + found
        end = self._advance(view, s, limit)
        lost = _check_loss(gaps(view, s.seq, end.seq), self.opts.fail_on_data_loss,
                           "streaming query: ") + self._went_back(view, s.seq)
        for key in [k for k in self._late if k[0] < s.seq]:  # counted by an earlier batch
            del self._late[key]
        late = self._late.get(s.key(), 0)
        self._consumed = end.seq
        if end.seq == s.seq and not lost and not late:
            return start  # nothing new: the same offset, so Spark plans no batch
        origin = s.seq if s.seq != START.seq else (first_seq(view) or s.seq)
        moved = s.moved(end.seq, lost + late, late)
        return Offset(moved.seq, moved.lost, moved.after_planning, origin, journal).to_dict()

    def _replaced(self, s: Offset, journal: str, limit: ReadLimit) -> dict:
        """The journal was removed and recorded anew since offset *s* (its identity
        changed): its sequence numbers start again, so *s* means nothing in it.  An error;
        or (failOnDataLoss=false) the next batch reads the new journal from its first row
        (`origin`).  What the old one held past *s* is gone uncounted: nobody can count
        it now, which the log says."""
        text = (f"the journal at {printable(self.opts.path, 200)} is another one than the "
                f"one this query's offsets are of (its id was {printable(s.journal, 40)}, "
                f"it is {journal}: removed and recorded anew?), so its sequence numbers "
                "start again")
        if self.opts.fail_on_data_loss:
            raise DataLoss(f"streaming query: {text}; start a new checkpoint, or set option "
                           "failOnDataLoss=false to read the new journal from its first row")
        log.warning("streaming query: %s; reading the new journal from its first row "
                    "(what the old one held past seq %d is not counted: it is gone)",
                    text, s.seq)
        self._cache.clear()  # (block lists of the old journal's segment names)
        view = self._view()
        origin = first_seq(view) or 1
        end = self._advance(view, Offset(origin), limit)
        self._consumed = end.seq
        return Offset(end.seq, s.lost, s.after_planning, origin, journal).to_dict()

    def _went_back(self, view: View, start: int) -> int:
        """Rows this query will skip because the journal now ends before *start*, an
        offset it had reached: the recorder lost its last rows (a power loss: the open
        segment is fsynced only at its seal; or a journal put back from an older copy)
        and numbers the rows it records next from its end again.  An error, or counted
        once (failOnDataLoss=false).  Not for a start the query was given (a sequence
        number not yet recorded is where it waits)."""
        end = advance(view, START).seq
        if start <= end or start == self._back or \
                start == seq_at(self.opts.path, view, self.opts.starting):
            return 0
        text = (f"the journal ends at seq {end}, before this query's offset {start}: the "
                f"rows it had up to there are gone (the recorder lost them: a power loss, "
                f"or a journal put back from an older copy), and it numbers new rows from "
                f"{end} again, so the query skips {start - end:,} new rows")
        if self.opts.fail_on_data_loss:
            raise DataLoss(f"streaming query: {text}{_HINT}")
        log.warning("streaming query: %s; counted as lost (failOnDataLoss=false)", text)
        self._back = start
        return start - end

    def reportLatestOffset(self) -> dict:
        """The journal's end, shown as the source's ``latestOffset`` in the query's
        progress, with how many rows the query is behind it (``rowsBehindLatest``: rows
        between the end offset of the batch just planned and the journal's end; Kafka's
        source reports the same as ``avgOffsetsBehindLatest``/``maxOffsetsBehindLatest``,
        but PySpark gives a Python source no metrics of its own)."""
        view = self._view()
        latest = advance(view, START)
        d = latest.to_dict()
        if self._consumed is not None:
            d["rowsBehindLatest"] = max(0, latest.seq - max(self._consumed,
                                                             first_seq(view) or 0))
        return d

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = advance(self._view(), START)

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        view = self._view()
        s, e = Offset.from_dict(start, view), Offset.from_dict(end, view)
        if e.origin is not None and e.origin != s.seq:
            # Batch 0 replayed after a restart: Spark asked the initial offset again, which
            # is where the journal begins *now*; the batch was planned from e.origin.
            s = Offset(e.origin, s.lost, s.after_planning)
        missing = gaps(view, s.seq, e.seq)
        # What the end offset counts as lost besides rows of the batch before it: gaps in
        # this batch's range when it was planned.
        planned_gone = (e.lost - e.after_planning) - (s.lost - s.after_planning)
        if sum(hi - lo for lo, hi in missing) > planned_gone:  # gone since it was planned
            now = _check_loss(missing, self.opts.fail_on_data_loss, "planned micro-batch: ")
            self._late[e.key()] = now - planned_gone
        report = self._reports.dir if self._reports is not None else None
        return [RangePartition(p, report)
                for p in partitions(view, s.seq, e.seq, split_size(view, self.opts, s.seq,
                                                                    e.seq))]

    def read(self, partition: InputPartition) -> Iterator:
        return _read(self.opts, self.rows, partition, self.columns)

    def commit(self, end: dict) -> None:
        pass

    def stop(self) -> None:
        if self._reports is not None:
            self._reports.close()
