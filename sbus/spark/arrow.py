"""Journal blocks to Arrow record batches, and the byte ranges a Spark task reads.

A block is stored column-wise with Arrow's ``binary`` layout (int32 offsets + data), so
the key and payload arrays are built on the bytes read, without a copy or a Python
loop.  Keys that are not valid UTF-8 (rare) take a slow path: ``key`` gets U+FFFD for
each bad byte sequence while ``key_bytes`` keeps the exact bytes; for every other key
``key_bytes`` is null (``key`` is exact), which costs next to nothing to carry.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..journal.format import Block, block_size
from ..journal.store import read_blocks
from ..routing import matches

__all__ = ["COLUMNS", "DEFAULT_SCHEMA", "ARROW_TYPES", "NULLABLE", "Range", "arrow_schema",
           "block_batch", "read_range", "pattern_bytes"]

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
    """Rows of one segment from ``(start, start_row)`` up to ``(end, end_row)``: byte
    positions of block starts plus a row within that block (for exact row limits)."""

    segment: int
    start: int
    start_row: int
    end: int
    end_row: int


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


def block_batch(block: Block, columns: list[str] | pa.Schema, pattern: bytes | None = None,
                lo: int = 0, hi: int | None = None) -> pa.RecordBatch | None:
    """Rows ``lo:hi`` of *block* as a record batch with *columns* (names, or an Arrow schema
    from `arrow_schema`); rows whose key the routing *pattern* does not match are dropped.
    None when nothing is left."""
    schema = columns if isinstance(columns, pa.Schema) else arrow_schema(columns)
    names = schema.names
    n = block.count
    hi = n if hi is None else hi
    keys = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(block.key_offsets),
                                                  pa.py_buffer(block.keys)])
    cols: dict[str, pa.Array] = {}
    if "key" in names or "key_bytes" in names:
        cols["key"], cols["key_bytes"] = _key_columns(keys)
    for name in names:
        if name == "payload":
            cols[name] = pa.Array.from_buffers(
                pa.binary(), n, [None, pa.py_buffer(block.payload_offsets),
                                 pa.py_buffer(block.payloads)])
        elif name == "ts":
            micros = np.frombuffer(block.ts, dtype="<i8") // 1000
            cols[name] = pa.array(micros, ARROW_TYPES["ts"])
        elif name == "seq":
            cols[name] = pa.array(np.arange(block.first_seq, block.first_seq + n, dtype=np.int64))
    batch = pa.RecordBatch.from_arrays([cols[c] for c in names], schema=schema)
    if lo or hi != n:
        batch = batch.slice(lo, hi - lo)
        keys = keys.slice(lo, hi - lo)
    if pattern is not None:
        # Keys repeat a lot: match each distinct key once, then spread the answer.
        encoded = keys.dictionary_encode()
        verdict = pa.array([matches(pattern, k) for k in encoded.dictionary.to_pylist()],
                           pa.bool_())
        mask = pc.take(verdict, encoded.indices)
        if not pc.any(mask).as_py():
            return None
        if not pc.all(mask).as_py():
            batch = batch.filter(mask)
    return batch if batch.num_rows else None


def read_range(directory: str, rng: Range, columns: list[str] | pa.Schema,
               pattern: bytes | None = None, verify: bool | None = None
               ) -> Iterator[pa.RecordBatch]:
    """Record batches for the rows of *rng* (see `Range`), with *columns* as in
    `block_batch`."""
    schema = columns if isinstance(columns, pa.Schema) else arrow_schema(columns)
    stop = rng.end + (1 if rng.end_row else 0)  # include the block at `end` for its head rows
    pos = rng.start
    for block in read_blocks(directory, rng.segment, rng.start, stop, verify):
        lo = rng.start_row if pos == rng.start else 0
        hi = rng.end_row if pos == rng.end else block.count
        pos += block_size(block.count, len(block.keys), len(block.payloads))
        batch = block_batch(block, schema, pattern, lo, hi)
        if batch is not None:
            yield batch

