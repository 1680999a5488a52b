"""What crosses the bridge, marked and counted: a pure object, no sockets (h11 style).

The shell feeds it every message from either side and carries out the answer:

* ``from_bus(key, payload)`` -> the MQTT topic to publish, or None (refused or an echo);
* ``from_mqtt(topic, payload, marker)`` -> the local key to publish, or None (refused,
  filtered, or our own message come back).

No loops, in two layers. On MQTT every message the bridge publishes carries a user
property ``sbus-bridge: <client id>`` (`MARKER`) and the bridge subscribes with No
Local; a message that still comes back with our own marker (through a broker bridge or a
cluster, where No Local does not reach) is dropped and counted as ``looped``. On the bus
the bridge sees its own imports again if an export pattern matches them: it remembers
each such import (key and payload hash, in the order published, bounded) and drops the
first identical message from the bus; a single connection's messages come back in order,
so only the oldest entry can match; only after the broker reported dropping messages for
the bridge (``blocking/dropped``) may entries older than a match be forgotten (their
echo was perhaps dropped), and only those remembered when the report came. While the
memory is full, imports that would need an entry are dropped (counted) rather than
risking a loop. The memory is bounded in entries and in the bytes of their keys
(`ECHO_LIMIT`, `ECHO_BYTES`).

What never arrived, counted. A sending bridge stamps each export: a spooled (QoS 1) one
with `STAMP` (the epoch of the run that spooled it and a sequence number that grows by
one per export across runs; a record sent again after a restart keeps its stamp), a
QoS 0 one with `STAMP0` (an epoch of this run and its own sequence, numbered only when the
MQTT client takes the message, so that what the sender counts as ``dropped`` is no gap),
and names the MQTT filters that cover every topic it stamps in that numbering (`SCOPE`).
A receiving bridge whose own subscriptions cover that scope must see every number; a
number skipped (same epoch) is counted as ``missing``, and taken off again if it arrives
late (out of order, e.g. through another node of a cluster). A receiver that takes only
part of a sender's topics would see gaps that are no loss: it counts none for that
sender, but still remembers the gaps, so that a late number is imported rather than
taken for a copy. What a receiver remembers survives its clean restart (`senders_saved`),
so that what was published while it was away is counted too. Of a sender's earlier
epochs it keeps the highest number of each (`EPOCHS_KEPT`), so that a record an earlier
run spooled and a later one sends again is still known as a copy.
"""

from __future__ import annotations

import os
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass, fields

from ..display import brief
from ..routing import matches
from . import topics
from .topics import Filter, Mapping

__all__ = ["BridgeCore", "Rule", "Counters", "MARKER", "STAMP", "STAMP0", "SCOPE",
           "ECHO_LIMIT", "covers"]

#: The MQTT 5 user property every message published by an sbus bridge carries.
MARKER = "sbus-bridge"
#: The user property of a spooled (QoS 1) export: ``EPOCH.SEQ`` (hex), increasing per
#: spool, so that a receiving bridge recognises what a restarted or reconnected sender
#: sent again.
STAMP = "sbus-seq"
#: The user property of a QoS 0 export: ``EPOCH.SEQ`` (hex) of a numbering of its own,
#: with an epoch per run of the sender (QoS 0 is never sent again).
STAMP0 = "sbus-seq0"
#: The user property (one per filter) beside a stamp: MQTT filters that together cover
#: every topic the sender stamps; a receiver counts gaps only if its imports cover them.
SCOPE = "sbus-scope"
#: A scope longer than this (bytes of its filters) is sent as ``#`` (still true, coarser),
#: and a longer one received is not considered (no gaps counted for that sender).
SCOPE_BYTES = 1024
#: Senders' numberings (QoS 1, QoS 0) whose last stamp is remembered (least recently
#: heard forgotten first), and the bytes of their ids at most.
STAMP_SENDERS = 4096
STAMP_BYTES = 1 << 20
#: A sender's earlier epochs remembered (their highest number each): its records sent
#: again by later runs, after as many restarts in a row with records still
#: unacknowledged, are still known as copies.
EPOCHS_KEPT = 16
#: Gaps (ranges of numbers not seen) remembered per sender; beyond, the oldest is
#: forgotten: its numbers stay counted as missing, and arriving late would be taken for
#: copies.
GAP_RANGES = 16
IDENTITY = Mapping()
#: Imports remembered to recognise their echo from the bus (bounds memory and loops),
#: and the bytes of their keys at most.
ECHO_LIMIT = 65536
ECHO_BYTES = 16 * 1024 * 1024


