"""sbus sub PATTERN...: print messages until interrupted, --count N or --timeout."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..client import Client, Publish, SbusError
from ..defaults import duration_arg
from ..msgformat import DIRECTIVES, FORMATS, compile_format, format_message, wildcard_hint
from ..routing import matches


def _format_string(text: str) -> list:
    try:
        return compile_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("patterns", nargs="+", metavar="PATTERN",
                   help="routing key pattern ('' for everything not secret)")
    p.add_argument("--count", "-n", type=int, default=None, metavar="N",
                   help="exit after N messages")
    p.add_argument("--timeout", type=duration_arg, default=None, metavar="SECONDS",
                   help="exit once nothing arrived for this long (e.g. 5, 500ms); with --count, "
                        "exit status 1 if fewer than N arrived")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--format", choices=FORMATS, default="lines",
                     help="lines: 'KEY PAYLOAD' per message, control bytes and invalid UTF-8 "
                          "escaped (\\x1b, \\n) so that a message cannot drive the terminal; "
                          "raw: payload bytes only, as they are; json: one object per line "
                          "(non-UTF-8 as *_base64)")
    directives = "; ".join(f"%{k} {what}" for k, (what, _) in DIRECTIVES.items())
    how.add_argument("-F", "--format-string", type=_format_string, metavar="FORMAT",
                     help=f"print each message as FORMAT, e.g. '%t %k %p' (\\n, \\t "
                          f"allowed): {directives}".replace("%", "%%"))
    p.add_argument("-t", "--timestamps", action="store_true",
                   help="lines: start each line with the time it arrived; json: add 'time'")
    p.add_argument("--exclude", "-T", action="append", default=[], metavar="PATTERN",
                   help="skip messages whose key matches PATTERN (repeatable)")
    p.add_argument("--pretty", action="store_true",
                   help="lines: payloads that are JSON objects or arrays indented over "
                        "several lines; json: each object indented")


def run(args: argparse.Namespace) -> int:
    if (args.timestamps or args.pretty) and args.format_string is not None:
        raise SbusError("--timestamps and --pretty do not go with -F (%t is the time)")
    if (args.timestamps or args.pretty) and args.format == "raw":
        raise SbusError("--timestamps and --pretty do not go with --format raw")
    fmt = args.format_string if args.format_string is not None else args.format
    for pattern in args.patterns:
        hint = wildcard_hint(os.fsencode(pattern))
        if hint:
            print(f"sbus sub: note: {hint}", file=sys.stderr)
    excluded = [os.fsencode(x) for x in args.exclude]
    out = sys.stdout.buffer
    seen = 0
    with Client(args.address) as bus:
        for pattern in args.patterns:
            bus.subscribe(os.fsencode(pattern))
        while args.count is None or seen < args.count:
            try:
                msg = bus.receive(timeout=args.timeout)
            except TimeoutError:
                if args.count is None:
                    return 0
                raise SbusError(f"{seen} of {args.count} messages, then none for "
                                f"{args.timeout:g} s") from None
            if not isinstance(msg, Publish):
                continue
            if any(matches(x, msg.key) for x in excluded):
                continue
            out.write(format_message(msg, fmt, time.time(), timestamps=args.timestamps,
                                     pretty=args.pretty))
            out.flush()
            seen += 1
    return 0
