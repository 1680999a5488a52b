"""Where the journal is known to miss messages (``DIR/gaps.jsonl``), sans-IO: lines in,
`Gap` out, and back.

The bus keeps nothing, so what the recorder did not receive is not in the journal, and its
sequence numbers (its own) run on without a break.  This file says where such a loss lies,
one JSON object per line::

    {"after": 41, "before": 42, "kind": "away", "lost": null, "from": 17643..., "to": 17643...}

``after``/``before``
    The loss lies between records *after* and *before* (``after`` 0: before the first
    record).  One event gives consecutive numbers; a line may also sum the losses of one
    kind noted within one flush, or a loss whose place within a batch is not known, and
    then lies somewhere between the two.
``kind``
    `DROPPED`, `OVERSIZED`, `AWAY` or `STOPPED` (below): messages the recorder never
    received; or `DAMAGED`: records it had, in a segment moved aside as damaged.
``lost``
    How many messages: a count for `DROPPED` and `OVERSIZED`, null for the others (nobody
    can count what was published while nobody received it).
``from``/``to``
    When (nanoseconds since the epoch, UTC); ``from`` null where not known.

Nothing read is trusted: a line that is not such an object is a `FormatError` naming it
(a reader turns it into one clear line); a last line without its newline is one being
written (or torn by a crash) and is not a gap yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .format import FormatError

__all__ = ["Gap", "KINDS", "FILE", "LINE_BYTES", "encode", "decode", "said", "totals"]

FILE = "gaps.jsonl"
#: The broker dropped them for the recorder (its queue was full): the broker's count.
DROPPED = "dropped"
#: Longer than the recorder receives whole: never recorded cut, counted.
OVERSIZED = "oversized"
#: The broker went away (``from``) until the recorder was subscribed again (``to``).
AWAY = "away"
#: No recorder ran between its last record kept (received at ``from``) and a start (``to``).
STOPPED = "stopped"
#: Records the journal had and no longer has: a segment whose index or header was damaged,
#: moved aside at a start (``to``); ``before`` is where records resume (or, with no
#: segment after it, a number beyond any it can have held: never reused).
DAMAGED = "damaged"
KINDS = (DROPPED, OVERSIZED, AWAY, STOPPED, DAMAGED)
#: Kinds whose ``lost`` is null (nobody can count them); the others always have a count.
UNCOUNTED = (AWAY, STOPPED, DAMAGED)
#: A longer line is damage: a real one is under 150 bytes.
LINE_BYTES = 512


@dataclass(frozen=True, slots=True)
class Gap:
    """Messages missing between records *after* and *before* (see the module)."""

    after: int
    before: int
    kind: str
    lost: int | None
    from_ns: int | None
    to_ns: int

    def merged(self, later: Gap) -> Gap:
        """This gap and a *later* one of its kind as one line: the span of both."""
        lost = None if self.lost is None or later.lost is None else self.lost + later.lost
        return Gap(min(self.after, later.after), later.before, self.kind, lost,
                   self.from_ns if self.from_ns is not None else later.from_ns, later.to_ns)


def totals(noted: list[Gap]) -> tuple[int, int, int]:
    """Messages counted lost in *noted*; how many of its gaps are times nothing was
    recorded (nobody could count them); how many are segments moved aside (`DAMAGED`)."""
    damaged = sum(g.kind == DAMAGED for g in noted)
    return (sum(g.lost or 0 for g in noted), sum(g.lost is None for g in noted) - damaged,
            damaged)


def said(noted: list[Gap]) -> str:
    """*noted*'s `totals` in words, for a person (those that are not zero)."""
    counted, away, damaged = totals(noted)
    return ", ".join(([f"{counted:,} counted lost"] if counted else [])
                     + ([f"{away:,} time(s) nothing was recorded"] if away else [])
                     + ([f"{damaged:,} damaged segment(s) moved aside"] if damaged else []))


def encode(gap: Gap) -> bytes:
    return json.dumps({"after": gap.after, "before": gap.before, "kind": gap.kind,
                       "lost": gap.lost, "from": gap.from_ns, "to": gap.to_ns}).encode() + b"\n"


def _count(value: object, none: bool = False) -> bool:
    return (none and value is None) or (type(value) is int and 0 <= value < 1 << 63)


def decode(line: bytes) -> Gap:
    """One line of the file (its newline included or not); `FormatError` if it is not one
    `encode` writes."""
    if len(line) > LINE_BYTES:
        raise FormatError(f"a line of {len(line)} bytes (a gap takes under {LINE_BYTES})")
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise FormatError("not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {"after", "before", "kind", "lost", "from",
                                                 "to"}:
        raise FormatError("not a gap record (its fields differ)")
    after, before, kind, lost = doc["after"], doc["before"], doc["kind"], doc["lost"]
    if not (_count(after) and _count(before) and after < before and kind in KINDS
            and (lost is None if kind in UNCOUNTED else _count(lost))
            and _count(doc["from"], none=True) and _count(doc["to"])):
        raise FormatError("not a gap record (a field out of its range)")
    return Gap(after, before, kind, lost, doc["from"], doc["to"])
