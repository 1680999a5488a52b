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

While the pool is full, a frame offered to a client whose address holds less than a
fair part of it (`make_room`) takes the place of the oldest frames queued for the
address holding the most, as the broker's flood policy drops the heaviest user's
first: a prompt reader is not starved by hosts whose clients never read.  Every
discard is counted by the bound that caused it (`OWN`, `SHARE`, `POOL`), per client and
per address.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Iterable

from .admission import Peer, Pool

__all__ = ["CAUSES", "OWN", "POOL", "SHARE", "Echo", "Outbox", "Shared", "make_room"]

#: Why a message was discarded for a client: its own buffer was full, its address's
#: share of queued bytes, or the gateway's pool (`Outbox.dropped_by`, `Peer.dropped`).
OWN, SHARE, POOL = 0, 1, 2
CAUSES = ("its buffer full", "its address's share full", "the buffer pool full")
#: Frames dropped from other queues to make room for one frame, at most: past that the
#: frame is discarded instead (the work for one frame stays small).
EVICT_MAX = 256
#: Searches for the addresses holding the most, at most, in making room for one frame.
SEARCHES = 2
#: Seconds a client's socket took nothing, at least, before the unwritten end of a frame
#: it holds in the full pool is taken by ending its connection (`Outbox.cut`).
STALLED = 1.0
#: Addresses taken from in turn, at most, found by one search: the heaviest.  Room is
#: made from messages that up to `SEARCHES` times as many addresses hold (past that,
#: the frame is discarded, counted and said).
CANDIDATES = 64


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


class Rest(Shared):
    """The unwritten end of a frame partly written: its client's own copy, charged to the
    pool as the frame was, never evicted (the stream would break)."""

    __slots__ = ()


class Echo(Shared):
    """A keep-alive echo: queued past the bounds (`Outbox.force`), never charged nor
    evicted."""

    __slots__ = ()


class Outbox:
    __slots__ = ("max_messages", "max_bytes", "frames", "size", "dropped_by", "peer",
                 "messages", "progress", "cut")

    #: Times any outbox crossed its message bound, up or down: a fan-out that judged
    #: which clients are full (`Gateway._deliver`) may go on trusting that judgement
    #: while this stays the same.
    crossings = 0

    def __init__(self, max_messages: int = 100, max_bytes: int = 1 << 20,
                 peer: Peer | None = None) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("an outgoing buffer needs room for at least one message")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.frames: deque[Shared] = deque()
        self.size = 0
        #: Discarded ever, by cause (`OWN`, `SHARE`, `POOL`); the only count kept, as a
        #: client that never reads is counted here for every message.
        self.dropped_by = [0, 0, 0]
        #: The peer address this client shares a queued-bytes bound with.
        self.peer = peer if peer is not None else Peer("")
        self.messages = 0  # queued whole, which `evict` may take (not echoes nor a rest)
        self.progress = 0.0  # when a frame was last partly written: its `Rest` made
        #: Ends the connection (the server's), to free the unwritten end of a frame its
        #: socket took nothing of for `STALLED` seconds while the pool is full.
        self.cut: Callable[[], None] | None = None

    def offer(self, frame: Shared) -> int:
        """Queue *frame* if there is room: 1 if the buffer was empty (wake the writer),
        2 if it was not; 0 if full (its own bound or its address's), when the frame is
        counted as discarded.

        A frame larger than the byte bound on its own is still accepted into an empty
        buffer, so a bound below the frame limit cannot starve a client.  The shared
        pool is charged by the caller, once per fan-out (`Gateway._offer`).
        """
        frames = self.frames
        n = len(frames)
        size = len(frame.data)
        peer = self.peer
        if n:
            if n >= self.max_messages or self.size + size > self.max_bytes:
                cause = OWN
            elif peer.queued + size > peer.queue_limit:
                cause = SHARE
            else:
                cause = -1
            if cause >= 0:  # (inline: a client that never reads comes here per message)
                self.dropped_by[cause] += 1
                peer.dropped[cause] += 1
                return 0
        frame.refs += 1
        frames.append(frame)
        self.messages += 1
        self.size += size
        peer.queued += size
        if n + 1 == self.max_messages:
            Outbox.crossings += 1  # full now
        return 2 if n else 1

    def fits(self, size: int) -> bool:
        """Whether `offer` would queue a frame of *size* bytes."""
        n = len(self.frames)
        return not n or (n < self.max_messages and self.size + size <= self.max_bytes
                         and self.peer.queued + size <= self.peer.queue_limit)

    def discard(self, cause: int = POOL) -> None:
        """Count a frame discarded for this client, and for its address, by *cause*."""
        self.dropped_by[cause] += 1
        self.peer.dropped[cause] += 1

    def evict(self) -> bool:
        """Drop the oldest queued message to make room in the full pool, counted as
        discarded for this client; False if it holds none.  Echoes stay (any message
        behind them may go: echoes a client that never reads queues once made them all
        stay), and so does the `Rest` of a frame partly written (the stream needs it),
        unless the socket took nothing for `STALLED` seconds: then the connection is
        `cut` (one non-reader's rests of 60 KB frames held the whole 4 MiB pool, and a
        prompt reader got nothing)."""
        frames = self.frames
        if not self.messages:
            if frames and type(frames[0]) is Rest and self.cut is not None \
                    and time.monotonic() - self.progress > STALLED:  # (`done`)
                self.discard(POOL)
                self.cut()
                return True
            return False
        for i in range(len(frames)):
            frame = frames[i]
            if type(frame) is Shared and frame.pool is not None:
                if len(frames) == self.max_messages:
                    Outbox.crossings += 1  # room again
                del frames[i]
                self.messages -= 1
                size = len(frame.data)
                self.size -= size
                self.peer.queued -= size
                frame.release()
                self.discard(POOL)
                return True
        return False

    def force(self, data: bytes, extra: int = 0) -> bool:
        """Queue *data* even when the buffer is full of messages (keep-alive echoes),
        but not beyond twice the message bound (and *extra* frames more): a peer that
        sends keep-alives and never reads must not grow the buffer without end.  False
        (not counted) if refused; always once the connection is being cut."""
        bound = self.max_messages
        if not bound or len(self.frames) >= 2 * bound + extra:
            return False
        frame = Echo(data)
        frame.refs = 1
        self.frames.append(frame)
        self.size += len(data)
        self.peer.queued += len(data)
        if len(self.frames) == self.max_messages:
            Outbox.crossings += 1
        return True

    def peek(self, limit: int = 256 * 1024) -> bytes:
        """The queued frames from the oldest, joined, about *limit* bytes at most (at least
        one), left queued: `done` removes what was written of them."""
        frames = self.frames
        first = frames[0].data
        if len(frames) == 1 or len(first) >= limit:
            return first
        out = []
        n = 0
        for frame in frames:
            data = frame.data
            if n and n + len(data) > limit:
                break
            out.append(data)
            n += len(data)
        return b"".join(out)

    def done(self, n: int) -> None:
        """The first *n* bytes of `peek` were written: their whole frames are removed, a
        frame partly written is replaced by its unwritten `Rest` (at most one per client)."""
        frames = self.frames
        if len(frames) >= self.max_messages:
            Outbox.crossings += 1  # (room again, unless only a rest was written)
        self.size -= n
        self.peer.queued -= n
        while n:
            frame = frames[0]
            size = len(frame.data)
            self.messages -= type(frame) is Shared
            if size > n:  # a rest: the socket took nothing more while it is at the head
                self.progress = time.monotonic()  # (one written in part is made anew)
                rest = Rest(frame.data[n:])
                rest.refs = 1
                if frame.pool is not None:
                    rest.hold(frame.pool)
                frames[0] = rest
                frame.release()
                return
            frames.popleft()
            frame.release()
            n -= size

    def take(self, limit: int = 256 * 1024) -> bytes:
        """Remove and return queued frames joined, about *limit* bytes at most (at least one)."""
        data = self.peek(limit)
        self.done(len(data))
        return data

    def clear(self) -> None:
        """Forget every queued frame (the connection is gone) and give their bytes back."""
        if len(self.frames) >= self.max_messages:
            Outbox.crossings += 1
        for frame in self.frames:
            frame.release()
        self.peer.queued -= self.size
        self.frames.clear()
        self.size = 0
        self.messages = 0

    @property
    def dropped(self) -> int:
        """Messages discarded for this client, ever."""
        return sum(self.dropped_by)

    def __len__(self) -> int:
        return len(self.frames)

    def __bool__(self) -> bool:
        return bool(self.frames)


