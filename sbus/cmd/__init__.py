"""The command line of every ``sbus`` subcommand (argparse, environment, output), one
module each; `sbus.cli` imports one when its subcommand is used."""

from __future__ import annotations

import sys


def read_stdin(command: str, what: str, instead: str) -> bytes:
    """Standard input, all of it; a person at a terminal is first told what is awaited
    and how to give it *instead* (a forgotten payload must not look like a hang:
    mosquitto_pub refuses at once)."""
    if sys.stdin.isatty():
        print(f"{command}: reading {what} from the terminal until Ctrl-D (or give it: "
              f"{instead})", file=sys.stderr, flush=True)
    return sys.stdin.buffer.read()
