#!/usr/bin/env python3
"""User-space instructions the broker spends per message, counted by callgrind.

Wall-clock rates on a shared 2-core machine drift by 2x; instruction counts do
not, so this is how optimisations of the broker's hot path are compared before
and after.  The broker runs under ``valgrind --tool=callgrind``; a raw publisher
sends N messages to S subscribers of one key, in bursts of 64 that are received
in full before the next (so the broker drains a burst per wake-up in every run);
the run is repeated with two values of N and the difference divided by the extra
messages, which removes start-up and shutdown.  Kernel work (the syscalls
themselves) is not counted.

Usage: tools/bench_instructions.py [--tree DIR ...] [--subscribers 1,10]
  --tree: a checkout to measure (default: this one); give several to compare,
          e.g. a `git worktree add /tmp/before REV`.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BURST = 64


def count(tree: Path, subscribers: int, messages: int) -> int:
    with tempfile.TemporaryDirectory(prefix="sbus-instr-", dir="/tmp") as tmp:
        path = f"{tmp}/b.sock"
        env = dict(os.environ, PYTHONPATH=str(tree))
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             "-m", "sbus.cli", "serve", "--address", path, "--hard", "block"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp)
        deadline = time.monotonic() + 120
        subs: list[socket.socket] = []
        while len(subs) < subscribers:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.connect(path)
            except OSError:
                s.close()
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("broker under valgrind did not start") from None
                time.sleep(0.1)
                continue
            s.send(b"SUB k.000")
            s.send(b"CMSG !/cred/whoami")  # the reply means the SUB is in place
            s.recv(4096)
            subs.append(s)

        pub = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pub.connect(path)
        packet = b"MSG k.000\0" + b"x" * 64
        # bursts, each delivered in full before the next: the broker then wakes the same
        # number of times in every run, so the count does not depend on timing
        for _ in range(messages // BURST):
            for _ in range(BURST):
                pub.send(packet)
            for s in subs:
                for _ in range(BURST):
                    s.recv(4096)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        m = re.search(r"Collected : (\d+)", err)
        if not m:
            raise RuntimeError(f"no callgrind total in: {err[-500:]}")
        return int(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", type=Path, help="checkout(s) to measure")
    ap.add_argument("--subscribers", default="1,10")
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--large", type=int, default=12000)
    args = ap.parse_args()
    trees = args.tree or [ROOT]
    fans = [int(x) for x in args.subscribers.split(",")]
    print("| tree | subscribers | instructions per published message | per delivery |")
    print("|---|---|---|---|")
    for tree in trees:
        for fan in fans:
            small = count(tree, fan, args.small)
            large = count(tree, fan, args.large)
            per = (large - small) / (args.large - args.small)
            print(f"| {tree} | {fan} | {per:,.0f} | {per / fan:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
