"""sbus on Apache Spark: the ``sbus`` data source (journal reads, batch and streaming) and
sink (publish onto a bus), and the ``sbus analyze`` pipeline.

>>> import sbus.spark                                   # doctest: +SKIP
>>> sbus.spark.register(spark)
>>> spark.read.format("sbus").load("/var/lib/sbus/journal").show()
"""

from __future__ import annotations

__all__ = ["register", "read_journal", "SCHEMA"]

SCHEMA = ("key string not null, payload binary not null, ts timestamp not null, "
          "seq long not null, key_bytes binary")


def register(spark) -> None:
    """Register the ``sbus`` format on *spark* (a SparkSession); idempotent.  Also turns on
    filter pushdown for Python data sources, which the source's ``pushFilters`` needs
    (Spark refuses a source that implements it while the setting is off)."""
    from .source import SbusDataSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(SbusDataSource)


def read_journal(spark, journal: str, parquet: str | None = None):
    """The journal as one DataFrame (columns ``seq, ts, key, key_bytes, payload``): the
    sealed segments exported by ``sbus journal export`` under *parquet*, plus every row
    after the last exported one read by the ``sbus`` source (segments not exported yet
    and the open segment's tail).  Tools without this package read *parquet* alone."""
    from pyspark.sql import functions as F

    register(spark)
    names = ["seq", "ts", "key", "key_bytes", "payload"]
    tail = spark.read.format("sbus")
    if parquet is None:
        return tail.load(journal).select(*names)
    sealed = spark.read.parquet(parquet).select(*names)
    last = sealed.agg(F.max("seq")).first()[0]
    if last is not None:
        tail = tail.option("startingSeq", str(last + 1))
    return sealed.unionByName(tail.load(journal).select(*names))
