#!/usr/bin/env python3
"""Python time of the flood-control queue (sbus/flood.py) per packet, against another tree.

The broker's queue is used only for a subscriber whose kernel buffer is full, so the
whole-broker benchmark (tools/bench.py) sees it only where a reader lags, and its noise
(±5 %) hides a change of 0.1 µs there.  This times `OutQueue` itself, in a fresh
interpreter per tree and round (the trees take turns), on three paths:

  queued     a packet queued and sent later (offer + pop), the queue never full
  flooder    a full queue's drop of the packet of the user holding the most of it
  users      a full queue with 6 users, 5 of them taking turns (each holds less than the
             flooder): their packets are dropped, or give way where the share exists

    .venv/bin/python tools/bench_flood.py --before /tmp/before --runs 5

Printed: the median nanoseconds per packet of each tree, and after/before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATHS = ("queued", "flooder", "users")

# Runs in a child interpreter in the tree (first on the path): argv = path, count.
CHILD = r"""
import inspect, json, sys, time
from sbus.flood import OutQueue, Verdict
path, count = sys.argv[1], int(sys.argv[2])
shared = "owner" in inspect.signature(OutQueue.offer).parameters
packet = b"MSG a/b/c\0" + b"x" * 54

def offer(q, uid):
    return q.offer(packet, False, uid) if shared else q.offer(packet, False)

if path == "queued":
    q = OutQueue(limit=1 << 40)
    started = time.thread_time_ns()
    for i in range(count):
        offer(q, 1000)
        if i & 1:
            q.pop()
    while q:
        q.pop()
else:
    q = OutQueue(limit=4 << 20)
    while offer(q, 1000) is Verdict.QUEUED:
        pass
    for n in range(count):  # the users settle to their shares first
        offer(q, 1000 if path == "flooder" else 2000 + n % 5)
    started = time.thread_time_ns()
    for n in range(count):
        offer(q, 1000 if path == "flooder" else 2000 + n % 5)
print(json.dumps((time.thread_time_ns() - started) / count))
"""


def run(tree: Path, path: str, count: int) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(count)], check=True,
                         capture_output=True, text=True, cwd=tree).stdout  # (first on the path)
    return float(json.loads(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the other tree")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--count", type=int, default=200_000, help="packets per run")
    args = ap.parse_args()
    trees = {"this": ROOT, "before": args.before}
    times: dict[str, dict[str, list[float]]] = {t: {p: [] for p in PATHS} for t in trees}
    for _ in range(args.runs):
        for path in PATHS:
            for name, tree in trees.items():
                times[name][path].append(run(tree, path, args.count))
    print(f"ns of Python per packet, median of {args.runs} (thread CPU time)\n")
    print("| path | this | before | this/before |")
    print("|---|---|---|---|")
    for path in PATHS:
        this = statistics.median(times["this"][path])
        before = statistics.median(times["before"][path])
        print(f"| {path} | {this:.0f} | {before:.0f} | {this / before:.2f} |")


if __name__ == "__main__":
    main()
