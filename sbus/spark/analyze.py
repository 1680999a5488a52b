"""``sbus analyze``: traffic statistics of a journal, with Spark.

Batch (default): per-key and per-prefix statistics (messages, payload bytes, first/last
time, mean rate, payload size percentiles) and traffic per time window, written as
Parquet under ``--out`` together with ``report.md`` and a plot ``traffic.png``.

Streaming (``--stream``): per-minute (``--window``) rollups per prefix, published onto the
bus as ``stats/<prefix>`` with a JSON payload once each window is complete (event time
plus ``--late``), through the ``sbus`` sink, so restarts do not publish a window twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from sbus.client import SbusError  # absolute: spark-submit runs this file as a script
from sbus.display import printable

STATS_PREFIX = "stats/"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("journal", metavar="DIR", help="journal directory (from sbus record)")
    p.add_argument("--out", "-o", metavar="DIR", help="output directory (batch mode)")
    p.add_argument("--pattern", default=None, help="only keys matching this routing pattern")
    p.add_argument("--window", default="1 minute",
                   help="time window for traffic over time / rollups (default '1 minute')")
    p.add_argument("--prefix-depth", type=int, default=1, metavar="N",
                   help="a key's prefix is its first N '/'-separated segments (default 1)")
    p.add_argument("--master", default=None,
                   help="Spark master (default: local[*], or what spark-submit set)")
    p.add_argument("--stream", action="store_true",
                   help="streaming: publish rollups onto the bus under stats/ (needs "
                        "--checkpoint)")
    p.add_argument("--checkpoint", metavar="DIR", help="streaming checkpoint directory")
    p.add_argument("--late", default="10 seconds",
                   help="streaming: how long to wait for late records before a window is "
                        "published (default '10 seconds')")
    p.add_argument("--trigger", default="10 seconds",
                   help="streaming: micro-batch interval, or 'available-now' to process what "
                        "is recorded and stop")
    p.add_argument("--max-rows", type=int, default=None, metavar="N",
                   help="streaming: at most N journal rows per micro-batch")


# -- transformations (pure DataFrame -> DataFrame) -----------------------------------------


def with_prefix(df, depth: int):
    from pyspark.sql import functions as F

    return df.withColumn("prefix", F.array_join(F.slice(F.split("key", "/", -1), 1, depth), "/"))


def group_stats(df, *by: str):
    """messages, bytes, first/last ts, mean msg/s and payload size percentiles per group."""
    from pyspark.sql import functions as F

    size = F.length("payload")
    stats = df.groupBy(*by).agg(
        F.count("*").alias("messages"),
        F.sum(size).alias("bytes"),
        F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"),
        F.percentile_approx(size, [0.5, 0.9, 0.99], 10000).alias("pct"),
        F.max(size).alias("max_size"),
    )
    span = F.greatest(F.unix_micros("last_ts") - F.unix_micros("first_ts"), F.lit(1_000_000))
    return stats.select(
        *by, "messages", "bytes", "first_ts", "last_ts",
        (F.col("messages") / (span / 1e6)).alias("msg_per_s"),
        F.col("pct")[0].alias("p50_size"), F.col("pct")[1].alias("p90_size"),
        F.col("pct")[2].alias("p99_size"), "max_size",
    )


def window_stats(df, window: str):
    """Traffic per time window and prefix."""
    from pyspark.sql import functions as F

    return (df.groupBy(F.window("ts", window).alias("w"), "prefix")
            .agg(F.count("*").alias("messages"), F.sum(F.length("payload")).alias("bytes"))
            .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                    "prefix", "messages", "bytes"))


def rollups(df, window: str, late: str):
    """Streaming rollups as sink rows: key ``stats/<prefix>``, JSON payload."""
    from pyspark.sql import functions as F

    agg = (df.withWatermark("ts", late)
           .groupBy(F.window("ts", window).alias("w"), "prefix")
           .agg(F.count("*").alias("messages"), F.sum(F.length("payload")).alias("bytes")))
    body = F.struct(
        F.col("prefix"),
        F.date_format("w.start", "yyyy-MM-dd'T'HH:mm:ss'Z'").alias("window_start"),
        F.date_format("w.end", "yyyy-MM-dd'T'HH:mm:ss'Z'").alias("window_end"),
        "messages", "bytes")
    return agg.select(F.concat(F.lit(STATS_PREFIX), "prefix").alias("key"),
                      F.encode(F.to_json(body), "UTF-8").alias("payload"))


# -- batch -----------------------------------------------------------------------------------


def analyze(spark, journal: str, out: str | os.PathLike, *, pattern: str | None = None,
            window: str = "1 minute", depth: int = 1) -> dict:
    """Run the batch analysis; returns a summary (also written into the report)."""
    reader = spark.read.format("sbus")
    if pattern is not None:
        reader = reader.option("pattern", pattern)
    df = with_prefix(reader.load(journal), depth).cache()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        keys = group_stats(df, "key", "key_bytes")
        prefixes = group_stats(df, "prefix")
        windows = window_stats(df, window)
        keys.write.mode("overwrite").parquet(str(out / "keys.parquet"))
        prefixes.write.mode("overwrite").parquet(str(out / "prefixes.parquet"))
        windows.write.mode("overwrite").parquet(str(out / "windows.parquet"))
        read = spark.read.parquet
        top_keys = read(str(out / "keys.parquet")).orderBy("messages", ascending=False) \
            .limit(20).collect()
        top_prefixes = read(str(out / "prefixes.parquet")).orderBy("messages", ascending=False) \
            .limit(20).collect()
        traffic = read(str(out / "windows.parquet")).orderBy("window_start").collect()
    finally:
        df.unpersist()
    from pyspark.sql import functions as F

    totals = read(str(out / "prefixes.parquet")).agg(
        F.sum("messages"), F.sum("bytes"), F.count("*"), F.min("first_ts"),
        F.max("last_ts")).first()
    summary = {
        "journal": str(journal),
        "messages": int(totals[0] or 0),
        "bytes": int(totals[1] or 0),
        "keys": read(str(out / "keys.parquet")).count(),
        "prefixes": int(totals[2]),
        "first": totals[3],
        "last": totals[4],
    }
    plot = plot_traffic(traffic, out / "traffic.png", window)
    (out / "report.md").write_text(render_report(summary, top_keys, top_prefixes, window, plot))
    return summary


def plot_traffic(traffic: list, path: Path, window: str) -> str | None:
    """Messages per window over time, total and the busiest prefixes; the PNG's name."""
    if not traffic:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_prefix: dict[str, dict] = {}
    totals: dict = {}
    for r in traffic:
        per_prefix.setdefault(r["prefix"], {})[r["window_start"]] = r["messages"]
        totals[r["window_start"]] = totals.get(r["window_start"], 0) + r["messages"]
    busiest = sorted(per_prefix, key=lambda p: -sum(per_prefix[p].values()))[:6]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    xs = sorted(totals)
    marker = "o" if len(xs) < 30 else None
    ax.plot(xs, [totals[x] for x in xs], color="black", linewidth=2, label="all", marker=marker)
    for p in busiest:
        ax.plot(xs, [per_prefix[p].get(x, 0) for x in xs], label=_label(p), marker=marker)
    width = traffic[0]["window_end"] - traffic[0]["window_start"]
    ax.set_xlim(xs[0] - width, xs[-1] + width)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (UTC)")
    ax.set_ylabel(f"messages per {window}")
    ax.set_title("sbus traffic over time")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _row(cols: list) -> str:
    return "| " + " | ".join(str(c) for c in cols) + " |"


