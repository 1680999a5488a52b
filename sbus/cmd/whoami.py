"""sbus whoami: ask the broker which credentials it sees for us."""

from __future__ import annotations

import argparse
import sys

from ..client import Client


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    with Client(args.address) as bus:
        sys.stdout.buffer.write(bus.whoami() + b"\n")
    return 0
