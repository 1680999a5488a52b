"""Offsets over the journal and the planning of read ranges, pure (no Spark, no files).

An offset is a sequence number: the next row to read.  Sequence numbers belong to the
records, not to files, so an offset means the same rows whatever happens to segment files
later (sealing re-blocks them, retention deletes them), which is what makes a checkpointed
streaming query replay exactly the rows of an interrupted micro-batch, or know exactly
which of them are gone.

A *journal view* is a list of ``(segment, [BlockInfo, ...])`` in journal order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..journal.arrow import Range
from ..journal.format import BlockInfo

__all__ = ["Offset", "START", "View", "advance", "gaps", "plan", "partitions", "from_legacy"]

View = list[tuple[int, list[BlockInfo]]]


@dataclass(frozen=True, order=True, slots=True)
class Offset:
    """The next sequence number to read; ``lost`` counts rows the query found gone and
    skipped (``failOnDataLoss=false``) before it, carried along so it shows in progress;
    ``after_planning`` is the part of ``lost`` that was still there when the micro-batch
    that should read it was planned (the retention race), which the next end offset counts.
    An end offset also names the first row its micro-batch was planned to read
    (``origin``, ``"from"``): Spark does not log the start of batch 0 but asks the source's
    initial offset again when it replays that batch after a restart, and retention may
    have moved the journal's first row since; the batch's start is carried in the offset
    Spark does log, as Kafka's source writes its initial offsets into the checkpoint.
    ``journal`` is the journal's identity (`sbus.journal.store.journal_id`), where it has
    one: a sequence number means nothing in a journal removed and recorded anew."""

    seq: int
    lost: int = field(default=0, compare=False)
    after_planning: int = field(default=0, compare=False)
    origin: int | None = field(default=None, compare=False)
    journal: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict:
        d: dict = {"seq": self.seq}
        if self.origin is not None:
            d["from"] = self.origin
        if self.lost:
            d["lost"] = self.lost
        if self.after_planning:
            d["lostAfterPlanning"] = self.after_planning
        if self.journal is not None:
            d["journal"] = self.journal
        return d

    def key(self) -> tuple[int, int, int]:
        """All of the offset (its order and equality look at ``seq`` only)."""
        return self.seq, self.lost, self.after_planning

    def moved(self, seq: int, lost: int = 0, after_planning: int = 0) -> Offset:
        """This offset at *seq*, with *lost* more rows lost (*after_planning* of them late)."""
        return Offset(seq, self.lost + lost, self.after_planning + after_planning,
                      journal=self.journal)

    @classmethod
    def from_dict(cls, d: dict, view: View | None = None) -> Offset:
        if "seq" in d:
            origin, journal = d.get("from"), d.get("journal")
            if journal is not None and not isinstance(journal, str):
                raise ValueError(f"not an sbus offset: {d!r} (its journal is not a name)")
            return cls(int(d["seq"]), int(d.get("lost", 0)), int(d.get("lostAfterPlanning", 0)),
                       None if origin is None else int(origin), journal)
        if "segment" in d and view is not None:  # a checkpoint of the byte-position offsets
            return cls(from_legacy(view, int(d["segment"]), int(d["position"]),
                                   int(d.get("row", 0))))
        raise ValueError(f"not an sbus offset: {d!r} (expected {{\"seq\": N}})")


#: Before everything.  Rows before the first one there are not "lost" from here: the
#: journal's beginning is wherever retention has left it.
START = Offset(0)


def from_legacy(view: View, segment: int, position: int, row: int) -> int:
    """The sequence number an old ``(segment, position, row)`` offset named."""
    for seg, blocks in view:
        if seg != segment:
            continue
        for b in blocks:
            if b.pos == position:
                return b.first_seq + row
        if blocks and position >= blocks[-1].end:
            return blocks[-1].next_seq
    return max(segment, 1)  # gone (or re-blocked): from its start; the gap check counts it


def first_seq(view: View) -> int | None:
    return next((bs[0].first_seq for _, bs in view if bs), None)


def advance(view: View, start: Offset, max_rows: int | None = None,
            target: Offset | None = None) -> Offset:
    """The offset after at most *max_rows* existing rows from *start* (all if None), never
    beyond *target*.  Returns *start* itself when there is nothing new."""
    pos = start.seq
    budget = max_rows
    limit = target.seq if target is not None else None
    for _, blocks in view:
        for b in blocks:
            if b.next_seq <= start.seq:
                continue
            lo = max(b.first_seq, start.seq)
            hi = b.next_seq if limit is None else min(b.next_seq, limit)
            if hi <= lo:
                return start.moved(pos)
            if budget is not None and hi - lo >= budget:
                return start.moved(lo + budget if budget > 0 else pos)
            if budget is not None:
                budget -= hi - lo
            pos = hi
    return start.moved(pos)


def gaps(view: View, start: int, end: int) -> list[tuple[int, int]]:
    """Sequence ranges ``[lo, hi)`` inside ``[start, end)`` that no block holds (rows
    removed by retention or moved aside as damaged).  From `START` (0) the rows before
    the first one in the journal do not count."""
    out = []
    at = start
    if start == START.seq:
        at = first_seq(view) or end
    for _, blocks in view:
        for b in blocks:
            if b.next_seq <= at:
                continue
            if b.first_seq >= end:
                break
            if b.first_seq > at:
                out.append((at, b.first_seq))
            at = b.next_seq
    if at < end:
        out.append((at, end))
    return out


def plan(view: View, start: int, end: int, max_bytes: int) -> list[Range]:
    """Ranges covering the rows in ``[start, end)``, one segment each (see `partitions`)."""
    return [r for part in partitions(view, start, end, max_bytes) for r in part]


def partitions(view: View, start: int, end: int, max_bytes: int,
               keep: Callable[[BlockInfo], bool] | None = None) -> list[list[Range]]:
    """The rows ``start <= seq < end`` as partitions of *max_bytes* of blocks or a little
    more (a partition ends with the block that reaches the size).  A partition may span
    segments, so a journal splits into equal tasks whatever its segment sizes.  *keep*
    prunes blocks (a ``ts`` filter against the index's min/max)."""
    parts: list[list[Range]] = []
    part: list[Range] = []
    size = 0
    for seg, blocks in view:
        run: list[BlockInfo] = []
        for b in blocks:
            if b.next_seq <= start or b.first_seq >= end or (keep and not keep(b)):
                if run:
                    part.append(_range(seg, run, start, end))
                    run = []
                continue
            run.append(b)
            size += b.size
            if size >= max_bytes:
                parts.append([*part, _range(seg, run, start, end)])
                part, run, size = [], [], 0
        if run:
            part.append(_range(seg, run, start, end))
    if part:
        parts.append(part)
    return parts


def _range(seg: int, run: list[BlockInfo], start: int, end: int) -> Range:
    return Range(seg, run[0].pos, run[-1].end, max(start, run[0].first_seq),
                 min(end, run[-1].next_seq))
