"""A remote client's bounded outgoing buffer: pure bookkeeping, no I/O.

The pubsub design deals with slow readers by giving each client a fixed buffer
and discarding *new* messages while it is full, so a slow client loses only its
own messages and never slows the bus or other clients.  The bound is both a
message count and a byte count; messages are counted when discarded.  The clients
of one peer address share one more bound (`admission.Peer.queued`), so one host's
many connections cannot hold more than its share either.

Keep-alive echoes are `force`d past a full buffer: they are one byte and keep the
client alive.  A frame fanned out to many clients is one `Shared` object: the
gateway's pool (`--buffer-pool`) is charged its bytes once, when the first outbox
takes it, and given them back when the last outbox lets it go, so the pool counts
the bytes really held, not one copy per subscriber.
"""

from __future__ import annotations

from collections import deque

from .admission import Peer, Pool

__all__ = ["Outbox", "Shared"]


class Shared:
    """One frame queued in any number of outboxes; *pool* is charged once while held."""

    __slots__ = ("data", "refs", "pool")

    def __init__(self, data: bytes, pool: Pool | None = None) -> None:
        self.data = data
        self.refs = 0
        self.pool = pool

    def hold(self, pool: Pool) -> None:
        """Charge *pool* for the frame (once: call when an outbox took it)."""
        self.pool = pool
        pool.used += len(self.data)

    def release(self) -> None:
        self.refs -= 1
        if not self.refs and self.pool is not None:
            self.pool.used -= len(self.data)
            self.pool = None


class Outbox:
    __slots__ = ("max_messages", "max_bytes", "frames", "size", "dropped", "dropped_total",
                 "peer")

    def __init__(self, max_messages: int = 100, max_bytes: int = 1 << 20,
                 peer: Peer | None = None) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("an outgoing buffer needs room for at least one message")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.frames: deque[Shared] = deque()
        self.size = 0
        #: Discarded since the last `take_dropped`, and ever.
        self.dropped = 0
        self.dropped_total = 0
        #: The peer address this client shares a queued-bytes bound with.
        self.peer = peer if peer is not None else Peer("")

    def offer(self, frame: Shared) -> int:
        """Queue *frame* if there is room: 1 if the buffer was empty (wake the writer),
        2 if it was not; 0 if full (its own bound or its address's), when the frame is
        counted as discarded.

        A frame larger than the byte bound on its own is still accepted into an empty
        buffer, so a bound below the frame limit cannot starve a client.  The shared
        pool is charged by the caller, once per fan-out (`Gateway._deliver`).
        """
        frames = self.frames
        n = len(frames)
        size = len(frame.data)
        peer = self.peer
        if n and (n >= self.max_messages or self.size + size > self.max_bytes
                  or peer.queued + size > peer.queue_limit):
            self.dropped += 1
            self.dropped_total += 1
            return 0
        frame.refs += 1
        frames.append(frame)
        self.size += size
        peer.queued += size
        return 2 if n else 1

    def discard(self) -> None:
        """Count a frame discarded for this client by the caller (the pool was full)."""
        self.dropped += 1
        self.dropped_total += 1

    def force(self, data: bytes) -> bool:
        """Queue *data* even when the buffer is full of messages (keep-alive echoes),
        but not beyond twice the message bound: a peer that sends keep-alives and never
        reads must not grow the buffer without end.  False (not counted) if refused."""
        if len(self.frames) >= 2 * self.max_messages:
            return False
        frame = Shared(data)
        frame.refs = 1
        self.frames.append(frame)
        self.size += len(data)
        self.peer.queued += len(data)
        return True

    def take(self, limit: int = 256 * 1024) -> bytes:
        """Remove and return queued frames joined, about *limit* bytes at most (at least one)."""
        frames = self.frames
        out = []
        n = 0
        while frames and (not out or n < limit):
            frame = frames.popleft()
            data = frame.data
            if n and n + len(data) > limit:
                frames.appendleft(frame)
                break
            frame.release()
            out.append(data)
            n += len(data)
        self.size -= n
        self.peer.queued -= n
        return out[0] if len(out) == 1 else b"".join(out)

    def clear(self) -> None:
        """Forget every queued frame (the connection is gone) and give their bytes back."""
        for frame in self.frames:
            frame.release()
        self.peer.queued -= self.size
        self.frames.clear()
        self.size = 0

    def take_dropped(self) -> int:
        n, self.dropped = self.dropped, 0
        return n

    def __len__(self) -> int:
        return len(self.frames)

    def __bool__(self) -> bool:
        return bool(self.frames)
