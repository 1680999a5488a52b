"""The gateway's word to remote clients about what they miss (pure: frames, no I/O).

The pubsub protocol has no error frame, so a remote subscriber could not learn that
messages meant for it were discarded (its buffer full) or never reached the gateway (the
bus away, or the broker dropping for a gateway that fell behind): only the gateway's log
said so, which a remote user does not see.  A client that subscribes to `TOPIC` gets
these as messages on that topic; one that does not sees the protocol unchanged.

`TOPIC` is ``!/gateway/notices`` whatever the broker's separator: on a ``/`` bus it is a
secret-looking key that the broker refuses, so no bus key is taken from remote clients; on
a ``.`` bus, where it is an ordinary key, the gateway neither forwards it (nor any key
under it) from the bus nor lets remote clients publish to it: a notice cannot be forged.
Each body is one JSON object with an ``event`` field:

* ``{"event": "discarded", "count": N, "causes": {"own": a, "address": b, "pool": c}}``:
  N messages for this client were discarded since its previous such notice (by the
  bound that was full: its buffer, its address's share, the gateway's pool); sent when
  its buffer has drained, so it comes after what was queued before the gap was noticed.
* ``{"event": "bus-away"}``: the gateway lost the bus; what is published on it is not
  received until ``bus-back``.
* ``{"event": "bus-back", "away": S}``: the bus is back after S seconds; what was
  published meanwhile did not reach the gateway (a hand-over keeps the connection: no
  notice, nothing lost).
* ``{"event": "bus-dropped", "count": N}``: the broker dropped N messages for the gateway
  (it fell behind); they may have been for any of its subscribers.
* ``{"event": "unconfirmed", "count": N}``: after ``bus-away``, to a client that published:
  up to N of its publishes, sent to the bus since the broker last confirmed them (a few
  times a second), may be lost with the connection (a broker killed before it read
  them; one that stopped cleanly read them all).
"""

from __future__ import annotations

import json

from . import codec
from .outbox import OWN, POOL, SHARE

__all__ = ["TOPIC", "bus_away", "bus_back", "bus_dropped", "discarded", "parse",
           "unconfirmed"]

TOPIC = b"!/gateway/notices"
_CAUSE_NAMES = {OWN: "own", SHARE: "address", POOL: "pool"}


def _frame(event: str, **fields: object) -> bytes:
    body = json.dumps({"event": event, **fields}, separators=(",", ":")).encode()
    return codec.publish(TOPIC, body)


def discarded(by_cause: list[int]) -> bytes:
    """The frame saying that ``sum(by_cause)`` messages were discarded (`outbox.CAUSES`)."""
    causes = {name: by_cause[i] for i, name in _CAUSE_NAMES.items() if by_cause[i]}
    return _frame("discarded", count=sum(by_cause), causes=causes)


def bus_away() -> bytes:
    return _frame("bus-away")


def bus_back(away: float) -> bytes:
    return _frame("bus-back", away=round(away, 3))


def bus_dropped(count: int) -> bytes:
    return _frame("bus-dropped", count=count)


def unconfirmed(count: int) -> bytes:
    return _frame("unconfirmed", count=count)


def parse(body: bytes) -> dict:
    """A notice's body as a dict (raises ValueError if it is not one)."""
    value = json.loads(body)
    if not isinstance(value, dict) or not isinstance(value.get("event"), str):
        raise ValueError(f"not a gateway notice: {body[:80]!r}")
    return value
