"""The ``sbus`` Spark source and sink and ``sbus analyze``, with one real local SparkSession
for the whole run and real brokers and recorders."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from collections import Counter
from pathlib import Path

import pytest
from conftest import SBUS, BrokerProcess, raw, recorded_pairs, sync
from sparkkit import FAST_JVM

from sbus.journal.store import JournalWriter, list_segments  # noqa: E402

ROUNDS = 600
KEYS = [b"sensors/a/temp", b"sensors/b/temp", b"sensors/a/hum", b"logs/app", b"\xff\xfe/bin"]


def payload(i: int) -> bytes:
    return b"\0" + bytes([i % 256]) + b"\0bin\xff" + b"x" * (i % 50)


EXPECTED = [(KEYS[i % len(KEYS)], payload(i)) for i in range(ROUNDS * len(KEYS))]


@pytest.fixture(scope="session")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    import sbus.spark
    from sbus.spark.session import UDS

    session = (SparkSession.builder.master("local[2]").appName("sbus-tests")
               .config("spark.driver.defaultJavaOptions", FAST_JVM)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.session.timeZone", "UTC")
               .config(UDS, "true")  # as sbus analyze's embedded session
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    sbus.spark.register(session)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def bus():
    d = tempfile.mkdtemp(prefix="sbus-sp-", dir="/tmp")
    b = BrokerProcess(os.path.join(d, "bus.sock")).start()
    yield b
    b.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def recorded(bus, tmp_path_factory, spark):
    """A journal written by a real ``sbus record`` from a real broker: EXPECTED, in order,
    over several segments; also checks a batch read of the live (open) journal."""
    jdir = tmp_path_factory.mktemp("journal")
    rec = subprocess.Popen([*SBUS, "record", "sensors/", "logs/", b"\xff\xfe/",
                            "--dir", str(jdir), "--address", bus.address,
                            "--segment-size", "40k", "--flush", "0.05"],
                           stderr=subprocess.PIPE, text=True)
    assert "recording into" in rec.stderr.readline()
    started = time.time()
    pub = raw(bus.address)
    chunk = len(EXPECTED) // 5
    for c in range(5):  # in chunks, so the recorder writes several blocks and segments
        for key, data in EXPECTED[c * chunk:(c + 1) * chunk]:
            pub.send(b"MSG " + key + b"\0" + data)
        pub.send(b"MSG other/key\0not recorded")
        sync(pub)
        deadline = time.monotonic() + 10
        # (recorded_pairs: a segment the recorder is creating may not have its header yet)
        while len(recorded_pairs(jdir)) < (c + 1) * chunk and time.monotonic() < deadline:
            time.sleep(0.05)
    pub.close()
    live = spark.read.format("sbus").load(str(jdir)).count()
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(10) == 0
    assert live == len(EXPECTED)
    return jdir, started, time.time()


def exact_key(row) -> bytes:
    return row.key_bytes if row.key_bytes is not None else row.key.encode()


def test_batch_read_row_for_row(spark, recorded):
    jdir, t0, t1 = recorded
    assert len(list_segments(jdir)) > 2
    df = spark.read.format("sbus").load(str(jdir))
    assert df.rdd.getNumPartitions() > 1
    assert [f.name for f in df.schema.fields] == ["key", "payload", "ts", "seq", "key_bytes"]
    assert [f.nullable for f in df.schema.fields] == [False, False, False, False, True]
    rows = df.orderBy("seq").collect()
    assert [(exact_key(r), bytes(r.payload)) for r in rows] == EXPECTED
    # key_bytes carries only what key cannot: keys that are not UTF-8.
    assert {r.key_bytes for r in rows} == {None, b"\xff\xfe/bin"}
    assert [r.seq for r in rows] == list(range(1, len(EXPECTED) + 1))
    assert {r.key for r in rows} == {k.decode("utf-8", "replace") for k in KEYS}
    assert all(t0 - 1 <= r.ts.timestamp() <= t1 + 1 for r in rows)


def test_pattern_pushdown_and_column_choice(spark, recorded):
    jdir = str(recorded[0])

    def read():
        return spark.read.format("sbus")

    temp = read().option("pattern", "sensors/*/temp").load(jdir)
    assert temp.count() == 2 * ROUNDS
    assert {r.key for r in temp.select("key").distinct().collect()} == {
        "sensors/a/temp", "sensors/b/temp"}
    binary = read().option("patternHex", b"\xff\xfe/".hex()).load(jdir).collect()
    assert len(binary) == ROUNDS and {r.key_bytes for r in binary} == {b"\xff\xfe/bin"}
    assert read().option("pattern", "nothing/*").load(jdir).count() == 0
    some = spark.read.format("sbus").schema("seq long, payload binary").load(jdir)
    assert some.where("seq = 7").first().payload == payload(6)
    with pytest.raises(Exception, match="cannot be NOT NULL"):
        spark.read.format("sbus").schema("seq long, key_bytes binary not null").load(jdir).count()
    with pytest.raises(Exception, match="no column"):
        spark.read.format("sbus").schema("seq long, nope string").load(jdir).collect()
    with pytest.raises(Exception, match="no journal directory"):
        spark.read.format("sbus").load(jdir + "/missing").collect()


def test_batch_read_matches_parquet_copy(spark, recorded, tmp_path):
    """Same rows through Parquet: the source's types are what Spark stores."""
    df = spark.read.format("sbus").load(str(recorded[0]))
    df.write.parquet(str(tmp_path / "copy"))
    back = spark.read.parquet(str(tmp_path / "copy"))
    # (Spark reads file sources as nullable, whatever the writer declared.)
    assert [(f.name, f.dataType) for f in back.schema] == [(f.name, f.dataType) for f in df.schema]
    assert back.orderBy("seq").collect() == df.orderBy("seq").collect()


