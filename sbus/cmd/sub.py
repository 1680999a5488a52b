"""sbus sub PATTERN...: print messages until interrupted or --count N."""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

from ..client import Client, Publish
from ..display import printable


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("patterns", nargs="+", metavar="PATTERN",
                   help="routing key pattern ('' for everything not secret)")
    p.add_argument("--count", "-n", type=int, default=None, help="exit after N messages")
    p.add_argument("--format", choices=["lines", "raw", "json"], default="lines",
                   help="lines: 'KEY PAYLOAD' per message, control bytes and invalid UTF-8 "
                        "escaped (\\x1b, \\n) so that a message cannot drive the terminal; "
                        "raw: payload bytes only, as they are; json: one object per line "
                        "(non-UTF-8 as *_base64)")


def format_message(msg: Publish, fmt: str) -> bytes:
    if fmt == "raw":
        return msg.payload
    if fmt == "lines":
        line = printable(msg.key) + " " + printable(msg.payload.rstrip(b"\n"))
        return line.encode() + b"\n"
    obj: dict[str, str] = {}
    for name, value in (("key", msg.key), ("payload", msg.payload)):
        try:
            obj[name] = value.decode()
        except UnicodeDecodeError:
            obj[name + "_base64"] = base64.b64encode(value).decode()
    return json.dumps(obj).encode() + b"\n"


def run(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    with Client(args.address) as bus:
        for pattern in args.patterns:
            bus.subscribe(os.fsencode(pattern))
        seen = 0
        if args.count == 0:
            return 0
        for msg in bus:
            out.write(format_message(msg, args.format))
            out.flush()
            seen += 1
            if args.count is not None and seen >= args.count:
                break
    return 0
