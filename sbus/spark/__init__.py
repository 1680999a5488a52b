"""sbus on Apache Spark: the ``sbus`` data source (journal reads, batch and streaming) and
sink (publish onto a bus), and the ``sbus analyze`` pipeline.

>>> import sbus.spark                                   # doctest: +SKIP
>>> sbus.spark.register(spark)
>>> spark.read.format("sbus").load("/var/lib/sbus/journal").show()
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("sbus.spark")

__all__ = ["register", "read_journal", "SCHEMA"]

#: read_journal's columns, in the order of the Parquet files.
COLUMNS = ["seq", "ts", "key", "key_bytes", "payload"]
PARQUET_SCHEMA = ("seq long, ts timestamp, key string, key_bytes binary, payload binary")
#: The Parquet reader's (parquet-mr's) setting that checks each page's CRC; Spark hands a
#: read's options to it.
PAGE_CRC = "parquet.page.verify-checksum.enabled"

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
                 columns: list[str] | tuple[str, ...] | None = None,
                 tail_cache: str | None = None):
    """The journal as one DataFrame (columns ``seq, ts, key, key_bytes, payload``, or
    *columns* of them), each row once, as ONE Parquet scan: its sealed segments from their
    Parquet files (*parquet*, by default ``JOURNAL/parquet``, where ``sbus record`` writes
    them as it seals), and the rows after the last exported one (the open segment, and a
    segment sealed but not exported yet) from small Parquet files this call writes on the
    driver with pyarrow, reusing those of earlier calls and converting only the rows
    recorded since (`sbus.journal.tail`: in ``PARQUET/.tail`` if the caller may write
    there, else under *tail_cache*, by default ``~/.cache/sbus/tail``; on a cluster, a
    directory the executors see as the driver does).  So Spark prunes columns and row
    groups everywhere.  The seam comes from the files' names and footers, not from a Spark job.
    Rows the tail files cannot take (no writable place, or more than
    `sbus.journal.tail.TAIL_BYTES` of journal after the seam) are read through the
    ``sbus`` source, which builds only *columns*; so is a journal with no export.
    Like a ``load()``, the DataFrame is one snapshot of a live journal."""
    from ..journal.export import split
    from ..journal.store import EXPORT_SUBDIR
    from ..journal.tail import cache_dir, cover

    names = list(COLUMNS if columns is None else columns)
    unknown = [n for n in names if n not in COLUMNS]
    if unknown or not names:
        raise ValueError(f"read_journal: no column(s) {unknown}; the journal has {COLUMNS}")
    parquet = os.path.join(journal, EXPORT_SUBDIR) if parquet is None else parquet
    cut = split(journal, parquet)
    types = dict(f.split(" ") for f in PARQUET_SCHEMA.split(", "))
    # Only the columns asked for, in their order: Parquet reads just those, no select.
    schema = ", ".join(f"{n} {types[n]}" for n in names)

    def source(start: int | None = None):
        register(spark)
        reader = spark.read.format("sbus").schema(schema)
        if start is not None:
            reader = reader.option("startingSeq", str(start))
        return reader.load(journal).select(*names)

    if not cut.files:
        return source()
    pieces, seam, more = [], cut.seam, None
    cache = cache_dir(journal, parquet, tail_cache)
    if cache is not None:
        try:
            tail = cover(journal, cut.rest, cut.seam, cache)
        except OSError as exc:  # a full disk, say: slower, through the source, but right
            log.warning("read_journal: the tail through the sbus source, as writing its "
                        "Parquet pieces into %s failed: %s", cache, exc)
        else:
            pieces, seam, more = tail.files, tail.end, tail.more
    if more is None:
        more = cut.tail
    sealed = _parquet(spark, parquet, cut.files, pieces, schema)
    return sealed.unionByName(source(seam)) if more else sealed


def _parquet(spark, directory: str, files: list, pieces: list, schema: str = PARQUET_SCHEMA):
    """The Parquet files and the tail's pieces as one DataFrame, the files by their
    directory when they are all it holds (Spark lists more than 32 paths with a job of
    its own; it skips the pieces' dot directory), else by name."""
    extra = list(map(str, pieces))
    # every page's CRC checked (`sbus.journal.export.write_parquet` writes them)
    read = spark.read.option(PAGE_CRC, "true").schema(schema)
    df = read.parquet(directory, *extra)
    wanted = {f.name for f in files} | {os.path.basename(p) for p in extra}
    if {os.path.basename(f) for f in df.inputFiles()} != wanted:  # exported meanwhile
        df = read.parquet(*map(str, files), *extra)
    return df
