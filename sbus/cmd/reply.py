"""sbus reply PATTERN -- COMMAND...: answer each request (sbus/request.py) with what
COMMAND prints when given the request's body on its standard input.

A service: it reconnects when the broker goes away (saying so on stderr) and survives
every request, however malformed; what goes wrong with one request is one line on stderr,
counted, and the next is served."""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from .. import rlimits
from ..client import Client, Publish, SbusError
from ..defaults import MAX_MESSAGE, count_arg, duration_arg, size_arg
from ..display import brief, printable
from ..errors import InvalidRequest
from ..limits import LogAllowance
from ..request import NotARequest, parse_request
from ..session import Refusal

#: Seconds a stopped replier waits for the broker to take its last reply.
STOP_WAIT = 5.0
#: Lines about single requests written at once, then one per `LINES_EVERY` seconds.
LINES_BURST = 20
LINES_EVERY = 1.0


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


def _feed(fd: int, body: bytes) -> None:
    """Write *body* to the command's standard input and close it; a command that exits
    (or closes its input) before reading it all is its own business, not an error."""
    view = memoryview(body)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:  # EPIPE: it stopped reading
        pass
    finally:
        os.close(fd)


def answer(command: list[str], key: bytes, body: bytes, limit: int,
           timeout: float, say: Callable[[str], None] | None = None
           ) -> tuple[bytes | None, str | None]:
    """Run *command* on one request: (its output, None), or (None, why there is no reply).
    What it prints is read up to *limit* bytes, never more; it has *timeout* seconds to
    print and exit."""
    env = dict(os.environ, SBUS_KEY=os.fsdecode(key))
    try:
        # its own process group: what it started dies with it when it is killed
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=env, bufsize=0, process_group=0)
    except OSError as exc:
        return None, f"cannot run {command[0]}: {exc.strerror or exc}"
    stdin = os.dup(proc.stdin.fileno())  # written raw by the feeder, closed by it alone
    proc.stdin.close()
    writer = threading.Thread(target=_feed, args=(stdin, body), daemon=True)
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
    if why is None:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its output, went on running
            why = f"{command[0]} took longer than {timeout:g} s"
    if why:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # gone already, with all it started
            pass
    proc.stdout.close()
    status = proc.wait()
    writer.join()
    if why:
        return None, why
    if status:
        (say or _say)(f"{command[0]} exited with status {status} (replied with its output "
                      "all the same)")
    return bytes(out), None


def _say(line: str) -> None:
    print(f"sbus reply: {line}", file=sys.stderr, flush=True)


class _Server:
    """Serves requests one at a time; whatever one request does wrong (no reply key, a
    reply key the broker refuses, a command that fails) is counted and said in one line,
    and the next request is served."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.answered = self.failed = self.ignored = 0
        #: lines about single requests: anyone may send them by the thousand (7,084
        #: lines in 15 s in the audit); what is held back is counted in the next one
        self._lines = LogAllowance(burst=LINES_BURST, interval=LINES_EVERY)

    def say(self, line: str) -> None:
        """A line about one request, rationed (`LINES_BURST`, then one a second)."""
        held = self._lines.take(0)
        if held is not None:
            _say(line + (f" ({held} such lines not written)" if held else ""))

    def refused(self, refusal: Refusal) -> None:
        """The broker refused one of our replies (checked by the broker, not by us)."""
        self.failed += 1
        self.say(f"the broker refused a reply: {printable(refusal.reason, 200)} "
                 f"({self.failed} failed so far)")

    def serve(self, bus: Client, msg: Publish) -> None:
        try:
            reply_key, body = parse_request(msg.payload)
        except NotARequest as exc:
            self.ignored += 1
            self.say(f"ignored a message on {brief(msg.key)}: {exc}")
            return
        self.answered += 1
        out, why = answer(self.args.program, msg.key, body, self.args.max_reply,
                          self.args.command_timeout, self.say)
        if out is not None:
            try:
                bus.publish(reply_key, out)
                return
            except InvalidRequest as exc:  # a reply key or size the broker would refuse
                why = str(exc)
        self.failed += 1
        self.say(f"no reply to the request on {brief(msg.key)}: {why} "
                 f"({self.failed} failed so far)")


class _Stop(Exception):
    """SIGTERM or SIGINT while waiting for a request."""


class _Stopper:
    """SIGTERM/SIGINT end the service after the request being answered (never in the
    middle of one: its command would be left running), at once while it waits."""

    def __init__(self) -> None:
        self.asked = False
        self.busy = False

    def __call__(self, signum, frame) -> None:
        self.asked = True
        if not self.busy:
            raise _Stop


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    if shutil.which(args.program[0]) is None:
        raise SbusError(f"cannot run {args.program[0]}: no such program")
    server = _Server(args)
    stopper = _Stopper()
    old = {s: signal.signal(s, stopper) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with Client(args.address, reconnect=True, on_connection=lambda up, line: _say(line),
                    on_drop=lambda n: _say(f"the broker dropped {n} requests for us"),
                    on_refusal=server.refused) as bus:
            bus.subscribe(os.fsencode(args.pattern))  # in force: say so to whoever waits
            _say(f"answering requests on {args.pattern!r}")
            try:
                while (args.count is None or server.answered < args.count) \
                        and not stopper.asked:
                    msg = bus.receive()
                    if isinstance(msg, Publish):
                        stopper.busy = True
                        try:
                            server.serve(bus, msg)
                        finally:
                            stopper.busy = False
            except _Stop:
                pass
            stopper.busy = True  # (a second signal: the last line is still written)
            if not stopper.asked:
                bus.sync(None)  # the last reply is with the broker (or its refusal said)
            else:  # stopped: not waiting for good for a broker that is away
                try:
                    bus.sync(STOP_WAIT)
                except (TimeoutError, SbusError) as exc:
                    _say(f"the last reply may not have reached the broker: {exc}")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    # also after a stop: the lines rationed away are in these counts
    _say(f"{server.answered} requests, {server.failed} without a reply, "
         f"{server.ignored} other messages ignored"
         + (", stopped by a signal" if stopper.asked else ""))
    return 0