def make_room(pool: Pool, size: int, peers: Callable[[], Iterable[Peer]], fair: int) -> bool:
    """Make *size* bytes of room in the full *pool* for a client whose address holds less
    than *fair* bytes queued, by evicting the oldest frames queued for the address that
    holds the most (round robin over its clients), while it holds more than *fair*:
    whether there is room now.

    A frame fanned out is freed only when every client holding it let it go, so frames
    go from the heaviest of up to `CANDIDATES` addresses above their fair part, each
    time from the one holding the most (a heap): addresses holding the same frames lose
    them in turn.  The candidates are found by one search of *peers* (the addresses) and
    remembered in the pool with the most an address left out held; the search is made
    again when none is left above its fair part, or none above that.  At most
    `EVICT_MAX` frames go and `SEARCHES` searches are made per call."""
    heap = _heaviest_first(pool.heaviest, fair)
    searches = 0
    for _ in range(EVICT_MAX):
        if pool.used + size <= pool.limit:
            break
        if not heap or -heap[0][0] < pool.left_out:
            searches += 1
            if searches > SEARCHES:
                break
            heavy = heapq.nlargest(CANDIDATES + 1, (p for p in peers() if p.conns),
                                   key=_queued)
            pool.left_out = heavy.pop().queued if len(heavy) > CANDIDATES else 0
            heap = _heaviest_first(heavy, fair)
            if not heap:
                break
        victim = heapq.heappop(heap)[2]
        if _evict_one(victim) and victim.queued > fair:  # (else down to its fair part,
            heapq.heappush(heap, (-victim.queued, id(victim), victim))  # or all kept)
    pool.heaviest = [entry[2] for entry in heap]
    return pool.used + size <= pool.limit


def _heaviest_first(peers: Iterable[Peer], fair: int) -> list[tuple[int, int, Peer]]:
    """A heap of the connected *peers* holding more than *fair*, the most first."""
    heap = [(-p.queued, id(p), p) for p in peers if p.queued > fair and p.conns]
    heapq.heapify(heap)
    return heap


def _queued(peer: Peer) -> int:
    return peer.queued


def _evict_one(peer: Peer) -> bool:
    """Evict the oldest frame of the next of *peer*'s clients that has one."""
    boxes = peer.boxes
    for _ in range(len(boxes)):
        peer.evict_at = (peer.evict_at + 1) % len(boxes)
        if boxes[peer.evict_at].evict():
            return True
    return False
