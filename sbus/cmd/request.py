"""sbus request KEY [PAYLOAD]: publish a request, print the reply (sbus/request.py)."""

from __future__ import annotations

import argparse
import os
import sys

from ..client import Client, SbusError
from ..defaults import ANSWER_TIMEOUT, duration_arg
from ..display import printable
from . import read_stdin


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", help="routing key the replier listens on")
    p.add_argument("payload", nargs="?", help="request body (default: standard input)")
    p.add_argument("--timeout", type=duration_arg, default=ANSWER_TIMEOUT, metavar="SECONDS",
                   help=f"how long to wait for the reply (default {ANSWER_TIMEOUT:g}), a "
                        "lost broker included; none: exit status 1 (at once when nobody "
                        "serves KEY)")
    p.add_argument("--raw", action="store_true",
                   help="print the reply's bytes as they are also on a terminal (elsewhere "
                        "they always are; a terminal gets a newline after them if they end "
                        "without one); by default a terminal gets control bytes and "
                        "invalid UTF-8 escaped, so a reply cannot drive it")


def run(args: argparse.Namespace) -> int:
    body = (read_stdin("sbus request", "the request body", "sbus request KEY PAYLOAD")
            if args.payload is None else os.fsencode(args.payload))
    # within its timeout a lost broker is waited for and the request sent again
    with Client(args.address, reconnect=True,
                on_connection=lambda up, line: print(f"sbus request: {line}",
                                                     file=sys.stderr, flush=True)) as bus:
        try:
            reply = bus.request(os.fsencode(args.key), body, args.timeout)
        except TimeoutError as exc:
            raise SbusError(str(exc)) from None
    if sys.stdout.isatty() and not args.raw:
        # line by line: a multi-line answer reads as lines, each escaped
        print("\n".join(printable(line) for line in reply.rstrip(b"\n").split(b"\n")))
    else:
        sys.stdout.buffer.write(reply)
        if sys.stdout.isatty() and not reply.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")  # the shell's prompt starts on a line of its own
        sys.stdout.flush()
    return 0
