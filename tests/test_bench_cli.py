"""`sbus bench` as a user types it, against a real broker."""

from __future__ import annotations

import subprocess

from conftest import SBUS


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SBUS, "bench", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_bench_counts_every_message_and_prints_a_summary(broker):
    out = bench("--address", broker.address, "--pub", "2", "--sub", "3", "--msgs", "5000")
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line.split() for line in out.stdout.splitlines() if line.split()}
    assert lines["published"][1] == "5,000" and lines["received"][1] == "15,000"
    assert "dropped: 0  out of order: 0" in out.stdout and "latency (µs): p50" in out.stdout
    assert "received 15,000/15,000" in out.stderr  # the progress line, at the end


def test_bench_without_a_broker_is_one_clear_line(short_tmp):
    out = bench("--address", str(short_tmp / "none.sock"), "--msgs", "10")
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "sbus bench:" in out.stderr