def test_stream_exactly_once_across_a_crash(spark, recorded, tmp_path):
    """A query dies mid-batch after a partial write; the restart from its checkpoint
    replays that batch, so an idempotent sink ends with each row exactly once."""
    jdir, out, ck = str(recorded[0]), tmp_path / "out", str(tmp_path / "ck")
    crash = {"at": 1}

    def sink(df, batch_id):  # idempotent: a batch's output is replaced, never appended
        df.write.mode("overwrite").parquet(str(out / f"batch={batch_id}"))
        if batch_id == crash["at"]:
            crash["at"] = None
            raise RuntimeError("simulated crash after a partial write")

    def start(**trigger):
        return (spark.readStream.format("sbus").option("path", jdir)
                .option("maxRowsPerTrigger", "1100").load()
                .writeStream.foreachBatch(sink).option("checkpointLocation", ck)
                .trigger(**trigger).start())

    q = start(processingTime="0 seconds")
    with pytest.raises(Exception, match="simulated crash"):
        q.awaitTermination(120)
    assert crash["at"] is None
    q = start(availableNow=True)
    q.awaitTermination(120)
    assert q.exception() is None
    got = spark.read.parquet(str(out))
    sizes = [r["count"] for r in got.groupBy("batch").count().collect()]
    assert max(sizes) <= 1100 and len(sizes) == -(-len(EXPECTED) // 1100)
    seqs = Counter(r.seq for r in got.select("seq").collect())
    assert sorted(seqs) == list(range(1, len(EXPECTED) + 1))
    assert set(seqs.values()) == {1}
    # A restart with nothing new reads nothing.
    q = start(availableNow=True)
    q.awaitTermination(60)
    assert spark.read.parquet(str(out)).count() == len(EXPECTED)


STREAM_DRIVER = """
import json, sys, time
from pyspark.sql import SparkSession
import sbus.spark

spark = (SparkSession.builder.master("local[1]").appName("sbus-killed-driver")
         .config("spark.driver.defaultJavaOptions",
                 f"{sys.argv[2]} -Djava.io.tmpdir={sys.argv[3]}")
         .config("spark.local.dir", sys.argv[3])  # (killed: nothing of it cleans up)
         .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "1")
         .getOrCreate())
sbus.spark.register(spark)

def start(jdir, out, ck, flag, stop_at):
    def sink(df, batch_id):
        df.write.mode("overwrite").parquet(f"{out}/batch={batch_id}")
        if batch_id == stop_at:  # written, not committed: the kill comes now
            open(flag, "w").close()
            time.sleep(600)

    return (spark.readStream.format("sbus").option("path", jdir)
            .option("maxRowsPerTrigger", "1100").load()
            .writeStream.foreachBatch(sink).option("checkpointLocation", ck).start())

for run in json.loads(sys.argv[1]):
    start(**run)
spark.streams.awaitAnyTermination()
"""


class DriverToKill:
    """STREAM_DRIVER in a process of its own (Python and its JVM in one process group), one
    streaming query per entry of *runs* (``name: (journal, batch)``); `kill` SIGKILLs it
    once every query is inside its micro-batch *batch*, after its sink wrote and before
    the batch committed."""

    def __init__(self, tmp: Path, runs: dict[str, tuple[str, int]]) -> None:
        self.dirs = {name: (jdir, tmp / name / "out", str(tmp / name / "ck"))
                     for name, (jdir, _) in runs.items()}
        self.flags = [tmp / f"{name}-in-batch-{batch}" for name, (_, batch) in runs.items()]
        spec = [dict(jdir=jdir, out=str(out), ck=ck, flag=str(flag), stop_at=runs[name][1])
                for (name, (jdir, out, ck)), flag in zip(self.dirs.items(), self.flags,
                                                         strict=True)]
        script = tmp / "driver.py"
        script.write_text(STREAM_DRIVER)
        #: the JVM's scratch directories: removed here, as the killed JVM cannot (in /tmp,
        #: each run left three behind)
        self.scratch = tmp / "spark-scratch"
        self.scratch.mkdir()
        self.log = tmp / "driver.log"  # a file: nobody reads a pipe while other tests run
        self.stopped = False
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), json.dumps(spec), FAST_JVM, str(self.scratch)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)

    def kill(self) -> dict[str, tuple]:
        """``name: (journal, out, checkpoint)`` of each query, once killed inside its batch."""
        try:
            deadline = time.monotonic() + 240
            while (not all(f.exists() for f in self.flags) and self.proc.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            assert all(f.exists() for f in self.flags), \
                self.log.read_text(errors="replace")[-3000:]
        finally:
            self.stop()
        return self.dirs

    def stop(self) -> None:
        if self.stopped:  # once: the group's id may be reused after it was reaped
            return
        self.stopped = True
        try:  # the JVM too, even if the Python driver is gone: nothing gets to clean up
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


@pytest.fixture(scope="module", autouse=True)
def driver_to_kill(request, tmp_path_factory):
    """The driver of the two kill -9 scenarios below, started at the module's first test
    (once the recorded journal is there) when a test that needs it is selected, so that
    its JVM starts and runs beside the tests before them: a query of the recorded journal
    to be killed inside micro-batch 1, and one of a small journal (600 rows in several
    segments, for retention) inside micro-batch 0."""
    if not any("killed" in item.fixturenames for item in request.session.items
               if item.module is request.module):
        yield None
        return
    recorded = request.getfixturevalue("recorded")
    tmp = tmp_path_factory.mktemp("killed")
    small_journal(tmp / "j", 600, segment_bytes=2500)
    driver = DriverToKill(tmp, {"batch1": (str(recorded[0]), 1), "batch0": (str(tmp / "j"), 0)})
    yield driver
    driver.stop()


@pytest.fixture(scope="module")
def killed(driver_to_kill):
    return driver_to_kill.kill()


def test_stream_follows_a_live_recording(spark, bus, tmp_path):
    """Rows appended to the open segment show up in later micro-batches."""
    jdir = tmp_path / "live"
    rec = subprocess.Popen([*SBUS, "record", "live/", "--dir", str(jdir), "--address",
                            bus.address, "--flush", "0.05"], stderr=subprocess.PIPE, text=True)
    assert "recording into" in rec.stderr.readline()
    seen: list[int] = []
    q = (spark.readStream.format("sbus").option("path", str(jdir)).load()
         .writeStream.foreachBatch(lambda df, _: seen.extend(r.seq for r in df.collect()))
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="0.2 seconds")
         .start())
    try:
        pub = raw(bus.address)
        for round_ in range(3):
            for i in range(100):
                pub.send(b"MSG live/%d\0%d" % (round_, i))
            sync(pub)
            deadline = time.monotonic() + 30
            while len(seen) < 100 * (round_ + 1) and time.monotonic() < deadline:
                time.sleep(0.1)
        pub.close()
    finally:
        q.stop()
        rec.send_signal(signal.SIGTERM)
        rec.wait(10)
    assert sorted(seen) == list(range(1, 301))


def drain(sock: socket.socket, sentinel: bytes) -> list[bytes]:
    """Packets until the *sentinel* message (published after the thing under test)."""
    out = []
    while True:
        p = sock.recv(1 << 20)
        if p == sentinel:
            return out
        out.append(p)


