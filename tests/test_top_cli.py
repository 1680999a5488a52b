"""``sbus top`` / ``sbus-top`` as a command: snapshots for scripts, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from conftest import SBUS

from sbus.client import Client

TOP = [sys.executable, "-m", "sbus.top"]


def publish_for(address: str, seconds: float, stop: threading.Event) -> threading.Thread:
    """Publish two keys (100/s and 10/s) in a thread until *stop* or *seconds*."""
    def run():
        with Client(address) as bus:
            start = time.monotonic()
            i = 0
            while not stop.is_set() and time.monotonic() - start < seconds:
                bus.publish(b"cli/fast", b"tick %d" % i)
                if i % 10 == 0:
                    bus.publish(b"cli/slow", bytes([0, 1, 2, 255]))
                i += 1
                time.sleep(max(0.0, start + i / 100 - time.monotonic()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def json_snapshot(address: str, seconds: str) -> dict:
    """``sbus-top --json --seconds SECONDS`` over `publish_for`'s traffic."""
    stop = threading.Event()
    top = subprocess.Popen([*TOP, "--address", address, "--json", "--seconds", seconds],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert f"counting {seconds} s" in top.stderr.readline()  # subscribed from here on
    pub = publish_for(address, 10, stop)
    out, err = top.communicate(timeout=30)
    stop.set()
    pub.join()
    assert top.returncode == 0, err
    return json.loads(out)


def test_json_snapshot_counts_real_traffic(broker):
    snap = json_snapshot(broker.address, "2.5")
    assert snap["state"] == "connected" and snap["address"] == broker.address
    rows = {r["key"]: r for r in snap["rows"]}
    assert set(rows) == {"cli/fast", "cli/slow"}
    assert 70 <= rows["cli/fast"]["rate"] <= 130
    assert 150 <= rows["cli/fast"]["total"] <= 260
    assert rows["cli/slow"]["preview"] == "00 01 02 ff"
    assert rows["cli/fast"]["preview"].startswith("tick ")
    assert snap["total"] == sum(r["total"] for r in rows.values())
    assert snap["keys"] == 2 and snap["dropped_by_broker"] == 0
    assert snap["history"] and len(snap["recent"]) == 10


def test_a_window_shorter_than_a_tick_still_has_rates(broker):
    """``--seconds 0.6`` ends before the first once-a-second tick: the rates are the
    window's own, not 0 (the tutorial's ``--seconds 1`` met this half the time)."""
    snap = json_snapshot(broker.address, "0.6")
    fast = {r["key"]: r for r in snap["rows"]}["cli/fast"]
    assert fast["total"] > 0 and 30 <= fast["rate"] <= 200, fast
    assert len(snap["history"]) == 1


def test_once_prints_the_screen_as_text(broker, short_tmp):
    stop = threading.Event()
    pub = publish_for(broker.address, 10, stop)
    svg = short_tmp / "top.svg"
    out = subprocess.run([*SBUS, "top", "--address", broker.address, "--once",
                          "--seconds", "1.5", "--sort", "key", "--svg", str(svg), "cli/"],
                         capture_output=True, text=True, timeout=30,
                         env={"COLUMNS": "90", "LINES": "24", "PATH": "/usr/bin:/bin"})
    stop.set()
    pub.join()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 24 and max(map(len, lines)) <= 90
    assert lines[0].startswith("sbus-top") and "connected" in lines[0]
    assert lines[4].startswith("cli/fast") and lines[5].startswith("cli/slow")
    assert "\x1b[" not in out.stdout  # not a terminal: no colour codes
    picture = svg.read_text()
    assert picture.startswith("<svg") and "cli/fast" in picture and "sbus-top" in picture


def test_live_screen_needs_a_terminal(broker):
    out = subprocess.run([*TOP, "--address", broker.address], capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 1
    assert out.stderr.strip() == ("sbus-top: the live screen needs a terminal on stdin and "
                                  "stdout; use --once (a text snapshot) or --json for scripts")


def test_missing_broker_is_a_clear_error(short_tmp):
    out = subprocess.run([*SBUS, "top", "--address", str(short_tmp / "none.sock"), "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert out.stderr.startswith("sbus top: cannot connect to the sbus broker at ")
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_bad_arguments_are_refused(broker):
    for args in (["--seconds", "0"], ["--seconds", "x"], ["--max-keys", "-1"],
                 ["--sort", "colour"]):
        out = subprocess.run([*TOP, "--address", broker.address, "--json", *args],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and "sbus-top: error:" in out.stderr, args
    out = subprocess.run([*TOP, "--address", broker.address, "--json", "--group", "-1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--group must be 0 or more" in out.stderr


def test_idle_ends_a_snapshot_after_a_burst_with_an_exact_count(broker):
    top = subprocess.Popen([*TOP, "--address", broker.address, "--json", "--seconds", "60",
                            "--idle", "0.5", "--limit", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "counting" in top.stderr.readline()
    start = time.monotonic()
    with Client(broker.address) as bus:
        for i in range(5000):
            bus.publish(b"burst/%d" % (i % 7), b"x" * 10)
    out, err = top.communicate(timeout=30)
    assert top.returncode == 0, err
    assert time.monotonic() - start < 15  # ended by --idle, not by --seconds
    snap = json.loads(out)
    assert snap["total"] == 5000 and snap["total_bytes"] == 50_000 and snap["keys"] == 7
    assert len(snap["rows"]) == 1
