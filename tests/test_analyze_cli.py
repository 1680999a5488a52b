"""``sbus analyze`` as a user runs it: interrupted with Ctrl-C, and without the spark
extra; the pure parts of the report (window sizing, partial windows)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import matplotlib.dates as mdates
from conftest import SBUS
from sparkkit import FAST_JVM

from sbus.extras import install_command
from sbus.journal.store import JournalWriter
from sbus.spark.analyze import (
    pick_window,
    silent_periods,
    traffic_figure,
    window_series,
    window_text,
)


def test_windows_sized_to_the_span_and_partial_edges_rated_over_what_was_recorded():
    assert [window_text(pick_window(s)) for s in (30, 600, 3 * 3600, 7 * 86400)] == \
        ["1 second", "10 seconds", "5 minutes", "3 hours"]
    base = datetime(2026, 1, 1, 0, 0, 0)
    traffic = [dict(window_start=base.replace(second=s), prefix=p, messages=m)
               for s, p, m in ((0, "a", 5), (10, "a", 100), (10, "b", 100), (40, "a", 10))]
    first = int(datetime(2026, 1, 1, 0, 0, 5).timestamp() * 1e9)
    last = int(datetime(2026, 1, 1, 0, 0, 45).timestamp() * 1e9)
    s = window_series(traffic, 10, (first, last))
    assert s["partial"] == [True, False, False, False, True]
    assert s["total"] == [1.0, 20.0, 0.0, 0.0, 2.0]  # 5 in 5 s, 200 in 10 s, 10 in 5 s
    assert s["prefixes"]["b"] == [0.0, 10.0, 0.0, 0.0, 0.0]
    assert silent_periods(s["total"], s["starts"], 10) == \
        [(base.replace(second=20), base.replace(second=40), 2)]


def test_the_plot_draws_every_prefix_bytes_and_the_pause_and_covers_no_peak():
    """Nine prefixes give nine panels (the ninth was not drawn), there is a bytes/s panel,
    the longest pause is shaded on the top panel, and the top legend sits above the
    panel, so it cannot cover the peak (it sat in the upper right corner, over the data)."""
    base = datetime(2026, 1, 1, 0, 0, 0)
    traffic = [dict(window_start=base.replace(second=10 * w), prefix=f"p{p}",
                    messages=(100 if w == 5 else 10) * (p + 1), bytes=7 * (p + 1))
               for w in range(6) for p in range(9)]
    first = int(base.timestamp() * 1e9)
    s = window_series(traffic, 10, (first, first + 60 * 10**9 - 1))
    assert s["bytes"][0] == sum(7 * (p + 1) for p in range(9)) / 10
    gap = (10.0, int(base.timestamp() * 1e6) + 12 * 10**6, int(base.timestamp() * 1e6) + 22 * 10**6)
    fig = traffic_figure(s, "10 seconds", gap)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert all(any(f"prefix p{p}:" in t for t in titles) for p in range(9)), titles
    assert any("bytes per second" in t for t in titles)
    top = fig.axes[0]
    fig.canvas.draw()
    legend = top.get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert any("longest pause: 10.0 s" in t for t in texts), texts
    box = legend.get_window_extent()
    area = top.get_window_extent()
    assert box.y0 >= area.y1 - 1, (box, area)  # above the data area, not over it
    peak = top.transData.transform((mdates.date2num(s["starts"][5]), max(s["total"])))
    assert not box.contains(*peak)
    import matplotlib.pyplot as plt

    plt.close(fig)


def journal(directory, rows: int = 400_000) -> None:
    with JournalWriter(directory, fsync=False) as w:
        for i in range(0, rows, 2000):
            w.append(10**18 + i * 10**6, [b"k/%d" % (i % 7)] * 2000, [b"x" * 50] * 2000)


def test_ctrl_c_is_one_line_and_leaves_no_half_report(tmp_path):
    jdir, out = tmp_path / "j", tmp_path / "report"
    journal(jdir)
    env = dict(os.environ,  # the embedded JVM starts faster; the command is unchanged
               PYSPARK_SUBMIT_ARGS=f"--conf spark.driver.defaultJavaOptions={FAST_JVM} "
                                   "pyspark-shell")
    proc = subprocess.Popen([*SBUS, "analyze", str(jdir), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    lines = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if "per-key statistics" in line or not line:
            break
    assert "per-key statistics" in lines[-1], "".join(lines)
    # Inside the Spark job: it has set up the first output (in the run's temporary
    # directory), and reading 400,000 rows takes it far longer than this wait's step.
    deadline = time.monotonic() + 60
    while not any(tmp_path.glob(".report.*/keys.parquet")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the first Spark job did not start"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    rest = proc.stderr.read()
    assert proc.wait(60) == 130, rest
    assert rest.strip().splitlines() == ["sbus analyze: interrupted; no report written"], rest
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["j"]  # no temporary report left


def test_a_damaged_block_is_one_line_naming_the_segment(tmp_path):
    """A flipped payload byte fails the block's checksum inside a Spark worker: one line
    saying so (it was the worker's 50-line traceback), status 1, no report."""
    jdir, out = tmp_path / "j", tmp_path / "report"
    journal(jdir, 20_000)
    seg = next(jdir.glob("*.sbj"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(data)
    env = dict(os.environ,
               PYSPARK_SUBMIT_ARGS=f"--conf spark.driver.defaultJavaOptions={FAST_JVM} "
                                   "pyspark-shell")
    done = subprocess.run([*SBUS, "analyze", str(jdir), "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"sbus analyze: reading {jdir} failed: ") and seg.name in last, last
    assert "checksum" in last and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not out.exists()


def test_without_the_spark_extra_one_friendly_line(tmp_path):
    journal(tmp_path / "j", 10)
    code = ("import sys; sys.modules['pyspark'] = None; from sbus.cli import main; "
            f"sys.exit(main(['analyze', {str(tmp_path / 'j')!r}, '--out', "
            f"{str(tmp_path / 'out')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "sbus analyze: needs the spark extra (pyspark is not installed): "
        f"{install_command('spark')}, and a Java 17 runtime"]
