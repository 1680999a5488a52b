#!/usr/bin/env python3
"""Broker memory per idle client and per subscription (RSS, measured).

Starts a broker, reads its RSS, connects N clients that do nothing (a whoami round
trip on each proves the broker holds it), reads RSS again, then has one client
subscribe P distinct patterns of each shape in turn, reading RSS after each: exact
(``exact/<i>/x``), with a trailing separator (``tail/<i>/``) and with a wildcard
(``star/<i>*/x``).  Per client = growth / N, per subscription = growth / P.

Usage: tools/bench_memory.py [--clients N] [--patterns P] [--before TREE]
``--before TREE`` measures the broker of another checkout too, in the same run.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


SHAPES = {"exact": b"exact/%d/x", "tail": b"tail/%d/", "wildcard": b"star/%d*/x"}


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def settle(pid: int) -> int:
    """RSS once it stopped moving (the broker finished what it was sent)."""
    last = -1
    for _ in range(50):
        time.sleep(0.2)
        now = rss_kb(pid)
        if now == last:
            return now
        last = now
    return last


def roundtrip(s: socket.socket) -> None:
    s.send(b"CMSG !/cred/whoami")
    while not s.recv(4096).startswith(b"CMSG !/cred/whoami"):
        pass


def measure(tree: Path, n: int, patterns: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="sbus-mem-", dir="/tmp") as tmp:
        path = f"{tmp}/b.sock"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.Popen([sys.executable, "-m", "sbus.cli", "serve", "--address", path],
                                cwd=tree, env=env, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                if os.path.exists(path):
                    break
                time.sleep(0.05)
            first = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            first.connect(path)
            roundtrip(first)
            base = settle(proc.pid)
            clients = []
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.connect(path)
                clients.append(s)
            for s in clients:
                roundtrip(s)
            idle = settle(proc.pid)
            rss = {}
            for shape, form in SHAPES.items():
                for start in range(0, patterns, 1000):
                    for i in range(start, min(patterns, start + 1000)):
                        first.send(b"SUB " + form % i)
                    roundtrip(first)
                rss[shape] = settle(proc.pid)
            for s in clients:
                s.close()
            first.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    result = {"base_kb": base, "idle_kb": idle, "per_client_b": (idle - base) * 1024 / n}
    last = idle
    for shape in SHAPES:
        result[f"{shape}_b"] = (rss[shape] - last) * 1024 / patterns
        last = rss[shape]
    result["subscribed_kb"] = last
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--patterns", type=int, default=100_000)
    ap.add_argument("--before", type=Path, metavar="TREE")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.clients + 100)), hard))
    trees = {"sbus": ROOT}
    if args.before:
        trees["before"] = args.before.resolve()
    print(f"\n{args.clients:,} idle clients, then {args.patterns:,} distinct patterns "
          "of each shape\n")
    print("| broker | base RSS MB | + idle clients MB | + patterns MB | B per idle client "
          "| B per subscription: exact / tail / wildcard |")
    print("|---|---|---|---|---|---|")
    for name, tree in trees.items():
        r = measure(tree, args.clients, args.patterns)
        print(f"| {name} | {r['base_kb'] / 1024:.1f} | {r['idle_kb'] / 1024:.1f} | "
              f"{r['subscribed_kb'] / 1024:.1f} | {r['per_client_b']:,.0f} | "
              + " / ".join(f"{r[f'{shape}_b']:,.0f}" for shape in SHAPES) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
