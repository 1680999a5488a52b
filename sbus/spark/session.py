"""A SparkSession for sbus commands: the embedded ``local[*]`` default, or whatever
``spark-submit`` configured, with the ``sbus`` format registered."""

from __future__ import annotations

import atexit
import os
import sys
import tempfile

__all__ = ["get_session", "UDS"]

UDS = "spark.python.unix.domain.socket.enabled"


#: The embedded JVM's log configuration when quiet: errors only, on stderr.
QUIET_LOG4J = """\
rootLogger.level = error
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = error
rootLogger.appenderRef.stderr.ref = stderr
appender.console.type = Console
appender.console.name = stderr
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = spark: %p %c{1}: %m%n
"""


def _jvm_stderr_to_log() -> int:
    """Point fd 2 at a temporary log file while the JVM is started, so what the JVM and
    its Python workers print themselves (the launcher's warnings) stays off the terminal;
    errors still reach the driver as exceptions.  Returns the saved fd 2."""
    fd, path = tempfile.mkstemp(prefix="sbus-spark-", suffix=".log")
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    saved = os.dup(2)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def get_session(master: str | None = None, app: str = "sbus", quiet: bool = False):
    """The active session if there is one (tests, notebooks, spark-submit), else a new
    one on *master* (default ``local[*]`` unless spark-submit set ``spark.master``);
    *quiet* keeps the embedded JVM's start-up and warnings off the terminal."""
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
        conf_file = None
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
            if quiet:
                fd, conf_file = tempfile.mkstemp(prefix="sbus-log4j2-", suffix=".properties")
                os.write(fd, QUIET_LOG4J.encode())
                os.close(fd)
                builder = builder.config("spark.driver.extraJavaOptions",
                                         f"-Dlog4j2.configurationFile=file:{conf_file}")
        saved = _jvm_stderr_to_log() if conf_file else None
        try:
            spark = builder.getOrCreate()
        finally:
            if saved is not None:
                os.dup2(saved, 2)
                os.close(saved)
            if conf_file:  # read once, when the JVM started
                os.unlink(conf_file)
        spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
