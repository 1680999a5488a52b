"""The ``sbus`` Spark data source: batch and streaming reads of a journal, and a streaming
sink that publishes onto a bus.

Options (reads): ``path`` (the journal directory, or ``load(DIR)``), ``pattern`` (a routing
pattern; only matching keys are returned, filtered inside the reader; ``patternHex`` gives
it as hex bytes, for patterns that are not UTF-8),
``maxPartitionBytes`` (split size, default 128M), ``minPartitions`` (split a read into
this many equal partitions when there are enough blocks, more only if maxPartitionBytes asks
for it; default: the planning machine's CPU count), ``verify`` (check block CRCs:
true, the default, or false for journals you trust; sizes and offsets are checked
either way); streaming also ``maxRowsPerTrigger`` and
``startingOffsets`` (earliest | latest).
Sink options: see `sbus.spark.sink`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from pyspark.sql.types import StructType

from ..defaults import parse_size
from ..journal.format import FILE_HEAD, BlockInfo
from ..journal.store import JournalError, list_segments, segment_blocks
from .arrow import COLUMNS, DEFAULT_SCHEMA, NULLABLE, Range, arrow_schema, pattern_bytes, read_range
from .offsets import START, Offset, View, advance, partitions

try:  # Trigger.AvailableNow for Python sources arrived in Spark 4.2
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # pragma: no cover - older Spark
    SupportsTriggerAvailableNow = object  # type: ignore[misc,assignment]

__all__ = ["SbusDataSource"]

log = logging.getLogger("sbus.spark")


class RangePartition(InputPartition):
    """One Spark task's share: byte ranges of consecutive segments."""

    def __init__(self, ranges: list[Range]) -> None:
        super().__init__(ranges)
        self.ranges = tuple(ranges)


def _columns(schema: StructType) -> pa.Schema:
    """The Arrow schema for the query's *schema* (default or user-given), checked."""
    names = [f.name for f in schema.fields]
    unknown = [n for n in names if n not in COLUMNS]
    if unknown:
        raise ValueError(f"the sbus source has no column(s) {unknown}; it has {list(COLUMNS)}")
    not_null = {f.name for f in schema.fields if not f.nullable}
    if not_null & NULLABLE:
        raise ValueError(f"column(s) {sorted(not_null & NULLABLE)} have nulls: they cannot be "
                         "NOT NULL")
    return arrow_schema(names, not_null)


def _read(opts: _Options, partition: InputPartition, columns: pa.Schema) -> Iterator:
    for rng in getattr(partition, "ranges", ()):  # none: Spark's stand-in for no partitions
        yield from read_range(opts.path, rng, columns, opts.pattern, opts.verify)


def _bool(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    if value.lower() not in ("true", "false"):
        raise ValueError(f"expected true or false, got {value!r}")
    return value.lower() == "true"


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


END = Offset(2**62, 0)


def split_size(view: View, opts: _Options, start: Offset = START, end: Offset = END) -> int:
    """Bytes per partition: the range's share of minPartitions, at most maxPartitionBytes
    (Python tasks have a fixed start-up cost, so fewer, larger partitions are faster, but
    every core should get one, and equal ones, so that none waits for a straggler)."""
    total = sum(b.size for seg, blocks in view for b in blocks
                if start <= Offset(seg, b.pos) < end)
    return max(1, min(opts.max_bytes, -(-total // opts.min_partitions)))


class _Options:
    def __init__(self, options) -> None:
        self.path = options.get("path")
        if not self.path:
            raise ValueError("the sbus source needs a journal directory: "
                             "spark.read.format('sbus').load(DIR) or option('path', DIR)")
        self.pattern = pattern_bytes(options.get("pattern"))
        if options.get("patternHex") is not None:  # non-UTF-8 patterns (py4j carries text)
            try:
                self.pattern = bytes.fromhex(options["patternHex"])
            except ValueError:
                raise ValueError("patternHex must be hexadecimal bytes, e.g. 'fffe2f'") from None
        self.max_bytes = parse_size(options.get("maxPartitionBytes", "128M"))
        self.min_partitions = int(options.get("minPartitions", os.cpu_count() or 1))
        if self.max_bytes <= 0 or self.min_partitions <= 0:
            raise ValueError("maxPartitionBytes and minPartitions must be positive")
        verify = options.get("verify")
        self.verify = None if verify is None else _bool(verify, True)
        mrt = options.get("maxRowsPerTrigger")
        self.max_rows = None if mrt is None else int(mrt)
        if self.max_rows is not None and self.max_rows <= 0:
            raise ValueError("maxRowsPerTrigger must be positive")
        self.starting = options.get("startingOffsets", "earliest").lower()
        if self.starting not in ("earliest", "latest"):
            raise ValueError("startingOffsets must be 'earliest' or 'latest'")


class SbusDataSource(DataSource):
    """``spark.read.format("sbus").load(DIR)`` / ``readStream`` / ``writeStream``."""

    @classmethod
    def name(cls) -> str:
        return "sbus"

    def schema(self) -> str:
        return DEFAULT_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return BatchReader(_Options(self.options), _columns(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return StreamReader(_Options(self.options), _columns(schema))

    def writer(self, schema: StructType, overwrite: bool):
        from .sink import BusBatchWriter

        return BusBatchWriter(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool):
        from .sink import BusStreamWriter

        return BusStreamWriter(self.options, schema)


class BatchReader(DataSourceReader):
    def __init__(self, opts: _Options, columns: pa.Schema) -> None:
        self.opts = opts
        self.columns = columns

    def partitions(self) -> list[InputPartition]:
        try:
            view = journal_view(self.opts.path)
        except JournalError as exc:
            raise ValueError(str(exc)) from None
        return [RangePartition(p)
                for p in partitions(view, START, END, split_size(view, self.opts))]

    def read(self, partition: InputPartition) -> Iterator:
        return _read(self.opts, partition, self.columns)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over the journal; see `sbus.spark.offsets` for the offset model."""

    def __init__(self, opts: _Options, columns: pa.Schema) -> None:
        self.opts = opts
        self.columns = columns
        self._cache: dict = {}
        self._target: Offset | None = None

    def _view(self) -> View:
        try:
            return journal_view(self.opts.path, self._cache)
        except JournalError:
            return []  # no journal yet: nothing to read until the recorder creates it

    def initialOffset(self) -> dict:
        if self.opts.starting == "latest":
            return advance(self._view(), START).to_dict()
        return START.to_dict()

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_rows is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_rows)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        return advance(self._view(), Offset.from_dict(start), max_rows,
                       self._target).to_dict()

    def reportLatestOffset(self) -> dict:
        return advance(self._view(), START).to_dict()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = advance(self._view(), START)

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        view = self._view()
        s, e = Offset.from_dict(start), Offset.from_dict(end)
        if view and s.segment and s.segment < view[0][0]:
            log.warning("journal segments before %d were removed (retention) before they "
                        "were read: rows lost", view[0][0])
        return [RangePartition(p)
                for p in partitions(view, s, e, split_size(view, self.opts, s, e))]

    def read(self, partition: InputPartition) -> Iterator:
        return _read(self.opts, partition, self.columns)

    def commit(self, end: dict) -> None:
        pass
