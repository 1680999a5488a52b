"""``df.writeStream.format("sbus").option("address", SOCK)``: publish rows onto a bus.

Rows need a ``payload`` (binary or string) and a key: ``key_bytes`` (binary, used when
present and not null, so keys read from a journal round-trip exactly) or ``key``
(string, sent as UTF-8).

Replays: Spark re-runs a micro-batch after a failure with the same batch id.  The sink
keeps a record in a *state directory* (``option("state", DIR)``, default
``<checkpointLocation>/sbus-sink``; it must be on storage every executor sees):

* ``done/<batch>-<partition>`` once a task has published its whole partition (after a
  whoami round trip, so the broker has taken every message);
* ``committed/<batch>`` once the driver has committed the batch.

A task skips a batch that is committed and a partition already done, so a replayed
micro-batch is not published twice.  Only a task that died mid-partition republishes
(that partition's rows, at least once).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, StringType, StructType

__all__ = ["BusStreamWriter", "BusBatchWriter", "PublishedMessage"]

BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by Spark's micro-batch engine on tasks


@dataclass
class PublishedMessage(WriterCommitMessage):
    batch_id: int
    partition: int
    published: int
    skipped: bool


def _touch(path: Path) -> None:
    """Create *path* atomically (temp name, then rename), so a marker is all or nothing."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


class _Publisher:
    """Column checks and the publishing loop, shared by the batch and streaming writers."""

    def _columns(self, options, schema: StructType) -> None:
        self.address = options.get("address")  # None: $SBUS_ADDRESS or the default
        fields = {f.name: f.dataType for f in schema.fields}
        if "payload" not in fields or not isinstance(fields["payload"], BinaryType | StringType):
            raise ValueError("the sbus sink needs a 'payload' column (binary or string)")
        self.key_bytes = isinstance(fields.get("key_bytes"), BinaryType)
        self.key = isinstance(fields.get("key"), StringType)
        if not (self.key_bytes or self.key):
            raise ValueError("the sbus sink needs a 'key' (string) or 'key_bytes' (binary) "
                             "column")

    def _publish(self, iterator) -> int:
        from ..client import Client

        n = 0
        with Client(self.address) as bus:
            publish = bus.publish
            for batch in iterator:
                keys = self._keys(batch)
                payloads = batch.column("payload").to_pylist()
                for key, payload in zip(keys, payloads, strict=True):
                    if key is None:
                        raise ValueError("the sbus sink cannot publish a row without a key")
                    if isinstance(payload, str):
                        payload = payload.encode()
                    publish(key, payload or b"")
                    n += 1
            bus.whoami(timeout=60)  # round trip: the broker has taken every message
        return n

    def _keys(self, batch) -> list:
        if self.key_bytes:
            raw = batch.column("key_bytes").to_pylist()
            if self.key:
                text = batch.column("key").to_pylist()
                return [r if r is not None else (t.encode() if t is not None else None)
                        for r, t in zip(raw, text, strict=True)]
            return raw
        return [None if t is None else t.encode() for t in batch.column("key").to_pylist()]


class BusBatchWriter(_Publisher, DataSourceArrowWriter):
    """``df.write.format("sbus").option("address", SOCK).save()``: publish once, no
    replay bookkeeping (a failed job may have published part of the rows)."""

    def __init__(self, options, schema: StructType) -> None:
        self._columns(options, schema)

    def write(self, iterator: Iterator) -> PublishedMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        return PublishedMessage(-1, ctx.partitionId() if ctx else 0, self._publish(iterator),
                                False)


class BusStreamWriter(_Publisher, DataSourceStreamArrowWriter):
    def __init__(self, options, schema: StructType) -> None:
        self._columns(options, schema)
        state = options.get("state")
        if state is None and options.get("checkpointLocation"):
            state = os.path.join(options["checkpointLocation"], "sbus-sink")
        if state is None:
            raise ValueError("the sbus sink needs option('checkpointLocation', DIR) or "
                             "option('state', DIR) to record published batches")
        self.state = state.removeprefix("file:")
        for sub in ("done", "committed"):
            os.makedirs(os.path.join(self.state, sub), exist_ok=True)

    def write(self, iterator: Iterator) -> PublishedMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        batch_id = int(ctx.getLocalProperty(BATCH_ID_PROPERTY) or -1) if ctx else -1
        partition = ctx.partitionId() if ctx else 0
        state = Path(self.state)
        done = state / "done" / f"{batch_id}-{partition}"
        if batch_id >= 0 and ((state / "committed" / str(batch_id)).exists() or done.exists()):
            for _ in iterator:  # drain: Spark expects the input consumed
                pass
            return PublishedMessage(batch_id, partition, 0, True)
        n = self._publish(iterator)
        if batch_id >= 0:
            _touch(done)
        return PublishedMessage(batch_id, partition, n, False)

    def commit(self, messages, batchId: int) -> None:
        _touch(Path(self.state) / "committed" / str(batchId))
        # Partition markers of committed batches are no longer needed.
        for marker in (Path(self.state) / "done").glob(f"{batchId}-*"):
            marker.unlink(missing_ok=True)

    def abort(self, messages, batchId: int) -> None:
        pass
