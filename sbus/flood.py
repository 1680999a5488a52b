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
               budget of queued bytes is spent) drops a packet: the new one, or the
               oldest of a user (publisher's UID) holding over twice as much as the
               new one's user, so that a user holding little always gets in (see
               "A share for each user" below)
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
A share for each user: a full queue gives way to a publisher's user (UID) holding less than
half of what another user holds of it.  The oldest packets of users holding over twice
what the arriving packet's user would are dropped in its place (counted and reported like
any drop; `Verdict.EVICTED`), so one user flooding a subscriber loses its own packets, not
everybody's, and a subscriber that carries many users (the bridge, a shared reader) loses
only the flooder's.  The search looks at the oldest `EVICT_SCAN` packets of the queue;
under ``order random`` (a heap) the arriving packet is dropped as before.  Packets the
broker queues itself (`force`) have no user and never give way; those a predecessor
handed over keep their users (`carry_over`).

Turns for each user: in ``order/queue`` a queue holding packets of two users or more
sends them in turns, a packet of each user's (oldest first) in a round, the broker's own
replies taking turns as one more user.  A subscriber that carries many users (the
bridge, the gateway's bus connection) used to send its waiting packets in arrival
order, so after a flooder had filled its queue every other user's message waited for
the whole of it (3–8 s behind the bridge in the audit of 2026-11-27, with nothing lost);
now it waits for one packet of each user.  Each user's packets, and the broker's
replies among themselves, keep their order; while one user holds them all the queue is
the plain deque it always was.

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
#: Bytes charged per user taking turns in a queue (its lane: a deque, and its entries in
#: the turns and the counts per user; ~920 measured), to that user: a carrier naming a
#: user per packet must not make a queue hold ten times what it is charged (the audit of
#: 2026-11-27: 75,000 addresses through the gateway, 800 MB in 16 unread queues).
LANE_OVERHEAD = 1024
#: Bytes charged per user counted in a queue (its entry in `OutQueue.held`: ~100
#: measured), to that user, in every order (a user holding one packet in each of many
#: queues held that much more than it was charged).
USER_OVERHEAD = 128
#: Packets re-sorted at most when the order changes.
REORDER_LIMIT = 256
#: Packets looked at, oldest first, for those that give way to one arriving packet.
EVICT_SCAN = 64
#: Users counted in one queue beyond which the search for the heaviest is spread out:
#: once in every len(held) // SEARCH_SPREAD offers (a trusted carrier can name many).
SEARCH_SPREAD = 16


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
    EVICTED = 4  # kept in place of `OutQueue.evicted` packets of a heavier user (dropped)


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
                 "nbytes", "dropped", "budget", "owners", "held", "_top", "_stale", "_unowned",
                 "evicted", "_searched_ago", "lanes", "_count", "_carried", "_carried_below",
                 "_lane", "_user", "report_in")

    def __init__(self, limit: int, budget: Budget | None = None,
                 lane_overhead: int = LANE_OVERHEAD,
                 user_overhead: int = USER_OVERHEAD) -> None:
        self.limit = limit
        # (tests of the share's rules set both 0: exact sums)
        self._lane, self._user = lane_overhead, user_overhead
        self.budget = budget  # shared by all queues of one user, if limited
        self.soft = Soft.QUEUE
        self.hard = Hard.DISCARD
        self._order = Order.QUEUE
        self._next_order: Order | None = None  # asked for, waiting for a short queue
        self._overhead = PACKET_OVERHEAD
        #: the waiting packets, true while any wait (what the broker asks): a deque, a
        #: heap in ``order/random``, or with `lanes` the users whose turn comes, in order
        self.items: deque = deque()
        # beside `items` (not in a heap); both made at the first queued packet, since
        # most clients never have one (an empty deque costs 770 bytes)
        self.owners: deque[int | None] | None = None
        #: with two users' packets waiting in ``order/queue``: each user's, oldest first
        #: (None: the broker's replies), taken in turns (module docstring)
        self.lanes: dict[int | None, deque[bytes]] | None = None
        self._count = 0  # packets in `lanes`
        #: packets a predecessor handed over (`carry_over`), still first in the deque:
        #: no turns until they are gone (their users are not known: format 2)
        self._carried = 0
        self._carried_below = 0  # ... in a heap: those numbered below this
        # bytes queued per user (publisher's UID), counted once a second user's packet
        # waits (`_count_users`): while one user holds them all, that is `nbytes` less
        # `_unowned`, and the queued path pays nothing for the share
        self.held: dict[int, int] | None = None
        self._top: int | None = None  # the user holding the most (`_heaviest`) ...
        self._stale = False  # ... unless its holding went down since
        self._searched_ago = 0  # offers that took a stale `_top` as it was (`_heaviest`)
        self._unowned = 0  # bytes of packets without a user (`force`)
        self._seq = itertools.count()
        self.nbytes = 0
        self.dropped = 0  # packets dropped since last `take_dropped()`
        #: packets to send before their report is due, counted from the first write turn
        #: after a drop (`BrokerCore.writable`); None while none is pending
        self.report_in: int | None = None
        self.evicted = 0  # packets the last `Verdict.EVICTED` dropped

    def __len__(self) -> int:
        return self._count if self.lanes is not None else len(self.items)

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
        if len(self) > REORDER_LIMIT:
            self._next_order = order  # `pop` applies it once the queue is short
            return
        self._reorder(order)

    def _reorder(self, order: Order) -> None:
        self._next_order = None
        queued = self._arrivals()
        carried = self._carried  # (first among `_arrivals`: kept first, `carry_over`)
        self.clear()  # the re-push below charges the budget again
        self._order = order
        self._overhead = HEAP_OVERHEAD if order is Order.RANDOM else PACKET_OVERHEAD
        self.items = [] if order is Order.RANDOM else deque()
        self._carried = carried
        for n, (packet, owner) in enumerate(queued):
            if n == carried and order is Order.RANDOM:
                self._carried_below = next(self._seq)
            self._push(packet, owner)

    def _arrivals(self) -> list[tuple[bytes, int | None]]:
        """The queued packets and their users, oldest first (with `lanes`: in the order
        they would be sent)."""
        if self._order is Order.RANDOM:  # a heap: back to arrival order
            return [(p, o) for _, _, p, o in sorted(self.items, key=lambda item: item[1])]
        if self.lanes is not None:
            return self._in_turns()
        return list(zip(self.items, self.owners or (), strict=True))

    def _in_turns(self) -> list[tuple[bytes, int | None]]:
        """The packets of `lanes` in the order `pop` takes them."""
        lanes = self.lanes or {}
        out: list[tuple[bytes, int | None]] = []
        turn = [(owner, iter(lanes[owner])) for owner in self.items]
        while turn:
            left = []
            for owner, packets in turn:
                packet = next(packets, None)
                if packet is not None:
                    out.append((packet, owner))
                    left.append((owner, packets))
            turn = left
        return out

    def arrival_order(self) -> list[tuple[bytes, int | None]]:
        """The queued packets and their users, oldest first (what a successor is handed),
        or with `lanes` in the order they would be sent."""
        return self._arrivals()

    def offer(self, packet: bytes, may_block: bool = True, owner: int | None = None) -> Verdict:
        """A packet the kernel would not take now (or that must wait behind others).

        *may_block*: whether this client may pause the packet's publisher; if not, a
        blocking policy is served as soft queue, hard discard.  *owner*: the publisher's
        user, whose share of a full queue decides what is dropped (None: no share).
        """
        soft = self.soft
        if soft is Soft.DISCARD:
            self.dropped += 1
            return Verdict.DROPPED
        if soft is Soft.ERROR:
            return Verdict.ERROR
        if soft is Soft.BLOCK and may_block:
            self._push(packet, owner)
            return Verdict.BLOCK
        budget = self.budget
        size = len(packet) + self._overhead
        if self.lanes is not None and owner not in self.lanes:
            size += self._lane  # (what `_push` will charge)
        if self.held is not None and owner is not None and owner not in self.held:
            size += self._user
        if self.nbytes + size > self.limit or \
                budget is not None and budget.queued + size > budget.limit:  # (`_fits`)
            hard = self.hard
            if hard is Hard.ERROR and soft is not Soft.BLOCK:
                return Verdict.ERROR
            if hard is Hard.BLOCK and soft is not Soft.BLOCK and may_block:
                self._push(packet, owner)
                return Verdict.BLOCK
            if owner is not None and (owner != self._top or self._stale):  # (a flooder: no)
                held = self.held
                if held is None and self._top is not None:
                    held = self._count_users()
                if held and self._order is not Order.RANDOM:
                    top = self._heaviest() if self._stale else self._top
                    if top is not None and top != owner and \
                            held[top] > 2 * (held.get(owner, 0) + size) and \
                            self._give_way(owner, size, top):
                        self._push(packet, owner)
                        return Verdict.EVICTED
            self.dropped += 1
            return Verdict.DROPPED
        self._push(packet, owner)
        return Verdict.QUEUED

    def _give_way(self, owner: int, size: int, top: int) -> bool:
        """Make room for *size* bytes of *owner* by dropping the oldest packets of users
        holding over twice what *owner* would (`offer` saw that the heaviest does);
        whether the room is there (`evicted` says how many went).  The factor of two
        ends the churn of users holding about alike giving way to each other with every
        packet (4 µs each) once a queue never drains: they lose the arriving packet
        instead, and a user holding little still gets in.  The search starts at the
        oldest packet, where a flood that filled the queue lies, and looks at
        `EVICT_SCAN` packets at most: to hide a heavy user's packets behind them, that
        many would have to come from users holding little.  With `lanes`, the oldest of
        the heaviest user (*top*) go, `EVICT_SCAN` at most."""
        held = self.held
        if self.lanes is not None:
            return self._lane_gives_way(size, top)
        twice = 2 * (held.get(owner, 0) + size)
        items, owners = self.items, self.owners
        evicted = i = 0
        for _ in range(min(EVICT_SCAN, len(owners))):
            victim = owners[i]
            if victim is None or held[victim] <= twice:
                i += 1
                continue
            packet = items[i]
            del items[i]
            del owners[i]
            self._uncharge(len(packet) + self._overhead, victim)
            evicted += 1
            if self._fits(size):
                break
        self.evicted = evicted
        self.dropped += evicted
        return self._fits(size)  # if not, what went stays gone (counted): fairer for it

    def _lane_gives_way(self, size: int, top: int) -> bool:
        """`_give_way` with `lanes`: *top*'s oldest packets go until *size* fits."""
        lanes = self.lanes or {}
        lane = lanes[top]
        evicted = 0
        while lane and evicted < EVICT_SCAN and not self._fits(size):
            packet = lane.popleft()
            self._count -= 1
            self._uncharge(len(packet) + self._overhead, top)
            evicted += 1
        if not self._count:  # (else an empty lane is left: `_front` drops it)
            self._leave_lanes()
        self.evicted = evicted
        self.dropped += evicted
        return self._fits(size)

    def _fits(self, size: int) -> bool:
        """Whether *size* more bytes fit under the queue's limit and its user's budget
        (`offer` asks it inline: the queued path)."""
        budget = self.budget
        return self.nbytes + size <= self.limit and \
            (budget is None or budget.queued + size <= budget.limit)

    def _count_users(self) -> dict[int, int]:
        """Start counting bytes per user: a second user's packet came.  Until now one
        user (`_top`) held every packet that has a user."""
        mine = self.nbytes - self._unowned
        self.held = {self._top: mine + self._user} if mine else {}
        if mine:  # its entry
            self._more(self._user)
        self._stale = not mine  # (`_push` names the new heaviest then)
        return self.held

    def _heaviest(self) -> int | None:
        """The user holding the most of the queue, searched for again once its holding
        went down (`_push` keeps it otherwise): a full queue's drops change nothing, so
        there a flooder's drop costs two comparisons, and another user's two lookups.
        Among many users (a carrier naming each, each holding a packet: every pop took
        the top's, and each search was O(users), 1.5 ms with 59,000) the search is made
        once in len(held) // `SEARCH_SPREAD` offers; meanwhile the last top if it still
        holds any (`offer` compares what it holds now), else None: nobody gives way
        then, which is right where users hold alike, and a flooder that holds much
        stays the top."""
        held = self.held or {}
        top = self._top
        if self._searched_ago < len(held) // SEARCH_SPREAD:
            self._searched_ago += 1
            return top if top in held else None
        self._top = max(held, key=held.__getitem__, default=None)
        self._stale = False
        self._searched_ago = 0
        return self._top

    def force(self, packet: bytes) -> None:
        """Queue a packet whatever the policy (the broker's own replies): it has no user
        and never gives way."""
        self._push(packet, None)

    def carry_over(self, packets: list[bytes], owners: list[int | None] | None = None) -> None:
        """Queue what a predecessor had queued (a hand-over), whatever the limits, as
        `force` does.  With their *owners* (users) they are queued as they came, each in
        its user's share and turn, and give way as any packet does: a flooder's do not
        crowd out the others' after the restart.  Without (a predecessor that did not
        hand its users over) they have no user and go first, before any turns: they
        hold publishers' older packets, and a turn of a publisher's newer packet would
        pass them; they stay first through changes of order (`_reorder`)."""
        if owners is not None:
            for packet, owner in zip(packets, owners, strict=True):
                self._push(packet, owner)
            return
        for packet in packets:
            self._push(packet, None)
        self._carried += len(packets)
        if self._order is Order.RANDOM:
            self._carried_below = next(self._seq)

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
            if self.lanes is not None:
                return self._front()[0]
            return items[0]
        if self._order is Order.STACK:
            return items[-1]
        return items[0][2]

    def front(self, n: int, nbytes: int) -> list[bytes] | None:
        """The next packets `pop` takes, in order, where that is the plain queue's front:
        at most *n*, and no more than *nbytes* of them (but at least one); None with
        lanes, a stack, a heap or an order change waiting (those are taken one at a
        time)."""
        if self._order is not Order.QUEUE or self.lanes is not None or \
                self._next_order is not None:
            return None
        run: list[bytes] = []
        for packet in itertools.islice(self.items, n):
            nbytes -= len(packet)
            if nbytes < 0 and run:
                break
            run.append(packet)
        return run

    def pop(self) -> bytes:
        """Remove the packet `peek` returned (after the kernel took it)."""
        items = self.items
        if self._order is Order.QUEUE:
            if self.lanes is not None:
                return self._pop_turn()
            packet = items.popleft()
            owner = self.owners.popleft()
            if self._carried:
                self._carried -= 1
        elif self._order is Order.STACK:
            packet = items.pop()
            owner = self.owners.pop()
            if self._carried > len(items):  # (the newest first: those come last)
                self._carried = len(items)
        else:
            _, seq, packet, owner = heapq.heappop(items)
            if seq < self._carried_below and self._carried:
                self._carried -= 1
        self._uncharge(len(packet) + self._overhead, owner)
        if self._next_order is not None and len(items) <= REORDER_LIMIT:
            self._reorder(self._next_order)
        return packet

    def _pop_turn(self) -> bytes:
        """`pop` with `lanes`: the oldest packet of the user whose turn it is, who then
        goes to the back; the plain deque again once nothing waits."""
        turns = self.items
        lane = self._front()
        owner = turns[0]
        packet = lane.popleft()
        if lane:
            turns.rotate(-1)
        else:
            turns.popleft()
            self._drop_lane(owner)
        self._count -= 1
        self._uncharge(len(packet) + self._overhead, owner)
        if not self._count:  # (empty lanes may be left in the turns: `_front`)
            self._leave_lanes()
        if self._next_order is not None and len(self) <= REORDER_LIMIT:
            self._reorder(self._next_order)
        return packet

    def _front(self) -> deque[bytes]:
        """The lane whose turn it is, past those a user's packets gave way from (left
        empty there: taking them out of the turns at once would cost O(users))."""
        turns, lanes = self.items, self.lanes or {}
        while not lanes[turns[0]]:
            self._drop_lane(turns.popleft())
        return lanes[turns[0]]

    def _drop_lane(self, owner: int | None) -> None:
        """*owner*'s lane is empty and leaves the turns: its cost given back."""
        del self.lanes[owner]  # type: ignore[union-attr]
        if self._lane:
            self._uncharge(self._lane, owner)

    def _to_lanes(self) -> None:
        """A second user's packet comes to a deque (`order/queue`): from now on turns.
        What waits is usually one user's: the deque becomes that user's lane as it is;
        else (the broker's replies among it, or what waited behind a hand-over's
        packets) it is split.  Each lane is charged to its user (`LANE_OVERHEAD`): all
        alike, so the heaviest stays the heaviest."""
        items, owners = self.items, self.owners or deque()
        if not items:
            lanes: dict[int | None, deque[bytes]] = {}
        elif not self._unowned and len(self.held or ()) <= 1:
            lanes = {owners[0]: items}
        else:
            lanes = {}
            for packet, who in zip(items, owners, strict=True):
                lane = lanes.get(who)
                if lane is None:
                    lane = lanes[who] = deque()
                lane.append(packet)
        self._count = len(items)
        self.lanes, self.owners = lanes, None
        self.items = deque(lanes)
        held = self.held if self.held is not None else self._count_users()
        for who in lanes:
            self._more(self._lane)
            if who is None:
                self._unowned += self._lane
            else:
                held[who] += self._lane

    def _leave_lanes(self) -> None:
        """Nothing waits any more: the plain deque again (the empty lanes left in the
        turns given back)."""
        for owner in list(self.lanes or ()):
            self._drop_lane(owner)
        self.lanes, self.owners, self.items = None, None, deque()

    def _more(self, size: int) -> None:
        """*size* more bytes held (the queue's and its user's budget)."""
        self.nbytes += size
        if self.budget is not None:
            self.budget.queued += size

    def _uncharge(self, size: int, owner: int | None) -> None:
        self._more(-size)
        if owner is None:
            self._unowned -= size
        elif self.held is not None:
            left = self.held[owner] - size
            if left != self._user:
                self.held[owner] = left
            else:  # nothing of it left (every packet and lane costs more): its entry goes
                del self.held[owner]
                self._more(-self._user)
            if owner == self._top:
                self._stale = True

    def take_dropped(self) -> int:
        n, self.dropped, self.report_in = self.dropped, 0, None
        return n

    def clear(self) -> None:
        if self.budget is not None:
            self.budget.queued -= self.nbytes
        self.items.clear()
        self.owners = self.held = self._top = self.lanes = None
        self._count = self._carried = 0
        self._stale = False
        self.nbytes = self._unowned = 0

    def _push(self, packet: bytes, owner: int | None) -> None:
        size = len(packet) + self._overhead
        if not self.items:  # a new backlog: nobody holds anything
            self.held = self._top = None
            self._stale = False
        lanes = self.lanes
        # (the one user's packet, the queued path's usual case, fails the first test)
        if lanes is None and (self.held is not None or
                              self._top is not None and owner != self._top) and \
                owner is not None and self._order is Order.QUEUE and not self._carried:
            self._to_lanes()  # a second user: turns from now on
            lanes = self.lanes
        if lanes is not None and owner not in lanes:
            size += self._lane  # its lane, charged to it
        if owner is None:
            self._unowned += size
        elif self.held is not None:
            held = self.held
            if owner not in held:
                size += self._user  # its entry
            mine = held[owner] = held.get(owner, 0) + size
            if not self._stale and mine > held.get(self._top, 0):
                self._top = owner
        elif owner != self._top:
            if self._top is None:
                self._top = owner  # the one user, so far
            else:
                held = self._count_users()
                size += self._user  # its entry
                held[owner] = size
                if self._stale or size > held[self._top]:
                    self._top, self._stale = owner, False
        self._more(size)
        if self._order is Order.RANDOM:
            heapq.heappush(self.items, (-len(packet), next(self._seq), packet, owner))
            return
        if lanes is not None:
            lane = lanes.get(owner)
            if lane is None:
                lane = lanes[owner] = deque()
                self.items.append(owner)
            lane.append(packet)
            self._count += 1
            return
        self.items.append(packet)
        owners = self.owners
        if owners is None:
            owners = self.owners = deque()
        owners.append(owner)
