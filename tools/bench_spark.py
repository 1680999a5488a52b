#!/usr/bin/env python3
"""Spark over a realistic journal: `sbus.spark.read_journal` (the exported Parquet files
plus the open tail as Parquet pieces written on the driver) against plain Parquet of the
same rows, with the ways it was read before, in one run.

    flock /work/bench.lock .venv/bin/python tools/bench_spark.py [--rows 1750000] \\
        [--repeat 5] [--tail 100000] [--cache /var/tmp/sbus-bench-spark]

The journal (`bench_journal.realistic_journal`: 200 keys, 20-400-byte payloads, ~300-row
blocks re-blocked at seal, 64 MiB segments), its export (``DIR/parquet``, as ``sbus
record`` writes it) and Spark's own Parquet copy of the same rows are built once and
kept in --cache.  Two queries: ``groupBy(key).count()`` and ``count + sum(length(payload))``.
Each timed run makes its DataFrame (``read_journal`` lists and plans per DataFrame) and
collects the result; the cases alternate in every round; median wall and CPU seconds
(the whole process tree: JVM and Python workers) of --repeat rounds after a warm-up.
Figures are rows/s relative to plain Parquet.  Cases:

- ``parquet``: ``spark.read.parquet`` of Spark's own copy (the baseline);
- ``read_journal``: every segment sealed and exported (no tail);
- ``read_journal+tail``: the same with an open segment of --tail more rows being recorded
  (a writer holds it open; a recorder's open segment is on average half a segment);
- ``read_journal(columns)``: the same, asking only for the query's columns;
- ``54e8480+tail``: read_journal as it was at 54e8480 (the rows after the export through
  the ``sbus`` source, unioned to the Parquet scan), with the same open tail (today's
  writes the tail as Parquet pieces on the driver, `sbus.journal.tail`: the first call
  converts it, and each later one only what was recorded since; both costs are printed);
- ``before``: read_journal as it was (``max(seq)`` over the Parquet by a Spark job, then
  an always-scanned tail), no tail;
- ``sbus`` / ``sbus(schema)``: the ``sbus`` source alone, all columns / the query's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_journal import interleaved, realistic_journal, spark_session  # noqa: E402


def read_journal_before(spark, journal: str, parquet: str):
    """`sbus.spark.read_journal` as it was at 13ff452 (for the before/after)."""
    from pyspark.sql import functions as F

    names = ["seq", "ts", "key", "key_bytes", "payload"]
    tail = spark.read.format("sbus")
    sealed = spark.read.parquet(parquet).select(*names)
    last = sealed.agg(F.max("seq")).first()[0]
    if last is not None:
        tail = tail.option("startingSeq", str(last + 1))
    return sealed.unionByName(tail.load(journal).select(*names))


def read_journal_54e8480(spark, journal: str):
    """`sbus.spark.read_journal` as it was at 54e8480: the tail through the source."""
    from sbus.journal.export import split
    from sbus.journal.store import EXPORT_SUBDIR
    from sbus.spark import COLUMNS, _parquet

    parquet = os.path.join(journal, EXPORT_SUBDIR)
    cut = split(journal, parquet)
    sealed = _parquet(spark, parquet, cut.files, []).select(*COLUMNS)
    if not cut.tail:
        return sealed
    tail = spark.read.format("sbus").option("startingSeq", str(cut.seam)).load(journal)
    return sealed.unionByName(tail.select(*COLUMNS))


def build(cache: Path, rows: int) -> tuple[Path, Path]:
    """The journal with its export, and Spark's Parquet copy of its rows (kept)."""
    from sbus.journal.export import export_journal
    from sbus.journal.store import EXPORT_SUBDIR

    journal = cache / "journal"
    if not journal.exists():
        print(f"building a realistic journal of {rows:,} rows in {journal}", file=sys.stderr)
        realistic_journal(journal, rows)
    # Each run's open tail is sealed at its end: back to the journal as built, so runs
    # compare like with like (else each run adds a small segment and a file to scan).
    for seg in journal.glob("*.sbj"):
        if int(seg.stem) > rows:
            seg.unlink()
            (journal / EXPORT_SUBDIR / f"{seg.stem}.parquet").unlink(missing_ok=True)
    shutil.rmtree(journal / EXPORT_SUBDIR / ".tail", ignore_errors=True)
    export_journal(journal, journal / EXPORT_SUBDIR)  # what is not exported yet
    return journal, cache / "copy.parquet"


