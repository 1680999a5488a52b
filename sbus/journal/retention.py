"""Retention policy, pure: which sealed segments to delete (``--keep 7d`` / ``--keep-bytes``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SegmentAge", "expired"]


@dataclass(frozen=True, slots=True)
class SegmentAge:
    """What retention needs to know of a sealed segment."""

    name: str
    size: int
    last_ts_ns: int  # newest receive time in the segment


def expired(segments: list[SegmentAge], now_ns: int, keep_seconds: float | None = None,
            keep_bytes: int | None = None, live_bytes: int = 0) -> list[str]:
    """Names of segments to delete, oldest first.

    *segments* are the sealed ones in journal order; *live_bytes* is the size of the open
    segment, which counts toward ``keep_bytes`` but is never deleted."""
    doomed: list[str] = []
    total = live_bytes + sum(s.size for s in segments)
    for seg in segments:
        too_old = keep_seconds is not None and now_ns - seg.last_ts_ns > keep_seconds * 1e9
        too_big = keep_bytes is not None and total > keep_bytes
        if not (too_old or too_big):
            break
        doomed.append(seg.name)
        total -= seg.size
    return doomed
