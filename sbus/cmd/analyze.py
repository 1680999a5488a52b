"""``sbus analyze DIR --out OUT`` / ``--stream``: options to typed arguments for
`sbus.spark.analyze.run` (imported only when run: it needs the spark extra).

This file is also what ``spark-submit`` runs on a cluster (docs/spark.md), as a script:
hence absolute imports only."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("journal", metavar="DIR", help="journal directory (from sbus record)")
    p.add_argument("--out", "-o", metavar="DIR", help="output directory (batch mode)")
    p.add_argument("--pattern", default=None, help="only keys matching this routing pattern")
    p.add_argument("--window", default=None,
                   help="time window for traffic over time (default: sized to the journal's "
                        "span, about 60 windows) and for streaming rollups (default "
                        "'1 minute'); e.g. 10s, 5min, '1 hour'")
    p.add_argument("--prefix-depth", type=int, default=1, metavar="N",
                   help="a key's prefix is its first N '/'-separated segments (default 1)")
    p.add_argument("--master", default=None,
                   help="Spark master (default: local[*], or what spark-submit set)")
    p.add_argument("--stream", action="store_true",
                   help="streaming: publish rollups onto the bus under stats/ (needs "
                        "--checkpoint)")
    p.add_argument("--checkpoint", metavar="DIR", help="streaming checkpoint directory")
    p.add_argument("--late", default="10 seconds",
                   help="streaming: how long to wait for late records before a window is "
                        "published (default '10 seconds')")
    p.add_argument("--trigger", default="10 seconds",
                   help="streaming: micro-batch interval, or 'available-now' to process what "
                        "is recorded and stop")
    p.add_argument("--max-rows", type=int, default=None, metavar="N",
                   help="streaming: at most N journal rows per micro-batch")
    p.add_argument("--skip-lost", action="store_true",
                   help="read past rows the journal no longer has (a segment moved aside "
                        "as damaged, or removed by retention while read) instead of "
                        "failing; they show as sequence gaps in the report")


def run(args: argparse.Namespace) -> int:
    return analyze_args(args)


def analyze_args(args: argparse.Namespace) -> int:
    """`run`, also for spark-submit (`main`)."""
    from sbus.spark.analyze import run as analyze

    return analyze(args.journal, out=args.out, pattern=args.pattern, window=args.window,
                   depth=args.prefix_depth, master=args.master, stream=args.stream,
                   checkpoint=args.checkpoint, address=args.address, late=args.late,
                   trigger=args.trigger, max_rows=args.max_rows,
                   verbose=getattr(args, "verbose", 0),
                   skip_lost=getattr(args, "skip_lost", False))


def main() -> int:
    """Entry point for ``spark-submit .../sbus/cmd/analyze.py DIR --out OUT``."""
    from sbus.errors import SbusError

    parser = argparse.ArgumentParser(prog="analyze.py")
    parser.add_argument("--address", default=None)
    add_arguments(parser)
    try:
        return analyze_args(parser.parse_args())
    except SbusError as exc:
        print(f"sbus analyze: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
