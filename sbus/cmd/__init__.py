"""The command line of every ``sbus`` subcommand (argparse, environment, output), one
module each; `sbus.cli` imports one when its subcommand is used."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from ..display import one_line, printable
from ..errors import SbusError, UsageError
from ..extras import missing_extra_message


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a wrong command line is one line (the usage it would print first
    is what ``--help`` is for); exit status 2 as before."""

    def error(self, message: str):  # type: ignore[override]
        if not message.isprintable():  # (argparse quotes most values with repr already)
            message = printable(message)
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def print_help(self, file=None) -> None:
        # argparse's own drops a failed write (its help then exits 0, having said nothing)
        (file or sys.stdout).write(self.format_help())


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None,
                       name: str) -> argparse.Namespace:
    """``parser.parse_args``; ``--help`` or ``--version`` that standard output did not
    take ends with one line and status 1, not 0."""
    try:
        return parser.parse_args(argv)
    except SystemExit as done:  # the text printed (0), or a wrong command line said (2)
        if done.code not in (0, None):
            raise
        try:
            sys.stdout.flush()
        except OSError as exc:
            raise SystemExit(_output_failed(name, exc)) from None
        raise
    except OSError as exc:
        raise SystemExit(_output_failed(name, exc)) from None


def _output_failed(name: str, exc: OSError) -> int:
    settle_stdout()
    if isinstance(exc, BrokenPipeError):  # ``| head``: no error, as in `run_command`
        return 0
    print(f"{name}: cannot write standard output: {exc.strerror or exc}", file=sys.stderr)
    return 1


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
    (exit 1; 2 for a `UsageError`), and so are a broker that does not answer in time
    and a failed system call (standard output on a full disk; ``-vv`` shows its
    traceback); a missing extra says what to install, Ctrl-C is 130, a closed pipe
    (``| head``) is no error.  *name* starts each line ("sbus sub")."""
    try:
        code = run(args) or 0
        sys.stdout.flush()  # a failing output is this command's failure, said here
        return code
    except SbusError as exc:
        print(f"{name}: {one_line(str(exc))}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1
    except TimeoutError as exc:  # the client's word for a broker that does not answer
        print(f"{name}: {one_line(str(exc.strerror or exc))}", file=sys.stderr)
        return 1
    except ImportError as exc:  # a part imported only once needed (e.g. pyfuse3)
        message = missing_extra_message(name, exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        settle_stdout()
        return 0
    except OSError as exc:  # e.g. standard output on a full disk
        if getattr(args, "verbose", 0) >= 2:
            raise  # -vv: the whole story, for a bug report
        settle_stdout()
        where = f": {exc.filename}" if exc.filename is not None else ""
        print(f"{name}: {one_line(f'{exc.strerror or exc}{where}')}", file=sys.stderr)
        return 1


def settle_stdout() -> None:
    """Write what is buffered for standard output; if that fails, what is left goes
    nowhere, or Python's exit would flush it into the same failure and print a
    traceback after the command's one line."""
    try:
        sys.stdout.flush()
        return
    except OSError:
        pass
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no standard output at all
        pass
