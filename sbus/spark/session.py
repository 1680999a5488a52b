"""A SparkSession for sbus commands: the embedded ``local[*]`` default, or whatever
``spark-submit`` configured, with the ``sbus`` format registered."""

from __future__ import annotations

import os
import sys

__all__ = ["get_session", "UDS"]

UDS = "spark.python.unix.domain.socket.enabled"


def get_session(master: str | None = None, app: str = "sbus"):
    """The active session if there is one (tests, notebooks, spark-submit), else a new
    one on *master* (default ``local[*]`` unless spark-submit set ``spark.master``)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession

    from . import register

    spark = SparkSession.getActiveSession()
    if spark is None:
        # Under spark-submit the Python driver is started by a JVM that already holds the
        # submitted configuration (spark.master among it); a SparkConf made before the
        # gateway is connected cannot see it, so connect first.
        if "PYSPARK_GATEWAY_PORT" in os.environ:
            SparkContext._ensure_initialized()
        conf = SparkConf()
        builder = SparkSession.builder.appName(app)
        if master or not conf.contains("spark.master"):
            # Embedded: workers use this interpreter (where sbus is importable), quiet UI.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            builder = (builder.master(master or "local[*]")
                       .config("spark.ui.enabled", "false")
                       .config("spark.ui.showConsoleProgress", "false")
                       .config("spark.sql.shuffle.partitions", "8")
                       .config("spark.sql.session.timeZone", "UTC")
                       # Python workers over a unix socket, not loopback TCP, where each
                       # task of the sbus source was measured waiting ~35 ms for its input
                       # before read() starts (the signature of Nagle plus delayed ACK).
                       .config(UDS, "true"))
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