def test_sink_publishes_once_even_when_a_batch_is_replayed(spark, recorded, bus, tmp_path):
    from pyspark.sql import functions as F

    jdir, ck = str(recorded[0]), tmp_path / "ck"
    sub = raw(bus.address, timeout=30)
    sub.send(b"SUB out/")
    sync(sub)

    def run_query():
        src = (spark.readStream.format("sbus").option("path", jdir)
               .option("maxRowsPerTrigger", "1000").load())
        q = (src.select(F.concat(F.lit("out/"), "key").alias("key"),
                        F.concat(F.lit(b"out/"), "key_bytes").alias("key_bytes"), "payload")
             .writeStream.format("sbus").option("address", bus.address)
             .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
        q.awaitTermination(120)
        assert q.exception() is None
        with raw(bus.address) as p:
            p.send(b"MSG out/sentinel\0")
        return drain(sub, b"MSG out/sentinel\0")

    got = run_query()
    # Tasks of one micro-batch publish concurrently: every row once, order only per task.
    assert Counter(got) == Counter(b"MSG out/" + k + b"\0" + p for k, p in EXPECTED)
    assert len(got) == len(EXPECTED)
    # The driver died after the sink committed the last batch but before Spark logged it:
    # Spark replays that batch on restart; the sink must not publish it again.
    commits = sorted((p for p in (ck / "commits").iterdir() if p.name.isdigit()),
                     key=lambda p: int(p.name))
    last = commits[-1]
    last.unlink()
    (ck / "commits" / f".{last.name}.crc").unlink(missing_ok=True)
    assert run_query() == []
    assert last.exists()  # the batch was really run again
    assert (ck / "sbus-sink" / "committed" / last.name).exists()
    sub.close()


def test_batch_write_and_bad_sink_input(spark, bus):
    sub = raw(bus.address)
    sub.send(b"SUB df/")
    sync(sub)
    df = spark.createDataFrame([("df/1", b"\0a"), ("df/2", b"b\0")], "key string, payload binary")
    df.coalesce(1).write.format("sbus").option("address", bus.address).mode("append").save()
    with raw(bus.address) as p:
        p.send(b"MSG df/end\0")
    assert drain(sub, b"MSG df/end\0") == [b"MSG df/1\0\0a", b"MSG df/2\0b\0"]
    with pytest.raises(Exception, match="needs a 'payload' column"):
        spark.createDataFrame([("k",)], "key string").write.format("sbus") \
            .option("address", bus.address).mode("append").save()
    sub.close()


def test_analyze_end_to_end(spark, recorded, tmp_path, capsys):
    from pyspark.sql import functions as F

    from sbus.cmd import analyze

    out = tmp_path / "report"
    args = Namespace(journal=str(recorded[0]), out=str(out), pattern=None, window="1 minute",
                     prefix_depth=1, master=None, stream=False, checkpoint=None, address=None,
                     late="10 seconds", trigger="10 seconds", max_rows=None)
    assert analyze.run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["messages"] == len(EXPECTED) and summary["keys"] == len(KEYS)
    keys = {exact_key(r): r for r in spark.read.parquet(str(out / "keys.parquet")).collect()}
    for k in KEYS:
        mine = [p for key, p in EXPECTED if key == k]
        sizes = sorted(map(len, mine))
        r = keys[k]
        assert r.messages == len(mine) and r.bytes == sum(sizes) and r.max_size == sizes[-1]
        assert sizes[0] <= r.p50_size <= r.p90_size <= r.p99_size <= sizes[-1]
    prefixes = {r.prefix: r.messages
                for r in spark.read.parquet(str(out / "prefixes.parquet")).collect()}
    assert prefixes == {"sensors": 3 * ROUNDS, "logs": ROUNDS, "\ufffd\ufffd": ROUNDS}
    exact = {bytes(r.prefix_bytes) for r in spark.read.parquet(str(out / "prefixes.parquet"))
             .where("prefix_bytes IS NOT NULL").collect()}
    assert exact == {b"\xff\xfe"}  # the key's own bytes, not Spark's U+FFFD
    windows = spark.read.parquet(str(out / "windows.parquet"))
    assert windows.agg(F.sum("messages")).first()[0] == len(EXPECTED)
    report = (out / "report.md").read_text()
    assert "`sensors`" in report and "sensors/a/temp" in report and "traffic.png" in report
    assert "`\\xff\\xfe`" in report and "`\\xff\\xfe/bin`" in report and "\ufffd" not in report
    assert f"Messages: {len(EXPECTED):,}," in report  # thousands separators
    assert "## Stale keys" in report and "No sequence gaps" in report
    assert summary["window"] == "1 minute"
    assert (out / "traffic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analyze_reports_and_marks_a_10_s_outage(spark, tmp_path):
    """A journal of 9 prefixes with a real 10 s total outage (written with the receive
    times a recorder would have stamped, not by sleeping): the report gives the longest
    pause, exactly, with its times, though no whole window is silent, and the plot is made."""
    from sbus.spark import analyze

    jdir = tmp_path / "j"
    base = 10**18  # 2001-09-09T01:46:40Z
    with JournalWriter(jdir, fsync=False, segment_bytes=20_000) as w:
        for tick in range(600):  # every 0.1 s for 60 s, nothing from 25.0 s to 35.0 s
            at = tick * 10**8
            if 25 * 10**9 < at < 35 * 10**9:
                continue
            w.append(base + at, [b"p%d/k" % p for p in range(9)], [b"x" * (tick % 40)] * 9)
            if tick % 25 == 0:
                w.flush()
    assert len(list_segments(jdir)) > 2
    summary = analyze.analyze(spark, str(jdir), tmp_path / "out", window="20 seconds")
    assert summary["longest_gap_s"] == 10.0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "Longest pause between two consecutive messages: **10.0 s**, from " \
           "2001-09-09 01:47:05.000000 to 2001-09-09 01:47:15.000000 UTC" in report
    assert "No silent window" not in report
    assert (tmp_path / "out" / "traffic.png").stat().st_size > 10_000


def test_streaming_rollups_published_under_stats(spark, bus, tmp_path):
    """Four minutes of synthetic traffic: each complete minute is published once as
    ``stats/<prefix>``; a restart publishes no window twice."""
    from sbus.spark.analyze import start_stream

    jdir = tmp_path / "j"
    minute = 60 * 10**9
    t0 = (time.time_ns() // minute - 10) * minute
    expect: Counter = Counter()
    with JournalWriter(jdir, fsync=False) as w:
        for m in range(4):
            for i in range(50 + 10 * m):
                key = [b"a/x", b"b/y", b"stats/old"][i % 3]
                w.append(t0 + m * minute + i * 10**8, [key], [b"p" * (i % 7)])
                if not key.startswith(b"stats/"):
                    expect[(key.split(b"/")[0].decode(), m)] += 1
            w.flush()
    sub = raw(bus.address, timeout=30)
    sub.send(b"SUB stats/")
    sync(sub)

    def run_once():
        q = start_stream(spark, str(jdir), str(tmp_path / "ck"), bus.address, late="5 seconds",
                         trigger="available-now", max_rows=130)
        q.awaitTermination(120)
        assert q.exception() is None
        with raw(bus.address) as p:
            p.send(b"MSG stats/end\0")
        return drain(sub, b"MSG stats/end\0")

    got = {}
    for packet in run_once():
        key, body = packet[4:].split(b"\0", 1)
        doc = json.loads(body)
        m = (int(time.mktime(time.strptime(doc["window_start"], "%Y-%m-%dT%H:%M:%SZ")))
             - time.timezone) * 10**9
        slot = (doc["prefix"], (m - t0) // minute)
        assert key == b"stats/" + doc["prefix"].encode()
        assert slot not in got
        got[slot] = doc["messages"]
    # Every window but the last minute's is closed by the watermark, and published once.
    assert got == {k: v for k, v in expect.items() if k[1] < 3}
    assert run_once() == []
    sub.close()


def test_a_damaged_journal_fails_the_query_with_one_clear_error(spark, tmp_path):
    """A flipped bit in a sealed segment: the Python worker neither crashes nor returns a
    wrong row; the query fails naming the file and the block's position.  With
    verify=false (trusted journals) offsets that point outside a block still fail."""
    import struct

    from sbus.journal import format as fmt

    jdir = tmp_path / "damaged"
    with JournalWriter(jdir, fsync=False) as w:
        w.append(1_000_000, [b"a/%d" % i for i in range(50)], [b"x" * i for i in range(50)])
        w.flush()
        w.seal()
    (seg,) = list_segments(jdir)
    data = bytearray(seg.path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside the payloads
    seg.path.write_bytes(data)
    with pytest.raises(Exception, match="damaged journal segment .*block at byte 32"):
        spark.read.format("sbus").load(str(jdir)).collect()
    at = fmt.FILE_HEAD.size + fmt.BLOCK_HEAD.size + 8 * 50 + 4 * 10  # a key offset
    struct.pack_into("<i", data, at, 10**7)
    seg.path.write_bytes(data)
    with pytest.raises(Exception, match="corrupt key offsets"):
        spark.read.format("sbus").option("verify", "false").load(str(jdir)).collect()


def small_journal(directory, rows: int, segment_bytes: int = 1 << 20) -> None:
    """*rows* records one second apart from 2001-09-09T01:46:40Z, keys a/0..a/4, flushed
    every 20 rows (so re-blocked at seal)."""
    with JournalWriter(directory, fsync=False, segment_bytes=segment_bytes) as w:
        for i in range(rows):
            w.append(10**18 + i * 10**9, [b"a/%d" % (i % 5)], [b"p%d" % i])
            if i % 20 == 19:
                w.flush()


def test_pushdown_and_kafka_like_options(spark, tmp_path):
    """With option pushdown, filters on ts, seq and key are taken by the source (no Filter
    left in Spark's plan) and give exactly the rows Spark's own filtering gives.  Without
    it a DataFrame reused for another query stays right (PySpark 4.3 reuses the first
    query's planned read).  The Kafka-style options bound a batch read; an unknown option
    names the nearest valid one."""
    from datetime import UTC, datetime

    from pyspark.sql import functions as F

    small_journal(tmp_path, 3000, segment_bytes=20_000)

    def pushing():
        return spark.read.format("sbus").option("pushdown", "true").load(str(tmp_path))

    at = [datetime.fromtimestamp(10**9 + s, UTC) for s in (100, 150)]
    pushed = pushing().where((F.col("ts") >= at[0]) & (F.col("ts") < at[1]) &
                             (F.col("key") == "a/1"))
    plan = pushed._jdf.queryExecution().executedPlan().toString()
    assert "BatchScan sbus" in plan and not re.search(r"\bFilter [(\[]", plan), plan
    assert [r.seq for r in pushed.collect()] == list(range(102, 151, 5))
    assert [r.seq for r in pushing().where("seq between 10 and 20 and key like 'a/2%' and "
                                           "key in ('a/2', 'a/3')").collect()] == [13, 18]
    # The same rows as Spark filtering them itself (a local copy has no pushdown).
    plain = spark.read.format("sbus").load(str(tmp_path))
    local = spark.createDataFrame(plain.collect(), plain.schema)
    assert local.count() == 3000
    cond = "seq > 2500 and ts <= timestamp'2001-09-09 02:28:00' or key = 'a/4'"
    assert sorted(pushing().where(cond).collect()) == sorted(local.where(cond).collect())
    reused = spark.read.format("sbus").load(str(tmp_path))
    assert reused.where("seq < 10").count() == 9 and reused.count() == 3000

    def read(**opts):
        r = spark.read.format("sbus")
        for k, v in opts.items():
            r = r.option(k, v)
        return [row.seq for row in r.load(str(tmp_path)).select("seq").collect()]

    assert read(startingSeq=2990) == list(range(2990, 3001))
    assert read(startingOffsets='{"seq": 2995}', endingOffsets='{"seq": 2998}') == \
        [2995, 2996, 2997]
    assert read(startingTimestamp=str((10**9 + 10) * 1000), endingSeq=14) == [11, 12, 13]
    assert read(startingTimestamp="2001-09-09T02:36:38Z") == [2999, 3000]
    with pytest.raises(Exception, match=r"'maxrowspertriger' \(did you mean maxRowsPerTrigger"):
        read(maxRowsPerTriger=5)
    with pytest.raises(Exception, match="give one of startingSeq, startingTimestamp"):
        read(startingSeq=1, startingTimestamp=1)
    # Retention removed the first segment: asking for rows before it is a loss.
    first = list_segments(tmp_path)[0]
    first.path.unlink()
    assert read(startingSeq=3000) == [3000]
    with pytest.raises(Exception, match=r"rows lost: seq 1\.\..*failOnDataLoss=false"):
        read(startingSeq=1)
    assert read(startingSeq=1, failOnDataLoss="false")[0] > 1


def test_one_dataframe_is_one_snapshot_and_options_fail_at_load(spark, tmp_path):
    """A DataFrame loaded from a live journal answers every query from the journal as it
    was at load(), also queries that push filters (each of which plans its read again);
    an end past the journal's end is named as rows not recorded, not as a loss; a wrong
    option fails load() itself."""
    small_journal(tmp_path, 1000, segment_bytes=20_000)
    df = spark.read.format("sbus").load(str(tmp_path))
    pushing = spark.read.format("sbus").option("pushdown", "true").load(str(tmp_path))
    with JournalWriter(tmp_path, fsync=False) as w:  # the recorder goes on
        for i in range(500):
            w.append(2 * 10**18, [b"a/%d" % (i % 5)], [b"late"])
        w.flush()
        assert [df.count(), df.where("seq > 990").count()] == [1000, 10]
        assert [pushing.where("seq > 990").count(), pushing.where("key = 'a/1'").count(),
                pushing.where("seq > 0").count()] == [10, 200, 1000]
    fresh = spark.read.format("sbus").load(str(tmp_path))
    assert fresh.count() == 1500
    with pytest.raises(Exception, match=r"seq 1501\.\.1999 have not been recorded") as err:
        spark.read.format("sbus").option("endingSeq", 2000).load(str(tmp_path)).count()
    assert "lost" not in str(err.value)
    for name, value, says in (("maxRowsPerTriger", "5", "did you mean maxRowsPerTrigger"),
                              ("minPartitions", "0", "minPartitions must be positive"),
                              ("startingSeq", "x", "must be a sequence number")):
        with pytest.raises(Exception, match=says):
            spark.read.format("sbus").option(name, value).load(str(tmp_path))  # no action


def test_lag_explain_and_schema_errors_say_what_they_are(spark, tmp_path, capsys):
    """Lag: each progress report gives the rows behind the journal's end (as Kafka's
    offsetsBehindLatest), and ``sbus journal lag`` gives it for a checkpoint; EXPLAIN
    names the filters the source took; a schema with a wrong type names what the source
    offers."""
    jdir = tmp_path / "j"
    small_journal(jdir, 300, segment_bytes=20_000)
    ck = str(tmp_path / "ck")
    q = (spark.readStream.format("sbus").option("maxRowsPerTrigger", "100").load(str(jdir))
         .writeStream.foreachBatch(lambda df, _: None).option("checkpointLocation", ck)
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    latest = [json.loads(p.sources[0].latestOffset) for p in q.recentProgress]
    assert [x["rowsBehindLatest"] for x in latest] == [200, 100, 0]
    assert {x["seq"] for x in latest} == {301}

    def lag(*more):
        done = subprocess.run([*SBUS, "journal", "lag", str(jdir), "--checkpoint", ck, *more],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert json.loads(lag("--json")) == {"journal_end": 301, "committed_batch": 2,
                                         "committed_seq": 301, "lost": 0, "behind": 0}
    with JournalWriter(jdir, fsync=False) as w:
        w.append(2 * 10**18, [b"a/1"] * 250, [b"x"] * 250)
    assert lag().strip().endswith("batch 2 committed up to seq 300; the journal ends at "
                                  "seq 550: 250 rows behind")

    df = (spark.read.format("sbus").option("pushdown", "true").load(str(jdir))
          .where("seq < 10 and key = 'a/1'"))
    df.explain(mode="formatted")
    plan = capsys.readouterr().out
    assert re.search(r"PushedFilters: \[.*seq.*\]", plan), plan
    with pytest.raises(Exception, match="seq is bigint, the schema says string.* it offers "
                                        "key string, payload binary"):
        spark.read.format("sbus").schema("seq string, key string").load(str(jdir)).collect()


def reuse_sequence(df) -> list[int]:
    """Counts of queries on ONE DataFrame that PySpark 4.3 plans with one shared read:
    filtered, unfiltered, filtered differently, a filter Spark cannot push, a union and a
    self-join of two differently filtered views (see docs/spark.md, "Filter pushdown")."""
    return [df.where("seq < 10").count(), df.count(), df.where("key = 'a/1'").count(),
            df.where("payload = X'7031'").count(),
            df.where("seq < 10").union(df.where("seq >= 2990")).count(),
            df.where("seq < 10").alias("a").join(df.where("seq > 2995").alias("b")).count()]


RIGHT = [9, 3000, 600, 1, 20, 45]


def test_one_dataframe_stays_right_for_any_sequence_of_queries(spark, tmp_path):
    """By default (no pushdown) every query on a DataFrame gets its own rows, whatever
    ran on the same DataFrame before or beside it, and so do new DataFrames."""
    small_journal(tmp_path, 3000, segment_bytes=20_000)

    def load():
        return spark.read.format("sbus").load(str(tmp_path))

    df = load()
    assert reuse_sequence(df) == RIGHT
    assert reuse_sequence(df) == RIGHT  # and again, after all of them
    assert [load().where("seq < 10").count(), load().count(),
            load().where("seq between 100 and 199").count()] == [9, 3000, 100]


def test_pyspark_still_shares_a_pushed_read_so_pushdown_stays_opt_in(spark, tmp_path):
    """Why pushdown is not the default: PySpark 4.3 keeps the read planned with pushed
    filters on the DataFrame's data source object (PythonScanBuilder.pushFilters ->
    PythonDataSourceV2.setReadInfo) and every later or sibling scan of that DataFrame that
    pushes nothing reads it (PythonBatch -> getOrCreateReadInfo), filters and all; two
    pushing scans in one query both read the last one planned.  When this test fails, the
    installed Spark scopes pushed reads to their scan: make pushdown the default."""
    small_journal(tmp_path, 3000, segment_bytes=20_000)

    def load():
        return spark.read.format("sbus").option("pushdown", "true").load(str(tmp_path))

    got = reuse_sequence(load())
    assert got[0] == 9 and got[2] == 600  # each pushing query on its own is right
    assert got[1] == 9, "the unfiltered count read the filtered query's planned read"
    assert got[4] == 22 and got[5] == 25, "both scans read the last pushed read"
    assert got != RIGHT
    # A new DataFrame per query (the documented use of the option) is right.
    assert [load().where("seq < 10").count(), load().count(),
            load().where("key = 'a/1'").count()] == RIGHT[:3]


def test_pushdown_prunes_blocks_by_the_index(spark, tmp_path):
    """With pushdown a ts or seq range reads only the blocks that can hold it: a damaged
    block elsewhere is never read (the same query without pushdown reads it and fails)."""
    from datetime import UTC, datetime

    from pyspark.sql import functions as F

    small_journal(tmp_path, 3000, segment_bytes=20_000)
    last = list_segments(tmp_path)[-1]
    assert last.first_seq > 2000
    data = bytearray(last.path.read_bytes())
    data[len(data) // 2] ^= 0x10  # inside its block's payloads
    last.path.write_bytes(data)
    at = [datetime.fromtimestamp(10**9 + s, UTC) for s in (100, 150)]

    def ranges(**opts):
        r = spark.read.format("sbus")
        for k, v in opts.items():
            r = r.option(k, v)
        df = r.load(str(tmp_path))
        return (df.where((F.col("ts") >= at[0]) & (F.col("ts") < at[1])).count(),
                df.where("seq between 500 and 599").count())

    assert ranges(pushdown="true") == (50, 100)
    with pytest.raises(Exception, match="damaged journal segment"):
        ranges()


def test_retention_race_fails_or_skips_as_failOnDataLoss_says(spark, tmp_path):
    """A micro-batch is planned, then retention deletes the segment it reads (inside the
    batch, before its rows are read): the query fails naming the exact rows, and fails
    again when restarted; with failOnDataLoss=false the rows are skipped, and rows deleted
    before a batch is planned are counted in its end offset (shown in progress)."""
    rows = 400  # segments at seq 1, 121, 221, 321; micro-batches of 100
    jdir = tmp_path / "j"
    small_journal(jdir, rows, segment_bytes=2500)
    view = [(s.first_seq, s.path) for s in list_segments(jdir)]
    assert len(view) > 3

    def segment_of(seq):
        return next(p for first, p in reversed(view) if first <= seq)

    def start(ck, seen, doomed, **opts):
        def handle(df, batch_id):
            for path in doomed.pop(batch_id, ()):
                path.unlink()  # retention, between planning this batch and reading it
            seen.extend(r.seq for r in df.select("seq").collect())

        reader = spark.readStream.format("sbus").option("maxOffsetsPerTrigger", 100)
        for k, v in opts.items():
            reader = reader.option(k, v)
        return (reader.load(str(jdir)).writeStream.foreachBatch(handle)
                .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())

    victim = segment_of(150)  # batch 1 reads seq 101..200
    lo = int(victim.name.split(".")[0])
    hi = min(next(first for first, _ in view if first > lo), 201)  # what batch 1 reads of it
    lost = f"{hi - lo} rows lost: seq {lo}..{hi - 1} "
    q = start(tmp_path / "ck", [], {1: [victim]})
    with pytest.raises(Exception, match=lost):
        q.awaitTermination(120)
    q = start(tmp_path / "ck", [], {})  # the restart replays batch 1: still lost
    with pytest.raises(Exception, match=f"planned micro-batch: .*{lost}"):
        q.awaitTermination(120)
    # Restarted with failOnDataLoss=false: the replayed batch 1 finds its rows gone when
    # its partitions are planned, skips them, and the next end offset counts them.
    seen: list[int] = []
    q = start(tmp_path / "ck", seen, {}, failOnDataLoss="false")
    q.awaitTermination(120)
    assert q.exception() is None
    rest = next(first for first, _ in view if first > lo)  # batch 2 finds the rest gone
    assert sorted(seen) == [s for s in range(101, rows + 1) if not lo <= s < rest]
    ends = [{k: v for k, v in json.loads(p.sources[0].endOffset).items() if k != "journal"}
            for p in q.recentProgress]  # (the journal's identity aside)
    assert ends[0] == {"seq": 201, "from": 101}  # the replayed batch: logged before
    assert ends[1:] == [{"seq": s, "from": f, "lost": rest - lo, "lostAfterPlanning": hi - lo}
                        for f, s in zip((201, *range(rest + 100, rows + 1, 100)),
                                        (*range(rest + 100, rows + 1, 100), rows + 1),
                                        strict=True)]

    # failOnDataLoss=false: batch 1 loses what is deleted under it and goes on; batch 2 is
    # planned after a segment it would read was deleted, and its end offset counts those.
    jdir = tmp_path / "j2"
    small_journal(jdir, rows, segment_bytes=2500)
    view = [(s.first_seq, s.path) for s in list_segments(jdir)]
    doomed = [segment_of(150), segment_of(260)]
    assert doomed[0] != doomed[1]
    gone = {s for first, path in view if path in doomed
            for s in range(first, next((f for f, _ in view if f > first), rows + 1))}
    seen: list[int] = []
    q = start(tmp_path / "ck2", seen, {1: doomed}, failOnDataLoss="false")
    q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(seen) == sorted(set(range(1, rows + 1)) - gone)
    offsets = [json.loads(p.sources[0].endOffset) for p in q.recentProgress]
    # Rows that vanish after batch 1's partitions were planned, before its task opened
    # their segment, are reported by the task and counted in the next end offset
    # (lostAfterPlanning); those gone before batches 2 and 3 were planned, in their own.
    during = len([s for s in gone if 101 <= s <= 200])
    assert offsets[-1]["seq"] == rows + 1
    assert offsets[-1]["lost"] == len([s for s in gone if s > 100])
    assert offsets[-1]["lostAfterPlanning"] == during
    batch1 = next(p for p in q.recentProgress if p.batchId == 1)
    assert batch1.numInputRows == 100 - during


def test_a_stream_over_a_journal_recorded_anew_stops_or_reads_it_whole(spark, tmp_path):
    """A query's journal is removed and recorded again from seq 1 under its checkpoint:
    the restarted query stops naming it; with failOnDataLoss=false it reads the new
    journal's rows, all of them once (the audit of 2026-11-28: it skipped those below
    its old offset)."""
    import shutil

    jdir, ck = tmp_path / "j", tmp_path / "ck"
    small_journal(jdir, 300)

    def run(seen: list[int], **opts):
        reader = spark.readStream.format("sbus")
        for k, v in opts.items():
            reader = reader.option(k, v)
        q = (reader.load(str(jdir)).writeStream
             .foreachBatch(lambda df, _: seen.extend(r.seq for r in df.select("seq")
                                                     .collect()))
             .option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
        q.awaitTermination(120)
        return q

    first: list[int] = []
    assert run(first).exception() is None and sorted(first) == list(range(1, 301))
    shutil.rmtree(jdir)
    small_journal(jdir, 120)  # numbered from 1 again, below the query's offset (301)
    with pytest.raises(Exception, match="another one than the one this query's offsets"):
        run([])
    again: list[int] = []
    q = run(again, failOnDataLoss="false")
    assert q.exception() is None and sorted(again) == list(range(1, 121))


def test_stream_exactly_once_after_kill9_of_the_driver(spark, killed):
    """The driver process (Python and its JVM) is killed with SIGKILL in the middle of a
    micro-batch; another driver restarted from the same checkpoint ends with each row
    exactly once in an idempotent sink."""
    jdir, out, ck = killed["batch1"]
    assert sorted(p.name for p in out.iterdir()) == ["batch=0", "batch=1"]
    # Batch 1 was planned (its offsets logged) but never committed: the restart replays it.
    assert os.path.exists(f"{ck}/offsets/1") and not os.path.exists(f"{ck}/commits/1")

    def sink(df, batch_id):
        df.write.mode("overwrite").parquet(str(out / f"batch={batch_id}"))

    q = (spark.readStream.format("sbus").option("path", jdir).option("maxRowsPerTrigger", "1100")
         .load().writeStream.foreachBatch(sink).option("checkpointLocation", ck)
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    assert q.exception() is None
    got = spark.read.parquet(str(out))
    assert got.select("batch").distinct().count() == -(-len(EXPECTED) // 1100)
    seqs = Counter(r.seq for r in got.select("seq").collect())
    assert sorted(seqs) == list(range(1, len(EXPECTED) + 1))
    assert set(seqs.values()) == {1}


def test_batch_0_killed_then_retention_is_an_error_or_the_exact_count(spark, killed):
    """The issue's case, through real processes: a query is killed with SIGKILL inside
    micro-batch 0 (its end offset logged, its start not), retention then removes the
    oldest segment, and the query restarts from its checkpoint.  Spark asks the source's
    initial offset again for the replay; the batch's own end offset says where it began,
    so with failOnDataLoss=true the restart fails naming the rows, and with false it
    skips exactly them, counts them in its progress and delivers every other row once."""
    jdir, out, ck = killed["batch0"]
    segs = list_segments(jdir)
    oldest, second = segs[0], segs[1]
    removed = second.first_seq - oldest.first_seq
    assert sorted(p.name for p in out.iterdir()) == ["batch=0"]
    assert os.path.exists(f"{ck}/offsets/0") and not os.path.exists(f"{ck}/commits/0")
    total = sum(s.path.stat().st_size for s in segs)
    JournalWriter(jdir, fsync=False, keep_bytes=total - oldest.path.stat().st_size).close()
    assert list_segments(jdir)[0].first_seq == second.first_seq  # the recorder's retention

    def start(**opts):
        def sink(df, batch_id):
            df.write.mode("overwrite").parquet(str(out / f"batch={batch_id}"))

        reader = spark.readStream.format("sbus").option("maxRowsPerTrigger", "1100")
        for k, v in opts.items():
            reader = reader.option(k, v)
        return (reader.load(str(jdir)).writeStream.foreachBatch(sink)
                .option("checkpointLocation", ck).trigger(availableNow=True).start())

    q = start()
    with pytest.raises(Exception, match=f"{removed} rows lost: seq 1..{removed} "):
        q.awaitTermination(120)
    q = start(failOnDataLoss="false")
    q.awaitTermination(120)
    assert q.exception() is None
    ends = [json.loads(p.sources[0].endOffset) for p in q.recentProgress]
    assert ends[0]["seq"] == 601 and "lost" not in ends[0]  # the replayed batch 0
    assert ends[-1]["lost"] == removed and ends[-1]["lostAfterPlanning"] == removed
    seqs = Counter(r.seq for r in spark.read.parquet(str(out)).select("seq").collect())
    assert sorted(seqs) == list(range(removed + 1, 601))  # none lost but the counted ones
    assert set(seqs.values()) == {1}  # none twice


def plan(df) -> str:
    return df._jdf.queryExecution().analyzed().toString()


def test_exported_parquet_and_the_open_tail_read_as_one(spark, tmp_path, monkeypatch):
    """The open segment's rows join the exported ones as Parquet pieces written on the
    driver: one Parquet scan, no ``sbus`` source.  What is over the pieces' budget is read
    through the source, which builds only the columns asked for."""
    from sbus.journal import tail
    from sbus.journal.export import export_journal
    from sbus.spark import read_journal

    jdir = tmp_path / "j"
    small_journal(jdir, 500, segment_bytes=3000)
    export_journal(jdir, tmp_path / "pq")
    with JournalWriter(jdir, fsync=False) as w:  # more rows, and an open segment
        w.append(time.time_ns(), [b"late/1", b"late/2"], [b"x", b"y"])
        w.flush()
        df = read_journal(spark, str(jdir), str(tmp_path / "pq"))
        assert df.columns == ["seq", "ts", "key", "key_bytes", "payload"]
        assert "RelationV2" not in plan(df) and plan(df).count("parquet") == 1
        assert [r.seq for r in df.orderBy("seq").select("seq").collect()] == list(range(1, 503))
        assert df.where("key like 'late/%'").count() == 2
        assert len(list((tmp_path / "pq" / ".tail").iterdir())) == 1
        w.append(time.time_ns(), [b"late/3"], [b"z"])
        w.flush()
        assert read_journal(spark, str(jdir), str(tmp_path / "pq")).count() == 503
        monkeypatch.setattr(tail, "TAIL_BYTES", 0)  # no room for new pieces: the source
        w.append(time.time_ns(), [b"late/4", b"late/5"], [b"", b""])
        w.flush()
        narrow = read_journal(spark, str(jdir), str(tmp_path / "pq"), columns=["key", "seq"])
        assert narrow.columns == ["key", "seq"]
        assert sorted(r.seq for r in narrow.collect()) == list(range(1, 506))
        built = re.search(r"RelationV2\[([^]]*)\] sbus",  # what the tail's source builds
                          plan(narrow)).group(1)
        assert re.sub(r"#\d+L?| ", "", built).split(",") == ["key", "seq"]
        with pytest.raises(ValueError, match="no column"):
            read_journal(spark, str(jdir), columns=["nope"])
        alone = read_journal(spark, str(jdir), str(tmp_path / "none"), columns=["seq"])
        assert "parquet" not in plan(alone)  # no export: the source alone
        assert sorted(r.seq for r in alone.collect()) == list(range(1, 506))


def test_read_journal_says_what_a_segment_moved_aside_took(spark, tmp_path):
    """A sealed segment between two exported ones is gone (moved aside as damaged):
    `read_journal` fails as the ``sbus`` source does, naming the rows lost, instead of
    reading the files on both sides (the audit of 2026-11-28: 28,156 of 36,138 rows and
    no word)."""
    from sbus.journal.export import export_journal
    from sbus.journal.store import list_segments
    from sbus.spark import read_journal

    jdir = tmp_path / "j"
    small_journal(jdir, 500, segment_bytes=3000)
    export_journal(jdir, tmp_path / "pq")
    segs = list_segments(jdir)
    gone = segs[2]
    gone.path.rename(gone.path.with_name(gone.path.name + ".corrupt"))
    lost = f"{segs[3].first_seq - gone.first_seq} rows lost: seq {gone.first_seq}.."
    with pytest.raises(Exception, match=re.escape(lost)):
        read_journal(spark, str(jdir), str(tmp_path / "pq")).count()
    # `sbus analyze` says so in one line (it died with two tracebacks), and reads past
    # them when asked, the loss a sequence gap of its report
    from sbus.errors import SbusError
    from sbus.spark.analyze import run

    with pytest.raises(SbusError, match=re.escape(lost)) as failed:
        run(str(jdir), out=str(tmp_path / "report"))
    assert "\n" not in str(failed.value) and "--skip-lost" in str(failed.value)
    assert not (tmp_path / "report").exists()
    assert run(str(jdir), out=str(tmp_path / "report"), skip_lost=True) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"* seq {gone.first_seq}..{segs[3].first_seq - 1}:" in report


def test_read_journal_checks_every_parquet_pages_crc(spark, tmp_path):
    """A bit flipped inside an exported file's pages is an error naming the checksum, not
    other rows (the audit of 2026-11-28: a seq read twice and one missing, or payloads
    changed, and no error)."""
    import pyarrow.parquet as pq

    from sbus.journal.export import export_journal
    from sbus.spark import read_journal

    jdir = tmp_path / "j"
    small_journal(jdir, 500, segment_bytes=3000)
    (first, *_) = export_journal(jdir, tmp_path / "pq")
    path = tmp_path / "pq" / f"{first.segment}.parquet"
    seq = pq.read_metadata(path).row_group(0).column(0)
    start = seq.dictionary_page_offset or seq.data_page_offset  # the seq column's pages
    data = bytearray(path.read_bytes())
    data[start + seq.total_compressed_size - 2] ^= 0x10  # inside its last page's body
    path.write_bytes(bytes(data))
    with pytest.raises(Exception, match="(?i)checksum|crc"):
        read_journal(spark, str(jdir), str(tmp_path / "pq"), columns=["seq"]).collect()


def test_read_journal_on_a_full_disk_reads_the_tail_through_the_source(spark, tmp_path,
                                                                        caplog):
    """A full disk where the pieces go (a real one: a 16 KiB tmpfs mounted there and
    filled) costs speed, not rows: one warning, the tail through the source, each row
    once, no half-written piece left."""
    from sbus.journal.export import export_journal
    from sbus.spark import read_journal

    jdir, pq = tmp_path / "j", tmp_path / "pq"
    small_journal(jdir, 300, segment_bytes=3000)
    export_journal(jdir, pq)
    (pq / ".tail").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(pq / ".tail")],
                   check=True)
    try:
        with contextlib.suppress(OSError), open(pq / ".tail" / "filler", "wb") as f:
            f.write(b"x" * 65536)
        with JournalWriter(jdir, fsync=False) as w:
            w.append(time.time_ns(), [b"late/%d" % i for i in range(200)], [b"p" * 50] * 200)
            w.flush()
            with caplog.at_level(logging.WARNING, logger="sbus.spark"):
                df = read_journal(spark, str(jdir), str(pq))
            assert "RelationV2" in plan(df)  # the tail through the source
            assert sorted(r.seq for r in df.select("seq").collect()) == list(range(1, 501))
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "No space left" in warned[0], warned
        assert sorted(p.name for p in (pq / ".tail").iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(pq / ".tail")], check=True)


def test_read_journal_while_recording_has_each_row_once(spark, bus, tmp_path):
    """``sbus record`` exports each segment it seals into ``DIR/parquet`` by default, and
    `read_journal`, taken again and again while messages are recorded, reads Parquet for
    the sealed segments and Parquet pieces it writes of the rest (`sbus.journal.tail`),
    as one Parquet scan, with each sequence number exactly once (the publisher's own
    counter is the payload, so a row read twice or missed at the seam shows); the reads
    go on while the publisher does; once everything is sealed and exported, no tail is
    scanned."""
    import threading

    from sbus.journal.export import split
    from sbus.spark import read_journal

    jdir = tmp_path / "j"
    rec = subprocess.Popen([*SBUS, "record", "live/", "--dir", str(jdir), "--address",
                            bus.address, "--segment-size", "16k", "--flush", "0.02",
                            "--block"], stderr=subprocess.PIPE, text=True)
    assert "recording into" in rec.stderr.readline()
    total = 6000
    pub = raw(bus.address)

    def publish(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            pub.send(b"MSG live/%d\0%d" % (i % 7, i))
            if i % 100 == 99:
                sync(pub)
                time.sleep(0.01)
        sync(pub)

    publish(0, total // 2)  # several segments sealed: wait for their export
    deadline = time.monotonic() + 30
    while len(split(jdir, jdir / "parquet").files) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop = threading.Event()
    published = [total // 2]

    def keep_publishing() -> None:  # until the reads below met the seam (or 60,000)
        while not stop.is_set() and published[0] < 60_000:
            publish(published[0], published[0] + 300)
            published[0] += 300

    writer = threading.Thread(target=keep_publishing)
    writer.start()
    seams, cuts = [], []
    try:
        while len(seams) < 3 and len(cuts) < 40:
            cut = split(jdir, jdir / "parquet")
            df = read_journal(spark, str(jdir))
            assert "RelationV2" not in plan(df)  # the tail too is read as Parquet pieces
            rows = df.select("seq", "payload").collect()
            seqs = [r.seq for r in rows]
            assert sorted(seqs) == list(range(1, len(seqs) + 1))  # no gap, none twice
            assert all(int(r.payload) == r.seq - 1 for r in rows)
            cuts.append((len(cut.files), cut.seam, cut.tail, len(seqs)))
            if cut.files and cut.tail and cut.seam <= len(seqs):
                seams.append(cut.seam)
    finally:
        stop.set()
        writer.join(60)
        pub.close()
        rec.send_signal(signal.SIGTERM)  # it records what the broker still holds for it
        assert rec.wait(20) == 0
    assert not writer.is_alive()
    total = published[0]
    assert seams, f"no read met both exported segments and a tail: {cuts}"
    cut = split(jdir, jdir / "parquet")
    assert not cut.tail and len(cut.files) == len(list_segments(jdir)) > 2
    df = read_journal(spark, str(jdir))
    assert "RelationV2" not in plan(df)  # no sbus scan
    assert sorted(r.seq for r in df.select("seq").collect()) == list(range(1, total + 1))