@dataclass
class Counters:
    """What STATUS= shows: each message that reached the bridge counted once, in exactly
    one of these; ``missing`` counts those that never did."""

    exported: int = 0   # handed to the MQTT client (QoS 1: queued until acknowledged)
    imported: int = 0   # published on the local bus
    dropped: int = 0    # lost for lack of room or of a connection (either side)
    refused: int = 0    # a key the other side cannot carry (topics.py), or a broker's no
    looped: int = 0     # our own message come back, not forwarded again
    filtered: int = 0   # arrived from MQTT but matches no import pattern
    resent: int = 0     # sent again after a restart (may be twice): taken from the spool
    #                     (not in exported again), or read again from the bus after a
    #                     crash (in exported too: this run exported it)
    duplicates: int = 0  # arrived again from a bridge (its stamp seen before): not imported
    missing: int = 0    # numbers skipped in a bridge's stamps (QoS 1 and QoS 0): handed to
    #                     its MQTT client, never arrived
    redelivered: int = 0  # imported with MQTT's DUP flag: the broker sent it before (to
    #                       this run or one killed before its PUBACK), so perhaps twice
    exported_bytes: int = 0  # topic + payload bytes of the exported messages
    imported_bytes: int = 0  # key + payload bytes of the imported messages

    def line(self) -> str:
        out = []
        for f in fields(self):
            if f.name.endswith("_bytes"):
                continue
            text = f"{f.name} {getattr(self, f.name)}"
            size = getattr(self, f.name + "_bytes", None)
            out.append(text if size is None else f"{text} ({size} B)")
        return ", ".join(out)

    def saved(self) -> dict[str, int]:
        return asdict(self)

    def restore(self, saved: dict) -> None:
        """The counters of the bridge's last run (`spool.StateDir`), where they make sense."""
        for f in fields(self):
            value = saved.get(f.name)
            if isinstance(value, int) and value >= 0:
                setattr(self, f.name, value)


@dataclass(frozen=True)
class Rule:
    """One map of one direction (a ``[[export]]`` or ``[[import]]`` table of --config):
    local *patterns*, the prefix *mapping*, the MQTT *qos*."""

    patterns: tuple[bytes, ...]
    mapping: Mapping = Mapping()
    qos: int = 1


