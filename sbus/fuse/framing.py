"""What a reader of a mounted file sees: messages framed as bytes, cut to read sizes.  Pure.

Formats (``sbus mount --format``):

* ``lines`` (default): each payload followed by a newline unless it already ends
  with one, so ``echo hi >`` on one side gives ``hi`` on the other; one ``read(2)``
  returns as many messages as fit.
* ``raw``: payloads verbatim and unframed, one message per ``read(2)`` so a program
  with a large enough buffer sees message boundaries; empty payloads are skipped
  (a zero-byte read would mean end of file).
* ``keyed``: like ``lines``, each payload preceded by its key and a space (as
  ``sbus sub`` and ``mosquitto_sub -v`` print), so a pattern's reader sees where each
  message came from;
* ``jsonl``: one JSON object per line with ``key``, ``payload`` (or
  ``payload_base64`` when it is not UTF-8) and ``time`` (seconds since the epoch when
  the mount received it), for programs that need keys of pattern subscriptions.

In every format a message longer than the reader's buffer continues in the next read.

Messages the broker dropped for a reader (it fell behind), or that it may have missed
(its connection was lost and made again: a broker restart that was no hand-over), are
never skipped without a word: in ``jsonl`` a line ``{"dropped": N, "time": T}`` stands
where they were (N null after a reconnect: the broker does not say how many); in the
other formats, which have no room for it, the read that reaches that place fails once
with ENOBUFS ("No buffer space available") and the next one goes on after it
(`Outbox.push_gap`).
"""

from __future__ import annotations

import base64
import json
from collections import deque

__all__ = ["FORMATS", "frame", "dropped_frame", "Outbox"]

FORMATS = ("lines", "raw", "keyed", "jsonl")


def frame(fmt: str, key: bytes, payload: bytes, when: float) -> bytes:
    """The bytes one message contributes to the stream (empty: nothing to show)."""
    if fmt == "lines":
        return payload if payload.endswith(b"\n") else payload + b"\n"
    if fmt == "raw":
        return payload
    if fmt == "keyed":
        return key + b" " + (payload if payload.endswith(b"\n") else payload + b"\n")
    if fmt == "jsonl":
        record: dict[str, object] = {"key": key.decode("utf-8", "backslashreplace")}
        try:
            record["payload"] = payload.decode("utf-8")
        except UnicodeDecodeError:
            record["payload_base64"] = base64.b64encode(payload).decode("ascii")
        record["time"] = round(when, 6)
        # escaped to ASCII: a key's C1 controls (``\u009b`` is CSI) and bidi overrides
        # must not reach a terminal that shows the stream raw (the audit of 2026-11-28)
        return json.dumps(record).encode() + b"\n"
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def dropped_frame(count: int | None, when: float) -> bytes:
    """The ``jsonl`` line standing where *count* messages were dropped (None: some may
    have been, how many is not known)."""
    return json.dumps({"dropped": count, "time": round(when, 6)}).encode() + b"\n"


class _Gap:
    """Where messages were dropped, and how many (None: not known) (`Outbox.push_gap`)."""

    __slots__ = ("count",)

    def __init__(self, count: int | None) -> None:
        self.count = count


class Outbox:
    """Framed messages waiting for ``read(2)``, and the places where some were dropped.

    *one_per_read* keeps message boundaries (``raw``): a read returns the rest of
    one message at most.  Otherwise reads are filled across messages, up to a gap.
    """

    __slots__ = ("one_per_read", "_items", "_offset", "nbytes")

    def __init__(self, one_per_read: bool = False) -> None:
        self.one_per_read = one_per_read
        self._items: deque[bytes | _Gap] = deque()
        self._offset = 0  # bytes of _items[0] already read
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def push(self, data: bytes) -> None:
        if data:
            self._items.append(data)
            self.nbytes += len(data)

    def push_gap(self, count: int | None) -> None:
        """*count* messages were dropped here (None: some may have been): the read that
        reaches this place learns of it (`gap`), once for gaps in a row."""
        items = self._items
        if items and type(items[-1]) is _Gap:
            last = items[-1]
            last.count = None if last.count is None or count is None else last.count + count
        else:
            items.append(_Gap(count))

    def gap(self) -> int | None | bool:
        """Whether a gap is at the head: False if not, else how many were dropped there
        (None: not known), and it is gone from the head."""
        items = self._items
        if items and type(items[0]) is _Gap:
            return items.popleft().count
        return False

    def take(self, size: int) -> bytes:
        """Up to *size* bytes (at least one unless empty or at a gap), up to a gap."""
        items = self._items
        if not items or size <= 0 or type(items[0]) is _Gap:
            return b""
        first = items[0]
        rest = len(first) - self._offset
        if rest > size or self.one_per_read:
            n = min(rest, size)
            out = first[self._offset:self._offset + n]
            self._consume_first(n)
            return out
        parts = [first[self._offset:] if self._offset else first]
        items.popleft()
        self._offset = 0
        room = size - rest
        while items and type(items[0]) is not _Gap and len(items[0]) <= room:
            item = items.popleft()
            parts.append(item)
            room -= len(item)
        if items and room and type(items[0]) is not _Gap:
            parts.append(items[0][:room])
            self._offset = room
            room = 0
        self.nbytes -= size - room
        return b"".join(parts)

    def _consume_first(self, n: int) -> None:
        self._offset += n
        self.nbytes -= n
        if self._offset == len(self._items[0]):
            self._items.popleft()
            self._offset = 0