def copy(spark, journal: Path, out: Path) -> int:
    rows = spark.read.format("sbus").schema("seq long").load(str(journal)).count()
    marker = out / f"_ROWS_{rows}"
    if not marker.exists():
        print(f"copying {rows:,} rows to {out} (Spark's Parquet)", file=sys.stderr)
        spark.read.format("sbus").load(str(journal)).write.mode("overwrite").parquet(str(out))
        marker.touch()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_750_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tail", type=int, default=100_000,
                    help="rows in the open segment for the read_journal+tail case")
    ap.add_argument("--cache", type=Path, default=Path("/var/tmp/sbus-bench-spark"))
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    journal, pq_copy = build(args.cache, args.rows)
    from pyspark.sql import functions as F

    import sbus.spark
    from sbus.journal.store import EXPORT_SUBDIR, JournalWriter

    spark = spark_session()
    rows = copy(spark, journal, pq_copy)
    exported = str(journal / EXPORT_SUBDIR)
    j = str(journal)
    queries = {
        "groupBy(key).count()": (["key"], lambda df: df.groupBy("key").count().collect()),
        "count + sum(length(payload))": (
            ["payload"], lambda df: df.agg(F.count(F.lit(1)),
                                           F.sum(F.length("payload"))).collect()),
    }
    makers = {
        "parquet": lambda cols: spark.read.parquet(str(pq_copy)),
        "read_journal": lambda cols: sbus.spark.read_journal(spark, j),
        "before": lambda cols: read_journal_before(spark, j, exported),
        "sbus": lambda cols: spark.read.format("sbus").load(j),
        "sbus(schema)": lambda cols: spark.read.format("sbus").schema(
            ", ".join(f"{c} {'string' if c == 'key' else 'binary'}" for c in cols)).load(j),
    }
    sealed = {(m, q): (lambda mk=mk, cols=cols, run=run: run(mk(cols)))
              for q, (cols, run) in queries.items() for m, mk in makers.items()}
    t = interleaved(sealed, args.repeat)

    # The same with an open tail being recorded: a writer holds the journal's open segment.
    writer = JournalWriter(journal, fsync=False, segment_seconds=1e12)
    try:
        keys = [b"tail/%d" % i for i in range(50)]
        for lo in range(0, args.tail, 300):
            n = min(300, args.tail - lo)
            writer.append(1_800_000_000 * 10**9 + lo, [keys[i % 50] for i in range(n)],
                          [b'{"v":%d}' % (lo + i) for i in range(n)])
            writer.flush()
        took = time.perf_counter()
        assert sbus.spark.read_journal(spark, j).count() == rows + args.tail
        took = time.perf_counter() - took
        print(f"first read_journal with the open tail (converts {args.tail:,} rows): "
              f"{took:.2f} s", file=sys.stderr)
        open_makers = {
            "parquet": makers["parquet"],
            "read_journal+tail": lambda cols: sbus.spark.read_journal(spark, j),
            "read_journal(columns)+tail": lambda cols: sbus.spark.read_journal(
                spark, j, columns=cols),
            "54e8480+tail": lambda cols: read_journal_54e8480(spark, j),
        }
        live = {(m, q): (lambda mk=mk, cols=cols, run=run: run(mk(cols)))
                for q, (cols, run) in queries.items() for m, mk in open_makers.items()}
        t2 = interleaved(live, args.repeat)
        more = []  # read_journal while recording: 1,000 rows more before each call
        for _ in range(args.repeat):
            lo = writer.next_seq
            writer.append(1_800_000_000 * 10**9 + lo, [keys[i % 50] for i in range(1000)],
                          [b'{"v":%d}' % i for i in range(1000)])
            writer.flush()
            took = time.perf_counter()
            df = sbus.spark.read_journal(spark, j)
            more.append(time.perf_counter() - took)
        print(f"read_journal (the DataFrame, no action) with 1,000 new rows in the tail: "
              f"median {statistics.median(more) * 1e3:.0f} ms", file=sys.stderr)
        assert df.count() == writer.next_seq - 1
    finally:
        writer.close()  # sealed: the next run exports it (and copies the rows again)
    spark.stop()

    print(f"\n{rows:,}-row realistic journal ({len(list(Path(exported).glob('*.parquet')))}"
          f" segments), local[2], median of {args.repeat}, cases alternating; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| query | case | s (CPU s) | rows/s vs Parquet (by CPU) |")
    print("|---|---|---|---|")
    for q in queries:
        base, base_cpu = t["parquet", q]
        for m in makers:
            w, c = t[m, q]
            print(f"| {q} | {m} | {w:.2f} ({c:.2f}) | {base / w:.2f}x ({base_cpu / c:.2f}x) |")
        base2, base2_cpu = t2["parquet", q]
        print(f"| {q} | parquet (alternating with the open-tail cases) | {base2:.2f} "
              f"({base2_cpu:.2f}) | 1.00x (1.00x) |")
        for m in open_makers:
            if m == "parquet":
                continue
            w, c = t2[m, q]
            n = rows + args.tail  # rows/s: the tail's rows count too
            r, rc = base2 / w * n / rows, base2_cpu / c * n / rows
            print(f"| {q} | {m} ({args.tail:,}-row open tail) | {w:.2f} ({c:.2f}) | "
                  f"{r:.2f}x ({rc:.2f}x) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
