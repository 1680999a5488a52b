"""A remote client's bounded outgoing buffer: pure bookkeeping, no I/O.

The pubsub design deals with slow readers by giving each client a fixed buffer
and discarding *new* messages while it is full, so a slow client loses only its
own messages and never slows the bus or other clients.  The bound is both a
message count and a byte count; messages are counted when discarded.
Keep-alive echoes are `force`d past a full buffer: they are one byte and keep the
client alive.  An optional shared `Pool` bounds all outboxes together, so many slow
readers cannot add up to more than the pool (a frame shared by many outboxes is
counted once for each: a safe over-estimate).
"""

from __future__ import annotations

from collections import deque

from .admission import Pool

__all__ = ["Outbox"]


class Outbox:
    __slots__ = ("max_messages", "max_bytes", "frames", "size", "dropped", "dropped_total",
                 "pool")

    def __init__(self, max_messages: int = 100, max_bytes: int = 1 << 20,
                 pool: Pool | None = None) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("an outgoing buffer needs room for at least one message")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.frames: deque[bytes] = deque()
        self.size = 0
        #: Discarded since the last `take_dropped`, and ever.
        self.dropped = 0
        self.dropped_total = 0
        self.pool = pool

    def offer(self, frame: bytes) -> int:
        """Queue *frame* if there is room: 1 if the buffer was empty (wake the writer),
        2 if it was not; 0 if full, when the frame is counted as discarded.

        A frame larger than the byte bound on its own is still accepted into an
        empty buffer, so a bound below the frame limit cannot starve a client.
        The shared pool is *not* charged here but by the caller, once per fan-out
        (`Gateway._deliver`: this is the hot path); `take` and `clear` give back.
        """
        frames = self.frames
        n = len(frames)
        if n and (n >= self.max_messages or self.size + len(frame) > self.max_bytes):
            self.dropped += 1
            self.dropped_total += 1
            return 0
        frames.append(frame)
        self.size += len(frame)
        return 2 if n else 1

    def discard(self) -> None:
        """Count a frame discarded for this client by the caller (the pool was full)."""
        self.dropped += 1
        self.dropped_total += 1

    def force(self, frame: bytes) -> bool:
        """Queue *frame* even when the buffer is full of messages (keep-alive echoes),
        but not beyond twice the message bound: a peer that sends keep-alives and never
        reads must not grow the buffer without end.  False (not counted) if refused."""
        if len(self.frames) >= 2 * self.max_messages:
            return False
        if self.pool is not None:
            self.pool.used += len(frame)  # one byte: may pass the pool by 2 * max_messages
        self.frames.append(frame)
        self.size += len(frame)
        return True

    def take(self, limit: int = 256 * 1024) -> bytes:
        """Remove and return queued frames joined, about *limit* bytes at most (at least one)."""
        frames = self.frames
        if len(frames) == 1 or frames[0].__len__() >= limit:
            frame = frames.popleft()
            n = len(frame)
            self.size -= n
            if self.pool is not None:
                self.pool.used -= n
            return frame
        out = []
        n = 0
        while frames and n < limit:
            frame = frames.popleft()
            out.append(frame)
            n += len(frame)
        self.size -= n
        if self.pool is not None:
            self.pool.used -= n
        return b"".join(out)

    def clear(self) -> None:
        """Forget every queued frame (the connection is gone) and give their bytes back."""
        if self.pool is not None:
            self.pool.used -= self.size
        self.frames.clear()
        self.size = 0

    def take_dropped(self) -> int:
        n, self.dropped = self.dropped, 0
        return n

    def __len__(self) -> int:
        return len(self.frames)

    def __bool__(self) -> bool:
        return bool(self.frames)
