"""sbus pub KEY [PAYLOAD]: publish one message (stdin when PAYLOAD is absent), or --count N
of them from a template.

With --count or --lines it reconnects when the broker goes away (saying so on stderr)
and goes on with the message it was sending; what was sent into the lost connection and
not yet taken by the broker is lost, as on any pubsub bus.

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


def _say(line: str) -> None:
    print(f"sbus pub: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    key = os.fsencode(args.key)
    if args.count is not None and args.lines:
        raise SbusError("--count and --lines do not go together")
    if args.interval and args.count is None:
        raise SbusError("--interval goes with --count")
    # a stream of messages (--count, --lines) is a long-running command: it waits for a
    # lost broker and goes on (saying so); one message is one-shot: a lost broker fails it
    stream = args.count is not None or args.lines
    with Client(args.address, max_message=args.max_message, reconnect=stream,
                on_connection=lambda up, line: _say(line)) as bus:
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
