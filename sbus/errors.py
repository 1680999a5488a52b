"""Every error sbus raises to its users, in one hierarchy.

`SbusError` is the root the CLI catches to print one line and exit non-zero; the
subclasses say whose fault it was, so a program can react to each (retry a lost
connection, fix a refused pattern).
"""

from __future__ import annotations

__all__ = ["SbusError", "ConnectError", "ConnectionLost", "InvalidRequest", "Refused",
           "NoResponders"]


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
    """The broker refused a packet and said why (``CMSG refused/VERB\\0reason``)."""

    def __init__(self, verb: str, reason: str) -> None:
        super().__init__(f"the broker refused the {verb.upper()}: {reason}")
        self.verb = verb
        self.reason = reason


class NoResponders(SbusError):
    """A request on a key nobody subscribes to: the broker said so at once."""
