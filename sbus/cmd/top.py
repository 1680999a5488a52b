"""``sbus top`` and ``sbus-top``: the command line of the live traffic monitor (sbus/top/).

The monitor itself receives a typed `sbus.top.app.Settings`; this module holds its
argparse, for both spellings of the command (and the man page and completion)."""

from __future__ import annotations

import argparse
import sys

from .. import rlimits
from ..defaults import default_address, size_arg
from ..errors import UsageError
from ..top.model import SortBy, ViewOptions

SORTS = {s.name.lower().replace("_", "-"): s for s in SortBy}


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("patterns", nargs="*", metavar="PATTERN",
                        help="routing key patterns to watch (default: '' = everything "
                             "that is not secret)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true",
                      help="count for --seconds, print the screen once as text, exit "
                           "(no terminal needed)")
    mode.add_argument("--json", action="store_true",
                      help="count for --seconds, print one JSON snapshot, exit")
    parser.add_argument("--seconds", type=_positive(float), default=3.0, metavar="N",
                        help="how long --once/--json count before printing (default 3)")
    parser.add_argument("--svg", metavar="FILE",
                        help="with --once: also save the screen as an SVG picture")
    parser.add_argument("--idle", type=_positive(float), default=None, metavar="S",
                        help="with --once/--json: stop early, S seconds after the last "
                             "message (once one arrived); --seconds stays the limit")
    parser.add_argument("--sort", choices=sorted(SORTS), default="rate",
                        help="initial sort column (default rate)")
    parser.add_argument("--filter", default="", metavar="TEXT",
                        help="show only keys containing TEXT (a pattern if it has * "
                             "or ends in /)")
    parser.add_argument("--group", type=int, default=0, metavar="DEPTH",
                        help="group keys by their first DEPTH segments (default 0: off)")
    parser.add_argument("--max-keys", type=_positive(int), default=10_000, metavar="N",
                        help="keys tracked at most; the least recently seen are "
                             "forgotten (default 10000)")
    parser.add_argument("--max-bytes", type=size_arg, default=32 << 20, metavar="BYTES",
                        help="memory for tracked keys and their last payloads at most; the "
                             "least recently seen are forgotten (default 32m)")
    parser.add_argument("--limit", type=_positive(int), default=None, metavar="N",
                        help="rows in a --json snapshot (default: all)")
    parser.add_argument("--interval", type=_positive(float), default=0.25, metavar="S",
                        help="seconds between redraws (default 0.25)")


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    from ..top.app import Settings, run_live, run_snapshot

    if args.group < 0:
        raise UsageError(f"--group must be 0 or more, not {args.group}")
    if args.svg and not args.once:
        raise UsageError("--svg goes with --once")
    settings = Settings(
        address=args.address, patterns=[p.encode() for p in args.patterns] or [b""],
        options=ViewOptions(sort=SORTS[args.sort], filter=args.filter, depth=args.group),
        max_keys=args.max_keys, max_bytes=args.max_bytes, interval=args.interval,
        seconds=args.seconds, idle=args.idle, limit=args.limit,
    )
    if args.once or args.json:
        return run_snapshot(settings, as_json=args.json, svg=args.svg)
    return run_live(settings)


def build_parser() -> argparse.ArgumentParser:
    """The ``sbus-top`` command's parser (also read by the man page and completion)."""
    from ..version import version
    from . import OneLineParser

    parser = OneLineParser(prog="sbus-top", description="live traffic monitor")
    parser.add_argument("-V", "--version", action="version", version=f"sbus-top {version()}",
                        help="print the version and exit")
    parser.add_argument("--address", default=None, metavar="PATH",
                        help=f"broker socket (default $SBUS_ADDRESS, else {default_address()})")
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``sbus-top`` console script: the same as ``sbus top``."""
    from . import parse_command_line, run_command

    return run_command("sbus-top", run, parse_command_line(build_parser(), argv, "sbus-top"))


if __name__ == "__main__":
    sys.exit(main())
