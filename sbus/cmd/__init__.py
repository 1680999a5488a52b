"""The command line of every ``sbus`` subcommand (argparse, environment, output), one
module each; `sbus.cli` imports one when its subcommand is used."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..errors import SbusError, UsageError
from ..extras import missing_extra_message


def read_stdin(command: str, what: str, instead: str) -> bytes:
    """Standard input, all of it; a person at a terminal is first told what is awaited
    and how to give it *instead* (a forgotten payload must not look like a hang:
    mosquitto_pub refuses at once)."""
    if sys.stdin.isatty():
        print(f"{command}: reading {what} from the terminal until Ctrl-D (or give it: "
              f"{instead})", file=sys.stderr, flush=True)
    return sys.stdin.buffer.read()


def run_command(name: str, run: Callable[[argparse.Namespace], int | None],
                args: argparse.Namespace) -> int:
    """Run one command as every sbus command ends: an `SbusError` is one line on stderr
    (exit 1; 2 for a `UsageError`), a missing extra says what to install, Ctrl-C is 130,
    a closed pipe (``| head``) is no error.  *name* starts each line ("sbus sub")."""
    try:
        return run(args) or 0
    except SbusError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    except ImportError as exc:  # a part imported only once needed (e.g. pyfuse3)
        message = missing_extra_message(name, exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
