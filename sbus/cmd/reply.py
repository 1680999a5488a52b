"""sbus reply PATTERN -- COMMAND...: answer each request (sbus/request.py) with what
COMMAND prints when given the request's body on its standard input."""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import threading
import time

from .. import rlimits
from ..client import Client, Publish, SbusError
from ..defaults import MAX_MESSAGE, count_arg, duration_arg, size_arg
from ..display import brief
from ..request import NotARequest, parse_request


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pattern", metavar="PATTERN", help="routing key pattern to serve")
    p.add_argument("program", nargs="+", metavar="COMMAND",
                   help="program and arguments to run per request (after '--'); it gets "
                        "the body on standard input and $SBUS_KEY, its standard output "
                        "is the reply")
    p.add_argument("--count", "-n", type=count_arg, default=None, metavar="N",
                   help="exit after answering N requests")
    p.add_argument("--command-timeout", type=duration_arg, default=30.0, metavar="SECONDS",
                   help="kill COMMAND after this long and send no reply (default 30)")
    p.add_argument("--max-reply", type=size_arg, default=MAX_MESSAGE - 1024, metavar="BYTES",
                   help="longest reply; a command that prints more is killed and no reply "
                        "sent (default 255k: the broker's message limit)")


def _feed(stdin, body: bytes) -> None:
    try:
        stdin.write(body)
    except BrokenPipeError:
        pass  # the command did not read it all: its business
    finally:
        stdin.close()


def answer(command: list[str], key: bytes, body: bytes, limit: int,
           timeout: float) -> tuple[bytes | None, str | None]:
    """Run *command* on one request: (its output, None), or (None, why there is no reply).
    What it prints is read up to *limit* bytes, never more."""
    env = dict(os.environ, SBUS_KEY=os.fsdecode(key))
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=env)
    except OSError as exc:
        raise SbusError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
    writer = threading.Thread(target=_feed, args=(proc.stdin, body), daemon=True)
    writer.start()
    out, why = bytearray(), None
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            why = f"{command[0]} took longer than {timeout:g} s"
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
        if len(out) > limit:
            why = f"{command[0]} printed more than {limit:,} bytes"
            break
    if why:
        proc.kill()
    proc.stdout.close()
    status = proc.wait()
    writer.join()
    if why:
        return None, why
    if status:
        print(f"sbus reply: {command[0]} exited with status {status} (replied with its "
              "output all the same)", file=sys.stderr, flush=True)
    return bytes(out), None


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    answered = 0
    with Client(args.address) as bus:
        bus.subscribe(os.fsencode(args.pattern))
        bus.whoami()  # the subscription is in force: say so to whoever waits for us
        print(f"sbus reply: answering requests on {args.pattern!r}", file=sys.stderr,
              flush=True)
        while args.count is None or answered < args.count:
            msg = bus.receive()
            if not isinstance(msg, Publish):
                continue
            try:
                reply_key, body = parse_request(msg.payload)
            except NotARequest as exc:
                print(f"sbus reply: ignored a message on {brief(msg.key)}: {exc}",
                      file=sys.stderr, flush=True)
                continue
            out, why = answer(args.program, msg.key, body, args.max_reply,
                              args.command_timeout)
            if out is None:
                print(f"sbus reply: no reply to the request on {brief(msg.key)}: {why}",
                      file=sys.stderr, flush=True)
            else:
                bus.publish(reply_key, out)
            answered += 1
    return 0
