"""sbus sub PATTERN...: print messages until interrupted or --count N.

What a user must see, this says on stderr: every drop report (``dropped N messages``),
a refused subscription (then exit 1), a lost broker and the reconnect (by default it
waits for the broker to come back and subscribes again).  ``--ready-fd`` tells a
script when the subscriptions are in force.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

from ..client import Client, Publish
from ..display import printable
from ..session import FLOOD_VALUES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("patterns", nargs="+", metavar="PATTERN",
                   help="routing key pattern ('' for everything not secret)")
    p.add_argument("--count", "-n", type=int, default=None, help="exit after N messages")
    p.add_argument("--format", choices=["lines", "raw", "json"], default="lines",
                   help="lines: 'KEY PAYLOAD' per message, control bytes and invalid UTF-8 "
                        "escaped (\\x1b, \\n) so that a message cannot drive the terminal; "
                        "raw: payload bytes only, as they are; json: one object per line "
                        "(non-UTF-8 as *_base64)")
    for name, values in FLOOD_VALUES.items():
        p.add_argument(f"--{name}", choices=values, default=None,
                       help=f"the broker's {name} flood policy for this subscriber "
                            "(docs/protocol.md)")
    p.add_argument("--block", action="store_true",
                   help="lose nothing: when the broker's queue for us is full, pause the "
                        "publishers (same as --hard block)")
    p.add_argument("--no-reconnect", dest="reconnect", action="store_false",
                   help="exit 1 when the broker goes away (default: wait for it to come "
                        "back and subscribe again, saying so on stderr)")
    p.add_argument("--ready-fd", type=int, default=None, metavar="FD",
                   help="write 'ready' and a newline to file descriptor FD (then close it, "
                        "unless it is 1 or 2) once the subscriptions are in force (for "
                        "scripts: no race with a publisher started after that)")


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


def _say(line: str) -> None:
    print(f"sbus sub: {line}", file=sys.stderr, flush=True)


def _ready(fd: int) -> None:
    try:
        os.write(fd, b"ready\n")
        if fd > 2:  # stdout or stderr stay open for what follows
            os.close(fd)
    except OSError as exc:
        _say(f"--ready-fd {fd}: {exc.strerror}")


def run(args: argparse.Namespace) -> int:
    out = sys.stdout.buffer
    hard = "block" if args.block else args.hard
    with Client(args.address, reconnect=args.reconnect, on_connection=lambda up, line: _say(line),
                on_drop=lambda n: _say(f"dropped {n} messages")) as bus:
        bus.set_flood(soft=args.soft, hard=hard, order=args.order)
        for pattern in args.patterns:
            bus.subscribe(os.fsencode(pattern), wait=False)
        bus.sync()  # every subscription in force, or the broker's refusal raised
        if args.ready_fd is not None:
            _ready(args.ready_fd)
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
