#!/usr/bin/env python3
"""Benchmarks of the Spark pipeline: the recorder against the broker's S1 rate, and batch
reads of a recorded journal against ``spark.read.parquet`` of the same rows.

    .venv/bin/python tools/bench_journal.py [--count 1000000] [--repeat 3] [--part all]

Recorder: S1 is lg pub -> sbus broker -> lg sub (1 key); the recorder run replaces lg sub
with ``sbus record ''``.  Broker on core 0, load (and recorder) on core 1, as in
tools/bench.py.  The recorder's rate is records / (last - first receive time) taken from
the journal itself, and every published message must be in the journal.

Read: the journal the recorder wrote (COUNT messages with lg's 64-byte payloads) read
with ``format("sbus")`` and, after copying the same rows to Parquet, with
``spark.read.parquet``; two queries each: a full materialisation (``noop`` sink, every
column) and a per-key aggregate (count, payload bytes).  Median of --repeat runs after
one warm-up, embedded ``local[2]``; the queries alternate within each round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sbus.client import wait_for_broker  # noqa: E402

SHARED = Path(os.environ.get("SBUS_BENCH_SHARED", ROOT.parent / "shared" / "bench"))
BIN = Path(os.environ.get("SBUS_BENCH_BIN", "/var/cache/sbus-bench"))
PY = sys.executable


def lg_binary() -> Path:
    BIN.mkdir(parents=True, exist_ok=True)
    src, exe = SHARED / "lg.c", BIN / "lg"
    if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
    return exe


def pinned(core: str, cmd: list) -> list:
    return ["taskset", "-c", core, *cmd] if shutil.which("taskset") and os.cpu_count() > 1 \
        else cmd


class Broker:
    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / "b.sock")
        self.proc = subprocess.Popen(pinned("0", [PY, "-m", "sbus.cli", "serve", "--address",
                                                  self.path]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=ROOT)
        wait_for_broker(self.path)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)


def publish(lg: Path, address: str, count: int) -> None:
    subprocess.run(pinned("1", [str(lg), "pub", "-p", "sbus", "-a", f"unix:{address}", "-n", "1",
                                "-K", "1", "-c", str(count), "-r", "0", "-T", "120"]),
                   stdout=subprocess.DEVNULL, check=True)


def s1_rate(lg: Path, tmp: Path, count: int) -> float:
    broker = Broker(tmp)
    try:
        sub = subprocess.Popen(pinned("1", [str(lg), "sub", "-p", "sbus", "-a",
                                            f"unix:{broker.path}", "-n", "1", "-K", "1", "-e",
                                            str(count), "-T", "120", "-I", "1500"]),
                               stdout=subprocess.PIPE, text=True)
        assert sub.stdout.readline().strip() == "READY"
        time.sleep(0.2)
        publish(lg, broker.path, count)
        result = json.loads(sub.stdout.readline())
        sub.wait(10)
        return result["rate"]
    finally:
        broker.stop()


#: Extra options for the recorder under test (``--record-option=--no-export``).
RECORD_OPTIONS: list[str] = []


def recorder_rate(lg: Path, tmp: Path, count: int, journal: Path) -> dict:
    from sbus.journal.store import list_segments, segment_blocks

    shutil.rmtree(journal, ignore_errors=True)
    broker = Broker(tmp)
    try:
        rec = subprocess.Popen(pinned("1", [PY, "-m", "sbus.cli", "record", "", "--dir",
                                            str(journal), "--address", broker.path,
                                            *RECORD_OPTIONS]),
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert "recording into" in rec.stderr.readline()
        cpu0 = process_cpu(rec.pid)
        publish(lg, broker.path, count)
        deadline = time.monotonic() + 120
        blocks: list = []
        while time.monotonic() < deadline:
            blocks = [b for s in list_segments(journal) for b in segment_blocks(s)]
            if sum(b.count for b in blocks) >= count:
                break
            time.sleep(0.2)
        cpu = process_cpu(rec.pid) - cpu0
        rec.send_signal(signal.SIGTERM)
        tail = rec.stderr.read()
        rec.wait(30)
    finally:
        broker.stop()
    recorded = sum(b.count for b in blocks)
    span = (max(b.max_ts for b in blocks) - min(b.min_ts for b in blocks)) / 1e9
    return {"recorded": recorded, "rate": recorded / span, "dropped": "dropped" in tail,
            "cpu_us": cpu * 1e6 / max(recorded, 1)}


def stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (index 11 is utime)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def realistic_journal(directory: Path, rows: int, rate: float = 3000.0,
                      flush: float = 0.1) -> None:
    """A journal as `sbus record` writes it at a modest rate: *rate* messages per second,
    a block per *flush* seconds (~300 rows at 3k msg/s), segments of 64 MiB sealed (and
    re-blocked) as the recorder does.  Traffic as a bus carries it: 200 keys under 8
    prefixes at skewed rates, payloads of 20-400 bytes (JSON-ish), a daily-ish wave in
    the rate, a few keys that fall silent half-way."""
    import numpy as np

    from sbus.journal.store import JournalWriter

    rng = np.random.default_rng(7)
    prefixes = ["sensors", "logs", "metrics", "events", "cmd", "status", "audit", "trace"]
    kinds = ["temp", "cpu", "rx", "err"]
    keys = [f"{prefixes[i % 8]}/node{i // 8:02d}/{kinds[i % 4]}".encode() for i in range(200)]
    weights = 1.0 / np.arange(1, 201) ** 0.8
    weights /= weights.sum()
    start = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z
    per_block = max(1, int(rate * flush))
    body = bytes(rng.integers(97, 123, 400, dtype=np.uint8))
    with JournalWriter(directory, fsync=False, segment_seconds=1e12) as w:
        done = 0
        t = start
        while done < rows:
            n = min(per_block, rows - done)
            wave = 1 + 0.5 * np.sin(done / rows * 6.28)
            idx = rng.choice(200, n, p=weights)
            if done > rows // 2:
                idx = np.where(idx % 50 == 7, 0, idx)  # keys ...07/... stop half-way
            sizes = rng.integers(20, 400, n)
            w.append(t, [keys[i] for i in idx],
                     [b'{"v":%d,"s":"' % (done + j) + body[:s] + b'"}'
                      for j, s in enumerate(sizes)])
            w.flush()  # what the recorder's --flush timer does at this rate
            done += n
            t += int(flush * 1e9 / wave)


def spark_session():
    os.environ["PYSPARK_PYTHON"] = PY
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    import sbus.spark
    from sbus.spark.session import UDS

    # the transport to Python workers that `sbus analyze` and docs/spark.md use (Parquet
    # runs in the JVM and does not care)
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config(UDS, "true")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    sbus.spark.register(spark)
    return spark


def tree_cpu() -> float:
    """CPU seconds used so far by this process and all its descendants (the Spark JVM and
    its Python workers, reaped ones included): less sensitive to a shared machine's load
    than wall time."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = stat_fields(name)
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(name))
        cpu[int(name)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def interleaved(cases: dict, repeat: int) -> dict:
    """Median (wall seconds, CPU seconds) per case; the cases alternate in every round, so a
    machine whose load drifts (shared CI hosts) slows them alike."""
    for fn in cases.values():
        fn()  # warm-up: Python workers, JIT
    runs: dict = {name: ([], []) for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            c, t = tree_cpu(), time.perf_counter()
            fn()
            runs[name][0].append(time.perf_counter() - t)
            runs[name][1].append(tree_cpu() - c)
    return {name: (statistics.median(w), statistics.median(c)) for name, (w, c) in runs.items()}


def both_sources(journal: Path, tmp: Path):
    """A session, the journal through the sbus source, and Parquet of the same rows."""
    spark = spark_session()
    sbus_df = spark.read.format("sbus").load(str(journal))
    rows = sbus_df.count()
    sbus_df.write.mode("overwrite").parquet(str(tmp / "copy.parquet"))
    pq_df = spark.read.parquet(str(tmp / "copy.parquet"))
    assert pq_df.count() == rows
    return spark, sbus_df, pq_df, rows


def read_bench(journal: Path, tmp: Path, repeat: int) -> dict:
    from pyspark.sql import functions as F

    spark, sbus_df, pq_df, rows = both_sources(journal, tmp)
    # The Python source cannot prune columns itself; a schema naming only the needed ones does.
    narrow = spark.read.format("sbus").schema("key string, payload binary").load(str(journal))

    def noop(df):
        return lambda: df.write.format("noop").mode("overwrite").save()

    def per_key(df):
        return lambda: df.groupBy("key").agg(F.count("*"), F.sum(F.length("payload"))).collect()

    t = interleaved({("sbus", "noop"): noop(sbus_df), ("parquet", "noop"): noop(pq_df),
                     ("sbus", "per_key"): per_key(sbus_df),
                     ("parquet", "per_key"): per_key(pq_df),
                     ("sbus", "per_key_narrow"): per_key(narrow)}, repeat)
    t["parquet", "per_key_narrow"] = t["parquet", "per_key"]
    out = {"rows": rows, "partitions": {"sbus": sbus_df.rdd.getNumPartitions(),
                                        "parquet": pq_df.rdd.getNumPartitions()}}
    for (src, q), secs in t.items():
        out.setdefault(src, {})[q] = secs
    spark.stop()
    return out


def register_floor(spark, journal: Path, tmp: Path) -> None:
    """Register format ``sbusfloor``: the record batches the sbus source sends for
    *journal*, saved as Arrow files and served from memory maps by a Python data source
    that does nothing else.  What Spark itself costs for a Python source of these rows."""
    import pyarrow as pa
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from sbus.spark.source import SbusDataSource

    reader = SbusDataSource({"path": str(journal)}).reader(
        spark.read.format("sbus").load(str(journal)).schema)
    files = []
    for i, part in enumerate(reader.partitions()):
        files.append(str(tmp / f"floor{i}.arrow"))
        batches = list(reader.read(part))
        with pa.OSFile(files[-1], "wb") as f, pa.ipc.new_file(f, batches[0].schema) as w:
            for b in batches:
                w.write_batch(b)

    class FloorReader(DataSourceReader):
        def partitions(self):
            return [InputPartition(f) for f in files]

        def read(self, partition):
            import pyarrow as pa

            r = pa.ipc.open_file(pa.memory_map(partition.value))
            for i in range(r.num_record_batches):
                yield r.get_batch(i)

    class Floor(DataSource):
        @classmethod
        def name(cls):
            return "sbusfloor"

        def schema(self):
            return SbusDataSource.schema(self)

        def reader(self, schema):
            return FloorReader()

    spark.dataSource.register(Floor)


def realistic_bench(journal: Path, tmp: Path, repeat: int) -> dict:
    """Full scan + group-by of a realistic journal against Parquet of the same rows, and a
    1 % ``ts`` range (pushed down: blocks pruned by the index) against the full scan."""
    from datetime import timedelta

    from pyspark.sql import functions as F

    spark, sbus_df, pq_df, rows = both_sources(journal, tmp)
    lo, hi = sbus_df.agg(F.min("ts"), F.max("ts")).first()
    a = lo + (hi - lo) * 0.5
    b = a + (hi - lo) / 100
    wanted = pq_df.where(F.col("ts").between(a, b)).count()

    # A new DataFrame for every query: PySpark 4.3 reuses a DataFrame's planned read
    # across queries (docs/spark.md, "Filter pushdown").
    def sbus(**opts):
        r = spark.read.format("sbus")
        for k, v in opts.items():
            r = r.option(k, v)
        return r.load(str(journal))

    def parquet():
        return spark.read.parquet(str(tmp / "copy.parquet"))

    def query(make, where=None):
        def run():
            df = make()
            if where is not None:
                df = df.where(where)
            return df.groupBy("key").agg(F.count("*").alias("n"),
                                         F.sum(F.length("payload"))).collect()
        return run

    in_range = F.col("ts").between(a, b)
    got = sum(r.n for r in query(lambda: sbus(pushdown="true"), in_range)())
    assert got == wanted, (got, wanted)
    assert sum(r.n for r in query(sbus)()) == rows
    parts = (sbus().rdd.getNumPartitions(),
             sbus(pushdown="true").where(in_range).rdd.getNumPartitions(),
             parquet().rdd.getNumPartitions())
    register_floor(spark, journal, tmp)
    assert sum(r.n for r in query(spark.read.format("sbusfloor").load)()) == rows
    t = interleaved({("sbus", "full"): query(sbus), ("parquet", "full"): query(parquet),
                     ("floor", "full"): query(spark.read.format("sbusfloor").load),
                     ("sbus", "range"): query(lambda: sbus(pushdown="true"), in_range),
                     ("parquet", "range"): query(parquet, in_range),
                     # the same query over no rows at all: what any query costs
                     ("sbus", "none"): query(lambda: sbus(pushdown="true"), "seq < 0"),
                     ("parquet", "none"): query(parquet, "seq < 0")}, repeat)
    spark.stop()
    return {"rows": rows, "wanted": wanted, "span": str(timedelta(seconds=(hi - lo)
                                                                      .total_seconds())),
            "t": t, "partitions": parts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--part", choices=["all", "recorder", "read", "realistic"], default="all")
    ap.add_argument("--journal", type=Path, default=None,
                    help="keep the recorded journal here (default: a temporary directory)")
    ap.add_argument("--record-option", action="append", default=[], metavar="OPTION",
                    help="pass OPTION to sbus record (e.g. --record-option=--no-export)")
    args = ap.parse_args()
    RECORD_OPTIONS.extend(args.record_option)
    lg = lg_binary() if args.part != "realistic" else None
    tmp = Path(tempfile.mkdtemp(prefix="sbus-bj-", dir="/tmp"))
    journal = args.journal or tmp / "journal"
    try:
        if args.part == "realistic":
            if not journal.exists():
                realistic_journal(journal, args.count)
            res = realistic_bench(journal, tmp, args.repeat)
            t, n = res["t"], res["rows"]
            print(f"\nRealistic journal: {n:,} rows over {res['span']} at ~3k msg/s, 0.1 s "
                  f"flushes, re-blocked at seal; local[2], median of {args.repeat}, queries "
                  f"alternating (load average {os.getloadavg()[0]:.1f}); partitions: sbus "
                  f"%d, sbus range %d, parquet %d\n" % res["partitions"])
            print("| query | sbus s (CPU s) | parquet s (CPU s) | sbus / parquet rows/s |")
            print("|---|---|---|---|")
            for q, label in (("full", "full scan + count, bytes per key"),
                             ("range", f"1 % ts range ({res['wanted']:,} rows), same"),
                             ("none", "no rows (seq < 0), same: the fixed cost")):
                (x, xc), (y, yc) = t["sbus", q], t["parquet", q]
                print(f"| {label} | {x:.2f} ({xc:.2f}) | {y:.2f} ({yc:.2f}) | "
                      f"{y / x:.2f}x (CPU {yc / xc:.2f}x) |")
            (x, xc), (y, yc) = t["floor", "full"], t["parquet", "full"]
            print(f"| full scan, the same Arrow batches from memory (floor) | {x:.2f} ({xc:.2f})"
                  f" | {y:.2f} ({yc:.2f}) | {y / x:.2f}x (CPU {yc / xc:.2f}x) |")
            rs, fs, ns = (t["sbus", q][0] for q in ("range", "full", "none"))
            print(f"\nsbus 1 % range / sbus full scan: {rs / fs:.2f}x of the time; above the "
                  f"fixed cost of a query: {max(rs - ns, 0) / max(fs - ns, 1e-9):.2f}x")
            return 0
        if args.part in ("all", "recorder"):
            s1, rec, cpu = [], [], []
            for _ in range(args.repeat):
                s1.append(s1_rate(lg, tmp, args.count))
                r = recorder_rate(lg, tmp, args.count, journal)
                assert r["recorded"] == args.count, f"recorder lost messages: {r}"
                rec.append(r["rate"])
                cpu.append(r["cpu_us"])
            print(f"\nRecorder vs broker S1 ({args.count:,} messages of 64 bytes, median of "
                  f"{args.repeat}; load average {os.getloadavg()[0]:.1f})\n")
            print("| run | msg/s | recorded | ratio to S1 |")
            print("|---|---|---|---|")
            m1, mr = statistics.median(s1), statistics.median(rec)
            print(f"| broker S1 (lg sub) | {m1:,.0f} | - | 1.00 |")
            print(f"| sbus record | {mr:,.0f} | {args.count:,} of {args.count:,} | "
                  f"{mr / m1:.2f} |")
            ratios = [r / s for s, r in zip(s1, rec, strict=True)]
            print(f"\nRatio in each round (S1 and the recorder run one after the other, "
                  f"so on the same machine state): {', '.join(f'{x:.2f}' for x in ratios)}; "
                  f"median {statistics.median(ratios):.2f}")
            print(f"Recorder CPU per message (user + system, its own process): "
                  f"{statistics.median(cpu):.2f} µs")
        if args.part in ("all", "read"):
            if not journal.exists():
                r = recorder_rate(lg, tmp, args.count, journal)
                assert r["recorded"] == args.count
            res = read_bench(journal, tmp, args.repeat)
            n = res["rows"]
            print(f"\nBatch read of {n:,} recorded 64-byte messages, local[2], median of "
                  f"{args.repeat} (partitions: sbus {res['partitions']['sbus']}, parquet "
                  f"{res['partitions']['parquet']}; load average {os.getloadavg()[0]:.1f})\n")
            print("| query | sbus s (CPU s) | sbus rows/s | parquet s (CPU s) | parquet rows/s "
                  "| sbus / parquet rows/s (by CPU) |")
            print("|---|---|---|---|---|---|")
            for q, label in (("noop", "read every column (noop sink)"),
                             ("per_key", "count + bytes per key"),
                             ("per_key_narrow", "same, sbus with .schema('key string, "
                                                "payload binary')")):
                (a, ac), (b, bc) = res["sbus"][q], res["parquet"][q]
                print(f"| {label} | {a:.2f} ({ac:.2f}) | {n / a:,.0f} | {b:.2f} ({bc:.2f}) | "
                      f"{n / b:,.0f} | {b / a:.2f}x ({bc / ac:.2f}x) |")
    finally:
        if args.journal is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