def _code(text: str, limit: int = 120) -> str:
    """Client text as a code span that stays inside its table cell: control bytes and
    newlines escaped (`printable`), pipes escaped, and a fence longer than any run of
    backticks in it, so a key cannot end the span, split the row or leave the table."""
    shown = printable(text, limit).replace("|", "\\|")
    runs = [len(r) for r in re.findall("`+", shown)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def _label(text: str) -> str:
    """A legend label: escaped, short, and with ``$`` taken literally (not mathtext)."""
    return printable(text, 40).replace("$", r"\$") or "(empty)"


def render_report(summary: dict, keys: list, prefixes: list, window: str,
                  plot: str | None) -> str:
    lines = [
        "# sbus traffic report", "",
        f"Journal: {_code(str(summary['journal']), 300)}  ",
        f"Messages: {summary['messages']}, payload bytes: {summary['bytes']}, "
        f"distinct keys: {summary['keys']}, prefixes: {summary['prefixes']}  ",
        f"From {summary['first']} to {summary['last']} (UTC)", "",
    ]
    if plot:
        lines += [f"![traffic per {window}]({plot})", ""]
    head = ["messages", "bytes", "msg/s", "p50 B", "p90 B", "p99 B", "max B"]

    def stats(r) -> list:
        return [r["messages"], r["bytes"], f"{r['msg_per_s']:.1f}", r["p50_size"],
                r["p90_size"], r["p99_size"], r["max_size"]]

    lines += ["## Busiest prefixes", "", _row(["prefix", *head]), _row(["---"] * 8)]
    lines += [_row([_code(r["prefix"]), *stats(r)]) for r in prefixes]
    lines += ["", "## Busiest keys", "", _row(["key", *head]), _row(["---"] * 8)]
    lines += [_row([_code(r["key"]), *stats(r)]) for r in keys]
    lines += ["", "Full tables: `keys.parquet`, `prefixes.parquet`, `windows.parquet`.", ""]
    return "\n".join(lines)


# -- streaming -------------------------------------------------------------------------------


def start_stream(spark, journal: str, checkpoint: str, address: str | None, *,
                 window: str = "1 minute", late: str = "10 seconds", depth: int = 1,
                 trigger: str = "10 seconds", max_rows: int | None = None,
                 pattern: str | None = None):
    """Start the rollup query; returns the StreamingQuery."""
    from pyspark.sql import functions as F

    reader = spark.readStream.format("sbus").option("path", journal)
    if pattern is not None:
        reader = reader.option("pattern", pattern)
    if max_rows is not None:
        reader = reader.option("maxRowsPerTrigger", str(max_rows))
    df = reader.load().where(~F.col("key").startswith(STATS_PREFIX))  # not our own output
    writer = (rollups(with_prefix(df, depth), window, late).writeStream.format("sbus")
              .outputMode("append").option("checkpointLocation", checkpoint))
    if address is not None:
        writer = writer.option("address", address)
    if trigger == "available-now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=trigger)
    return writer.start()


def run(args: argparse.Namespace) -> int:
    if args.prefix_depth < 1:
        raise SbusError("--prefix-depth must be at least 1")
    if not Path(args.journal).is_dir():
        raise SbusError(f"no journal directory at {args.journal}")
    if args.stream:
        if not args.checkpoint:
            raise SbusError("--stream needs --checkpoint DIR")
    elif not args.out:
        raise SbusError("batch analysis needs --out DIR (or use --stream)")
    from sbus.spark.session import get_session

    spark = get_session(args.master, "sbus analyze")
    if args.stream:
        query = start_stream(spark, args.journal, args.checkpoint, args.address,
                             window=args.window, late=args.late, depth=args.prefix_depth,
                             trigger=args.trigger, max_rows=args.max_rows, pattern=args.pattern)
        try:
            query.awaitTermination()
        except KeyboardInterrupt:
            query.stop()
        return 0
    started = time.monotonic()
    summary = analyze(spark, args.journal, args.out, pattern=args.pattern,
                      window=args.window, depth=args.prefix_depth)
    print(json.dumps({**summary, "first": str(summary["first"]), "last": str(summary["last"]),
                      "seconds": round(time.monotonic() - started, 1)}))
    return 0


def main() -> int:
    """Entry point for ``spark-submit .../sbus/spark/analyze.py DIR --out OUT``."""
    import sys

    parser = argparse.ArgumentParser(prog="analyze.py")
    parser.add_argument("--address", default=None)
    add_arguments(parser)
    try:
        return run(parser.parse_args())
    except SbusError as exc:
        print(f"sbus analyze: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
