"""Offsets over the journal and the planning of read ranges, pure (no Spark, no files).

An offset ``(segment, position, row)`` names the next row to read: row *row* of the block
starting at byte *position* of the segment whose first sequence number is *segment*.
Offsets order like tuples, and the same offsets mean the same rows forever (segments are
append-only and sealing does not move blocks), which is what makes a checkpointed
streaming query replay exactly the rows of an interrupted micro-batch.

A *journal view* is a list of ``(segment, [BlockInfo, ...])`` in journal order.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..journal.format import FILE_HEAD, BlockInfo
from .arrow import Range

__all__ = ["Offset", "START", "advance", "plan", "partitions"]

View = list[tuple[int, list[BlockInfo]]]


@dataclass(frozen=True, order=True, slots=True)
class Offset:
    segment: int
    position: int
    row: int = 0

    def to_dict(self) -> dict:
        return {"segment": self.segment, "position": self.position, "row": self.row}

    @classmethod
    def from_dict(cls, d: dict) -> Offset:
        return cls(int(d["segment"]), int(d["position"]), int(d.get("row", 0)))


#: Before everything: sequence numbers start at 1, so segment 0 never exists.
START = Offset(0, FILE_HEAD.size, 0)


def advance(view: View, start: Offset, max_rows: int | None = None,
            target: Offset | None = None) -> Offset:
    """The offset after at most *max_rows* rows from *start* (all if None), never beyond
    *target*.  Returns *start* itself when there is nothing new."""
    pos = start
    budget = max_rows
    for seg, blocks in view:
        if seg < start.segment:
            continue
        for b in blocks:
            here = Offset(seg, b.pos)
            if here < Offset(start.segment, start.position):
                continue
            if target is not None and here >= target:
                return pos
            skip = start.row if (seg, b.pos) == (start.segment, start.position) else 0
            avail = b.count - skip
            if budget is not None and avail > budget:
                return Offset(seg, b.pos, skip + budget) if budget > 0 else pos
            if budget is not None:
                budget -= avail
            pos = Offset(seg, b.end, 0)
    return pos


def plan(view: View, start: Offset, end: Offset, max_bytes: int) -> list[Range]:
    """Ranges covering the rows in ``[start, end)``, one segment each (see `partitions`)."""
    return [r for part in partitions(view, start, end, max_bytes) for r in part]


def partitions(view: View, start: Offset, end: Offset, max_bytes: int) -> list[list[Range]]:
    """The rows in ``[start, end)`` as partitions of *max_bytes* of blocks or a little more
    (a partition ends with the block that reaches the size; only the ends of ``[start, end)``
    may cut a block).  A partition may span segments, one range per segment, so a journal
    splits into equal tasks whatever its segment sizes (one task per core, no straggler)."""
    parts: list[list[Range]] = []
    part: list[Range] = []
    size = 0
    for seg, blocks in view:
        if seg < start.segment or seg > end.segment:
            continue
        group: list[tuple[BlockInfo, int, int]] = []
        for b in blocks:
            here = (seg, b.pos)
            if here < (start.segment, start.position) or here > (end.segment, end.position):
                continue
            if here == (end.segment, end.position) and end.row == 0:
                continue
            lo = start.row if here == (start.segment, start.position) else 0
            hi = end.row if here == (end.segment, end.position) else b.count
            if hi <= lo:
                continue
            group.append((b, lo, hi))
            size += b.size
            if size >= max_bytes:
                parts.append([*part, _range(seg, group)])
                part, group, size = [], [], 0
        if group:
            part.append(_range(seg, group))
    if part:
        parts.append(part)
    return parts


def _range(seg: int, group: list[tuple[BlockInfo, int, int]]) -> Range:
    first, lo, _ = group[0]
    last, _, hi = group[-1]
    if hi == last.count:
        return Range(seg, first.pos, lo, last.end, 0)
    return Range(seg, first.pos, lo, last.pos, hi)
