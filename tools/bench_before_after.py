#!/usr/bin/env python3
"""Before/after comparison of the recorder and FUSE benchmarks, alternating in one run.

    git worktree add --detach /tmp/before main
    .venv/bin/python tools/bench_before_after.py --before /tmp/before --rounds 6

Each round runs ``tools/bench_journal.py --part recorder`` and ``tools/bench_fuse.py`` from
the *before* tree and from this tree (the order flips every round), so both see the same
machine state on a shared, noisy machine.  Each benchmark runs its own tree's code (its
own ``ROOT`` comes first on the path).  Printed: the median of every figure on each side
and the ratio after/before (for rates higher is better, for CPU per message lower is),
also as the median of each round's own ratio (the two runs of a round saw the most
similar machine).
The before tree needs ``../shared/bench`` (``lg.c``) beside it, like this one.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: figure name -> (benchmark, regular expression whose group 1 is the number)
FIGURES: dict[str, tuple[str, str]] = {
    "recorder msg/s": ("recorder", r"\| sbus record \| ([\d,]+) \|"),
    "recorder ratio to S1": ("recorder", r"\| sbus record \| [\d,]+ \| [^|]+ \| ([\d.]+) \|"),
    "recorder CPU µs/msg": ("recorder", r"Recorder CPU per message[^:]*: ([\d.]+)"),
    "cat flat out msg/s": ("fuse", r"cat MNT/key\s+flat out(?:\s+\S+){3}\s+\d+\s+([\d,]+)"),
    "mount CPU µs/msg at 20k/s": ("fuse", r"cat MNT/key\s+20,000/s(?:\s+\S+){5}\s+([\d.]+)"),
    "mount CPU µs/msg flat out": ("fuse", r"cat MNT/key\s+flat out(?:\s+\S+){5}\s+([\d.]+)"),
    "echo > MNT/key publishes/s": ("fuse", r"([\d,]+) publishes/s"),
}


def run(tree: Path, bench: str, args: argparse.Namespace) -> str:
    if bench == "recorder":
        cmd = [sys.executable, str(tree / "tools/bench_journal.py"), "--part", "recorder",
               "--count", str(args.count), "--repeat", "1"]
    else:
        cmd = [sys.executable, str(tree / "tools/bench_fuse.py"), "--seconds",
               str(args.seconds), "--writes", str(args.writes)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("SBUS_BENCH_SHARED", str(ROOT.parent / "shared" / "bench"))
    for attempt in (1, 2):  # a shared machine sometimes times a run out: once more
        out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout
        print(f"{bench} from {tree} failed (attempt {attempt}):\n{out.stderr[-2000:]}",
              file=sys.stderr, flush=True)
    raise SystemExit(f"{bench} from {tree} failed twice")


def figures(bench: str, text: str) -> dict[str, float]:
    got = {}
    for name, (which, pattern) in FIGURES.items():
        if which == bench:
            m = re.search(pattern, text)
            if m is None:
                raise SystemExit(f"no {name!r} in the output of {bench}:\n{text}")
            got[name] = float(m.group(1).replace(",", ""))
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="the tree to compare against")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--count", type=int, default=300_000, help="recorder messages per run")
    ap.add_argument("--seconds", type=float, default=2.0, help="FUSE seconds per rate")
    ap.add_argument("--writes", type=int, default=2000)
    ap.add_argument("--only", choices=["recorder", "fuse"], default=None)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": ROOT}
    values: dict[str, dict[str, list[float]]] = {side: {} for side in trees}
    loads = []
    benches = [b for b in ("recorder", "fuse") if args.only in (None, b)]
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for bench in benches:
            for side in order:
                loads.append(os.getloadavg()[0])
                for name, v in figures(bench, run(trees[side], bench, args)).items():
                    values[side].setdefault(name, []).append(v)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{args.rounds} alternating rounds; load average {min(loads):.1f}–{max(loads):.1f} "
          f"on {os.cpu_count()} CPUs")
    print("\n| figure | before: median (range) | after: median (range) | after / before | "
          "median of round ratios |")
    print("|---|---|---|---|---|")
    for name in values["before"]:
        b, a = values["before"][name], values["after"][name]
        paired = statistics.median(y / x for x, y in zip(b, a, strict=True) if x)
        print(f"| {name} | {statistics.median(b):,.2f} ({min(b):,.2f}–{max(b):,.2f}) | "
              f"{statistics.median(a):,.2f} ({min(a):,.2f}–{max(a):,.2f}) | "
              f"{statistics.median(a) / statistics.median(b):.3f} | {paired:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
