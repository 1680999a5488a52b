"""sbus pub KEY [PAYLOAD]: publish one message (stdin when PAYLOAD is absent), or --count N
of them from a template.

The key and size are checked before sending, and a round trip at the end makes the
broker's refusal, if any, an error (exit 1) rather than a line in its log."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..client import Client, SbusError
from ..defaults import MAX_MESSAGE, count_arg, duration_arg, size_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", help="routing key")
    p.add_argument("payload", nargs="?", help="payload (default: standard input)")
    p.add_argument("--lines", action="store_true",
                   help="publish each line of standard input as its own message "
                        "(without the newline)")
    p.add_argument("--max-message", type=size_arg, default=MAX_MESSAGE, metavar="SIZE",
                   help="the broker's packet limit, checked before sending (default "
                        "256k, as 'sbus serve --max-message')")
    p.add_argument("-c", "--count", type=count_arg, default=None, metavar="N",
                   help="publish N messages; '{n}' in the payload becomes 1, 2, ... N and "
                        "'{time}' the time of sending (seconds since 1970)")
    p.add_argument("-i", "--interval", type=duration_arg, default=0.0, metavar="SECONDS",
                   help="with --count: pause between messages (e.g. 1, 100ms; default 0); "
                        "the pace is kept, not the pause")


def expand(template: bytes, n: int, now: float) -> bytes:
    """The payload of message *n* of ``--count``: ``{n}`` and ``{time}`` replaced (only
    those: other braces, as in JSON, stay as they are)."""
    return template.replace(b"{n}", b"%d" % n).replace(b"{time}", b"%.6f" % now)


def run(args: argparse.Namespace) -> int:
    key = os.fsencode(args.key)
    if args.count is not None and args.lines:
        raise SbusError("--count and --lines do not go together")
    if args.interval and args.count is None:
        raise SbusError("--interval goes with --count")
    with Client(args.address, max_message=args.max_message) as bus:
        if args.lines:
            for line in sys.stdin.buffer:
                bus.publish(key, line.rstrip(b"\n"))
        else:
            payload = (sys.stdin.buffer.read() if args.payload is None
                       else os.fsencode(args.payload))
            start = time.monotonic()
            for n in range(1, (1 if args.count is None else args.count) + 1):
                if n > 1 and args.interval:
                    time.sleep(max(0.0, start + (n - 1) * args.interval - time.monotonic()))
                bus.publish(key, payload if args.count is None
                            else expand(payload, n, time.time()))
        bus.sync(None)  # the broker took every message (or raised its refusal); a
        # publisher it paused for a slow subscriber waits here as in its sends
    return 0
