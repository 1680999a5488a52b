"""Every error sbus raises to its users, in one hierarchy.

`SbusError` is the root the CLI catches to print one line and exit non-zero; the
subclasses say whose fault it was, so a program can react to each (retry a lost
connection, fix a refused pattern).
"""

from __future__ import annotations

__all__ = ["SbusError", "ConnectError", "ConnectionLost", "InvalidRequest", "Refused",
           "ServeError", "UsageError", "NoResponders"]


class SbusError(Exception):
    """Something went wrong talking to the broker; the message says what, in one line."""


class ConnectError(SbusError):
    """No broker accepted the connection at the address named in the message."""


class ConnectionLost(SbusError):
    """The broker closed or reset a connection that was up."""


class InvalidRequest(SbusError, ValueError):
    """The library refused to send something the broker would refuse: a key or pattern
    against the broker's rules (sbus/keys.py), a message over the size limit, an unknown
    flood setting.  Nothing was sent."""


class Refused(SbusError):
    """A request refused, with why.  ``Refused(verb, reason)``: by the broker, *verb*
    naming what it refused (``CMSG refused/VERB\\0reason``).  ``Refused(reason)``: by a
    component for its own client: a remote client's frame (gateway), a file name (FUSE:
    *errno* is the kernel's answer)."""

    def __init__(self, verb: str, reason: str | None = None, *,
                 errno: int | None = None) -> None:
        if reason is None:
            verb, reason = "", verb
        super().__init__(f"the broker refused the {verb.upper()}: {reason}" if verb else reason)
        self.verb = verb
        self.reason = reason
        self.errno = errno


class UsageError(SbusError):
    """A command line that argparse accepts but that does not make sense (options that do
    not go together, another tool's spelling): the commands exit 2, as for a wrong option."""


class ServeError(SbusError):
    """A reason the broker cannot start, worded for the person starting it."""


class NoResponders(SbusError):
    """A request on a key nobody subscribes to: the broker said so at once."""
