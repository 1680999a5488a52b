"""Received ``MSG`` packets to journal columns, a whole batch at a time.

The recorder receives packets into the equal slots of one buffer (`PacketBatch`).
Splitting each into key and payload in a Python loop cost about a microsecond per
message, which left the recorder slower than the broker it records.  Here a batch is
split by a fixed number of array operations, so the cost per message falls as batches
grow, and batches grow exactly when the recorder falls behind.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..protocol import MSG_VERB

__all__ = ["WIDEST", "Columns", "split"]

#: Batches with a longer packet are split one packet at a time: the array work grows with
#: the number of packets times the longest one.
WIDEST = 2048

# Narrow integers: comparisons broadcast over a whole batch run several times faster on them.
_COLS = np.arange(WIDEST, dtype=np.uint16)
_AFTER_VERB = _COLS >= 4
_MSG = int.from_bytes(MSG_VERB, "little")


class Columns(NamedTuple):
    """Keys and payloads of ``count`` messages, each column one buffer plus lengths."""

    count: int
    keys: np.ndarray | bytes  # the keys one after another
    key_lengths: np.ndarray   # integers, one per message
    payloads: np.ndarray      # uint8, one dimension
    payload_lengths: np.ndarray

    @classmethod
    def of(cls, keys: list[bytes], payloads: list[bytes]) -> Columns:
        """Columns of messages given one by one."""
        n = len(keys)
        return cls(n, np.frombuffer(b"".join(keys), np.uint8),
                   np.fromiter(map(len, keys), np.int64, n),
                   np.frombuffer(b"".join(payloads), np.uint8),
                   np.fromiter(map(len, payloads), np.int64, n))


def split(slots: np.ndarray, lengths: np.ndarray) -> Columns | None:
    """Split packets ``slots[i, :lengths[i]]`` (a uint8 array of rows, one packet at the start
    of each) that are all ``MSG key\\0payload``.

    None if any packet is something else (a control message, a malformed or empty packet)
    or longer than `WIDEST`: the caller then takes them one by one, in order.
    """
    n = len(lengths)
    if not n:
        return None
    width, shortest = int(lengths.max()), int(lengths.min())
    if shortest < 5 or width > WIDEST:  # MSG_VERB and a NUL: the shortest MSG
        return None
    rows = slots[:n, :width]
    head = rows[0, :shortest].tobytes()
    end = head.find(b"\0") + 1
    if end and head.startswith(MSG_VERB) and (rows[:, :end] == rows[0, :end]).all():
        # Every packet starts with the first one's "MSG key\0" (within the shortest
        # packet, so no stale byte is compared): one key, no search.
        keys = head[4:end - 1] * n
        key_lengths = np.full(n, end - 5, np.uint16)
        if shortest == width:  # and one length: the payloads are a rectangle
            return Columns(n, keys, key_lengths, rows[:, end:].flatten(),  # a copy
                           np.full(n, width - end, np.uint16))
        size = lengths.astype(np.uint16)
        return Columns(n, keys, key_lengths, rows[:, end:][_COLS[end:width] < size[:, None]],
                       size - end)
    if not (rows[:, :4].view("<u4") == _MSG).all():
        return None
    size = lengths.astype(np.uint16)
    cols = _COLS[:width]
    inside = cols < size[:, None]  # bytes beyond a packet's length are stale
    zero = rows == 0
    zero &= inside
    nul = zero.argmax(axis=1).astype(np.uint16)  # the first NUL in the packet, 0 if none
    if nul.min() < 4:
        return None
    at = nul[:, None]
    keys = rows[_AFTER_VERB[:width] & (cols < at)]
    payloads = rows[(cols > at) & inside]
    return Columns(n, keys, nul - 4, payloads, size - nul - 1)
