#!/usr/bin/env python3
"""A subscriber catching up: the broker's CPU to hand over a queued backlog.

A subscriber that reads nothing while a publisher sends ``--count`` 70-byte messages
has them queued in the broker (``--queue-limit 64m``: none dropped); then it reads
them all, and the broker's CPU time from the first read to the last delivery is what
draining a queue costs.  The broker runs on core 0; ``--before TREE`` runs the broker
of another checkout too (e.g. a ``git worktree`` of the commit before a change), the
two taking turns, so a change is measured before and after in one run.

Usage: tools/bench_drain.py [--count 200000] [--runs 7] [--before TREE]
Prints a table (median and range of the CPU seconds, µs per message).  Results belong
in docs/performance.md with the command.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAYLOAD = b"MSG k\0" + b"x" * 64


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    return s


def _sync(s: socket.socket) -> None:
    s.send(b"CMSG !/cred/whoami")
    while not s.recv(1 << 16).startswith(b"CMSG !/cred/whoami"):
        pass


def drain_once(tree: Path, count: int) -> float:
    """The broker's CPU seconds to deliver *count* queued messages to a late reader."""
    with tempfile.TemporaryDirectory(prefix="sbus-drain-") as tmp:
        path = f"{tmp}/bus.sock"
        broker = subprocess.Popen(
            ["taskset", "-c", "0", sys.executable, "-m", "sbus.cli", "serve", "--address",
             path, "--queue-limit", "64m"], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(path):
                if time.monotonic() > deadline or broker.poll() is not None:
                    raise SystemExit(f"bench_drain: the broker of {tree} did not start")
                time.sleep(0.01)
            sub = _connect(path)
            sub.send(b"SUB k")
            _sync(sub)
            pub = _connect(path)
            for _ in range(count):
                pub.send(PAYLOAD)
            _sync(pub)  # all of them read by the broker: queued for *sub*
            before = _cpu(broker.pid)
            got = 0
            while got < count:
                got += sub.recv(256).startswith(b"MSG ")
            time.sleep(0.05)  # (the last turn's accounting)
            return _cpu(broker.pid) - before
        finally:
            broker.terminate()
            broker.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200_000, help="messages queued per run")
    ap.add_argument("--runs", type=int, default=7, help="runs per broker, taking turns")
    ap.add_argument("--before", type=Path, metavar="TREE",
                    help="also the broker of this checkout, as 'before'")
    args = ap.parse_args()
    trees = {"sbus": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    results: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            results[name].append(drain_once(tree, args.count))
    print(f"\nDraining a backlog of {args.count:,} queued messages to a late reader "
          f"(broker on core 0, {args.runs} runs each, taking turns)\n")
    print("| broker | CPU s, median | range | µs per message |")
    print("|---|---|---|---|")
    for name, cpu in results.items():
        mid = statistics.median(cpu)
        print(f"| {name} | {mid:.3f} | {min(cpu):.3f}–{max(cpu):.3f} | "
              f"{mid / args.count * 1e6:.2f} |")
    if "before" in results:
        ratio = statistics.median(results["sbus"]) / statistics.median(results["before"])
        print(f"\nsbus / before: {ratio:.2f}")


if __name__ == "__main__":
    main()
