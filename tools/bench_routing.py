#!/usr/bin/env python3
"""Routing lookup CPU, uncached: µs per `RoutingIndex.lookup` (no route cache).

Builds an index of P patterns of each shape that tools/bench_memory.py measures
(exact ``exact/<i>/x``, tail ``tail/<i>/``, wildcard ``star/<i>*/x``) plus a few shared
ones (``sensors/``, ``sensors/*/temp``, ``sensors/room*/``), then looks up keys that hit
each shape and keys that miss.  ``--before TREE`` runs the same in another checkout,
the two taking turns for ``--runs`` rounds; the best round of each counts.

Usage: tools/bench_routing.py [--patterns P] [--keys K] [--runs R] [--before TREE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KINDS = {
    "exact hit": b"exact/%d/x",
    "tail hit": b"tail/%d/y/z",
    "wildcard hit": b"star/%dq/x",
    "wildcard miss": b"star/%dq/y",
    "shared hit": b"sensors/room%d/temp",
    "no pattern": b"other/%d/x",
}

CHILD = r"""
import json, sys, time
from sbus.routing import RoutingIndex
patterns, nkeys, kinds = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
index = RoutingIndex()
for form in (b"exact/%d/x", b"tail/%d/", b"star/%d*/x"):
    for i in range(patterns):
        index.subscribe(i % 97, form % i)
for p in (b"sensors/", b"sensors/*/temp", b"sensors/room*/"):
    index.subscribe("shared", p)
out = {}
for name, form in kinds.items():
    keys = [form.encode() % (i * 7919 % patterns) for i in range(nkeys)]
    lookup = index.lookup
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for k in keys:
            lookup(k)
        best = min(best, time.perf_counter() - t)
    out[name] = best / nkeys * 1e6
print(json.dumps(out))
"""


def run(tree: Path, args) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    kinds = json.dumps({k: v.decode() for k, v in KINDS.items()})
    done = subprocess.run([sys.executable, "-c", CHILD, str(args.patterns), str(args.keys),
                           kinds], cwd=tree, env=env, check=True, capture_output=True)
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--patterns", type=int, default=100_000)
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--before", type=Path, metavar="TREE")
    args = ap.parse_args()
    trees = {"sbus": ROOT}
    if args.before:
        trees["before"] = args.before.resolve()
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            for kind, us in run(tree, args).items():
                best[name][kind] = min(us, best[name].get(kind, us))
    print(f"\nµs per uncached lookup, {args.patterns:,} patterns of each shape, "
          f"best of {args.runs} alternating rounds\n")
    print("| keys | " + " | ".join(trees) + (" | sbus/before |" if args.before else " |"))
    print("|---|" + "---|" * (len(trees) + bool(args.before)))
    for kind in KINDS:
        cells = [f"{best[name][kind]:.2f}" for name in trees]
        if args.before:
            cells.append(f"{best['sbus'][kind] / best['before'][kind]:.2f}")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
