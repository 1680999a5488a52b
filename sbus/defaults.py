"""Every default a user can meet in more than one command, and the one size parser.

A default written twice drifts (the 256 KiB packet limit once stood in six places):
each lives here and is imported where it is used.
"""

from __future__ import annotations

import argparse
import os
import re

__all__ = ["MAX_MESSAGE", "QUEUE_LIMIT", "parse_size", "size_arg", "parse_duration", "decimal",
           "duration_arg", "DEFAULT_ADDRESS", "default_address", "RECV_BUFFER", "SEND_BUFFER",
           "count_arg", "SEPARATOR", "SOCKET_MODE", "DEFAULT_SOFT", "DEFAULT_HARD",
           "DEFAULT_ORDER"]

#: Where the broker listens unless told otherwise (``$SBUS_ADDRESS`` overrides it).
DEFAULT_ADDRESS = "/run/sbus.socket"

#: Permissions of the socket file ``sbus serve`` creates (and ``sbus.socket``'s
#: ``SocketMode=``): a multi-user bus; secret keys are guarded by credentials.
SOCKET_MODE = 0o666
#: The routing key separator (``sbus serve --separator``).
SEPARATOR = b"/"
#: The flood policy of a client that sets none (``sbus serve --soft/--hard/--order``), in
#: the protocol's words (sbus/flood.py: `DEFAULT_POLICY` gives them their types).
DEFAULT_SOFT = b"queue"
DEFAULT_HARD = b"discard"
DEFAULT_ORDER = b"queue"

#: Seconds a call or a command waits for the broker's answer unless told otherwise
#: (``sync``, ``whoami``, ``request``; ``--timeout`` of ping, request, status).
ANSWER_TIMEOUT = 5.0

#: Largest packet the broker accepts and forwards (``--max-message``).
MAX_MESSAGE = 256 * 1024
#: Bytes the broker queues for one client before its hard policy applies (``--queue-limit``).
QUEUE_LIMIT = 4 * 1024 * 1024
#: A client's receive buffer: larger than any packet a broker forwards by default.
RECV_BUFFER = 1024 * 1024
#: Send buffer a client asks of the kernel, so packets up to `MAX_MESSAGE` can be sent.
SEND_BUFFER = 512 * 1024


def default_address() -> str:
    """``$SBUS_ADDRESS``, else `DEFAULT_ADDRESS`."""
    return os.environ.get("SBUS_ADDRESS") or DEFAULT_ADDRESS

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*")


def parse_size(text: str) -> int:
    """``"256k"`` -> 262144: units k, M, G, T are powers of 1024; ``B``/``iB`` may follow."""
    m = _SIZE.fullmatch(text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 256k, 4M, 10G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def size_arg(text: str) -> int:
    """`parse_size` for argparse: its message is the one the user sees."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_SECONDS = {"": 1, "s": 1, "ms": 0.001, "m": 60, "min": 60, "h": 3600, "d": 86400,
            "w": 7 * 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|min|[smhdw]?)\s*")


def parse_duration(text: str) -> float:
    """``"90s"``, ``"30m"``/``"30min"``, ``"12h"``, ``"7d"``, ``"2w"``, ``"250ms"`` ->
    seconds (a bare number is seconds)."""
    m = _DURATION.fullmatch(text.lower())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30min, 12h, 7d)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def duration_arg(text: str) -> float:
    """`parse_duration` for argparse."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None



def decimal(text: str) -> bool:
    """Whether *text* is a whole number in ASCII digits: ``str.isdigit`` also takes ``²``
    (which ``int`` refuses) and ``١٠٠`` (which it reads as 100), as a file name may hold."""
    return text.isascii() and text.isdigit()


def count_arg(text: str) -> int:
    """A count of 1 or more for argparse (``--count``)."""
    if not decimal(text.strip()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a count of 1 or more: {text!r}")
    return int(text)
