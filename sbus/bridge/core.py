"""What crosses the bridge, marked and counted: a pure object, no sockets (h11 style).

The shell feeds it every message from either side and carries out the answer:

* ``from_bus(key, payload)`` -> the MQTT topic to publish, or None (refused or an echo);
* ``from_mqtt(topic, payload, marker)`` -> the local key to publish, or None (refused,
  filtered, or our own message come back).

No loops, in two layers.  On MQTT every message the bridge publishes carries a user
property ``sbus-bridge: <client id>`` (`MARKER`) and the bridge subscribes with No Local;
a message that still comes back with our own marker (through a broker bridge or a
cluster, where No Local does not reach) is dropped and counted as ``looped``.  On the bus
the bridge sees its own imports again if an export pattern matches them: it remembers
each such import (key and payload hash, in the order published, bounded) and drops the
first identical message from the bus; a single connection's messages come back in
order, so older entries left unmatched (the broker dropped them for us) are forgotten as
soon as a later one returns.  While the memory is full, imports that would need an entry
are dropped (counted) rather than risking a loop.  The memory is bounded in entries and
in the bytes of their keys (`ECHO_LIMIT`, `ECHO_BYTES`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, fields

from ..display import brief
from ..routing import matches
from ..session import Backoff as Delays
from . import topics
from .topics import Filter, Mapping

__all__ = ["BridgeCore", "Counters", "Backoff", "MARKER", "ECHO_LIMIT"]

#: The MQTT 5 user property every message published by an sbus bridge carries.
MARKER = "sbus-bridge"
IDENTITY = Mapping()
#: A connection that stayed up this long (seconds) resets its side's backoff.
STABLE_AFTER = 10.0
#: Imports remembered to recognise their echo from the bus (bounds memory and loops),
#: and the bytes of their keys at most.
ECHO_LIMIT = 65536
ECHO_BYTES = 16 * 1024 * 1024


@dataclass
class Counters:
    """What STATUS= shows: each message counted once, in exactly one of these."""

    exported: int = 0   # handed to the MQTT client (QoS 1: queued until acknowledged)
    imported: int = 0   # published on the local bus
    dropped: int = 0    # lost for lack of room or of a connection (either side)
    refused: int = 0    # a key the other side cannot carry (topics.py), or a broker's no
    looped: int = 0     # our own message come back, not forwarded again
    filtered: int = 0   # arrived from MQTT but matches no import pattern

    def line(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))


class BridgeCore:
    def __init__(self, exports: list[bytes], imports: list[bytes], *,
                 export_map: Mapping = IDENTITY, import_map: Mapping = IDENTITY,
                 client_id: str = "sbus-bridge", echo_limit: int = ECHO_LIMIT,
                 echo_bytes: int = ECHO_BYTES) -> None:
        self.export_map, self.import_map = export_map, import_map
        self.exports = [topics.check_export(p, export_map) for p in exports]
        self.filters: list[Filter] = [topics.to_filter(p, import_map) for p in imports]
        self.client_id = client_id
        self.counters = Counters()
        self.echo_limit, self.echo_bytes = echo_limit, echo_bytes
        self._echo_held = 0  # bytes of the keys remembered
        self._echo: deque[tuple[bytes, int]] = deque()
        self._echo_count: Counter[tuple[bytes, int]] = Counter()
        self._echo_keys: Counter[bytes] = Counter()
        #: refusals (quoted key: why) for the shell to log, newest kept
        self.refusals: deque[str] = deque(maxlen=64)

    # -- what to subscribe -----------------------------------------------------------

    def bus_patterns(self) -> list[bytes]:
        return list(dict.fromkeys(self.exports))

    def mqtt_filters(self) -> list[str]:
        return list(dict.fromkeys(f.mqtt for f in self.filters))

    # -- bus -> MQTT -------------------------------------------------------------

    def from_bus(self, key: bytes, payload: bytes) -> str | None:
        """The topic to publish this local message on, or None (counted)."""
        if self._echo_keys.get(key) and self._take_echo(key, hash(payload)):
            self.counters.looped += 1
            return None
        if key.startswith(topics.SECRET):
            return self._refuse(key, "secret keys never leave the host")
        topic = self.export_map.to_remote(key)
        if topic is None:
            return self._refuse(key, "not under the local prefix of --export-map")
        problem = topics.topic_problem(topic)
        if problem:
            return self._refuse(key, problem)
        return topic.decode("utf-8")

    def exported(self) -> None:
        self.counters.exported += 1

    # -- MQTT -> bus -------------------------------------------------------------

    def from_mqtt(self, topic: bytes, payload: bytes, marker: str | None) -> bytes | None:
        """The local key to publish this MQTT message on, or None (counted)."""
        if marker == self.client_id:
            self.counters.looped += 1
            return None
        key = self.import_map.to_local(topic)
        if key is None or not any(f.matches(key) for f in self.filters):
            self.counters.filtered += 1
            return None
        problem = topics.local_problem(key)
        if problem:
            return self._refuse(key, problem)
        if any(matches(p, key) for p in self.exports):
            if (len(self._echo) >= self.echo_limit
                    or self._echo_held + len(key) > self.echo_bytes):
                self.counters.dropped += 1  # cannot tell its echo apart: a loop otherwise
                return None
            entry = (key, hash(payload))
            self._echo.append(entry)
            self._echo_held += len(key)
            self._echo_count[entry] += 1
            self._echo_keys[key] += 1
        return key

    def imported(self) -> None:
        self.counters.imported += 1

    # -- losses ------------------------------------------------------------------

    def dropped(self, n: int = 1) -> None:
        """*n* messages lost: the broker said ``blocking/dropped``, a side was down, or a
        queue was full."""
        self.counters.dropped += n

    def refused_by_broker(self) -> None:
        """A broker said no to a message already counted as handed over: the local one
        (``refused/msg``) or the MQTT one (a PUBACK with an error reason)."""
        self.counters.refused += 1

    def bus_reset(self) -> None:
        """The bus connection is new: no echo of an earlier import can arrive on it."""
        self._echo.clear()
        self._echo_held = 0
        self._echo_count.clear()
        self._echo_keys.clear()

    # -- internals ---------------------------------------------------------------

    def _take_echo(self, key: bytes, digest: int) -> bool:
        entry = (key, digest)
        if not self._echo_count.get(entry):
            return False
        while True:  # entries before it were dropped by the broker: they never return
            old = self._echo.popleft()
            self._echo_held -= len(old[0])
            self._echo_count[old] -= 1
            if not self._echo_count[old]:
                del self._echo_count[old]
            self._echo_keys[old[0]] -= 1
            if not self._echo_keys[old[0]]:
                del self._echo_keys[old[0]]
            if old == entry:
                return True

    def _refuse(self, key: bytes, why: str) -> None:  # returns None for the callers
        self.counters.refused += 1
        self.refusals.append(f"{brief(key)}: {why}")
        return None

    def status(self) -> str:
        return self.counters.line()


class Backoff:
    """When to try a side again: one policy for both (equal jitter, doubling from *first*
    to *maximum*); a connection that stayed up `stable` seconds starts it over."""

    def __init__(self, first: float, maximum: float, stable: float = STABLE_AFTER) -> None:
        self.stable = stable
        self.delays = Delays(first, maximum)  # sbus.session's policy, used by every client
        self.next_at = 0.0
        self._up_at: float | None = None

    def up(self, now: float) -> None:
        self._up_at = now

    def failed(self, now: float) -> float:
        """A connection attempt failed or a connection broke: the delay until the next."""
        if self._up_at is not None and now - self._up_at >= self.stable:
            self.delays.reset()
        self._up_at = None
        delay = self.delays.next()
        self.next_at = now + delay
        return delay
