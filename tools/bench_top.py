#!/usr/bin/env python3
"""Can sbus-top keep up with a saturated broker?  (scenario S1 of tools/bench.py)

One C publisher (`lg pub -n 1 -K 1 -r 0`, 64-byte payloads, as fast as the broker
takes them) → the broker → one subscriber of everything: first the C subscriber
(`lg sub`, the reference: what the broker delivers to a reader that is never slow),
then ``sbus-top --json`` in its own process.  sbus-top passes when it counts at least
95 % of what the publisher sent; ``dropped`` is what the broker reported discarding
for it (``CMSG blocking/dropped``), i.e. how much it was the slow reader.

    .venv/bin/python tools/bench_top.py [--count 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sbus.client import wait_for_broker

ROOT = Path(__file__).resolve().parent.parent
LG_SOURCE = Path("/work/shared/bench/lg.c")
PY = sys.executable


def build_lg(source: Path, out: Path) -> Path:
    if not out.exists() or out.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["gcc", "-O2", "-o", str(out), str(source)], check=True)
    return out


def publish(lg: Path, address: str, count: int) -> dict:
    out = subprocess.run([str(lg), "pub", "-p", "sbus", "-a", f"unix:{address}", "-n", "1",
                          "-K", "1", "-c", str(count), "-r", "0", "-T", "60"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_reference(lg: Path, address: str, count: int) -> dict:
    """lg sub as the reader: the broker's S1 rate when the reader is never the bottleneck."""
    sub = subprocess.Popen([str(lg), "sub", "-p", "sbus", "-a", f"unix:{address}", "-n", "1",
                            "-K", "1", "-e", str(count), "-T", "60", "-I", "1500"],
                           stdout=subprocess.PIPE, text=True)
    assert sub.stdout is not None
    if sub.stdout.readline().strip() != "READY":
        raise SystemExit("lg sub did not get ready")
    pub = publish(lg, address, count)
    res = json.loads(sub.stdout.readline())
    sub.wait(timeout=30)
    return {"reader": "lg sub (C)", "sent": pub["sent"], "pub_s": pub["dur_s"],
            "counted": res["recv"], "dropped": None, "cpu_us": None}


