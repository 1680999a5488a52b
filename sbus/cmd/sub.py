"""sbus sub PATTERN...: print messages until interrupted, --count N or --timeout.

What a user must see, this says on stderr: every drop report (``dropped N messages``),
a refused subscription (then exit 1), a lost broker and the reconnect (by default it
waits for the broker to come back and subscribes again).  ``--ready-fd`` tells a
script when the subscriptions are in force.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import rlimits
from ..client import Client, Publish, SbusError
from ..defaults import ANSWER_TIMEOUT, duration_arg
from ..errors import UsageError
from ..msgformat import DIRECTIVES, FORMATS, compile_format, format_message, wildcard_hint
from ..routing import matches
from ..session import FLOOD_VALUES


def _format_string(text: str) -> str:
    """``-F``, checked at parsing; compiled in `run` (``--local-time`` changes ``%t``)."""
    try:
        compile_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("patterns", nargs="*", metavar="PATTERN",
                   help="routing key pattern ('' for everything not secret)")
    p.add_argument("-t", "--topic", dest="topics", action="append", default=[],
                   metavar="PATTERN", help="a PATTERN given as mosquitto_sub -t takes it "
                                           "(repeatable)")
    p.add_argument("--count", "-n", "-C", type=int, default=None, metavar="N",
                   help="exit after N messages")
    p.add_argument("--timeout", type=duration_arg, default=None, metavar="SECONDS",
                   help="exit once nothing arrived for this long (e.g. 5, 500ms); with --count, "
                        "exit status 1 if fewer than N arrived; a broker gone that long "
                        "is exit status 1")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--format", choices=FORMATS, default="lines",
                     help="lines: 'KEY PAYLOAD' per message, control bytes and invalid UTF-8 "
                          "escaped (\\x1b, \\n) so that a message cannot drive the terminal; "
                          "raw: payload bytes only, as they are; json: one object per line "
                          "(non-UTF-8 as *_base64)")
    directives = "; ".join(f"%{k} {what}" for k, (what, _) in DIRECTIVES.items())
    how.add_argument("-F", "--format-string", type=_format_string, metavar="FORMAT",
                     help=f"print each message as FORMAT, e.g. '%t %k %p' (\\n, \\t "
                          f"allowed): {directives}".replace("%", "%%"))
    p.add_argument("--timestamps", action="store_true",
                   help="lines: start each line with the time it arrived; json: add 'time' "
                        "(RFC 3339 with microseconds, UTC)")
    p.add_argument("--local-time", action="store_true",
                   help="times (--timestamps, %%t) in the local time zone instead of UTC")
    p.add_argument("--exclude", "-T", action="append", default=[], metavar="PATTERN",
                   help="skip messages whose key matches PATTERN (repeatable)")
    p.add_argument("--pretty", action="store_true",
                   help="lines: payloads that are JSON objects or arrays indented over "
                        "several lines; json: each object indented")
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
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    if (args.timestamps or args.pretty) and args.format_string is not None:
        raise SbusError("--timestamps and --pretty do not go with -F (%t is the time)")
    if (args.timestamps or args.pretty) and args.format == "raw":
        raise SbusError("--timestamps and --pretty do not go with --format raw")
    if args.ready_fd is not None:  # checked first: a waiter on a wrong one waits forever
        try:
            os.fstat(args.ready_fd)
        except OSError as exc:
            raise UsageError(f"--ready-fd {args.ready_fd}: {exc.strerror}") from None
    patterns = [*args.patterns, *args.topics]
    if not patterns:
        raise UsageError("which keys? e.g. sbus sub 'greetings/*' ('' for everything "
                         "that is not secret)")
    fmt = (args.format if args.format_string is None
           else compile_format(args.format_string, local=args.local_time))
    for pattern in patterns:
        hint = wildcard_hint(os.fsencode(pattern))
        if hint:
            print(f"sbus sub: note: {hint}", file=sys.stderr)
    excluded = [os.fsencode(x) for x in args.exclude]
    out = sys.stdout.buffer
    seen = 0
    hard = "block" if args.block else args.hard
    with Client(args.address, reconnect=args.reconnect, timeout=args.timeout,
                on_connection=lambda up, line: _say(line),
                on_drop=lambda n: _say(f"dropped {n} messages")) as bus:
        bus.set_flood(soft=args.soft, hard=hard, order=args.order)
        for pattern in patterns:
            bus.subscribe(os.fsencode(pattern), wait=False)
        # every subscription in force, or the broker's refusal raised (--timeout bounds
        # this wait too: a broker that does not answer is not waited for longer)
        bus.sync(ANSWER_TIMEOUT if args.timeout is None else args.timeout)
        if args.ready_fd is not None:
            _ready(args.ready_fd)
        while args.count is None or seen < args.count:
            try:
                msg = bus.receive(timeout=args.timeout)
            except TimeoutError:
                if args.count is None:
                    return 0
                raise SbusError(f"{seen} of {args.count} messages, then none for "
                                f"{args.timeout:g} s") from None
            if not isinstance(msg, Publish):
                continue
            if any(matches(x, msg.key) for x in excluded):
                continue
            out.write(format_message(msg, fmt, time.time(), timestamps=args.timestamps,
                                     pretty=args.pretty, local=args.local_time))
            out.flush()
            seen += 1
    return 0
