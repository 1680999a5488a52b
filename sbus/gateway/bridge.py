"""The gateway's one connection to the local bus, shared by all remote clients.

Why one shared connection rather than one per remote client: the broker charges
connections to the gateway's UID (4096 by default), so 10,000 remote clients
could not each have one; the broker would also send one packet per remote
subscriber instead of one per message, and every remote client would cost a
second socket and task pair.  Instead the gateway keeps its own `RoutingIndex`
of remote subscriptions and holds each distinct pattern once on the bus
(reference counted), so the broker sends each matching message once and the
gateway fans it out.

The connection is an `sbus.client.AsyncClient` with ``reconnect=True``: its session
holds the distinct patterns, the flood policy (``soft=queue, hard=discard``: the broker
drops for a lagging gateway rather than blocking local publishers, and says how many)
and ``nowait`` as a publisher (one slow local ``block`` subscriber never stalls every
remote publisher), and restores all of them when the broker comes back; remote
clients stay connected meanwhile.  A remote publish made while the bus is down waits
for it (`wait_up`; one the outage caught while it was being sent, too: `_send`), up to
*bus_wait* seconds after it went away: the server reads no more of that publisher
meanwhile, so TCP holds its sends back and a restart loses nothing.  Only if the bus
stays away longer are publishes dropped; that is counted and said in the log once per
outage (and the server disconnects their publishers).  What a broker killed with
``kill -9`` had not read yet is lost with the connection: while publishes go, a whoami
question a few times a second confirms them (`Unconfirmed`), so the log says how many at
most it took, and each remote publisher hears how many of its own (`on_taken`).

The broker's whoami answer (``!/cred/G/U/P``, or ``!.cred.G.U.P`` for a
``--separator .`` broker) tells the separator, so the index routes and the
secret-key checks refuse keys the way this broker spells them.

Each SUB is followed by a whoami question: the broker answers a refused SUB before the
answer to the question after it, so every refusal is matched to its pattern, and the
remote clients holding it are told (`on_refused`): what the gateway routes is what the
bus holds.

One task (`run`) receives; any number send.  Every call into the client that can
reconnect (a send, a receive that waits) is made under one lock, so two tasks never
reconnect at once; the receiver waits for the socket outside the lock, in a cancel scope
that a reconnect by a sender cancels (a cancelled wait consumes nothing), and takes what
is ready outside it too (that read never reconnects): a sender may hold the lock while
the broker has no room for it, and the broker may be waiting for the gateway to read.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Hashable

import trio

from ..client import AsyncClient
from ..display import brief
from ..errors import SbusError
from ..keys import KeyRules
from ..limits import Limits, LogAllowance
from ..protocol import ProtocolError, Publish
from ..routing import CACHE_BYTES, RouteCache, RoutingIndex
from ..session import CONFIRM_EVERY, LAST_TRY, Backoff, Dropped, Refusal, Unconfirmed
from . import notices
from .admission import Pool

log = logging.getLogger("sbus.gateway")

__all__ = ["Bridge"]

#: The share of the broker's per-UID subscription budget (`sbus.limits.Limits`) the
#: gateway uses by default: three quarters, so the gateway's UID has room for another
#: connection (a restart overlapping the old process) and the broker never refuses.
BUS_SUBSCRIPTION_BYTES = Limits().subscription_bytes_per_user * 3 // 4
BUS_PATTERNS = Limits().subscriptions_per_user * 3 // 4
#: Reconnect backoff to the local broker (seconds): it is local, so retry briskly.
BUS_BACKOFF_FIRST, BUS_BACKOFF_MAX = 0.1, 5.0
#: Seconds after the bus went away during which remote publishes wait for it to come
#: back (`Bridge.wait_up`): a broker restart (SIGTERM, kill -9 and start) takes a second or
#: two and the reconnect backoff a few more; within the idle timeout (70 s) and the
#: client library's dead_after (60 s), so a held publisher is not taken for dead.
BUS_WAIT = 10.0
#: Publishes sent at once from one run while other runs wait for the bus connection
#: (`Bridge.publish_packets`): each then waits for a piece of each run ahead of it, not
#: for all of it (a run is up to 64 KiB: ~2,600 tiny publishes; behind 64 flooding
#: addresses an honest one waited 2.6-6.3 s, the audit of 2026-11-27).
PIECE = 64
#: SUB questions the broker has not answered yet, at most (`Bridge._change`): its answers
#: are queued for the gateway past a full queue, where no user's share makes room for
#: them, so 4 clients churning subscriptions filled the gateway's queue in the broker with
#: answers and other users' messages were dropped (the audit of 2026-11-28); a SUB past
#: this waits for answers, and its client for it.
QUESTIONS = 64
#: Seconds a SUB and its question, once made, are still sent after their remote client
#: was let go (`Bridge._send`).
WHOLE_GRACE = 5.0
#: Seconds the first whoami may take before the gateway gives up starting.
CONTROL_TIMEOUT = 10.0
#: Messages taken from the bus before the clients' writers get a turn: well under
#: the default per-client buffer, so a burst does not overflow a client that keeps up.
FORWARD_BATCH = 32
#: Seconds of fan-out (or of dropping a client's subscriptions, or of one client's
#: input: `server`) before other tasks get a turn: the loop never runs much longer
#: than this for any one cause.
TURN = 0.002
#: Seconds of a wide fan-out between two writes of what it queued (*flush*), at least:
#: each write to a client whose socket still takes data costs a system call, and
#: 1,000 non-readers' kernel buffers took ~1,000 writes each when every turn wrote,
#: which kept the gateway behind the bus for seconds.
FLUSH_EVERY = 0.010
#: After the client reconnected inside a receive, how long that receive may wait for
#: the first packet while holding the lock (then it is given up and the wait resumes
#: outside the lock).
REOPEN_WAIT = 0.05
#: Whose share of a full local queue remote publishes take, as the log says it, by
#: whether the broker trusts the gateway to name each address (``--trusted-user``).
_SHARES = {True: "each remote address has a share of its own",
           False: "remote publishers share the gateway user's share (not trusted by the "
                  "broker: sbus serve --trusted-user)"}
_TRUST = {True: "now lets the gateway name whose each publish is: " + _SHARES[True],
          False: "no longer lets the gateway name whose each publish is: " + _SHARES[False]}


async def _nothing() -> None:
    """No flush: the deliver callback writes (or wakes writers) itself."""


class Bridge:
    """Remote subscriptions (a routing index) and the bus connection that feeds them.

    *deliver(targets, messages, until)* is called for each run of messages from the bus
    (key, payload) that match the same remote subscribers, in a row, with those clients;
    the server encodes each frame once and offers it to each client's outbox, and says
    how many of the run it took before the clock passed *until* (the rest are matched
    again after the others' turn).  *flush()* is awaited after each
    batch of messages and, within a wide fan-out, every `FLUSH_EVERY` (other tasks get
    a turn every `TURN`): the server writes out what was queued (a fan-out behind the
    bus then costs one write per client per batch, not per message).
    *on_refused(pattern, reason)* is called when the broker refused a pattern; it
    calls `forget` for each holder.  *on_bus(event, value)* hears what remote
    subscribers miss (`notices`): ``"bus-away"``, ``"bus-back"`` (seconds away) and
    ``"bus-dropped"`` (how many the broker dropped for us).
    """

    def __init__(self, address: str | None,
                 deliver: Callable[[tuple, list[tuple[bytes, bytes]], float], int],
                 on_refused: Callable[[bytes, str], None],
                 flush: Callable[[], Awaitable[None]] | None = None,
                 cache_bytes: int = CACHE_BYTES,
                 on_separator: Callable[[bytes], None] | None = None,
                 budget: int = BUS_SUBSCRIPTION_BYTES,
                 max_patterns: int = BUS_PATTERNS, bus_wait: float = BUS_WAIT,
                 on_bus: Callable[[str, float], None] | None = None,
                 on_taken: Callable[[Counter], None] | None = None) -> None:
        self.deliver = deliver
        self.on_bus = on_bus
        self.on_taken = on_taken
        self.flush = flush if flush is not None else _nothing
        self.on_refused = on_refused
        self.cache_bytes = cache_bytes
        self.on_separator = on_separator  # called when a reconnected broker has another one
        #: What the bus connection's distinct patterns may cost the broker (charged to the
        #: gateway's UID, `routing.pattern_cost`), and how many there may be.
        self.budget = Pool(budget)
        self.max_patterns = max_patterns
        self._costs: dict[bytes, int] = {}
        self.sep = b"/"
        self.rules = KeyRules(self.sep)
        self.index: RoutingIndex[Hashable] = self._new_index()
        self._complaints = LogAllowance(burst=10, interval=60.0)
        self.patterns: Counter[bytes] = Counter()  # distinct remote patterns -> clients
        self._backoff = Backoff(BUS_BACKOFF_FIRST, BUS_BACKOFF_MAX)
        self.bus = AsyncClient(address, reconnect=True, on_drop=self._dropped,
                               on_connection=self._connection, on_refusal=self._refusal,
                               backoff=self._backoff)
        self.address = self.bus.address
        #: what a lost connection may take with it, by remote publisher (`_confirming`)
        self.unconfirmed = Unconfirmed(self.bus.session)
        self._wrote = trio.Event()  # publishes went since `_confirming` last looked
        self._hurry = trio.Event()  # someone waits for a confirmation (`confirmed`)
        #: they wait here, oldest first: [publishes sent when they asked, their event,
        #: whether confirmed]; an answer wakes only those it confirms
        self._confirm_waits: deque[list] = deque()
        self._lock = trio.Lock()
        self._waiting: trio.CancelScope | None = None  # the receiver's wait for the socket
        self._receiving: trio.CancelScope | None = None  # its receive, under the lock
        #: a send under way (`_send`): the bus lost under it, it waits `bus_wait` at most
        self._sending: trio.CancelScope | None = None
        #: the publishes it carries, and whose (`publish_packets`): counted again at each
        #: reconnect within it, on which the rest of them go
        self._sending_piece: tuple[int, Hashable] | None = None
        self._send_limit = math.inf  # its own deadline, outages aside
        self._up = False
        self.bus_wait = bus_wait
        self._back = trio.Event()  # set when the bus is up; a new one at each outage
        self._down_since: float | None = None  # (trio clock) when the bus went away
        self._outage_lost = 0  # publishes dropped in this outage (said when it ends)
        self._outage_said = False  # that publishes are being dropped
        #: the broker lets us name whose each publish is (`publish_packets`): we are trusted.
        #: Asked again in each opening (`Session.ask_for_trust`): a broker restarted with
        #: other settings may trust us, or no longer.
        self.for_peers = False
        self._trusted_before = False  # on the connection before this one
        #: a `publish_for` packet may have gone out cut short (a cancelled or failed send):
        #: the broker's idea of whose our publishes are is unknown until one goes whole
        self._for_unsure = False
        self._stale: list[bytes] = []  # patterns of another separator, to drop on the bus
        #: SUBs sent whose fate the broker has not told yet: [pattern, question number,
        #: refusal reason or None], oldest first; questions are numbered per connection.
        self._unconfirmed: deque[list] = deque()
        self._in_flight: Counter[bytes] = Counter()  # the same, by pattern
        self._asked = 0  # questions sent on this connection
        self._answered = trio.lowlevel.ParkingLot()  # SUBs waiting for `QUESTIONS` room
        #: patterns whose SUB or UNSUB was given up before it was made (its client went
        #: while it waited): the reader sets the bus right (`_reconcile`)
        self._deferred: set[bytes] = set()
        self._generation = 0  # connections made so far
        self._unmapped = 0  # SUB refusals during a reconnect: their patterns are unknown
        # counters
        self.published = 0  # remote publishes handed to the bus
        self.lost = 0  # remote publishes not sent: the bus stayed away, or over its limit
        #: outages of the bus while remote clients subscribed: what was published
        #: meanwhile never reached them (the broker keeps nothing for a connection away)
        self.missed_outages = 0
        #: remote publishes sent that a lost connection may have taken (not confirmed)
        self.unconfirmed_lost = 0
        self.received = 0  # messages from the bus
        self.bus_dropped = 0  # messages the broker reported dropping for us
        self.refused = 0  # distinct patterns the broker refused

    def _new_index(self) -> RoutingIndex[Hashable]:
        # one owner: the cache is bounded in bytes as a whole (keys come from the bus,
        # which does not say which remote client, if any, published them)
        return RoutingIndex(self.sep, RouteCache(self.sep, self.cache_bytes))

    @property
    def up(self) -> bool:
        return self._up

    # -- subscriptions ------------------------------------------------------------

    def fits(self, pattern: bytes, cost: int) -> bool:
        """Whether the broker's budget for the gateway (`budget`) has room for *pattern*
        (free if some remote client holds it already: the bus holds it once)."""
        return pattern in self.patterns or (
            len(self.patterns) < self.max_patterns and self.budget.fits(cost))

    async def subscribe(self, client: Hashable, pattern: bytes, cost: int) -> None:
        """Route *pattern* to *client*; the first holder also subscribes it on the bus and
        charges `budget`.  If the broker refuses it, *on_refused* hears of it."""
        self.index.subscribe(client, pattern)
        self.patterns[pattern] += 1
        if self.patterns[pattern] == 1:
            self.budget.used += cost
            self._costs[pattern] = cost
            await self._change(pattern, True)

    async def unsubscribe(self, client: Hashable, pattern: bytes) -> bool:
        if not self.index.unsubscribe(client, pattern):
            return False
        await self._release(pattern)
        return True

    async def remove_client(self, client: Hashable) -> None:
        index = self.index
        mine = index.patterns(client)
        start = time.perf_counter()
        for pattern, count in mine.items():
            if index is not self.index:
                return  # the separator changed: the new index never held these
            for _ in range(count):
                index.unsubscribe(client, pattern)
                await self._release(pattern)
            if time.perf_counter() - start > TURN:
                await trio.lowlevel.checkpoint()  # thousands of patterns: let others run
                start = time.perf_counter()

    def forget(self, client: Hashable, pattern: bytes) -> None:
        """Drop *client*'s route for a pattern the broker refused (no UNSUB: it holds none)."""
        self.index.unsubscribe(client, pattern)
        if self.patterns[pattern] <= 1:
            self.patterns.pop(pattern, None)
            self.budget.used -= self._costs.pop(pattern, 0)
        else:
            self.patterns[pattern] -= 1

    async def _release(self, pattern: bytes) -> None:
        self.patterns[pattern] -= 1
        if self.patterns[pattern] <= 0:
            del self.patterns[pattern]
            self.budget.used -= self._costs.pop(pattern, 0)
            await self._change(pattern, False)

    async def _change(self, pattern: bytes, subscribe: bool) -> None:
        """SUB (with its question) or UNSUB *pattern* through the session.  While the bus
        is down only the session learns of it: reconnecting restores its patterns.  A
        SUB waits while `QUESTIONS` are unanswered (decided under the lock, as it is
        made)."""
        wait = made = False

        def packets() -> list[bytes]:
            nonlocal wait, made
            session = self.bus.session
            wait = False
            if bool(session.patterns[pattern]) == subscribe:
                made = True  # the bus has it so already (`_reconcile`)
                return []
            if not subscribe:
                made = True
                return self._unsub_packets(pattern)
            wait = self._up and len(self._unconfirmed) >= QUESTIONS
            if wait:
                return []
            made = True
            return self._sub_packets(pattern)

        try:
            await self._send(packets, whole=True)
            while wait:
                await self._answered.park()  # (`_settle`, or the bus lost: `_connection`)
                await self._send(packets, whole=True)
        except trio.Cancelled:  # its client went, waiting for room or for the lock: the
            if not made:  # bus is set right by the reader (others may hold the pattern)
                self._deferred.add(pattern)
            raise

    def _unsub_packets(self, pattern: bytes) -> list[bytes]:
        """UNSUB *pattern* in the session and, with the bus up, its packet (under the
        lock)."""
        packet = self.bus.session.unsubscribe(pattern)
        return [packet] if self._up else []

    def _sub_packets(self, pattern: bytes) -> list[bytes]:
        """SUB *pattern* in the session and, with the bus up, the packets: it and its
        question (made under the lock)."""
        session = self.bus.session
        packet = session.subscribe(pattern)
        if not self._up:
            return []
        self._asked += 1
        self._unconfirmed.append([pattern, self._asked, None])
        self._in_flight[pattern] += 1
        return [packet, session.ask()]

    # -- publishing ---------------------------------------------------------------

    async def publish(self, key: bytes, payload: bytes, owner: int | None = None,
                      by: Hashable = None) -> bool:
        """Hand a remote client's message to the bus; False if the bus is down (or the
        message is refused as too large).  *owner*, *by*: as for `publish_packets`."""
        try:
            packet = self.bus.session.publish(key, payload)
        except SbusError as exc:  # the gateway checked the key first: too large
            self._complain("a message for the bus was not sent: %s", exc)
            self.lost += 1
            return False
        return await self.publish_packets([packet], owner, by) == 1

    async def publish_packets(self, packets: list[bytes], owner: int | None = None,
                              by: Hashable = None,
                              waiting: Callable[[], None] | None = None) -> int:
        """Hand remote clients' messages, as MSG packets (`Session.publish_head` + payload,
        keys checked), to the bus in order, as one run (one ``sendmmsg`` where the socket
        has room) or, while others wait for the bus connection, `PIECE` at a time: how
        many were sent.  While the bus is away this waits for it (`wait_up`); the packets
        not sent (it stayed away longer, or one is over the broker's limit) are counted
        as lost.  *owner*: the peer address's number (`admission.Peer.owner`), whose share
        of a full local queue they take where the broker trusts the gateway; None, the
        gateway's own.  *by*: the remote client whose they are, told how many of its own
        a lost connection may have taken (`on_taken`).  *waiting* is called before this
        waits (for the bus connection's lock, room in it, or the bus), at most once a
        piece: the caller lets others go on meanwhile (the server: its address's turn)."""
        total = len(packets)
        if not total:
            return 0
        limit = self.bus.session.max_message
        if max(map(len, packets)) > limit:
            packets = [p for p in packets if len(p) <= limit]
            self._complain("a message for the bus was not sent: over the broker's "
                           "%d-byte limit", limit)
        lock = self._lock
        switch: list[bytes] = []
        piece: list[bytes] = []
        sent = 0

        def build() -> list[bytes]:
            if not self._up:
                return []
            # others wait: a piece, and the lock (fair) is theirs before the next one
            end = sent + PIECE if lock.statistics().tasks_waiting else len(packets)
            piece[:] = packets[sent:end]
            switch[:] = self._for(owner)
            # counted as they are made: a send cut short counts some that never went
            # (an upper bound), never the other way round
            self.unconfirmed.add(len(piece), by)
            self._wrote.set()
            self._sending_piece = (len(piece), by)  # (a reconnect within counts it again)
            return switch + piece

        try:
            while sent < len(packets):
                if not self._up:
                    if waiting is not None:
                        waiting()
                    if not await self.wait_up():
                        break
                piece.clear()  # (made anew by `build`, if it sends)
                went = await self._send(build, waiting=waiting)
                if went:
                    sent += len(piece)
                    if switch:
                        self._for_unsure = False  # it went whole, with the piece
                    continue
                if self._up:  # not sent for another reason than the bus (complained)
                    break
        except trio.Cancelled:
            if not self._up:  # its client went while it waited: lost, and counted
                self._dropped_away(total - sent)
            raise
        self.published += sent
        if not self._up:
            self._dropped_away(total - sent)
        else:
            self.lost += total - sent
        return sent

    async def wait_up(self) -> bool:
        """Wait for the bus, at most until `bus_wait` seconds after it went away: whether
        it is up.  After that, once per outage, the log says remote publishes are being
        dropped (their count is said when the bus comes back)."""
        if self._up:
            return True
        if self._down_since is not None:
            with trio.move_on_at(self._down_since + self.bus_wait):
                await self._back.wait()
        if self._up:
            return True
        if not self._outage_said and self._down_since is not None:
            self._outage_said = True
            log.warning("the bus has been away for %g s: remote publishes are dropped until "
                        "it is back, and their publishers disconnected", self.bus_wait)
        return False

    def _dropped_away(self, count: int) -> None:
        self.lost += count
        self._outage_lost += count

    def _for(self, owner: int | None) -> list[bytes]:
        """The packet that makes the next publishes *owner*'s (`PUBLISHER_FOR`), unless
        they are already, or the broker does not trust us with it: then one share for
        every remote publisher.  Made under the lock, in the order of the wire."""
        session = self.bus.session
        if not self.for_peers or (session.publishing_for == owner and not self._for_unsure):
            return []
        self._for_unsure = True  # until `publish_packets` sees it sent
        return [session.publish_for(owner)]

    async def _send(self, build: Callable[[], list[bytes]], whole: bool = False,
                    waiting: Callable[[], None] | None = None) -> bool:
        """Send the packets *build* makes, back to back, in call order.  They are made
        under the lock, so the session's state and the questions asked follow the order
        of the wire even across a reconnect.  Waits while the broker is busy; False if
        nothing was sent (the bus is down, or a packet was refused).  *whole*: once made,
        they are sent even if the caller is cancelled meanwhile, for `WHOLE_GRACE`
        seconds (a SUB and its question: a question counted and never sent would leave
        every later refusal matched to the SUB before it, and one more place of
        `QUESTIONS` taken until the next connection).  A send the bus's loss catches
        waits for it as long as a publish would (`bus_wait`), shielded or not: the next
        connection asks its own questions, and restores the session's patterns.
        *waiting*: called before it waits (`publish_packets`)."""
        lock = self._lock
        try:
            lock.acquire_nowait()  # no checkpoint on the common, uncontended path
        except trio.WouldBlock:
            if waiting is not None:
                waiting()
            await lock.acquire()
        try:
            packets = build()
            whole = whole and len(packets) > 1
            self._send_limit = trio.current_time() + WHOLE_GRACE if whole else math.inf
            # (`_connection` may bound it: an outage, shielded or not)
            with trio.CancelScope(shield=whole, deadline=self._send_limit) as self._sending:
                if waiting is not None and packets:  # what goes at once, then its word
                    done = self.bus.send_run_nowait(packets)
                    if done < len(packets):
                        waiting()
                        await self.bus.send_packets(packets[done:])
                elif len(packets) == 1:
                    await self.bus.send_packet(packets[0])
                elif packets:
                    await self.bus.send_packets(packets)
            cut = self._sending.cancelled_caught
            if cut and self._up:  # (the broker read nothing of us for that long)
                self._complain("a subscription's question was not sent in %g s",
                               WHOLE_GRACE)
            return bool(packets) and not cut
        except SbusError as exc:  # InvalidRequest (the gateway checked first) or lost
            self._complain("a packet for the bus was not sent: %s", exc)
            return False
        finally:
            self._sending = None
            self._sending_piece = None
            lock.release()

    # -- what the client tells (called from inside its calls) -----------------------

    def _connection(self, up: bool, line: str) -> None:
        if not up:
            if self._up:  # (said again while away: a reconnect cancelled and taken up
                self._up = False  # again; the publishers wait on this outage's event)
                self._back = trio.Event()
                self._down_since = trio.current_time()
                # a broker back just before the publishers' wait ends is found in time,
                # not at the backoff's next step (up to 5 s later: the audit of 2026-11-28)
                self._backoff.try_by = time.monotonic() + self.bus_wait - LAST_TRY
                self._trusted_before, self.for_peers = self.for_peers, True  # until refused
                if self.on_bus is not None:
                    self.on_bus("bus-away", 0.0)
                line = self._taken(line)
            log.warning("lost the bus: %s; remote publishers wait for it up to %g s",
                        line, self.bus_wait)
            self._unconfirmed.clear()  # questions on the old connection: never answered
            self._in_flight.clear()
            self._asked = 0
            self._answered.unpark_all()
            if self._waiting is not None:  # the receiver waits on a socket now closed
                self._waiting.cancel()
            if self._sending is not None and self._down_since is not None:
                # a send found the bus gone and reconnects, holding the lock: as long as
                # a publish that comes now would wait, no longer (the reader then makes
                # the reconnect, and the publishers behind the lock are told at once)
                self._sending.deadline = min(self._sending.deadline,
                                             self._down_since + self.bus_wait)
            return
        self._up = True
        self._back.set()
        self._backoff.try_by = None
        if self._sending is not None:  # back within the bound: the rest of its run
            self._sending.deadline = self._send_limit  # waits for room as any send does
        if self._sending_piece is not None:  # publishes whose send spans this reconnect:
            self.unconfirmed.add(*self._sending_piece)  # counted on this connection too
            self._wrote.set()  # (the lost one's count took them already)
        away = trio.current_time() - (self._down_since or 0.0)
        if self._outage_lost:
            log.warning("%d remote publishes were dropped while the bus was away (%.1f s; "
                        "publishers wait for it up to %g s)", self._outage_lost, away,
                        self.bus_wait)
        self._outage_lost = 0
        self._outage_said = False
        if self.on_bus is not None:  # (a reconnect: the first connection is made in `run`)
            self.on_bus("bus-back", away)
        if self.patterns:
            self.missed_outages += 1
            log.warning("the bus is back after %.1f s: what was published meanwhile did not "
                        "reach the remote subscribers of its %d patterns", away,
                        len(self.patterns))
        self._generation += 1
        whoami = self.bus.session.whoami or b""
        if whoami.startswith(b"!") and len(whoami) > 1:
            self._set_separator(whoami[1:2])
        if self._receiving is not None:  # reconnected inside a receive: wait briefly
            self._receiving.deadline = min(self._receiving.deadline,
                                           trio.current_time() + REOPEN_WAIT)
        log.info("connected to the bus at %s (%d patterns)", self.address,
                 len(self.patterns))
        if self.for_peers != self._trusted_before:  # (the opening's question is answered)
            log.warning("the broker %s", _TRUST[self.for_peers])

    def _taken(self, line: str) -> str:
        """The lost connection's line, with how many remote publishes at most it took
        (those sent since the broker last confirmed); each publisher is told its own."""
        count = self.unconfirmed
        if self._confirm_waits:
            self._confirm()  # (an answer read before the loss confirmed theirs)
        n = count.lost()
        for waiter in self._confirm_waits:  # the rest: theirs may have been taken
            waiter[1].set()
        self._confirm_waits.clear()
        if not n:
            return line
        self.unconfirmed_lost += n
        taken = count.taken
        if self.on_taken is not None:
            self.on_taken(taken)
        return (f"{line} (up to {n} remote publish(es) of {len(taken)} client(s), sent "
                "since the broker last confirmed, may be lost with the connection)")

    async def _confirming(self) -> None:
        """While remote publishes go, ask the broker a few times a second to confirm
        them (`Unconfirmed`): its answers are taken by the reader.  Asked under the lock,
        in the order of the wire, numbered among the SUBs' questions (`_asked`); asleep
        while nobody publishes."""
        count = self.unconfirmed
        while True:
            await self._wrote.wait()
            self._wrote = trio.Event()
            with trio.move_on_after(CONFIRM_EVERY):
                await self._hurry.wait()
            if self._hurry.is_set():  # a publisher waits for its answer: no later
                self._hurry = trio.Event()
                count.next_at = 0.0
            async with self._lock:
                question = count.question(time.monotonic()) if self._up else None
                if question is not None:
                    if self.bus.send_nowait(question):
                        self._asked += 1
                    else:  # a full socket, or a reconnect under way: the next round asks
                        count.unsent()
            if count.pending:
                self._wrote.set()  # a round more: its answer, or the next question

    async def confirmed(self) -> bool:
        """Wait until the broker has confirmed every remote publish sent so far (asked at
        once, not at `_confirming`'s pace): True; False if the connection was lost first
        (it may have taken some of them), or no answer came within `bus_wait` seconds.
        For a publisher that answers its own client (the HTTPS endpoint's 201)."""
        count = self.unconfirmed
        if count.confirmed >= count.sent:
            return True
        waiter = [count.sent, trio.Event(), False]
        waits = self._confirm_waits
        waits.append(waiter)
        self._hurry_for(waiter[0])
        try:
            with trio.move_on_after(self.bus_wait):
                await waiter[1].wait()
        finally:
            if not waiter[1].is_set():  # (timed out, or its client went)
                waits.remove(waiter)
        return waiter[2]

    def _hurry_for(self, mark: int) -> None:
        """Have `_confirming` ask at once if no question under way covers *mark*."""
        asked = self.unconfirmed.asked_at
        if asked is None or asked < mark:
            self._hurry.set()
            self._wrote.set()

    def _confirm(self) -> None:
        """Wake the waiters (`confirmed`) whose publishes the broker has confirmed now;
        the next question for the rest goes at once.  (`_settle`, after each read.)"""
        count, waits = self.unconfirmed, self._confirm_waits
        count.answered()
        while waits and waits[0][0] <= count.confirmed:
            waiter = waits.popleft()
            waiter[2] = True
            waiter[1].set()
        if waits:
            self._hurry_for(waits[0][0])

    def _refusal(self, event: Refusal) -> None:
        if event.verb == "cmsg":  # the one control it may refuse: we are not trusted
            self.for_peers = False  # (said once the connection is up: `_connection`)
            self.bus.session.publishing_for = None  # the broker kept our own
            return
        if event.verb == "sub":
            if not self._up:
                self._unmapped += 1  # refused while the session restored its patterns
            else:
                answered = self._asked - self.bus.session.asked
                for entry in self._unconfirmed:
                    if entry[1] > answered:  # the first SUB whose question is unanswered
                        entry[2] = event.reason
                        break
        self._complain("the broker refused the gateway's %s: %s",
                       brief(event.verb.encode(), 16), brief(event.reason.encode(), 200))

    def _dropped(self, count: int) -> None:
        self.bus_dropped += count
        if self.on_bus is not None:
            self.on_bus("bus-dropped", count)
        self._complain("the broker dropped %d messages for the gateway (it could not "
                       "keep up)", count)

    def _complain(self, msg: str, *args: object) -> None:
        held = self._complaints.take(0)
        if held is not None:
            log.warning(msg + (f" ({held} more not logged)" if held else ""), *args)

    def _settle(self) -> None:
        """Every SUB whose question the broker has answered is refused (a refusal came
        before the answer) or in force.  A refused pattern leaves every remote client
        that holds it, so what the gateway routes is what the bus holds."""
        answered = self._asked - self.bus.session.asked
        if self._confirm_waits:
            self._confirm()
        if self._answered and self._unconfirmed and self._unconfirmed[0][1] <= answered:
            self._answered.unpark_all()  # (they find out under the lock whether room came)
        while self._unconfirmed and self._unconfirmed[0][1] <= answered:
            pattern, _, refused = self._unconfirmed.popleft()
            self._in_flight[pattern] -= 1
            if not self._in_flight[pattern]:
                del self._in_flight[pattern]
            if refused is None or pattern not in self.patterns:
                continue
            if pattern in self._in_flight:
                continue  # subscribed again since: the later SUB decides
            self.bus.session.unsubscribe(pattern)  # not held by the broker: nothing sent
            self.refused += 1
            self.on_refused(pattern, refused)  # calls `forget` for each client holding it

    def _set_separator(self, sep: bytes) -> None:
        if sep == self.sep:
            return
        old = list(self.patterns)
        log.log(logging.WARNING if old else logging.INFO,
                "the broker's separator is %r: routing and secret checks follow it%s",
                sep.decode("latin-1"), " (remote clients are disconnected)" if old else "")
        self.sep = sep
        self.rules = KeyRules(sep)
        self.index = self._new_index()
        self.patterns.clear()
        self._costs.clear()
        self.budget.used = 0
        self._stale += old  # the session restored them: they mean something else now
        if self.on_separator is not None:
            self.on_separator(sep)

    # -- the bus connection --------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect, then forward messages until cancelled (the client reconnects)."""
        bus = self.bus
        await bus.open()  # a gateway that never reached its bus is misconfigured
        try:
            await bus.send_packet(bus.session.publisher_nowait())
            # may we name whose each publish is?  (refused before the whoami answer if not;
            # asked again in every opening)
            self.for_peers = bus.session.ask_for_trust = True
            await bus.send_packet(bus.session.publish_for(None))
            await bus.set_flood(soft="queue", hard="discard")
            me = await bus.whoami(CONTROL_TIMEOUT)
        except TimeoutError:
            raise SbusError(f"the bus at {self.address} did not answer") from None
        if not me.startswith(b"!") or len(me) < 2:
            raise SbusError(f"the broker answered whoami with {brief(me)}")
        self._set_separator(me[1:2])
        self._up = True
        self._back.set()
        log.info("connected to the bus at %s (%d patterns); towards a slow local subscriber "
                 "%s", self.address, len(self.patterns), _SHARES[self.for_peers])
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._confirming)
                await self._forward()
        finally:
            self._up = False  # senders stop here, not at a closed client
            self._down_since = None  # (and wait for nothing)
            with trio.CancelScope(shield=True):
                await bus.aclose()

    async def _forward(self) -> None:
        bus = self.bus
        deliver = self.deliver
        flush = self.flush
        clock = time.perf_counter
        more, turn = False, 0.0  # the batch before was full and this turn has time left
        while True:
            down = not self._up
            if down:  # a sender is reconnecting (under the lock): the socket it replaces
                async with self._lock:  # is closed; wait until it is done
                    if self._up:
                        continue
                # Nobody is: a sender's reconnect was cancelled with its client (the client
                # reconnects at its next use).  The receive below makes it, or the bus
                # stayed away for good (the audit of 2026-11-28: 100 % CPU, no bus).
                more = False
            generation = self._generation
            if not down and not more:
                replaced = False
                with trio.CancelScope() as self._waiting:
                    try:
                        await trio.lowlevel.wait_readable(bus.fileno())
                    except trio.ClosedResourceError:  # a sender's reconnect closed it
                        replaced = True  # (the shell wakes waiters so): wait on the new
                self._waiting = None
                if replaced:
                    continue
                turn = clock()
            # What waits, without a turn of the loop and without the lock: this read never
            # reconnects (it takes nothing while the client is reconnecting), so it need
            # not wait for a sender, which holds the lock while the bus has no room for
            # it.  The broker stops reading a connection whose own queue is over its limit
            # (a reply forced past a queue full of messages) until it is read: a sender
            # waiting for room under the lock while this read waited for the lock stalled
            # every remote client for good (the audit of 2026-11-28: 4 clients churning
            # subscriptions beside a flood).
            packets = bus.receive_packets_ready(FORWARD_BATCH) \
                if generation == self._generation and not down else []
            if more and not packets:  # taken all that came: wait (not in the receive
                more = False  # below, which waits holding the lock)
                continue
            events = [self._event(packet) for packet in packets]
            if not packets or self._unmapped or self._stale or self._deferred:
                lock = self._lock  # a sender that is reconnecting finishes first
                try:
                    lock.acquire_nowait()  # no turn of the loop on the common path
                except trio.WouldBlock:
                    await lock.acquire()
                try:
                    if not packets and generation == self._generation \
                            and not (down and self._up):
                        # nothing after all, the connection ended, or the bus is away
                        # with nobody reconnecting: the call that waits and reconnects
                        with trio.CancelScope() as self._receiving:
                            packets = await bus.receive_packets(FORWARD_BATCH)
                        self._receiving = None
                        events = [self._event(packet) for packet in packets]
                    self._settle()
                    if self._unmapped:
                        await self._refused_unmapped()
                    for pattern in self._stale:
                        if bus.session.patterns[pattern]:
                            await bus.send_packet(bus.session.unsubscribe(pattern))
                    self._stale.clear()
                    await self._reconcile()
                finally:
                    lock.release()
            else:
                self._settle()
            # never forwarded, whatever the broker sent: secret keys, and (on a ``.`` bus,
            # where it is an ordinary key) the gateway's own notices topic
            secret = (self.rules.secret_prefix, notices.TOPIC)
            index = self.index
            self.received += sum(type(event) is Publish for event in events)
            start = flushed = clock()
            i, n = 0, len(events)
            ahead: tuple | None = None  # the clients of events[i], matched by the last run
            while i < n:
                # the run from *i*: the messages that match the same clients, in a row
                targets: tuple = ()
                run: list[tuple[bytes, bytes]] = []
                at: list[int] = []  # where each message of the run is in *events*
                j = i
                while j < n:
                    event = events[j]
                    if type(event) is Publish and not event.key.startswith(secret):
                        if ahead is not None:
                            found, ahead = ahead, None
                        else:
                            found = index.match(event.key)
                        if found:
                            if run and found != targets:
                                ahead = found  # the next run's first: not matched twice
                                break
                            targets = found
                            run.append((event.key, event.payload))
                            at.append(j)
                    j += 1
                i = j
                if run:
                    done = deliver(targets, run, start + TURN)
                    if done < len(run):  # the turn is over: the rest matched again after
                        i, ahead = at[done], None
                    now = clock()
                    if now - start > TURN:  # a wide fan-out: let the others run
                        ahead = None  # (the index may change meanwhile)
                        if now - flushed > FLUSH_EVERY:
                            await flush()
                            flushed = clock()
                        await trio.lowlevel.checkpoint()
                        start = clock()
            await flush()
            # The bus carries every remote client's messages: one batch per turn of the
            # loop was its whole share beside each busy client's `TURN`, and 4 addresses
            # flooding keep-alives held everyone's messages back 190 ms behind a local
            # flood (the audit of 2026-11-28).  So it takes batches for a `TURN` too
            # (the wait at the top then gives the others theirs).
            more = len(packets) >= FORWARD_BATCH and clock() - turn < TURN

    async def _reconcile(self) -> None:
        """For the patterns whose SUB or UNSUB was given up before it was made (`_change`),
        make the bus hold what remote clients hold now: a SUB as room comes, an UNSUB at
        once (under the lock)."""
        session = self.bus.session
        for pattern in list(self._deferred):
            held, on_bus = bool(self.patterns[pattern]), bool(session.patterns[pattern])
            if held and not on_bus:
                if len(self._unconfirmed) >= QUESTIONS:
                    break  # (the rest when answers come)
                packets = self._sub_packets(pattern)
            elif on_bus and not held:
                packets = self._unsub_packets(pattern)
            else:
                packets = []
            self._deferred.discard(pattern)
            if packets:
                await self.bus.send_packets(packets)

    def _event(self, packet: bytes) -> object:
        """What one packet from the bus means; control events are dealt with here (in
        wire order: a refusal is noted before the answer that settles its SUB)."""
        try:
            event = self.bus.session.receive(packet)
        except ProtocolError as exc:
            self._complain("the bus sent a malformed packet: %s", exc)
            return None
        kind = type(event)
        if kind is Refusal:
            self._refusal(event)
        elif kind is Dropped:
            self._dropped(event.count)
        return event

    async def _refused_unmapped(self) -> None:
        """The broker refused SUBs while the session restored the patterns after a
        reconnect (one question for all of them, so which ones is unknown): every
        pattern is dropped and its holders told, and they subscribe again one by one."""
        log.warning("the broker refused %d of the gateway's patterns when the bus came "
                    "back; every remote subscription is dropped", self._unmapped)
        self._unmapped = 0
        session = self.bus.session
        for pattern in list(self.patterns):
            if session.patterns[pattern]:  # those the broker holds go; others: harmless
                await self.bus.send_packet(session.unsubscribe(pattern))
            self.refused += 1
            self.on_refused(pattern, "refused when the bus came back")
