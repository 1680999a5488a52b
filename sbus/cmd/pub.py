"""sbus pub KEY [PAYLOAD]: publish one message (stdin when PAYLOAD is absent).

The key and size are checked before sending, and a round trip at the end makes the
broker's refusal, if any, an error (exit 1) rather than a line in its log."""

from __future__ import annotations

import argparse
import os
import sys

from ..client import Client
from ..defaults import MAX_MESSAGE, size_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", help="routing key")
    p.add_argument("payload", nargs="?", help="payload (default: standard input)")
    p.add_argument("--lines", action="store_true",
                   help="publish each line of standard input as its own message "
                        "(without the newline)")
    p.add_argument("--max-message", type=size_arg, default=MAX_MESSAGE, metavar="SIZE",
                   help="the broker's packet limit, checked before sending (default "
                        "256k, as 'sbus serve --max-message')")


def run(args: argparse.Namespace) -> int:
    key = os.fsencode(args.key)
    with Client(args.address, max_message=args.max_message) as bus:
        if args.payload is not None:
            bus.publish(key, os.fsencode(args.payload))
        elif args.lines:
            for line in sys.stdin.buffer:
                bus.publish(key, line.rstrip(b"\n"))
        else:
            bus.publish(key, sys.stdin.buffer.read())
        bus.sync(None)  # the broker took every message (or raised its refusal); a
        # publisher it paused for a slow subscriber waits here as in its sends
    return 0
