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
import socket
import statistics
import tempfile
import time
from pathlib import Path

from bench import Broker  # the broker started, pinned to core 0 and timed as there

PAYLOAD = b"MSG k\0" + b"x" * 64


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    return s


def _sync(s: socket.socket) -> None:
    s.send(b"CMSG !/cred/whoami")
    while not s.recv(1 << 16).startswith(b"CMSG !/cred/whoami"):
        pass


def drain_once(kind: str, count: int) -> float:
    """The CPU seconds broker *kind* ("sbus" or "before") takes to deliver *count*
    queued messages to a late reader."""
    with tempfile.TemporaryDirectory(prefix="sbus-drain-") as tmp:
        broker = Broker(kind, Path(tmp), Path("/nonexistent"), ["--queue-limit", "64m"])
        try:
            sub = _connect(broker.path)
            sub.send(b"SUB k")
            _sync(sub)
            pub = _connect(broker.path)
            for _ in range(count):
                pub.send(PAYLOAD)
            _sync(pub)  # all of them read by the broker: queued for *sub*
            before = broker.cpu_seconds()
            got = 0
            while got < count:
                got += sub.recv(256).startswith(b"MSG ")
            time.sleep(0.05)  # (the last turn's accounting)
            return broker.cpu_seconds() - before
        finally:
            broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=200_000, help="messages queued per run")
    ap.add_argument("--runs", type=int, default=7, help="runs per broker, taking turns")
    ap.add_argument("--before", type=Path, metavar="TREE",
                    help="also the broker of this checkout, as 'before'")
    args = ap.parse_args()
    kinds = ["sbus"]
    if args.before:
        Broker.before_tree = args.before.resolve()
        kinds.append("before")
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.runs):
        for kind in kinds:
            results[kind].append(drain_once(kind, args.count))
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
