"""sbus pub KEY [PAYLOAD]: publish one message (stdin when PAYLOAD is absent)."""

from __future__ import annotations

import argparse
import os
import sys

from ..client import Client


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", help="routing key")
    p.add_argument("payload", nargs="?", help="payload (default: standard input)")
    p.add_argument("--lines", action="store_true",
                   help="publish each line of standard input as its own message "
                        "(without the newline)")


def run(args: argparse.Namespace) -> int:
    key = os.fsencode(args.key)
    with Client(args.address) as bus:
        if args.payload is not None:
            bus.publish(key, os.fsencode(args.payload))
        elif args.lines:
            for line in sys.stdin.buffer:
                bus.publish(key, line.rstrip(b"\n"))
        else:
            bus.publish(key, sys.stdin.buffer.read())
    return 0
