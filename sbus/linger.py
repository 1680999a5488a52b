"""When a reader lets messages gather before it reads them: adaptive coalescing (the
bridge's readers, ``sbus bridge --linger``; the gateway's, ``sbus gateway --linger``).

At a steady moderate rate every message is a wake-up of the reading process, and a
Python wake-up costs several times what the message itself does (docs/performance.md,
"Bridge": 82 µs of CPU per export at 8,000 msg/s against 21 µs flat out).  Above a rate
at which waiting `delay` seconds gathers at least two messages, a reader waits that long
after a turn, so that the next turn takes a run: wake-ups fall with the rate, and no
message waits more than `delay` longer.  Below it (e.g. 1,000 msg/s with the default
1 ms) nothing waits: latency at low rates is unchanged.  Nor after a turn that took a run
of `RUN` or more: a burst already comes in runs, and a wait would only slow it.
``delay = 0`` turns it off.

A peer that sends a window of messages and then waits for their answers would be held
back a whole delay per window (a client with 50 in flight lost 7–29 % of its throughput
through the gateway).  So the gateway's reader, which waits on its client's TCP socket,
asks the kernel to wake it at `WAKE_BYTES` (``SO_RCVLOWAT``) or at the delay, whichever
comes first.  (The bridge's peer is a broker with a window of 1,000: it keeps the sleep.)
"""

from __future__ import annotations

import argparse

from .defaults import parse_duration

__all__ = ["LINGER", "Linger", "MAX_LINGER", "RUN", "WAKE_BYTES", "check_linger",
           "linger_arg"]

#: The default wait (``--linger`` of both): above 2,000 msg/s, a run per millisecond.
LINGER = 0.001
#: The longest wait allowed: a message held longer than this is a stall, not a batch.
MAX_LINGER = 0.1

#: A turn that took this many messages is a run already: no wait after it.
RUN = 32
#: Bytes of input that end a wait early, where the reader can ask the kernel to wake it
#: only then (``SO_RCVLOWAT``, TCP): a peer that sends a window at a time and waits for
#: its answers is not held back a whole delay once its next window is in.
WAKE_BYTES = 2048


def check_linger(seconds: float) -> float:
    """*seconds* as a ``--linger``, or ValueError saying why not."""
    if not 0 <= seconds <= MAX_LINGER:
        raise ValueError(f"at most {MAX_LINGER * 1000:g}ms (a longer wait is a stall, not "
                         "a batch)")
    return seconds


def linger_arg(text: str) -> float:
    """A ``--linger`` DURATION for argparse."""
    try:
        return check_linger(parse_duration(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Linger:
    """One reader's pace: `after` each turn says how long to wait before the next."""

    def __init__(self, delay: float) -> None:
        if delay < 0:
            raise ValueError("a linger cannot be negative")
        self.delay = delay
        #: messages per second above which a wait gathers two or more
        self.above = 2 / delay if delay else float("inf")
        self._last: float | None = None  # when the previous turn ended

    def after(self, now: float, taken: int) -> float:
        """A turn that took *taken* messages ended at *now*: seconds to wait (0: none)."""
        last, self._last = self._last, now
        if not self.delay or not taken or taken >= RUN or last is None:
            return 0.0
        gap = now - last
        return self.delay if gap <= 0 or taken / gap > self.above else 0.0