class BridgeCore:
    """*exports*/*imports* with *export_map*/*import_map* and their QoS are the command
    line's one rule per direction; *export_rules*/*import_rules* add more (--config).  An
    exported key takes the first export rule whose pattern matches it; an MQTT topic the
    first import rule that maps it to a key its patterns match."""

    def __init__(self, exports: list[bytes], imports: list[bytes], *,
                 export_map: Mapping = IDENTITY, import_map: Mapping = IDENTITY,
                 export_qos: int = 1, import_qos: int = 1,
                 export_rules: tuple[Rule, ...] = (), import_rules: tuple[Rule, ...] = (),
                 client_id: str = "sbus-bridge", echo_limit: int = ECHO_LIMIT,
                 echo_bytes: int = ECHO_BYTES) -> None:
        out = ([Rule(tuple(exports), export_map, export_qos)] if exports else []) + \
            list(export_rules)
        into = ([Rule(tuple(imports), import_map, import_qos)] if imports else []) + \
            list(import_rules)
        #: (pattern, mapping, qos) per export pattern, in order
        self.export_rules = [(topics.check_export(p, r.mapping), r.mapping, r.qos)
                             for r in out for p in r.patterns]
        self.exports = [p for p, _, _ in self.export_rules]
        #: (filter, mapping, qos) per import pattern, in order
        self.import_rules = [(topics.to_filter(p, r.mapping), r.mapping, r.qos)
                             for r in into for p in r.patterns]
        self.filters: list[Filter] = [f for f, _, _ in self.import_rules]
        self._one_export = len({(m, q) for _, m, q in self.export_rules}) <= 1
        self._one_import = len({m for _, m, _ in self.import_rules}) <= 1
        self.export_map = self.export_rules[0][1] if self.export_rules else IDENTITY
        self.import_map = self.import_rules[0][1] if self.import_rules else IDENTITY
        #: the QoS of the topic `from_bus` returned last
        self.last_qos = self.export_rules[0][2] if self.export_rules else 1
        self.export_qos_levels = {q for _, _, q in self.export_rules}
        self.client_id = client_id
        self.counters = Counters()
        self.echo_limit, self.echo_bytes = echo_limit, echo_bytes
        self._echo_held = 0  # bytes of the keys remembered
        self._echo: deque[tuple[bytes, int]] = deque()
        self._echo_count: Counter[tuple[bytes, int]] = Counter()
        self._echo_keys: Counter[bytes] = Counter()
        self._maybe_gone = 0  # oldest entries remembered when the broker reported drops
        #: the QoS 0 numbering of this run: its epoch and the number of the next export
        self.epoch0 = os.urandom(4).hex()
        self.next0 = 0
        self._stamps: OrderedDict[tuple[str, int], _Sender] = OrderedDict()
        self._stamp_bytes = 0  # of the sender ids remembered
        self._scopes: dict[tuple[str, ...], bool] = {}  # a sender's scope -> we cover it
        #: refusals (quoted key: why) for the shell to log, newest kept
        self.refusals: deque[str] = deque(maxlen=64)

    # -- what to subscribe -----------------------------------------------------------

    def bus_patterns(self) -> list[bytes]:
        return list(dict.fromkeys(self.exports))

    def mqtt_filters(self) -> list[str]:
        return [f for f, _ in self.mqtt_subscriptions()]

    def mqtt_subscriptions(self) -> list[tuple[str, int]]:
        """One MQTT filter per import with its QoS, minus those another one covers (which
        takes the higher QoS): the broker sends a message once per matching subscription,
        so overlapping ones would deliver it twice."""
        qos: dict[str, int] = {}
        for f, _, q in self.import_rules:
            qos[f.mqtt] = max(q, qos.get(f.mqtt, 0))
        kept = [f for f in qos if not any(g != f and covers(g, f) for g in qos)]
        return [(f, max(q for g, q in qos.items() if covers(f, g))) for f in kept]

    def stamp_scope(self, numbering: int = 1) -> list[str]:
        """MQTT filters covering every topic this bridge stamps in one *numbering* (its
        exports of that QoS), sent as `SCOPE` beside each stamp: receivers that cover
        them count gaps."""
        wanted: list[str] = []
        for pattern, mapping, qos in self.export_rules:
            if qos != numbering:
                continue
            try:
                f = topics.to_filter(pattern, mapping).mqtt
            except topics.ConfigError:
                continue  # no key it matches can be sent (refused), so none is stamped
            if f not in wanted:
                wanted.append(f)
        kept = [f for f in wanted if not any(g != f and covers(g, f) for g in wanted)]
        return ["#"] if sum(len(f.encode()) for f in kept) > SCOPE_BYTES else kept

    # -- bus -> MQTT -------------------------------------------------------------

    def from_bus(self, key: bytes, payload: bytes) -> str | None:
        """The topic to publish this local message on, or None (counted)."""
        if self._echo_keys.get(key) and self._take_echo(key, hash(payload)):
            self.counters.looped += 1
            return None
        if key.startswith(topics.SECRET):
            return self._refuse(key, "secret keys never leave the host")
        if self._one_export:
            topic = self.export_map.to_remote(key)
        else:
            topic = None
            for pattern, mapping, qos in self.export_rules:
                if matches(pattern, key):
                    topic = mapping.to_remote(key)
                    self.last_qos = qos
                    break
        if topic is None:
            return self._refuse(key, "not under the local prefix of --export-map")
        problem = topics.topic_problem(topic)
        if problem:
            return self._refuse(key, problem)
        return topic.decode("utf-8")

    def exported(self, size: int = 0, numbered: bool = False) -> None:
        """One export handed to the MQTT client; *numbered*: a QoS 0 one that carried the
        stamp `next0` (the next one gets the next number)."""
        self.counters.exported += 1
        self.counters.exported_bytes += size
        if numbered:
            self.next0 += 1

    # -- MQTT -> bus -------------------------------------------------------------

    def from_mqtt(self, topic: bytes, payload: bytes, marker: str | None,
                  stamp: str | None = None, scope: tuple[str, ...] = (),
                  numbering: int = 1) -> bytes | None:
        """The local key to publish this MQTT message on, or None (counted).  *stamp* and
        *scope* are a sending bridge's (`STAMP` with *numbering* 1, `STAMP0` with 0;
        `SCOPE`)."""
        if marker == self.client_id:
            self.counters.looped += 1
            return None
        if stamp is not None and marker is not None and \
                self._seen_before((marker, numbering), stamp, scope):
            self.counters.duplicates += 1
            return None
        if not topic:  # (a topic alias is never set up: MQTT 5 section 3.3.2.1)
            return self._refuse(topic, "an empty topic, which MQTT does not allow")
        if self._one_import:
            key = self.import_map.to_local(topic)
            if key is not None and not any(f.matches(key) for f in self.filters):
                key = None
        else:
            key = None
            for f, mapping, _ in self.import_rules:
                local = mapping.to_local(topic)
                if local is not None and f.matches(local):
                    key = local
                    break
        if key is None:
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

    def imported(self, size: int = 0) -> None:
        self.counters.imported += 1
        self.counters.imported_bytes += size

    def redelivered(self) -> None:
        """An import taken that MQTT marked as sent before (DUP) and no stamp caught: it
        may be on the bus twice (the run before a kill -9 had it there)."""
        self.counters.redelivered += 1

    # -- losses ------------------------------------------------------------------

    def dropped(self, n: int = 1) -> None:
        """*n* messages lost: the broker said ``blocking/dropped``, a side was down, or a
        queue was full."""
        self.counters.dropped += n

    def bus_dropped(self, n: int) -> None:
        """The local broker dropped *n* messages for the bridge: perhaps echoes of imports
        remembered now, which then never come back (module docstring)."""
        self.counters.dropped += n
        self._maybe_gone = len(self._echo)

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
        self._maybe_gone = 0

    # -- internals ---------------------------------------------------------------

    def _take_echo(self, key: bytes, digest: int) -> bool:
        """Is this message from the bus the echo of a remembered import?  Echoes return in
        the order the imports were published, so it must be the oldest entry, or one after
        entries whose echo the broker may have dropped (reported since they were made)."""
        entry = (key, digest)
        if not self._echo_count.get(entry):
            return False
        if self._echo[0] != entry:
            for i in range(min(self._maybe_gone, len(self._echo) - 1)):
                if self._echo[i + 1] == entry:
                    break
            else:
                return False  # a local message that looks like a later import: not an echo
        while True:
            old = self._echo.popleft()
            self._maybe_gone = max(0, self._maybe_gone - 1)
            self._echo_held -= len(old[0])
            self._echo_count[old] -= 1
            if not self._echo_count[old]:
                del self._echo_count[old]
            self._echo_keys[old[0]] -= 1
            if not self._echo_keys[old[0]]:
                del self._echo_keys[old[0]]
            if old == entry:
                return True

    def _seen_before(self, sender: tuple[str, int], stamp: str,
                     scope: tuple[str, ...] = ()) -> bool:
        """Has *sender* (a bridge's id and numbering) sent this stamp before?  A bridge's
        exports carry numbers that grow by one; a number above the last one is new, and the
        numbers it skips are a gap: counted as ``missing`` if we cover the sender's *scope*
        (module docstring).  A number not above the last one is a copy sent again after a
        reconnect or a restart, unless it lies in a gap: then it came late, and is new.
        A new epoch (the sender's next run) whose numbers go on from the last one's keeps
        the gaps; one whose numbers went back (its spool did: a power loss, an older
        copy; or an epoch forgotten) is new and remembered as an earlier one."""
        epoch, _, number = stamp.partition(".")
        if len(number) > 16 or len(epoch) > 16:
            return False
        try:
            seq = int(number, 16)
        except ValueError:
            return False  # not a stamp we can read: never a reason to drop
        if seq < 0:
            return False
        known = self._stamps.get(sender)
        if known is None:  # a new sender: start
            self._remember(sender, _Sender(epoch, seq))
            return False
        self._stamps.move_to_end(sender)
        if known.epoch != epoch:
            for i, (old, last) in enumerate(known.before):
                if old == epoch:  # an earlier run's record, sent again by a later one
                    if self._late(known, seq):
                        return False
                    if seq <= last:
                        return True
                    known.before[i] = (old, seq)
                    return False
            if seq <= known.last:  # an epoch forgotten (sent again after more restarts
                # than are kept), or a spool that went back: new, and remembered in the
                # oldest place, so that no newer epoch is forgotten for it (else each
                # pushed out the next one sent again, and every copy passed)
                if len(known.before) < EPOCHS_KEPT:
                    known.before.append((epoch, seq))
                else:
                    known.before[-1] = (epoch, seq)
                return False
            known.before = [(known.epoch, known.last), *known.before][:EPOCHS_KEPT]
            known.epoch = epoch
        if seq > known.last:
            if seq > known.last + 1:
                counted = self._covers(scope)
                known.gaps.append((known.last + 1, seq, counted))
                if counted:
                    self.counters.missing += seq - known.last - 1
                if len(known.gaps) > GAP_RANGES:
                    del known.gaps[0]
            known.last = seq
            return False
        return not self._late(known, seq)

    def _late(self, known: _Sender, seq: int) -> bool:
        """Is *seq* in a gap of *known* (it arrived late: new, and no longer missing)?"""
        for i, (first, end, counted) in enumerate(known.gaps):
            if first <= seq < end:
                known.gaps[i:i + 1] = [(a, b, counted) for a, b in ((first, seq), (seq + 1, end))
                                       if a < b]
                if len(known.gaps) > GAP_RANGES:
                    del known.gaps[0]
                if counted:
                    self.counters.missing -= 1
                return True
        return False

    def _remember(self, sender: tuple[str, int], entry: _Sender) -> None:
        old = self._stamps.pop(sender, None)
        if old is not None:
            self._stamp_bytes -= len(sender[0])
        self._stamps[sender] = entry
        self._stamp_bytes += len(sender[0])
        while len(self._stamps) > STAMP_SENDERS or self._stamp_bytes > STAMP_BYTES:
            gone, _ = self._stamps.popitem(last=False)
            self._stamp_bytes -= len(gone[0])

    def senders_saved(self) -> list:
        """What this receiver remembers of senders, for the state directory at a clean
        exit: a restarted receiver then counts what was published while it was away."""
        return [[sender, numbering, s.epoch, s.last, [list(g) for g in s.gaps],
                 [list(b) for b in s.before]] for (sender, numbering), s in self._stamps.items()]

    def restore_senders(self, saved: object) -> None:
        """Take back `senders_saved` (from our own state file: anything else in it, as
        from a damaged file, is skipped; the bounds hold as for senders heard)."""
        if not isinstance(saved, list):
            return
        for item in saved[-STAMP_SENDERS:]:
            try:
                sender, numbering, epoch, last, gaps, *before = item  # (older: no before)
                entry = _Sender(epoch, last)
                entry.gaps = [(a, b, c) for a, b, c in gaps[-GAP_RANGES:]]
                entry.before = [(e, n) for e, n in (before[0] if before else [])][:EPOCHS_KEPT]
            except (TypeError, ValueError):
                continue
            ints = [last, *(n for g in entry.gaps for n in g[:2]), *(n for _, n in entry.before)]
            epochs = [epoch, *(e for e, _ in entry.before)]
            if isinstance(sender, str) and numbering in (0, 1) and \
                    all(isinstance(e, str) and len(e) <= 16 for e in epochs) \
                    and all(type(n) is int and n >= 0 for n in ints) \
                    and all(a < b <= last and type(c) is bool for a, b, c in entry.gaps):
                self._remember((sender, numbering), entry)

    def _covers(self, scope: tuple[str, ...]) -> bool:
        """Do our subscriptions take every topic of a sender's *scope*?"""
        known = self._scopes.get(scope)
        if known is None:
            if not scope or sum(len(f) + 1 for f in scope) > SCOPE_BYTES:
                return False
            own = self.mqtt_filters()
            known = all(any(covers(g, f) for g in own) for f in scope)
            if len(self._scopes) >= 256:
                self._scopes.clear()
            self._scopes[scope] = known
        return known

    def _refuse(self, key: bytes, why: str) -> None:  # returns None for the callers
        self.counters.refused += 1
        self.refusals.append(f"{brief(key)}: {why}")
        return None

    def status(self) -> str:
        return self.counters.line()


class _Sender:
    """What a receiver remembers of one sending bridge: its run's epoch, the highest
    number seen, the gaps below it (first, end, counted as missing), oldest first, and
    the highest number of each earlier epoch, the newest first."""

    __slots__ = ("epoch", "last", "gaps", "before")

    def __init__(self, epoch: str, last: int) -> None:
        self.epoch, self.last = epoch, last
        self.gaps: list[tuple[int, int, bool]] = []
        self.before: list[tuple[str, int]] = []


def covers(wide: str, narrow: str) -> bool:
    """Does MQTT filter *wide* match every topic that filter *narrow* matches?"""
    a, b = wide.split("/"), narrow.split("/")
    for i, level in enumerate(a):
        if level == "#":
            return True  # also matches the parent level, as narrow's own '#' does
        if i >= len(b) or b[i] == "#" or (level != "+" and level != b[i]):
            return False
    return len(a) == len(b)
