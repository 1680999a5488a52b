"""sbus pub KEY [PAYLOAD]: publish one message (stdin when PAYLOAD is absent), or --count N
of them from a template.  mosquitto_pub's ``-t KEY -m PAYLOAD`` mean the same.

With --count or --lines it reconnects when the broker goes away (saying so on stderr)
and goes on with the message it was sending; what was sent into the lost connection and
not yet taken by the broker is lost, as on any pubsub bus, and said: the broker is asked
to confirm what it took a few times a second (`sbus.session.Unconfirmed`), so the line
says how many at most.

The key and size are checked before sending, and a round trip at the end makes the
broker's refusal, if any, an error (exit 1) rather than a line in its log."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..client import Client, SbusError
from ..defaults import MAX_MESSAGE, count_arg, duration_arg, size_arg
from ..errors import UsageError
from ..session import Unconfirmed
from . import read_stdin


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", nargs="?", metavar="KEY", help="routing key")
    p.add_argument("payload", nargs="?", metavar="PAYLOAD",
                   help="payload (default: standard input)")
    p.add_argument("-t", "--topic", metavar="KEY",
                   help="the KEY, as mosquitto_pub -t takes it")
    p.add_argument("-m", "--message", metavar="PAYLOAD",
                   help="the PAYLOAD, as mosquitto_pub -m takes it")
    p.add_argument("-l", "--lines", action="store_true",
                   help="publish each line of standard input as its own message "
                        "(without the newline)")
    p.add_argument("--max-message", type=size_arg, default=MAX_MESSAGE, metavar="SIZE",
                   help="the broker's packet limit, checked before sending (default "
                        "256k, as 'sbus serve --max-message')")
    p.add_argument("-c", "--count", type=count_arg, default=None, metavar="N",
                   help="publish N messages; '{n}' in the payload becomes 1, 2, ... N and "
                        "'{time}' the time of sending (seconds since 1970)")
    p.add_argument("--timeout", type=duration_arg, default=None, metavar="SECONDS",
                   help="give up (exit status 1) when the broker takes no message, or does "
                        "not confirm the last, for this long (default: wait as long as it "
                        "takes, as for a publisher the broker paused for a slow subscriber)")
    p.add_argument("-i", "--interval", type=duration_arg, default=0.0, metavar="SECONDS",
                   help="with --count: pause between messages (e.g. 1, 100ms; default 0); "
                        "the pace is kept, not the pause")


def expand(template: bytes, n: int, now: float) -> bytes:
    """The payload of message *n* of ``--count``: ``{n}`` and ``{time}`` replaced (only
    those: other braces, as in JSON, stay as they are)."""
    return template.replace(b"{n}", b"%d" % n).replace(b"{time}", b"%.6f" % now)


def key_and_payload(args: argparse.Namespace) -> tuple[str, str | None]:
    """KEY and PAYLOAD from the positional words or mosquitto's ``-t``/``-m`` (None:
    the payload comes from standard input)."""
    words = [w for w in (args.key, args.payload) if w is not None]
    key = args.topic if args.topic is not None else words.pop(0) if words else None
    if key is None:
        raise UsageError("which key? e.g. sbus pub greetings/world hello")
    if args.message is not None:
        words.append(args.message)
    if len(words) > 1:
        raise UsageError(f"one payload at most, not {len(words)} (-m is the PAYLOAD): "
                         "e.g. sbus pub greetings/world hello")
    return key, words[0] if words else None


def _say(line: str) -> None:
    print(f"sbus pub: {line}", file=sys.stderr, flush=True)


class _Unconfirmed:
    """`sbus.session.Unconfirmed` carried out for a stream of messages: its answers taken
    without waiting after a message, its questions sent, its count said on a lost
    connection (the message being sent then is sent again, not lost)."""

    def __init__(self, bus: Client) -> None:
        self.bus = bus
        self.count = Unconfirmed(bus.session)

    def one_sent(self) -> None:
        count = self.count
        count.sent += 1
        now = time.monotonic()
        if now < count.next_at:
            return
        if count.asked_at is not None:
            try:
                while True:  # (nothing else comes to a publisher: answers, refusals)
                    self.bus.receive(0)
            except TimeoutError:  # all there was, taken without waiting
                pass
        question = count.question(now)
        if question is not None:
            self.bus.send_packet(question)

    def said(self, up: bool, line: str) -> None:
        """The client's connection line, with what the lost connection may have taken."""
        _say(line if up else self.count.said(line))


def run(args: argparse.Namespace) -> int:
    text_key, text_payload = key_and_payload(args)
    key = os.fsencode(text_key)
    if args.count is not None and args.lines:
        raise SbusError("--count and --lines do not go together")
    if args.interval and args.count is None:
        raise SbusError("--interval goes with --count")
    if args.lines and text_payload is not None:
        raise UsageError("--lines reads standard input: no PAYLOAD with it")
    if args.lines and sys.stdin.isatty():
        print("sbus pub: reading one message per line from the terminal until Ctrl-D",
              file=sys.stderr, flush=True)
    # a stream of messages (--count, --lines) is a long-running command: it waits for a
    # lost broker and goes on (saying so); one message is one-shot: a lost broker fails it
    stream = args.count is not None or args.lines
    unconfirmed: _Unconfirmed | None = None
    with Client(args.address, max_message=args.max_message, reconnect=stream,
                timeout=args.timeout,
                on_connection=lambda up, line: unconfirmed.said(up, line)) as bus:
        unconfirmed = _Unconfirmed(bus)
        try:
            _publish_all(bus, key, text_payload, args, unconfirmed)
        except TimeoutError as exc:
            if args.timeout is None:
                raise  # not ours (a reconnect's opening): said as it is
            raise SbusError(f"the broker at {bus.address} did not take the messages "
                            f"within {args.timeout:g} s") from exc
    return 0


def _publish_all(bus: Client, key: bytes, text_payload: str | None,
                 args: argparse.Namespace, unconfirmed: _Unconfirmed) -> None:
    """Every message of this command, then the broker's word that it took them."""
    if args.lines:
        for line in sys.stdin.buffer:
            bus.publish(key, line.rstrip(b"\n"))
            unconfirmed.one_sent()
    else:
        payload = (read_stdin("sbus pub", "the payload", "sbus pub KEY PAYLOAD")
                   if text_payload is None
                   else os.fsencode(text_payload))
        start = time.monotonic()
        for n in range(1, (1 if args.count is None else args.count) + 1):
            if n > 1 and args.interval:
                time.sleep(max(0.0, start + (n - 1) * args.interval - time.monotonic()))
            bus.publish(key, payload if args.count is None
                        else expand(payload, n, time.time()))
            unconfirmed.one_sent()
    bus.sync(args.timeout)  # the broker took every message (or raised its refusal); a
    # publisher it paused for a slow subscriber waits here as in its sends
