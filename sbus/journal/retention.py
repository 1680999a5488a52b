"""Retention policy, pure: which sealed segments to delete (``--keep 7d`` / ``--keep-bytes``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["parse_duration", "parse_size", "SegmentAge", "expired"]

_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_UNITS_B = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_duration(text: str) -> float:
    """``"7d"`` -> seconds; units s, m, h, d, w (a bare number means seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * _UNITS_S[m.group(2) or "s"]


def parse_size(text: str) -> int:
    """``"10G"`` -> bytes; units k, M, G, T (powers of 1024), optional trailing B/iB."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 512M, 10G)")
    return int(float(m.group(1)) * _UNITS_B[m.group(2)])


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
