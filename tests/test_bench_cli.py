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


def test_bench_progress_is_one_line_rewritten_on_a_terminal(broker):
    """On a terminal the progress line is redrawn in place (\\r, erase to the end of the
    line) while the messages flow, and left standing at 100 %."""
    import os
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([*SBUS, "bench", "--address", broker.address, "--msgs", "40000",
                             "--size", "64"], stdout=subprocess.PIPE, stderr=follower,
                            stdin=subprocess.DEVNULL)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the bench closed its side
            break
        if not chunk:
            break
        seen += chunk
    out = proc.communicate(timeout=120)[0].decode()
    os.close(leader)
    assert proc.returncode == 0
    assert seen.endswith(b"\x1b[K\r\n")  # the last one stays (the terminal adds \r)
    updates = [u for u in seen.split(b"\r")[1:] if u != b"\n"]
    assert len(updates) >= 2 and all(u.startswith(b"published ") for u in updates)
    assert all(u.endswith(b" s\x1b[K") for u in updates)
    assert b"received 40,000/40,000 (100%)" in updates[-1]
    assert "msgs/s" in out and "latency (µs): p50" in out
