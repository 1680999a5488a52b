"""sbus on Apache Spark: the ``sbus`` data source (journal reads, batch and streaming) and
sink (publish onto a bus), and the ``sbus analyze`` pipeline.

>>> import sbus.spark                                   # doctest: +SKIP
>>> sbus.spark.register(spark)
>>> spark.read.format("sbus").load("/var/lib/sbus/journal").show()
"""

from __future__ import annotations

__all__ = ["register", "SCHEMA"]

SCHEMA = ("key string not null, payload binary not null, ts timestamp not null, "
          "seq long not null, key_bytes binary")


def register(spark) -> None:
    """Register the ``sbus`` format on *spark* (a SparkSession); idempotent.  Also turns on
    filter pushdown for Python data sources, which the source's ``pushFilters`` needs
    (Spark refuses a source that implements it while the setting is off)."""
    from .source import SbusDataSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(SbusDataSource)
