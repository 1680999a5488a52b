"""Flood control, sans-IO: what to do with a packet a client cannot take right now.

The broker first tries to hand each packet to the kernel (a non-blocking send).
Only when that would block, or packets are already waiting, does this module
decide, following the client's most recent ``CMSG blocking/…`` and ``CMSG order/…``:

=============  ==============================================================
soft queue     (default) keep the packet in the client's queue
soft discard   drop the packet (counted, reported later)
soft block     keep it, and pause each publisher that sends to this client
               until the client's queue is empty again
soft error     the client is misbehaving: disconnect it
hard discard   (default) with soft queue, a queue at its byte limit (or whose user's
               budget of queued bytes is spent) drops new packets
hard block     with soft queue, a full queue pauses publishers until it is half empty
hard error     with soft queue, a full queue disconnects the client
order queue    (default) waiting packets leave oldest first
order stack    newest first
order random   largest first: the order that frees memory fastest (ties oldest first)
=============  ==============================================================

A paused publisher is simply not read from, so the kernel pushes back on it and on
nobody else.  Pausing is a privilege (`OutQueue.offer`'s *may_block*): a publisher the
subscriber may not pause is served as if the subscriber had chosen soft queue, hard
discard.

Every queued packet is charged its length plus `PACKET_OVERHEAD` (the memory a queue
entry costs besides the bytes), so a queue of tiny packets is bounded like any other.
A change of order re-sorts at most `REORDER_LIMIT` packets at once: on a longer queue
it takes effect once the queue has drained to that length, so that flipping the order
back and forth costs the broker next to nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from enum import Enum

from .defaults import DEFAULT_HARD, DEFAULT_ORDER, DEFAULT_SOFT
from .protocol import HARD, ORDER, SOFT

__all__ = ["Soft", "Hard", "Order", "Verdict", "OutQueue", "Budget", "parse_control",
           "PACKET_OVERHEAD"]

#: Bytes charged per queued packet besides its length (object header, queue slot).
PACKET_OVERHEAD = 64
#: ... and in a largest-first queue (a heap entry: a tuple and a sequence number).
HEAP_OVERHEAD = 160
#: Packets re-sorted at most when the order changes.
REORDER_LIMIT = 256


class Budget:
    """Bytes queued across several queues (one user's), with a cap: a full budget counts
    as a full queue for each of them."""

    __slots__ = ("limit", "queued")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queued = 0


class Soft(Enum):
    QUEUE = b"queue"
    DISCARD = b"discard"
    BLOCK = b"block"
    ERROR = b"error"


class Hard(Enum):
    DISCARD = b"discard"
    BLOCK = b"block"
    ERROR = b"error"


class Order(Enum):
    QUEUE = b"queue"
    STACK = b"stack"
    RANDOM = b"random"


#: A new client's policy, unless ``sbus serve`` was told otherwise.
DEFAULT_POLICY: tuple[Soft, Hard, Order] = (Soft(DEFAULT_SOFT), Hard(DEFAULT_HARD),
                                            Order(DEFAULT_ORDER))


class Verdict(Enum):
    QUEUED = 0  # kept; the writer will send it
    DROPPED = 1  # not kept; counted in `dropped`
    BLOCK = 2  # kept; the publisher must wait until `publisher_may_continue()`
    ERROR = 3  # the client is misbehaving and must be disconnected


def parse_control(key: bytes) -> Soft | Hard | Order | None:
    """The flood setting a ``CMSG`` key asks for, or None if it is not a flood key."""
    head, _, value = key.rpartition(b"/")
    try:
        if head == SOFT:
            return Soft(value)
        if head == HARD:
            return Hard(value)
        if head == ORDER:
            return Order(value)
    except ValueError:
        return None
    return None


class OutQueue:
    """One client's waiting packets, their policy, and the byte limit of the hard policy."""

    __slots__ = ("limit", "soft", "hard", "_order", "_next_order", "_overhead", "items", "_seq",
                 "nbytes", "dropped", "budget")

    def __init__(self, limit: int, budget: Budget | None = None) -> None:
        self.limit = limit
        self.budget = budget  # shared by all queues of one user, if limited
        self.soft = Soft.QUEUE
        self.hard = Hard.DISCARD
        self._order = Order.QUEUE
        self._next_order: Order | None = None  # asked for, waiting for a short queue
        self._overhead = PACKET_OVERHEAD
        self.items: deque[bytes] | list[tuple[int, int, bytes]] = deque()
        self._seq = itertools.count()
        self.nbytes = 0
        self.dropped = 0  # packets dropped since last `take_dropped()`

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)

    def apply(self, setting: Soft | Hard | Order) -> None:
        if isinstance(setting, Soft):
            self.soft = setting
        elif isinstance(setting, Hard):
            self.hard = setting
        else:
            self.order = setting

    @property
    def order(self) -> Order:
        """The order asked for last (it may still wait for the queue to get short)."""
        return self._next_order or self._order

    @order.setter
    def order(self, order: Order) -> None:
        self._next_order = None
        if order is self._order:
            return
        if len(self.items) > REORDER_LIMIT:
            self._next_order = order  # `pop` applies it once the queue is short
            return
        self._reorder(order)

    def _reorder(self, order: Order) -> None:
        self._next_order = None
        if self._order is Order.RANDOM:  # back to arrival order
            packets = [p for _, _, p in sorted(self.items, key=lambda item: item[1])]
        else:
            packets = list(self.items)
        self.clear()  # the re-push below charges the budget again
        self._order = order
        self._overhead = HEAP_OVERHEAD if order is Order.RANDOM else PACKET_OVERHEAD
        self.items = [] if order is Order.RANDOM else deque()
        for packet in packets:
            self._push(packet)

    def offer(self, packet: bytes, may_block: bool = True) -> Verdict:
        """A packet the kernel would not take now (or that must wait behind others).

        *may_block*: whether this client may pause the packet's publisher; if not, a
        blocking policy is served as soft queue, hard discard.
        """
        soft = self.soft
        if soft is Soft.DISCARD:
            self.dropped += 1
            return Verdict.DROPPED
        if soft is Soft.ERROR:
            return Verdict.ERROR
        if soft is Soft.BLOCK and may_block:
            self._push(packet)
            return Verdict.BLOCK
        budget = self.budget
        size = len(packet) + self._overhead
        if self.nbytes + size > self.limit or \
                budget is not None and budget.queued + size > budget.limit:
            hard = self.hard
            if hard is Hard.ERROR and soft is not Soft.BLOCK:
                return Verdict.ERROR
            if hard is Hard.BLOCK and soft is not Soft.BLOCK and may_block:
                self._push(packet)
                return Verdict.BLOCK
            self.dropped += 1
            return Verdict.DROPPED
        self._push(packet)
        return Verdict.QUEUED

    def force(self, packet: bytes) -> None:
        """Queue a packet whatever the policy (the broker's own replies)."""
        self._push(packet)

    def publisher_may_continue(self) -> bool:
        """Whether a publisher paused by this queue may go on.

        A full queue (hard block) lets publishers go on only once it is back to half
        its limit: resuming at the first free byte would pause them again at once and
        turn every message into a task switch.
        """
        if self.soft is Soft.BLOCK:
            return not self.items
        return self.hard is not Hard.BLOCK or self.nbytes <= self.limit // 2

    def peek(self) -> bytes:
        """The packet to send next."""
        items = self.items
        if self._order is Order.QUEUE:
            return items[0]
        if self._order is Order.STACK:
            return items[-1]
        return items[0][2]

    def pop(self) -> bytes:
        """Remove the packet `peek` returned (after the kernel took it)."""
        items = self.items
        if self._order is Order.QUEUE:
            packet = items.popleft()
        elif self._order is Order.STACK:
            packet = items.pop()
        else:
            packet = heapq.heappop(items)[2]
        size = len(packet) + self._overhead
        self.nbytes -= size
        if self.budget is not None:
            self.budget.queued -= size
        if self._next_order is not None and len(items) <= REORDER_LIMIT:
            self._reorder(self._next_order)
        return packet

    def take_dropped(self) -> int:
        n, self.dropped = self.dropped, 0
        return n

    def clear(self) -> None:
        if self.budget is not None:
            self.budget.queued -= self.nbytes
        self.items.clear()
        self.nbytes = 0

    def _push(self, packet: bytes) -> None:
        size = len(packet) + self._overhead
        self.nbytes += size
        if self.budget is not None:
            self.budget.queued += size
        if self._order is Order.RANDOM:
            heapq.heappush(self.items, (-len(packet), next(self._seq), packet))
        else:
            self.items.append(packet)
