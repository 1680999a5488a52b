"""sbus on Apache Spark: the ``sbus`` data source (journal reads, batch and streaming) and
sink (publish onto a bus), and the ``sbus analyze`` pipeline.

>>> import sbus.spark                                   # doctest: +SKIP
>>> sbus.spark.register(spark)
>>> spark.read.format("sbus").load("/var/lib/sbus/journal").show()
"""

from __future__ import annotations

import os

__all__ = ["register", "read_journal", "SCHEMA"]

#: read_journal's columns, in the order of the Parquet files.
COLUMNS = ["seq", "ts", "key", "key_bytes", "payload"]
PARQUET_SCHEMA = ("seq long, ts timestamp, key string, key_bytes binary, payload binary")

SCHEMA = ("key string not null, payload binary not null, ts timestamp not null, "
          "seq long not null, key_bytes binary")


def register(spark) -> None:
    """Register the ``sbus`` format on *spark* (a SparkSession); idempotent.  Also turns on
    filter pushdown for Python data sources, which the source's ``pushFilters`` needs
    (Spark refuses a source that implements it while the setting is off)."""
    from .source import SbusDataSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(SbusDataSource)


def read_journal(spark, journal: str, parquet: str | None = None,
                 columns: list[str] | tuple[str, ...] | None = None):
    """The journal as one DataFrame (columns ``seq, ts, key, key_bytes, payload``, or
    *columns* of them), each row once: its sealed segments from their Parquet files
    (*parquet*, by default ``JOURNAL/parquet``, where ``sbus record`` writes them as it
    seals), so Spark prunes columns and row groups there, and the rows after the last
    exported one (the open segment, and segments not exported yet) through the ``sbus``
    source, which builds only *columns* (it cannot prune them itself).  The seam comes
    from the files' names and footers, not from a Spark job, and an empty tail is not
    scanned.  Like a ``load()``, the DataFrame is one snapshot of a live journal."""
    from ..journal.export import split
    from ..journal.store import EXPORT_SUBDIR

    register(spark)
    names = list(COLUMNS if columns is None else columns)
    unknown = [n for n in names if n not in COLUMNS]
    if unknown or not names:
        raise ValueError(f"read_journal: no column(s) {unknown}; the journal has {COLUMNS}")
    parquet = os.path.join(journal, EXPORT_SUBDIR) if parquet is None else parquet
    cut = split(journal, parquet)
    types = dict(f.split(" ") for f in PARQUET_SCHEMA.split(", "))
    source = spark.read.format("sbus").schema(", ".join(f"{n} {types[n]}" for n in names))
    if not cut.files:
        return source.load(journal).select(*names)
    sealed = _parquet(spark, parquet, cut.files).select(*names)
    if not cut.tail:
        return sealed
    tail = source.option("startingSeq", str(cut.seam)).load(journal).select(*names)
    return sealed.unionByName(tail)


def _parquet(spark, directory: str, files: list):
    """The Parquet files as a DataFrame, by their directory when they are all it holds
    (Spark lists more than 32 paths with a job of its own), else by name."""
    df = spark.read.schema(PARQUET_SCHEMA).parquet(directory)
    wanted = {f.name for f in files}
    if {os.path.basename(f) for f in df.inputFiles()} != wanted:  # exported meanwhile
        df = spark.read.schema(PARQUET_SCHEMA).parquet(*map(str, files))
    return df
