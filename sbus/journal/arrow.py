"""Journal blocks to Arrow record batches (pyarrow only, no Spark), and the byte ranges a
reader reads: used by the Parquet export here and by the Spark source (`sbus.spark`),
which depends on the journal, never the other way round.

A block is stored column-wise with Arrow's ``binary`` layout (int32 offsets + data), so
the key and payload arrays are built on the bytes read, without a copy or a Python
loop.  Keys that are not valid UTF-8 (rare) take a slow path: ``key`` gets U+FFFD for
each bad byte sequence while ``key_bytes`` keeps the exact bytes; for every other key
``key_bytes`` is null (``key`` is exact), which costs next to nothing to carry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..routing import matches
from .format import Block
from .store import read_seq_range

__all__ = ["COLUMNS", "DEFAULT_SCHEMA", "ARROW_TYPES", "NULLABLE", "Range", "RowFilter",
           "DataLoss", "arrow_schema", "block_batch", "read_range", "pattern_bytes",
           "lost_message", "BATCH_ROWS"]

#: Every column the source can produce, in the default order.
COLUMNS = ("key", "payload", "ts", "seq", "key_bytes")
#: Only ``key_bytes`` has nulls; saying so lets Spark skip null checks on every other value.
DEFAULT_SCHEMA = ("key string not null, payload binary not null, ts timestamp not null, "
                  "seq long not null, key_bytes binary")
NULLABLE = frozenset({"key_bytes"})
ARROW_TYPES = {
    "key": pa.string(),
    "payload": pa.binary(),
    "ts": pa.timestamp("us", tz="UTC"),
    "seq": pa.int64(),
    "key_bytes": pa.binary(),
}


def arrow_schema(names: list[str], not_null: frozenset[str] | set[str] = frozenset()
                 ) -> pa.Schema:
    """The Arrow schema of batches with columns *names*; Spark checks that it equals the
    query's schema, nullability included."""
    return pa.schema([pa.field(n, ARROW_TYPES[n], nullable=n not in not_null) for n in names])


def pattern_bytes(text: str | None) -> bytes | None:
    """A routing pattern option as bytes (non-UTF-8 bytes via surrogateescape, like argv)."""
    return None if text is None else os.fsencode(text)


@dataclass(frozen=True, slots=True)
class Range:
    """Rows ``lo <= seq < hi`` of one segment, planned as its blocks at byte positions
    ``[start, end)`` (see `sbus.journal.store.read_seq_range` for why both)."""

    segment: int
    start: int
    end: int
    lo: int
    hi: int


#: Record batches handed to Spark have at least this many rows or `BATCH_BYTES` (unless
#: the read ends): Spark's per-batch cost is fixed, and blocks of a
#: modest recording are a few hundred rows.  Blocks are merged as they are read
#: (`sbus.journal.store.read_seq_range`), so that costs no copy.
BATCH_ROWS = 1 << 16
BATCH_BYTES = 32 << 20


