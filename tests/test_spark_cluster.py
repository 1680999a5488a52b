"""``spark-submit`` of ``sbus analyze`` to a real Spark standalone cluster, the way
docs/spark.md says: one master and one worker on 127.0.0.1 (started from the pyspark
package's own ``spark-class``), the journal and the report on "shared storage" (a directory
both see), sbus shipped with ``--py-files``.  Master and worker are always stopped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import stop_process
from sparkkit import FAST_JVM

from sbus.journal.store import JournalWriter

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent          # the venv's bin: spark-class and spark-submit
KEYS = [b"sensors/a/temp", b"sensors/b/hum", b"logs/app"]
SIZES = [10, 100, 5]                      # payload bytes per key
ROUNDS = 400


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spark_env(tmp: Path) -> dict:
    """The environment docs/spark.md asks for: workers on this interpreter (which also lets
    the pip-installed ``spark-class`` find its SPARK_HOME), everything on 127.0.0.1."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1",
               SPARK_LOG_DIR=str(tmp / "logs"),
               SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",  # no fixed port 6066
               SPARK_DAEMON_JAVA_OPTS=FAST_JVM)  # master and worker
    env.pop("SPARK_HOME", None)
    env.pop("PYTHONPATH", None)  # the driver must get sbus from --py-files or the install
    return env


class Daemon:
    """A master or worker JVM in its own process group, its output in a log file."""

    def __init__(self, name: str, args: list[str], tmp: Path, ready: str) -> None:
        self.log = tmp / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([str(BIN / "spark-class"), *args], env=spark_env(tmp),
                                         stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 90
        while ready not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc, timeout=20)
        try:  # anything it started (a worker's executor) goes with it
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """``(master URL, worker directory)`` of a one-worker standalone cluster; one core and
    512 MiB are plenty for the job below and its executor starts and runs faster beside
    the rest of a 2-core machine (measured 25 s against 31 s with two cores)."""
    tmp = tmp_path_factory.mktemp("cluster")
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    master = Daemon("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", "0"], tmp,
                    "I have been elected leader")
    worker = None
    try:
        worker = Daemon("worker", ["org.apache.spark.deploy.worker.Worker", url,
                                   "--host", "127.0.0.1", "--webui-port", "0", "--cores", "1",
                                   "--memory", "512m", "--work-dir", str(tmp / "work")], tmp,
                        "Successfully registered with master")
        yield url, tmp / "work"
    finally:
        if worker is not None:
            worker.stop()
        master.stop()


def write_journal(directory: Path, start_ns: int) -> None:
    """ROUNDS records per key, one round every 0.5 s of (recorded) time, in small segments
    so the read is split into several partitions."""
    w = JournalWriter(directory, segment_bytes=16 << 10, fsync=False)
    for r in range(ROUNDS):
        w.append(start_ns + r * 500_000_000, KEYS, [bytes([r % 256]) * n for n in SIZES])
        if r % 20 == 19:
            w.flush()  # a block per 20 rounds, as a recorder's flush interval would make
    w.close()


def test_spark_submit_analyze_on_standalone_cluster(cluster, tmp_path):
    import pyarrow.parquet as pq

    url, workdir = cluster
    shared = tmp_path / "shared"
    journal, report = shared / "journal", shared / "report"
    write_journal(journal, 1_700_000_000 * 10**9)
    assert len(list(journal.glob("*.sbj"))) > 2
    # docs/spark.md, "Running on a cluster": ship sbus, submit the module file.
    subprocess.run([sys.executable, "-m", "zipfile", "-c", str(tmp_path / "sbus.zip"), "sbus"],
                   cwd=ROOT, check=True)
    analyze = subprocess.run([sys.executable, "-c",
                              "import sbus.cmd.analyze as m; print(m.__file__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    done = subprocess.run([str(BIN / "spark-submit"), "--master", url,
                           "--py-files", str(tmp_path / "sbus.zip"),
                           "--conf", "spark.ui.enabled=false",
                           # not in the docs' command: JVM tuning for this tiny job
                           "--conf", f"spark.driver.defaultJavaOptions={FAST_JVM}",
                           "--conf", f"spark.executor.defaultJavaOptions={FAST_JVM}",
                           "--conf", "spark.executor.memory=512m",
                           "--conf", "spark.python.unix.domain.socket.enabled=true",
                           analyze, str(journal), "--out", str(report)],
                          env=spark_env(tmp_path), cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["messages"] == ROUNDS * len(KEYS)
    assert summary["bytes"] == ROUNDS * sum(SIZES)
    assert (summary["keys"], summary["prefixes"]) == (3, 2)

    # The work ran on the cluster's executor, not in an embedded local[*] driver.
    logs = list(workdir.glob("app-*/*/stderr"))
    assert len(logs) == 1, logs
    assert "Running task" in logs[0].read_text()

    keys = {r["key"]: r for r in pq.read_table(report / "keys.parquet").to_pylist()}
    assert set(keys) == {k.decode() for k in KEYS}
    for key, size in zip(KEYS, SIZES, strict=True):
        row = keys[key.decode()]
        assert (row["messages"], row["bytes"], row["max_size"]) == (ROUNDS, ROUNDS * size, size)
    prefixes = {r["prefix"]: r["messages"]
                for r in pq.read_table(report / "prefixes.parquet").to_pylist()}
    assert prefixes == {"sensors": 2 * ROUNDS, "logs": ROUNDS}
    windows = pq.read_table(report / "windows.parquet").to_pylist()
    assert sum(w["messages"] for w in windows) == ROUNDS * len(KEYS)
    assert "# sbus traffic report" in (report / "report.md").read_text()
    assert (report / "traffic.png").read_bytes()[:4] == b"\x89PNG"
