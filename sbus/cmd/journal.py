"""``sbus journal cat|tail|gaps|export|lag DIR``: a recorded journal without Spark
(`sbus.journal.read`)."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import SbusError
from ..journal.read import cat, export, lag, show_gaps, since_ns, tail
from ..journal.store import JournalError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True,
                           help="cat, tail, gaps, export or lag")
    for name, helptext in (("cat", "print recorded messages"),
                           ("tail", "print the last messages, and with -f new ones"),
                           ("gaps", "where the journal misses messages, and why"),
                           ("export", "write sealed segments as zstd Parquet"),
                           ("lag", "how far a Spark streaming query is behind the journal")):
        a = sub.add_parser(name, help=helptext, description=helptext)
        a.add_argument("dir", metavar="DIR", help="journal directory (from sbus record)")
        if name == "export":
            a.add_argument("--out", "-o", required=True, metavar="DIR",
                           help="directory for <first_seq>.parquet, one per sealed segment")
            a.add_argument("--force", action="store_true",
                           help="export segments again even if their file exists")
            continue
        if name == "lag":
            a.add_argument("--checkpoint", "-c", required=True, metavar="DIR",
                           help="the query's checkpointLocation")
            a.add_argument("--json", action="store_true", help="one JSON object")
            continue
        if name == "gaps":
            a.add_argument("--since", default=None, metavar="TIME",
                           help="only gaps noted since TIME (as for cat)")
            a.add_argument("--json", action="store_true",
                           help="one object per line, as noted in DIR/gaps.jsonl")
            continue
        a.add_argument("--pattern", default=None,
                       help="only keys matching this routing pattern")
        a.add_argument("--since", default=None, metavar="TIME",
                       help="only messages received since TIME: a duration ago (10m, 2h) "
                            "or an ISO 8601 time (UTC unless it says otherwise)")
        a.add_argument("--format", choices=["lines", "raw", "json"], default="lines",
                       help="lines: 'TIME SEQ KEY PAYLOAD', escaped; raw: payload bytes; "
                            "json: one object per line (non-UTF-8 as *_base64)")
        if name == "tail":
            a.add_argument("-n", "--lines", type=int, default=10, metavar="N",
                           help="how many of the last messages (default 10)")
            a.add_argument("-f", "--follow", action="store_true",
                           help="keep printing messages as they are recorded")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "export":
            export(args.dir, args.out, args.force)
        elif args.action == "lag":
            lag(args.dir, args.checkpoint, args.json)
        elif args.action == "gaps":
            show_gaps(args.dir, since_ns(args.since), args.json, sys.stdout.buffer)
        else:
            pattern = None if args.pattern is None else os.fsencode(args.pattern)
            since = since_ns(args.since)
            if args.action == "cat":
                cat(args.dir, pattern, since, args.format, sys.stdout.buffer)
            else:
                tail(args.dir, args.lines, args.follow, pattern, since, args.format,
                     sys.stdout.buffer)
        return 0
    except JournalError as exc:
        raise SbusError(str(exc)) from None