@dataclass
class RowFilter:
    """What a read keeps, applied inside the reader: the routing ``pattern`` option, and
    the filters Spark pushed (`sbus.spark.source.BatchReader.pushFilters`): ``key`` in
    each of *key_sets*,
    ``key`` starting with each of *key_prefixes*, ``ts`` (microseconds) within
    ``[ts_min, ts_max]``.  A key's verdict is computed once per distinct key and cached."""

    pattern: bytes | None = None
    key_sets: tuple[frozenset[str], ...] = ()
    key_prefixes: tuple[str, ...] = ()
    ts_min: int | None = None
    ts_max: int | None = None
    _verdicts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def on_keys(self) -> bool:
        return self.pattern is not None or bool(self.key_sets or self.key_prefixes)

    def keeps_key(self, raw: bytes) -> bool:
        verdict = self._verdicts.get(raw)
        if verdict is None:
            if len(self._verdicts) > 100_000:  # bounded: keys can be anything
                self._verdicts.clear()
            text = raw.decode("utf-8", "replace")
            verdict = (self.pattern is None or matches(self.pattern, raw)) and \
                all(text in s for s in self.key_sets) and \
                all(text.startswith(p) for p in self.key_prefixes)
            self._verdicts[raw] = verdict
        return verdict

    def keeps_block(self, min_ts_ns: int, max_ts_ns: int) -> bool:
        """Whether a block with these receive times can hold a row the ``ts`` range keeps."""
        return (self.ts_min is None or max_ts_ns // 1000 >= self.ts_min) and \
            (self.ts_max is None or min_ts_ns // 1000 <= self.ts_max)


def _key_columns(keys: pa.Array) -> tuple[pa.Array, pa.Array]:
    """``(key, key_bytes)`` for binary keys.  Valid UTF-8 (the common case, one check for
    the whole block): ``key`` is a zero-copy view and ``key_bytes`` all null.  Otherwise,
    per row: invalid keys get U+FFFD in ``key`` and their exact bytes in ``key_bytes``."""
    text = keys.view(pa.string())
    try:
        text.validate(full=True)
        return text, pa.nulls(len(keys), pa.binary())
    except pa.ArrowInvalid:
        pass
    out_text, out_bytes = [], []
    for k in keys.to_pylist():
        try:
            out_text.append(k.decode())
            out_bytes.append(None)
        except UnicodeDecodeError:
            out_text.append(k.decode("utf-8", "replace"))
            out_bytes.append(k)
    return pa.array(out_text, pa.string()), pa.array(out_bytes, pa.binary())


def block_batch(block: Block, columns: list[str] | pa.Schema, rows: RowFilter | None = None,
                lo: int = 0, hi: int | None = None) -> pa.RecordBatch | None:
    """Rows ``lo:hi`` of *block* as a record batch with *columns* (names, or an Arrow schema
    from `arrow_schema`), keeping only what *rows* keeps.  None when nothing is left."""
    schema = columns if isinstance(columns, pa.Schema) else arrow_schema(columns)
    names = schema.names
    n = block.count
    hi = n if hi is None else hi
    keys = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(block.key_offsets),
                                                  pa.py_buffer(block.keys)])
    micros = np.frombuffer(block.ts, dtype="<i8") // 1000
    cols: dict[str, pa.Array] = {}
    if "key" in names or "key_bytes" in names:
        cols["key"], cols["key_bytes"] = _key_columns(keys)
    for name in names:
        if name == "payload":
            cols[name] = pa.Array.from_buffers(
                pa.binary(), n, [None, pa.py_buffer(block.payload_offsets),
                                 pa.py_buffer(block.payloads)])
        elif name == "ts":
            cols[name] = pa.array(micros, ARROW_TYPES["ts"])
        elif name == "seq":
            cols[name] = pa.array(np.arange(block.first_seq, block.first_seq + n, dtype=np.int64))
    batch = pa.RecordBatch.from_arrays([cols[c] for c in names], schema=schema)
    if lo or hi != n:
        batch = batch.slice(lo, hi - lo)
        keys = keys.slice(lo, hi - lo)
        micros = micros[lo:hi]
    if rows is not None:
        mask = None
        if rows.ts_min is not None or rows.ts_max is not None:
            keep = np.ones(len(micros), bool)
            if rows.ts_min is not None:
                keep &= micros >= rows.ts_min
            if rows.ts_max is not None:
                keep &= micros <= rows.ts_max
            mask = pa.array(keep)
        if rows.on_keys:
            # Keys repeat a lot: judge each distinct key once, then spread the answer.
            encoded = keys.dictionary_encode()
            verdict = pa.array([rows.keeps_key(k) for k in encoded.dictionary.to_pylist()],
                               pa.bool_())
            by_key = pc.take(verdict, encoded.indices)
            mask = by_key if mask is None else pc.and_(mask, by_key)
        if mask is not None:
            if not pc.any(mask).as_py():
                return None
            if not pc.all(mask).as_py():
                batch = batch.filter(mask)
    return batch if batch.num_rows else None


class DataLoss(Exception):
    """Rows a read was planned over are gone from the journal."""


def read_range(directory: str, rng: Range, columns: list[str] | pa.Schema,
               rows: RowFilter | None = None, verify: bool | None = None,
               on_loss=None) -> Iterator[pa.RecordBatch]:
    """Record batches (of `BATCH_ROWS` rows or `BATCH_BYTES`, but the last) for the rows of
    *rng*, with *columns* as in `block_batch`.  Rows of the range that are no longer in the journal
    (retention deleted the segment after the read was planned) go to
    ``on_loss(lo, hi, reason)`` for each missing ``[lo, hi)``; without *on_loss* they
    raise `DataLoss`."""
    schema = columns if isinstance(columns, pa.Schema) else arrow_schema(columns)
    pending: list[pa.RecordBatch] = []
    count = size = 0
    at = rng.lo
    reason = "a gap in the journal"
    try:
        for block in read_seq_range(directory, rng.segment, rng.start, rng.end, rng.lo,
                                    rng.hi, verify, (BATCH_ROWS, BATCH_BYTES)):
            lo = max(rng.lo - block.first_seq, 0)
            hi = min(rng.hi - block.first_seq, block.count)
            if hi <= lo:
                continue
            if block.first_seq + lo > at:
                _lost(on_loss, at, block.first_seq + lo, reason)
            at = block.first_seq + hi
            batch = block_batch(block, schema, rows, lo, hi)
            if batch is None:
                continue
            pending.append(batch)  # filtered batches can be small: join them
            count += batch.num_rows
            size += batch.nbytes
            if count >= BATCH_ROWS or size >= BATCH_BYTES:
                yield _concat(pending)
                pending, count, size = [], 0, 0
    except FileNotFoundError:
        reason = f"segment {rng.segment:020d} was removed (retention) after the read was planned"
    if at < rng.hi:
        _lost(on_loss, at, rng.hi, reason)
    if pending:
        yield _concat(pending)


def _lost(on_loss, lo: int, hi: int, reason: str) -> None:
    if on_loss is None:
        raise DataLoss(lost_message(lo, hi, reason))
    on_loss(lo, hi, reason)


def lost_message(lo: int, hi: int, reason: str) -> str:
    return f"{hi - lo:,} rows lost: seq {lo}..{hi - 1} are no longer in the journal ({reason})"


def _concat(batches: list[pa.RecordBatch]) -> pa.RecordBatch:
    return batches[0] if len(batches) == 1 else pa.concat_batches(batches)