def run_top(lg: Path, address: str, count: int, seconds: float) -> dict:
    top = subprocess.Popen([PY, "-m", "sbus.top", "--address", address, "--json",
                            "--seconds", str(seconds), "--idle", "3", "--limit", "5"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT)
    assert top.stderr is not None
    line = top.stderr.readline()  # "counting …": subscribed, the broker knows us
    if "counting" not in line:
        raise SystemExit(f"sbus-top did not start: {line}{top.stderr.read()}")
    pub = publish(lg, address, count)
    assert top.stdout is not None
    out = top.stdout.read()
    err = top.stderr.read()
    _, status, usage = os.wait4(top.pid, 0)  # its CPU time, which Popen does not give
    top.returncode = os.waitstatus_to_exitcode(status)
    if top.returncode:
        raise SystemExit(f"sbus-top failed: {err}")
    snap = json.loads(out)
    cpu = usage.ru_utime + usage.ru_stime
    return {"reader": "sbus-top --json", "sent": pub["sent"], "pub_s": pub["dur_s"],
            "counted": snap["total"], "dropped": snap["dropped_by_broker"],
            "cpu_us": cpu / max(snap["total"], 1) * 1e6}


def _pane(tmux: list[str], session: str) -> str:
    return subprocess.run([*tmux, "capture-pane", "-t", session, "-p"], check=True,
                          capture_output=True, text=True).stdout


def run_top_live(lg: Path, address: str, count: int, env: dict) -> dict:
    """The interactive screen (redrawing 4×/s in a 100×30 tmux pane) as the reader; the
    count is read off the screen's ``total N msgs`` once it stops moving."""
    session = f"bench-top-{os.getpid()}-{time.monotonic_ns()}"
    tmux = ["tmux", "-L", session]  # a private tmux server per run
    cmd = f"{PY} -m sbus.top --address {address}"
    subprocess.run([*tmux, "-f", "/dev/null", "new-session", "-d", "-s", session,
                    "-x", "100", "-y", "30", cmd], check=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 10
        while "● connected" not in _pane(tmux, session):
            if time.monotonic() > deadline:
                raise SystemExit(f"sbus-top did not connect:\n{_pane(tmux, session)}")
            time.sleep(0.1)
        pub = publish(lg, address, count)
        last, stable_since = -1, time.monotonic()
        while time.monotonic() - stable_since < 1.5:
            time.sleep(0.25)
            m = re.search(r"total\s+([\d,]+) msgs", _pane(tmux, session))
            total = int(m.group(1).replace(",", "")) if m else -1
            if total != last:
                last, stable_since = total, time.monotonic()
        m = re.search(r"dropped by broker ([\d,]+)", _pane(tmux, session))
        dropped = int(m.group(1).replace(",", "")) if m else 0
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    return {"reader": "sbus-top live screen", "sent": pub["sent"], "pub_s": pub["dur_s"],
            "counted": last, "dropped": dropped, "cpu_us": None}


def aggregation_cost(n: int = 1_000_000) -> tuple[float, float]:
    """µs per message of `TrafficModel.feed_packets`, one key and 1000 keys (no I/O)."""
    sys.path.insert(0, str(ROOT))
    from sbus.top.model import TrafficModel

    out = []
    for nkeys in (1, 1000):
        packets = [b"MSG k.%03d\0" % (i % nkeys) + bytes(64) for i in range(4096)]
        model = TrafficModel(0.0)
        start = time.perf_counter()
        for i in range(n // len(packets)):
            model.feed_packets(packets, float(i))
        out.append((time.perf_counter() - start) / model.total * 1e6)
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=1_000_000, help="messages per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lg", type=Path, default=LG_SOURCE, help="path of lg.c")
    ap.add_argument("--no-live", action="store_true",
                    help="skip the live-screen runs (sbus-top drawing in tmux)")
    ap.add_argument("--seconds", type=float, default=0,
                    help="longest sbus-top counts (default 300; it stops once idle 3 s)")
    args = ap.parse_args()

    load0 = f"{os.getloadavg()[0]:.1f}"
    tmp = Path(tempfile.mkdtemp(prefix="sbtop-", dir="/tmp"))
    lg = build_lg(args.lg, tmp / "lg")
    address = str(tmp / "bus.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    broker = subprocess.Popen([PY, "-m", "sbus.cli", "serve", "--address", address],
                              stderr=subprocess.DEVNULL, env=env)
    results = []
    try:
        wait_for_broker(address)
        ref = run_reference(lg, address, args.count)
        results.append(ref)
        seconds = args.seconds or 300.0  # an upper bound: it stops 3 s after the traffic
        for _ in range(args.runs):
            results.append(run_top(lg, address, args.count, seconds))
        if shutil.which("tmux") and not args.no_live:
            for _ in range(args.runs):
                results.append(run_top_live(lg, address, args.count, env))
    finally:
        broker.terminate()
        broker.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"S1: 1 publisher (lg pub, 64-byte payloads, full speed) -> broker -> 1 reader; "
          f"{args.count:,} messages per run")
    print()
    print(f"load average before: {load0}, after: {os.getloadavg()[0]:.1f} (2 CPUs)")
    print()
    print("| reader | sent | publisher msg/s | counted | counted % | dropped by broker "
          "| reader CPU µs/msg |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        pct = 100 * r["counted"] / r["sent"]
        dropped = "n/a" if r["dropped"] is None else f"{r['dropped']:,}"
        cpu = "n/a" if r["cpu_us"] is None else f"{r['cpu_us']:.2f}"
        print(f"| {r['reader']} | {r['sent']:,} | {r['sent'] / r['pub_s']:,.0f} | "
              f"{r['counted']:,} | {pct:.2f} % | {dropped} | {cpu} |")
    one, many = aggregation_cost()
    print()
    print(f"aggregation alone (TrafficModel.feed_packets, 64-byte payloads): "
          f"{one:.2f} µs/message on 1 key, {many:.2f} µs/message over 1000 keys")
    tops = [100 * r["counted"] / r["sent"] for r in results[1:]]
    print()
    print(f"sbus-top counted: median {statistics.median(tops):.2f} %, worst {min(tops):.2f} % "
          f"(target >= 95 %)")
    return 0 if min(tops) >= 95 else 1


if __name__ == "__main__":
    sys.exit(main())
