"""The broker's logic as a pure object: events in, decisions out, no sockets, no clock.

`BrokerCore` is fed what the I/O shell (sbus/broker.py) sees: a client connected
(`connect`, with its kernel-verified credentials), packets arrived from a client
(`receive`, a batch view), a client became writable (`writable`), a client is gone
(`hangup`), time passed (`advance`).  It owns routing, flood control, per-user
accounting and limits, refusals, introspection answers and the hand-over snapshot.
What the shell must do in turn it takes from the core (`take_dirty`, `take_gone`,
`take_logs`, `take_freed`; the lists are the core's, the shell only reads them):

* `Client.wants_read` / `Client.wants_write` for every client in `dirty`: pause or
  resume reading it, watch it for writability (what it watches is the shell's);
* `gone`: clients to disconnect (their sockets to close), in order;
* `logs`: ``(level, line)`` pairs to write, already rationed per UID;
* `freed`: batches a fan-out held and is done with.

Writing is the one thing the core does not hand back as data: which packets stay
queued under a client's flood policy depends on how many the kernel took *now*, and
the fast path hands a run of packets to each target straight from the receive buffer
(one ``sendmmsg``) before the next receive overwrites it.  So the core is given a
*link port*, the two non-blocking primitives it needs: ``write(link, packet)`` and
``send(batch, link, start, count)``.  Each returns what the kernel took (bytes,
packets: ``>= 0``) or one of the outcomes `FULL`, `GONE`, `TOO_BIG`, `FAILED`; the
shell maps its system calls' errors onto them, so no OS error reaches the core.  A
client's ``link`` is opaque to the core (the shell's fd), and is never written to once
the client is `Client.closed`.  Tests pass fakes for both that model a kernel buffer
of a chosen size, so every policy is exercised without a socket or a sleep.  A third,
optional primitive, ``write_each(batch, picks, links)`` (`WriteEach`), writes many
packets to many links back to back (defaults to ``write`` once per packet); a fourth,
``write_run(link, packets)`` (`WriteRun`), sends a run of a queue's packets to one link
in one call (without it a queue is written a packet at a time).

No client can hold the shell's loop through the core: every packet's work is bounded
(patterns are limited in shape, lookups probe once per prefix length, cache
invalidation is amortised, order changes re-sort a few hundred packets at most), a
client whose batches overran `TURN_SECONDS` is read fewer packets at once
(`turn_taken`), a departed client's subscriptions are dropped `REMOVALS_PER_TURN` at a
time (`tidy`), and everything a client makes the broker keep is charged to its UID
(sbus/limits.py).  A refused packet is answered with ``CMSG refused/VERB\\0reason``
and logged within the UID's allowance.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from . import flood, handover, introspect, protocol
from .defaults import MAX_MESSAGE, QUEUE_LIMIT, SEPARATOR
from .display import brief
from .flood import PACKET_OVERHEAD, Hard, Order, OutQueue, Soft, Verdict, parse_control
from .keys import Credentials, KeyRefused, KeyRules
from .limits import Limits, LogAllowance, UserAccounts
from .routing import RouteCache, RoutingIndex, pattern_cost

__all__ = ["BrokerCore", "Client", "Fanout", "TURN_SECONDS", "FIRST_SLOTS",
           "REMOVALS_PER_TURN", "WRITES_PER_TURN", "WRITE_RUN", "FULL", "GONE", "TOO_BIG",
           "FAILED"]

# -- the link port: what a write or send that took nothing tells the core ---------------
#: The kernel's buffer for the link is full: try again once it is writable.
FULL = -1
#: The peer hung up (or its link is closed): it is dropped, quietly.
GONE = -2
#: The packet is larger than the peer's socket can take: that packet is dropped.
TOO_BIG = -3
#: Any other failure of the link: the client is dropped, and the shell says why.
FAILED = -4

#: A client whose batch took longer than this is read fewer packets at once.
TURN_SECONDS = 0.002
#: Packets a writer sends from a queue per `writable` event.
WRITES_PER_TURN = 1024
#: Subscriptions of a departed client dropped per `tidy` call.
REMOVALS_PER_TURN = 512
#: Packets read at once from a new client; it earns more (up to the batch) by packets
#: that prove cheap, and a batch that overran its turn makes it read fewer: a client
#: whose packets are expensive (a fan-out to thousands, a lookup through a wide trie)
#: is served one packet per turn.
FIRST_SLOTS = 4
#: Packets for one target from which one `sendmmsg` beats a `write` each.
SEND_BATCH_MIN = 3
#: Queued packets handed to the kernel by one `WriteRun` at most, and their bytes (the
#: shell copies a run into one buffer: no more than a socket's buffer takes at once).
WRITE_RUN = 64
WRITE_RUN_BYTES = 64 << 10
#: Deliveries (packets times targets) of one batch from which it is fanned out in steps
#: (`BrokerCore.step`) when the shell can spare its buffer, rather than all at once.
HOLD_FROM = 1024
#: Bytes of packets in a batch held for a fan-out in steps, at most (larger batches are
#: delivered at once, and their publisher read fewer packets at a time).
HOLD_BYTES = 1 << 20
#: Copies of one pattern a handed-over client may hold (more: the snapshot is damaged).
RESTORED_COPIES = 1 << 20
#: Deliveries per `BrokerCore.step` (the shell takes steps until its turn is over).
STEP_DELIVERIES = 512

#: The drop report, its count appended (``CMSG blocking/dropped\0N``).
DROPPED = protocol.encode(protocol.Control(protocol.DROPPED, b""))


class Client:
    """One client as the core sees it: identity, queue, flood state, who it pauses."""

    __slots__ = ("id", "link", "cred", "out", "closed", "draining", "subscriptions",
                 "subscription_bytes", "status", "nowait", "owner", "may_pause_others", "held",
                 "slots",
                 "waiting_on", "paused", "own_full", "fanout", "__weakref__")

    def __init__(self, cid: int, link: object, cred: Credentials, queue_limit: int):
        self.id = cid
        self.link = link  # the shell's handle (an fd): never written to once closed
        self.cred = cred
        self.out = OutQueue(queue_limit)
        self.closed = False  # nothing is delivered or answered to it any more
        self.draining = False  # closed, and read to its end before it departs (`_hung_up`)
        self.subscriptions = 0
        self.subscription_bytes = 0
        self.status = b""  # its own one-line status (protocol.CLIENT_STATUS), bounded
        self.nowait = False  # asked never to be paused as a publisher (a shared connection)
        self.owner = cred.uid  # whose share of full queues its messages take (PUBLISHER_FOR)
        self.may_pause_others = False  # its `block` may pause other users' publishers
        self.held = 0  # bytes it sent beyond full queues while paused, charged to its user
        self.slots = FIRST_SLOTS  # packets read at once: fewer while its packets cost much
        self.waiting_on: list[Client] | None = None  # as a publisher: the targets it awaits
        self.paused: list[Client] = []  # publishers this client holds back
        self.own_full = False  # not read until its own queue has drained
        self.fanout: Fanout | None = None  # its batch still being delivered: not read

    @property
    def wants_read(self) -> bool:
        return not (self.closed and not self.draining or self.waiting_on or self.own_full
                    or self.fanout)

    @property
    def read_on(self) -> bool:
        """Is its link still read: not closed, or read to its end (`draining`)?"""
        return not self.closed or self.draining

    @property
    def wants_write(self) -> bool:
        out = self.out
        return not self.closed and bool(out.items or out.dropped)

    def __repr__(self) -> str:
        c = self.cred
        return f"client {self.id} (pid {c.pid} uid {c.uid} gid {c.gid})"


class Fanout:
    """A publisher's batch whose delivery goes on over several turns (`BrokerCore.step`).

    One packet to a thousand targets is a thousand system calls; a batch of them,
    delivered at once, would hold the loop for tens of milliseconds, and delivered one
    packet per turn it costs a system call per delivery.  Held, the batch goes to each
    target as one run (one ``sendmmsg``) and to a slice of the targets per step, so the
    fan-out is as cheap per delivery as the batch is long and no turn is longer for it.
    """

    __slots__ = ("publisher", "batch", "n", "runs", "run", "next", "blocked", "resume",
                 "copies", "charged")

    def __init__(self, publisher: Client, batch, n: int, runs, blocked, resume: int,
                 charged: int) -> None:
        self.publisher = publisher
        self.batch = batch
        self.n = n
        self.runs: list[tuple[int, int, tuple[Client, ...]]] = runs
        self.run = 0  # the run being delivered
        self.next = 0  # its next target
        self.blocked: list[Client] | None = blocked
        self.resume = resume  # where the batch goes on once the runs are delivered
        self.copies: dict[int, bytes] = {}  # packets copied out for queues, shared
        self.charged = charged  # bytes charged to the publisher's user meanwhile


#: ``write(link, packet)``: bytes taken, or `FULL`, `GONE`, `TOO_BIG`, `FAILED`.
Write = Callable[[object, bytes], int]
#: ``send(batch, link, start, count)``: packets taken from the batch, or an outcome.
Send = Callable[[object, object, int, int], int]
#: ``write_each(batch, picks, links)``: write batch packet ``picks[k]`` to ``links[k]``
#: for each k in order, stopping at the first write that took nothing: how many were
#: taken before it (the core writes that one and the rest again with `Write`, to learn
#: why).
WriteEach = Callable[[object, list, list], int]
#: ``write_run(link, packets)``: *packets* (bytes) to *link* in order, as many as its
#: kernel takes now (one ``sendmmsg``): how many, or the first one's outcome.
WriteRun = Callable[[object, list], int]


def send_batch(batch, link: object, start: int, count: int) -> int:
    """The default `Send`: the batch's own ``send``, for batches that speak the port."""
    return batch.send(link, start, count)


def writes_through(write: Write) -> WriteEach:
    """The default `WriteEach`: *write*, once per packet."""
    def write_each(batch, picks: list, links: list) -> int:
        buf, offsets, lengths = batch.buffer, batch.offsets, batch.lengths
        for k, (i, link) in enumerate(zip(picks, links, strict=True)):
            at = offsets[i]
            if write(link, buf[at:at + lengths[i]]) < 0:
                return k
        return len(picks)
    return write_each


class BrokerCore:
    """Everything the broker decides, for a shell that only moves bytes."""

    def __init__(
        self,
        write: Write,
        at_eof: Callable[[object], bool],
        *,
        send: Send = send_batch,
        write_each: WriteEach | None = None,
        write_run: WriteRun | None = None,
        sep: bytes = SEPARATOR,
        max_message: int = MAX_MESSAGE,
        queue_limit: int = QUEUE_LIMIT,
        limits: Limits | None = None,
        defaults: tuple[Soft, Hard, Order] = flood.DEFAULT_POLICY,
        batch_slots: int = 32,
        user_name: Callable[[int], str | None] = lambda uid: None,
        now: float = 0.0,
    ) -> None:
        self._write = write  # the link port (see the module's docstring)
        self._send = send
        self._write_many = write_each or writes_through(write)
        self._write_run = write_run
        self._at_eof = at_eof  # after an empty packet: did the peer hang up?
        self._user_name = user_name
        self.sep = sep
        self.defaults = defaults
        self.rules = KeyRules(sep)
        limits = limits or Limits()
        self.index: RoutingIndex[Client] = RoutingIndex(
            sep, RouteCache(sep, limits.cache_bytes, limits.cache_bytes_per_user,
                            framing=(protocol.MSG_VERB, b"\0")))
        self._whoami = protocol.WHOAMI.replace(b"/", sep)  # either spelling is answered
        self.max_message = max_message
        self.queue_limit = queue_limit
        self.batch_slots = batch_slots
        self.now = now
        self.accounts = UserAccounts(limits)
        self.allowance = LogAllowance(clock=lambda: self.now)
        self.connections: dict[int, Client] = {}  # id -> client, oldest first
        self._by_uid: dict[int, dict[int, Client]] = {}  # uid -> id -> client
        self.subscription_count = 0
        self.empty_since: float | None = now  # no client since (None: some)
        self._next_id = 1
        # what the shell acts on
        self.dirty: set[Client] = set()
        self.gone: list[Client] = []
        self.logs: list[tuple[int, str]] = []
        self.debug = False  # whether debug lines are wanted at all
        self.fanouts: list[Fanout] = []  # deliveries going on, oldest first (`step`)
        self.freed: list[object] = []  # batches held for them and done with: the shell's again
        self._departing: deque[Client] = deque()
        # counters (read by STATUS= and monitoring)
        self.published = 0
        self.delivered = 0
        self.dropped = 0
        self.disconnects = 0
        self.started = now

    # -- what the shell acts on, taken (the core starts afresh) --------------------

    def take_logs(self) -> list[tuple[int, str]]:
        logs, self.logs = self.logs, []
        return logs

    def take_gone(self) -> list[Client]:
        gone, self.gone = self.gone, []
        return gone

    def take_dirty(self) -> set[Client]:
        dirty, self.dirty = self.dirty, set()
        return dirty

    def take_freed(self) -> list[object]:
        freed, self.freed = self.freed, []
        return freed

    # -- events ---------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Time passed: *now* is the shell's monotonic clock."""
        self.now = now

    def connect(self, cred: Credentials, link: object, cid: int | None = None) -> Client | None:
        """A client connected; None (and a log line) if its user may not hold another."""
        if cid is None:
            cid = self._next_id
        self._next_id = max(self._next_id, cid + 1)
        conn = Client(cid, link, cred, self.queue_limit)
        for setting in self.defaults:
            conn.out.apply(setting)
        refusal = self.accounts.connect(conn)
        if refusal:
            self._log(conn, f"connection refused: {refusal}")
            return None
        conn.out.budget = self.accounts.budget(conn)
        conn.may_pause_others = self._trusted(cred.uid)
        self.connections[cid] = conn
        self.empty_since = None
        self._by_uid.setdefault(cred.uid, {})[cid] = conn
        self.dirty.add(conn)
        if self.debug:
            self.logs.append((logging.DEBUG, f"{conn!r} connected"))
        return conn

    def hangup(self, conn: Client, why: str | None = None) -> None:
        """The client is gone (end of file, a failed read): forget it."""
        if why is not None and not conn.closed:
            self.logs.append((logging.INFO, f"{conn!r}: {why}"))
        self._depart(conn)

    def receive(self, conn: Client, batch, n: int, *, hold: bool = False, start: int = 0,
                blocked: list[Client] | None = None) -> Fanout | None:
        """Act on the *n* packets *conn* sent that are in *batch* (a `PacketBatch` or any
        object with its ``buffer``, ``offsets``, ``lengths``, ``copy`` and ``heads``).

        ==========================  ================================================
        a publish with the open     joins the open run: its head (``MSG key\\0``) is
        run's head                  compared as bytes, nothing parsed
        a publish of another key    routed (`RoutingIndex.match`); the same targets
                                    continue the run, others open a new one
        the rest of the batch has   all of it joins the run at once (`_same_head`):
        that head (the usual case)  the batch is one run of one key
        anything else (a refused    the runs before it are delivered (`_flush`), then
        publish too)                it is acted on (`_act_on`) or refused, in the
                                    client's order
        the end of the batch        the runs are delivered (`_flush`), and the
                                    publisher is paused or goes on (`_settle`)
        ==========================  ================================================

        Consecutive publishes with the same targets form a run, delivered together
        (`_deliver`): the targets then take a run of packets back to back, with one
        system call each.  With *hold*, the core may keep *batch* (the shell reads into
        another buffer meanwhile): a delivery of more than `HOLD_FROM` packets is not
        made at once but returned as a `Fanout`, served `step` by step in later turns;
        the publisher is not read until it is done (*start* and *blocked* are its
        continuation's).
        """
        buf, offsets, lengths = batch.buffer, batch.offsets, batch.lengths
        max_message, msg_verb = self.max_message, protocol.MSG_VERB
        framed = self.index.cache.framed
        published = 0
        runs: list[tuple[int, int, tuple[Client, ...]]] = []  # (start, end, targets)
        run_start, run_targets = start, ()  # the open run: [run_start, i), same targets
        head, head_len = None, 0  # the MSG head of the open run, to spot the same key
        misses = 0  # packets in a row whose head was not the open run's
        heads, heads_from, width = (), n, 0  # the batch's heads, for `_one_by_one`
        takes = 2  # times they may be taken (again, for another width)
        go_on = start
        while go_on < n:
            resume = n  # where the loop goes on after `_one_by_one`, if it stops early
            for i in range(go_on, n):
                size = lengths[i]
                at = offsets[i]
                if head_len:
                    if head_len <= size <= max_message and buf[at:at + head_len] == head:
                        published += 1
                        misses = 0
                        continue
                    misses += 1
                targets = None
                routed = False  # a publish: routed, or refused if *targets* is None
                nul = buf.find(b"\0", at, at + size) if 4 < size <= max_message else -1
                if nul > 0:
                    head = buf[at:nul + 1]
                    targets = framed.get(head)
                    if targets is not None:
                        routed = True
                    elif head.startswith(msg_verb):
                        routed = True
                        key = head[4:-1]
                        if b"!" not in key or self._key_allowed(key):
                            targets = self.index.match(key, conn.cred.uid)
                if targets is not None:
                    published += 1
                    if targets is not run_targets:
                        if run_targets:
                            runs.append((run_start, i, run_targets))
                        run_start, run_targets = i, targets
                    if misses < 2:
                        head_len = nul + 1 - at
                        if published == 1 and self._same_head(batch, head, i + 1, n):
                            published += n - i - 1  # the usual batch: one key throughout
                            break
                        continue
                    # keys that change at every packet (many keys in turn): stop comparing
                    # heads; a packet for one target is delivered as it is routed
                    head_len = 0
                    if len(targets) > 1 or i + 1 == n:
                        continue
                    if width != nul + 1 - at:  # heads of another width: taken afresh,
                        if not takes:  # twice a batch at most (a call costs a few µs)
                            continue
                        takes -= 1
                        width, heads_from = nul + 1 - at, i + 1
                        heads = self._heads(batch, i + 1, n, width)
                    if not heads:
                        continue
                    runs.append((run_start, i + 1, run_targets))
                    job, blocked = self._flush(conn, batch, n, runs, blocked, hold, i + 1)
                    if job is not None:
                        self.published += published
                        return job
                    runs, run_targets = [], ()
                    resume, blocked = self._one_by_one(
                        conn, batch, i + 1, heads[i + 1 - heads_from:], blocked)
                    published += resume - i - 1
                    run_start = resume
                    break
                # not a publish (or a refused one): deliver what came before, then act on it
                if run_targets:
                    runs.append((run_start, i, run_targets))
                if runs:
                    job, blocked = self._flush(conn, batch, n, runs, blocked, hold, i)
                    if job is not None:
                        self.published += published  # packet i is acted on when it is done
                        return job
                    runs = []
                run_start, run_targets, head, head_len = i + 1, (), None, 0
                if routed:  # refused (after what came before was delivered), and said why
                    self._key_allowed(key, conn)
                elif self._act_on(conn, batch, i, size):
                    resume = n
                    break  # it is gone
            go_on = resume
        if run_targets:  # still open: it runs to the end of the batch
            runs.append((run_start, n, run_targets))
        # what was read was published, even if the publisher is gone now
        self.published += published
        if runs:
            job, blocked = self._flush(conn, batch, n, runs, blocked, hold, n)
            if job is not None:
                return job
        self._settle(conn, blocked)
        return None

    def _heads(self, batch, start: int, end: int, width: int) -> tuple[bytes, ...]:
        """The first *width* bytes of batch packets ``start .. end-1`` (`PacketBatch.heads`,
        one call), or () if a packet there is shorter than that or over the size limit
        (a slot's bytes past its packet are stale)."""
        sizes = batch.lengths[start:end]
        if min(sizes) < width or max(sizes) > self.max_message:
            return ()
        return batch.heads(start, end, width)

    def _one_by_one(self, conn: Client, batch, start: int, heads, blocked):
        """Publishes from batch packet *start* on (*heads* are theirs), for as long as each
        has at most one target: many keys in turn, each with its subscriber (S3), cost a
        dict probe per packet.  They are all routed first and then written back to back
        with one call of the `WriteEach` port (a loop in C): Python between two writes
        left the kernel's socket and wake-up state cold, and cost the broker more kernel
        time per write than the writes themselves (docs/performance.md, issue 26).  A
        head not cached is parsed and routed here unless it is not a plain publish.
        Returns where it stopped (a packet it leaves to `receive`: not a publish, a
        secret key, more than one target) and *blocked*; what was routed before it is
        written or queued by then, so the publisher's order holds."""
        get = self.index.cache.framed.get
        buf, offsets, lengths = batch.buffer, batch.offsets, batch.lengths
        msg_verb = protocol.MSG_VERB
        copies: dict[int, bytes] = {}
        picks: list[int] = []  # packets to write now, in order ...
        dests: list[Client] = []  # ... and their targets (none has a queue)
        for i, head in enumerate(heads, start):  # noqa: B007 - i is returned
            targets = get(head)
            if targets is None:  # not cached, or a key of another length: parse it
                at = offsets[i]
                nul = buf.find(b"\0", at, at + lengths[i])
                if nul < 0:
                    break
                head = buf[at:nul + 1]
                if not head.startswith(msg_verb) or b"!" in head:
                    break  # a secret key is checked in `receive`
                targets = self.index.match(head[4:-1], conn.cred.uid)
            if not targets:
                continue
            try:
                t, = targets
            except ValueError:
                break  # more than one target
            if t.closed:
                continue
            if t.out.items:  # behind its queue (a target's queue only grows meanwhile)
                blocked = self._enqueue(conn, t, batch, i, i + 1, copies, blocked)
                continue
            picks.append(i)
            dests.append(t)
        else:
            i = start + len(heads)
        if picks:
            taken = self._write_many(batch, picks, [t.link for t in dests])
            self.delivered += taken
            if taken < len(picks):
                blocked = self._write_rest(conn, batch, picks, dests, taken, copies, blocked)
        return i, blocked

    def _write_rest(self, conn: Client, batch, picks, dests, first: int, copies, blocked):
        """`_one_by_one`'s writes from the one the link refused on, one at a time: that
        target may be full (its packets queue behind) or gone."""
        buf, offsets, lengths, write = batch.buffer, batch.offsets, batch.lengths, self._write
        for n in range(first, len(picks)):
            t, i = dests[n], picks[n]
            if t.closed:
                continue
            if t.out.items:
                blocked = self._enqueue(conn, t, batch, i, i + 1, copies, blocked)
                continue
            at = offsets[i]
            got = write(t.link, buf[at:at + lengths[i]])
            if got >= 0:
                self.delivered += 1
            elif got == FULL:
                blocked = self._enqueue(conn, t, batch, i, i + 1, copies, blocked)
            else:
                self._unsent(t, got)
        return blocked

    def _flush(self, conn: Client, batch, n: int, runs, blocked, hold: bool, resume: int):
        """Deliver *runs* now, or keep *batch* for a fan-out in steps if they are worth
        it (and the shell can spare it): ``(the Fanout or None, blocked)``."""
        if hold and (nbytes := self._holdable(runs, batch, n)):
            return self._hold(conn, batch, n, nbytes, runs, blocked, resume), blocked
        return None, self._deliver(conn, batch, runs, blocked)

    def _act_on(self, conn: Client, batch, i: int, size: int) -> bool:
        """Packet *i* when it is not a routed publish: the end of file or an empty packet,
        one over the size limit, or the slow path (`packet`).  Whether *conn* is gone."""
        if size == 0:
            if self._at_eof(conn.link):
                self._depart(conn)
                return True
            self.refuse(conn, b"packet", "empty packet")
        elif conn.closed:
            pass  # hung up (`_hung_up`): only its publishes still matter
        elif size > self.max_message:
            self.refuse(conn, b"packet", f"over the {self.max_message}-byte limit")
        else:
            self.packet(conn, batch.copy(i))
        return not conn.read_on

    def _settle(self, conn: Client, blocked: list[Client] | None) -> None:
        """After a batch: the publisher waits for the targets that asked it to (`_pause`),
        and a client whose own replies pile up is not read until it reads them."""
        if conn.closed:
            return
        if blocked:
            self._pause(conn, blocked)
        out = conn.out
        if out.nbytes > out.limit or out.budget is not None and \
                out.budget.queued > out.budget.limit:
            conn.own_full = True
            self._recheck_own(conn)

    def turn_taken(self, conn: Client, n: int, spent: float) -> None:
        """A batch of *n* packets from *conn* took *spent* seconds: an expensive client is
        read fewer packets at once, a cheap one earns more (up to the batch)."""
        if spent > TURN_SECONDS:
            conn.slots = max(1, int(n * TURN_SECONDS / spent))
        elif n == conn.slots and conn.slots < self.batch_slots and spent * 4 < TURN_SECONDS:
            conn.slots = min(self.batch_slots, conn.slots * 2)

    def writable(self, conn: Client) -> None:
        """The client's kernel buffer has room: send what waits for it, report drops."""
        if conn.closed:
            return
        out = conn.out
        write = self._write
        link = conn.link
        turn = WRITES_PER_TURN
        if out.dropped and out.report_in is None:
            # The report's place: once the queue drains, or after the packets waiting now
            # at the latest; a flood that never lets the queue drain held it back for
            # as long as it lasted (the audit of 2026-11-28: 65 s at "dropped 0").
            out.report_in = len(out)
        due = out.report_in  # packets to send before the drop report (None: none due)
        stopped = False  # the kernel is full, or the client went
        write_run = self._write_run
        while out.items and turn and due != 0:
            # a run of the queue's front in one system call where the queue is plain
            # (S4's four publishers into one reader: a write per packet before)
            n = min(turn, WRITE_RUN, len(out.items), WRITE_RUN if due is None else due)
            run = out.front(n, WRITE_RUN_BYTES) \
                if write_run is not None and n >= SEND_BATCH_MIN else None
            if run and len(run) >= SEND_BATCH_MIN:
                n = len(run)
                got = write_run(link, run) or FULL  # (the first one's outcome if < 1)
                if got > 0:
                    for _ in range(got):
                        out.pop()
                    self.delivered += got
                    turn -= got
                    if due:
                        due -= got
                    if got < n:  # the kernel took what it could
                        stopped = True
                        break
                    continue
            else:
                got = write(link, out.peek())
            if got < 0:
                if got == FULL or not self._unsent(conn, got):
                    stopped = True
                    break
            else:
                self.delivered += 1
                turn -= 1
            out.pop()  # (got < 0: too large ever to be taken: dropped, counted, reported)
            if due:
                due -= 1
        if due is not None:
            out.report_in = due
        if out.dropped and not stopped and (due == 0 or not out.items):
            got = write(link, DROPPED + b"%d" % out.dropped)
            if got >= 0:
                out.take_dropped()
            elif got != FULL:
                self._unsent(conn, got)
        if conn.closed:
            return
        self.dirty.add(conn)
        if conn.paused:
            self._recheck_paused(conn)
        if conn.own_full:
            self._recheck_own(conn)

    def tidy(self, n: int = REMOVALS_PER_TURN) -> bool:
        """Drop up to *n* subscriptions of departed clients (a client with many leaves a
        few hundred at a time); whether more work is left."""
        while self._departing and n > 0:
            conn = self._departing[0]
            removed, left = self.index.remove_some(conn, n)
            self.subscription_count -= removed
            n -= max(removed, 1)
            if left:
                return True
            self._departing.popleft()
            self._forget(conn)
        return bool(self._departing)

    # -- one packet (the slow path) ---------------------------------------------------

    def packet(self, conn: Client, packet: bytes) -> None:
        """Every packet but a well-formed MSG: the slow path."""
        try:
            event = protocol.parse(packet)
        except protocol.ProtocolError as exc:
            self.refuse(conn, b"packet", str(exc))
            return
        if isinstance(event, protocol.Subscribe):
            self.subscribe(conn, event.pattern)
        elif isinstance(event, protocol.Unsubscribe):
            self.unsubscribe(conn, event.pattern)
        elif isinstance(event, protocol.Control):
            self.control(conn, event.key, event.payload)

    def _checked(self, conn: Client, verb: bytes, pattern: bytes) -> bytes | None:
        """*pattern* as the rules complete it for *conn*, or None (refused, and said why)."""
        try:
            return self.rules.check_pattern(pattern, conn.cred)
        except KeyRefused as exc:
            self.refuse(conn, verb, str(exc))
            return None

    def subscribe(self, conn: Client, pattern: bytes) -> None:
        pattern = self._checked(conn, b"sub", pattern)
        if pattern is None:
            return
        refusal = self.accounts.subscribe(conn, pattern_cost(pattern, self.sep))
        if refusal:
            self.refuse(conn, b"sub", f"{brief(pattern)}: {refusal}")
            return
        self.index.subscribe(conn, pattern)
        self.subscription_count += 1

    def unsubscribe(self, conn: Client, pattern: bytes) -> None:
        pattern = self._checked(conn, b"unsub", pattern)
        if pattern is None:
            return
        if self.index.unsubscribe(conn, pattern):
            self.accounts.unsubscribe(conn, pattern_cost(pattern, self.sep))
            self.subscription_count -= 1
        else:
            self.refuse(conn, b"unsub", f"not subscribed to {brief(pattern)}")

    def control(self, conn: Client, key: bytes, payload: bytes | None) -> None:
        if key == protocol.WHOAMI or key == self._whoami:
            self.reply(conn, protocol.encode(protocol.Control(key, conn.cred.path(self.sep))))
            return
        plain = key.replace(self.sep, b"/")
        if plain == protocol.PUBLISHER_NOWAIT:
            conn.nowait = True
            return
        if plain == protocol.PUBLISHER_FOR:
            self._publish_for(conn, payload or b"")
            return
        if plain == protocol.STATUS:
            self.reply(conn, introspect.answer(self, conn, payload))
            return
        if plain == protocol.REACH:
            self._reach(conn, payload or b"")
            return
        if plain == protocol.CLIENT_STATUS:
            conn.status = bytes((payload or b"")[:protocol.CLIENT_STATUS_BYTES])
            return
        setting = parse_control(plain)
        if setting is not None:
            conn.out.apply(setting)
            if conn.paused:
                self._recheck_paused(conn)  # paused publishers re-check under the new policy
            if self.debug:
                self.logs.append((logging.DEBUG, f"{conn!r}: flood control {setting}"))
            return
        self.refuse(conn, b"cmsg", f"control message {brief(key)} not understood")

    def _publish_for(self, conn: Client, payload: bytes) -> None:
        """`protocol.PUBLISHER_FOR`: a trusted connection that carries many users' messages
        (a mount, a gateway) names whose the next ones are, so that each of those users
        has its own share of a full queue instead of one for them all."""
        if not self._trusted(conn.cred.uid):
            self.refuse(conn, b"cmsg", "only a trusted user (root, sbus serve --trusted-user) "
                                       "may publish for another user")
            return
        if not payload:
            conn.owner = conn.cred.uid
            return
        if not (payload.isdigit() and len(payload) < 20 and
                int(payload) < protocol.OWNER_LIMIT):
            self.refuse(conn, b"cmsg", f"publishing for {brief(payload)}: not a user number")
            return
        conn.owner = int(payload)

    def _reach(self, conn: Client, key: bytes) -> None:
        """`protocol.REACH`: how many clients a message of *conn* on *key* would reach
        (one routing lookup, as a publish makes); another process's secret key gets
        ``?``, so nobody learns what a stranger's private keys are subscribed to."""
        try:
            self.rules.check_key(key)
        except KeyRefused as exc:
            self.refuse(conn, b"cmsg", str(exc))
            return
        mine = conn.cred.path(self.sep) + self.sep
        if self.rules.is_secret(key) and not key.startswith(mine):
            count = b"?"
        else:
            count = b"%d" % len(self.index.match(key, conn.cred.uid))
        self.reply(conn, protocol.encode(protocol.Control(protocol.REACH, key + b"\0" + count)))

    def refuse(self, conn: Client, verb: bytes, why: str) -> None:
        """Tell *conn* that its packet was refused, and log it within its allowance."""
        self._log(conn, f"{verb.decode()} refused: {why}")
        self.reply(conn, protocol.encode(protocol.Control(
            protocol.REFUSED + b"/" + verb, why.encode("utf-8", "backslashreplace"))))

    def reply(self, conn: Client, packet: bytes) -> None:
        """Send the broker's own packet to *conn*, whatever its flood policy."""
        if conn.closed:
            return
        if not conn.out.items:
            got = self._write(conn.link, packet)
            if got >= 0:
                return
            if got != FULL:
                self._unsent(conn, got)
                return
        conn.out.force(packet)
        self.dirty.add(conn)

    # -- delivering -------------------------------------------------------------------

    def _same_head(self, batch, head: bytes, start: int, end: int) -> bool:
        """Whether batch packets ``start .. end-1`` are all publishes that begin with *head*.

        Checked with a few calls that loop in C (`PacketBatch.heads`), rather than packet
        by packet.
        """
        if end - start < 2:
            return False
        size = len(head)
        at = batch.offsets[end - 1]
        if batch.buffer[at:at + size] != head:
            return False
        lengths = batch.lengths[start:end]
        first = lengths[0]
        if lengths.count(first) == end - start:  # one size throughout: count beats min+max
            if not size <= first <= self.max_message:
                return False
        elif min(lengths) < size or max(lengths) > self.max_message:
            return False
        return batch.heads(start, end, size).count(head) == end - start

    def _key_allowed(self, key: bytes, conn: Client | None = None) -> bool:
        """Whether *key* may be published to; if not, and *conn* is given, it is told why
        (a publish is refused once what its publisher sent before it is delivered)."""
        try:
            self.rules.check_key(key)
        except KeyRefused as exc:
            if conn is not None:
                self.refuse(conn, b"msg", str(exc))
            return False
        return True

    def _holdable(self, runs, batch, n: int) -> int:
        """The bytes of *batch*'s packets if *runs* are worth holding it for (`Fanout`),
        else 0."""
        deliveries = 0
        for start, end, targets in runs:
            deliveries += (end - start) * len(targets)
        if deliveries <= HOLD_FROM:
            return 0
        nbytes = sum(batch.lengths[:n])
        return nbytes if nbytes <= HOLD_BYTES else 0

    def _hold(self, conn: Client, batch, n: int, nbytes: int, runs, blocked,
              resume: int) -> Fanout:
        """Keep *batch* to deliver *runs* in steps; its *nbytes* are charged to *conn*'s
        user meanwhile."""
        charged = nbytes + n * PACKET_OVERHEAD
        budget = conn.out.budget
        if budget is not None:
            budget.queued += charged
        job = conn.fanout = Fanout(conn, batch, n, runs, blocked, resume, charged)
        self.fanouts.append(job)
        self.dirty.add(conn)
        return job

    def step(self, job: Fanout, deliveries: int = STEP_DELIVERIES) -> bool:
        """Deliver about *deliveries* more packets of *job*; whether it is done.

        Once it is, the publisher's batch goes on where it stopped (which may hold it
        again, as a new `Fanout`), and the batch is in `freed` once nothing holds it."""
        runs = job.runs
        while job.run < len(runs):
            if deliveries <= 0:
                return False
            start, end, targets = runs[job.run]
            first = job.next
            last = first + max(1, deliveries // (end - start))
            job.blocked = self._deliver(job.publisher, job.batch,
                                        [(start, end, targets[first:last])], job.blocked,
                                        job.copies)
            deliveries -= (min(last, len(targets)) - first) * (end - start)
            if last < len(targets):
                job.next = last
            else:
                job.run, job.next = job.run + 1, 0
        conn = job.publisher
        self.fanouts.remove(job)
        conn.fanout = None
        budget = conn.out.budget
        if budget is not None:
            budget.queued -= job.charged
        self.dirty.add(conn)
        if not conn.read_on or self.receive(conn, job.batch, job.n, hold=True,
                                            start=job.resume, blocked=job.blocked) is None:
            self.freed.append(job.batch)
        return True

    def finish_fanouts(self) -> None:
        """Deliver every held batch to the end (before a hand-over or a shutdown)."""
        while self.fanouts:
            self.step(self.fanouts[0], 1 << 30)

    def _deliver(self, publisher: Client, batch, runs, blocked, copies=None):
        """Hand each run's batch packets ``start .. end-1`` to each of its targets.

        ==========================  ================================================
        one packet, one target      written from the buffer (many keys in turn)
        one packet, many targets    copied once and written to each (`_write_each`)
        a run of packets            sent to each target from the buffer, one
                                    ``sendmmsg`` for the run (`_send_run`)
        what a target's kernel did  offered to its queue, after what already waits
        not take                    there, under its flood policy (`_enqueue`)
        a target that failed        dropped, or the packet lost if it was too large
                                    for the target's socket (`_unsent`)
        ==========================  ================================================

        Returns *blocked* plus the targets that now ask the publisher to wait: the
        publisher is paused after the whole batch (`_settle`), so a blocking queue can
        be over its limit by at most one batch.  *copies* holds the packets copied out
        of the batch for queues, shared by every target (and by the steps of a
        `Fanout`).
        """
        if copies is None:
            copies = {}
        buf, offsets, lengths = batch.buffer, batch.offsets, batch.lengths
        write, send = self._write, self._send
        sent = 0
        for start, end, targets in runs:
            if end - start == 1:
                if len(targets) == 1:  # many keys: one packet, one target
                    t = targets[0]
                    if t.closed:
                        continue
                    if not t.out.items:
                        at = offsets[start]
                        got = write(t.link, buf[at:at + lengths[start]])
                        if got >= 0:
                            sent += 1
                            continue
                        if got != FULL:
                            self._unsent(t, got)
                            continue
                    blocked = self._enqueue(publisher, t, batch, start, end, copies, blocked)
                    continue
                written, targets = self._write_each(targets, batch, start, copies)
                sent += written
                for t in targets:  # those whose kernel was full, or that have a queue
                    blocked = self._enqueue(publisher, t, batch, start, end, copies, blocked)
                continue
            count = end - start
            for t in targets:
                if t.closed:
                    continue
                if t.out.items:
                    i = start  # behind what waits
                elif count < SEND_BATCH_MIN:
                    i = self._send_run(t, batch, start, end, copies)
                else:
                    got = send(batch, t.link, start, count)
                    if got == count:
                        sent += count  # the usual case: the kernel took the whole run
                        continue
                    if got >= 0:
                        sent += got  # the kernel took what it could
                        i = start + got
                    elif got == FULL:
                        i = start
                    else:  # a failure: the run packet by packet (`_unsent`)
                        i = self._send_run(t, batch, start, end, copies)
                if i < end and not t.closed:
                    blocked = self._enqueue(publisher, t, batch, i, end, copies, blocked)
        self.delivered += sent
        return blocked

    def _write_each(self, targets, batch, i: int, copies) -> tuple[int, list[Client]]:
        """Packet *i* (copied once) written to each of *targets* that has no queue:
        ``(how many took it, the targets left to queue it)``."""
        packet = copies.get(i)
        if packet is None:
            at = batch.offsets[i]
            packet = copies[i] = batch.buffer[at:at + batch.lengths[i]]
        write = self._write
        written = 0
        waiting = []
        for t in targets:
            if t.closed:
                continue
            if t.out.items:
                waiting.append(t)
                continue
            got = write(t.link, packet)
            if got >= 0:
                written += 1
            elif got == FULL:
                waiting.append(t)
            else:
                self._unsent(t, got)
        return written, waiting

    def _send_run(self, t: Client, batch, start: int, end: int, copies) -> int:
        """Batch packets ``start .. end-1`` to *t*'s kernel, as many as it takes now (one
        ``sendmmsg`` for `SEND_BATCH_MIN` or more, a write each for fewer); returns
        where the rest begins (*end*: all taken, or *t* is gone)."""
        send, write = self._send, self._write
        link = t.link
        i, lost = start, 0
        while i < end:
            if end - i >= SEND_BATCH_MIN:
                got = send(batch, link, i, end - i)
                if got >= 0:
                    i += got
                    if i < end:
                        break  # the kernel took what it could
                    continue
            else:
                packet = copies.get(i)
                if packet is None:
                    packet = copies[i] = batch.copy(i)
                got = write(link, packet)
                if got >= 0:
                    i += 1
                    continue
            if got == FULL or not self._unsent(t, got):
                break
            i += 1  # that packet could not be delivered (counted, reported)
            lost += 1
        self.delivered += i - start - lost
        return i

    def _enqueue(self, publisher: Client, t: Client, batch, start: int, end: int, copies,
                 blocked: list[Client] | None) -> list[Client] | None:
        """Offer batch packets ``start .. end-1`` to *t*'s queue under its flood policy;
        returns *blocked*, with *t* if it asks the publisher to wait.

        Only a target of the publisher's own UID, or a trusted one, may pause it
        (`Limits.trusted`), and never a publisher that asked not to be paused
        (`protocol.PUBLISHER_NOWAIT`).  What a blocking queue holds beyond its limit is
        charged to the publisher's user (`Client.held`), and once that user's budget is
        spent the target loses the packet instead (counted, reported).  A full queue
        is shared by the publishers' users (`OutQueue.offer`'s *owner*): a flooder
        loses its own packets (`Verdict.EVICTED`)."""
        out = t.out
        pub_budget = publisher.out.budget
        uid = publisher.owner
        may_block = not (publisher.nowait or publisher.closed) and (
            t.cred.uid == publisher.cred.uid or t.may_pause_others)
        for j in range(start, end):
            packet = copies.get(j)
            if packet is None:
                packet = copies[j] = batch.copy(j)
            over = may_block and out.nbytes >= out.limit
            if over and pub_budget is not None and \
                    pub_budget.queued + len(packet) > pub_budget.limit:
                over = may_block = False  # its user cannot hold more: drop
            verdict = out.offer(packet, may_block, uid)
            if verdict is Verdict.DROPPED:
                self.dropped += 1
            elif verdict is Verdict.EVICTED:
                self.dropped += out.evicted
            elif verdict is Verdict.BLOCK:
                if over:
                    size = len(packet) + PACKET_OVERHEAD
                    publisher.held += size
                    if pub_budget is not None:
                        pub_budget.queued += size
                if blocked is None:
                    blocked = [t]
                elif t not in blocked:
                    blocked.append(t)
            elif verdict is Verdict.ERROR:
                self._drop(t, "its flood policy is 'error' and it could not take a message")
                break
        self.dirty.add(t)
        return blocked

    def _unsent(self, conn: Client, outcome: int) -> bool:
        """A write or send to *conn* took nothing, and not because its kernel was full
        (`GONE`, `TOO_BIG`, `FAILED`): whether *conn* is still connected (the packet is
        then lost, counted and reported to it)."""
        if outcome == TOO_BIG:
            self._log(conn, "a message too large for its socket could not be delivered: "
                            "dropped")
            conn.out.dropped += 1
            self.dropped += 1
            self.dirty.add(conn)
            return True
        if outcome == GONE:
            self._hung_up(conn)
        else:
            self._drop(conn, "sending to it failed")
        return False

    # -- pausing ---------------------------------------------------------------------

    def _pause(self, publisher: Client, blocked: list[Client]) -> None:
        """Stop reading *publisher* until every target in *blocked* lets it go on."""
        waiting = []
        for t in blocked:
            if not t.closed and not t.out.publisher_may_continue():
                waiting.append(t)
                t.paused.append(publisher)
        if waiting:
            publisher.waiting_on = waiting
            self.dirty.add(publisher)
        else:
            self._release_held(publisher)

    def _recheck_paused(self, target: Client) -> None:
        """The publishers *target* holds back go on once it lets them (or is gone)."""
        if not (target.closed or target.out.publisher_may_continue()):
            return
        publishers, target.paused = target.paused, []
        for p in publishers:
            waiting = p.waiting_on
            if waiting is None:
                continue
            if target in waiting:
                waiting.remove(target)
            if not waiting:
                p.waiting_on = None
                self._release_held(p)
                self.dirty.add(p)

    def _recheck_own(self, conn: Client) -> None:
        """A client over its own queue's limit is read again once its queue is back to
        half its limit, or empty."""
        out = conn.out
        budget = out.budget
        if out.items and (out.nbytes > out.limit // 2
                          or budget is not None and budget.queued > budget.limit):
            return
        conn.own_full = False
        self.dirty.add(conn)

    def _release_held(self, conn: Client) -> None:
        if conn.held:
            if conn.out.budget is not None:
                conn.out.budget.queued -= conn.held
            conn.held = 0

    # -- leaving -----------------------------------------------------------------------

    def _drop(self, conn: Client, why: str, level: int = logging.WARNING) -> None:
        """Disconnect *conn* and say why."""
        if not conn.closed:
            if level > logging.DEBUG or self.debug:
                self.logs.append((level, f"disconnecting {conn!r}: {why}"))
            self._depart(conn)

    def _hung_up(self, conn: Client) -> None:
        """A write found *conn*'s peer gone.  What it sent before it hung up is still on
        its socket, in order: it is read to its end of file (`wants_read`), its
        publishes delivered, and then it departs; nothing is delivered or answered to it
        meanwhile.  (Closed at once, a client that published and closed lost its last
        messages without a word whenever the broker wrote to it first.)"""
        if conn.closed:
            return
        if self.debug:
            self.logs.append((logging.DEBUG, f"{conn!r} hung up: reading what it sent"))
        self._stop_serving(conn)
        conn.draining = True
        conn.own_full = False  # (no reply of ours waits for it any more)
        conn.out.clear()
        self.dirty.add(conn)

    def _depart(self, conn: Client) -> None:
        """Nothing is delivered to *conn* from now on; the shell closes its link, and its
        subscriptions go a few hundred at a time (`tidy`)."""
        if conn.draining:  # read to its end (`_hung_up`)
            conn.draining = False
        elif conn.closed:
            return
        else:
            self._stop_serving(conn)
        self.gone.append(conn)
        self.dirty.discard(conn)
        self._departing.append(conn)

    def _stop_serving(self, conn: Client) -> None:
        """*conn* is closed: whoever waits for it goes on."""
        conn.closed = True
        if conn.waiting_on:  # it no longer waits for anyone
            for t in conn.waiting_on:
                if conn in t.paused:
                    t.paused.remove(conn)
            conn.waiting_on = None
        self._release_held(conn)
        self._recheck_paused(conn)  # whoever it held back goes on

    def _forget(self, conn: Client) -> None:
        self.subscription_count -= self.index.remove_client(conn)
        self.accounts.disconnect(conn)
        self.connections.pop(conn.id, None)
        if not self.connections:
            self.empty_since = self.now
        mine = self._by_uid.get(conn.cred.uid)
        if mine is not None:
            mine.pop(conn.id, None)
            if not mine:
                del self._by_uid[conn.cred.uid]
        conn.out.clear()
        self.disconnects += 1
        if self.debug:
            self.logs.append((logging.DEBUG, f"{conn!r} disconnected"))

    # -- policy helpers ------------------------------------------------------------------

    def _trusted(self, uid: int) -> bool:
        """Whether subscribers of *uid* may pause other users' publishers."""
        limits = self.accounts.limits
        if limits.may_pause_others(uid):
            return True
        names = {t for t in limits.trusted if isinstance(t, str)}
        return bool(names) and self._user_name(uid) in names

    def _log(self, conn: Client, what: str) -> None:
        """A warning about *conn*, within its UID's allowance (see `LogAllowance`).

        *what* must quote client input only through `display.brief`."""
        held = self.allowance.take(conn.cred.uid)
        if held is None:
            return
        more = f" ({held} more lines about uid {conn.cred.uid} were not logged)" if held else ""
        self.logs.append((logging.WARNING, f"{conn!r}: {what}{more}"))

    # -- handing over to a successor (sbus/handover.py) ------------------------------------

    def snapshot(self) -> handover.State:
        """Every connected client's state (the shell hands their links over separately)."""
        clients = []
        for conn in self.connections.values():
            if not conn.read_on:  # (one draining is read by the next broker)
                continue
            out = conn.out
            queued = out.arrival_order()
            clients.append(handover.ClientState(
                conn.id, sorted(self.index.patterns(conn).items()), out.soft.value,
                out.hard.value, out.order.value, conn.nowait, [p for p, _ in queued],
                out.dropped, None if conn.owner == conn.cred.uid else conn.owner,
                [o for _, o in queued]))
        counters = {"published": self.published, "delivered": self.delivered,
                    "dropped": self.dropped, "disconnects": self.disconnects}
        return handover.State(self.sep, counters, clients)

    def restore(self, state: handover.State,
                peers: dict[int, tuple[Credentials, object]]) -> list[Client]:
        """Take over a predecessor's clients: *peers* maps a client id to its credentials
        (asked of the kernel again) and link.  Returns the clients taken; a client the
        limits now refuse, or missing from *peers*, is not (the shell closes its link)."""
        self._check_snapshot(state)
        for name in ("published", "delivered", "dropped", "disconnects"):
            setattr(self, name, state.counters.get(name, 0))
        taken = []
        for c in state.clients:
            peer = peers.get(c.id)
            if peer is None:
                continue
            conn = self.connect(peer[0], peer[1], c.id)
            if conn is None:
                continue
            out = conn.out
            out.apply(Soft(c.soft))
            out.apply(Hard(c.hard))
            out.apply(Order(c.order))
            conn.nowait = c.nowait
            if c.owner is not None and conn.may_pause_others:  # still trusted
                conn.owner = c.owner
            for pattern, count in c.patterns:
                for _ in range(count):
                    held = conn.subscriptions
                    self.subscribe(conn, pattern)
                    if conn.subscriptions == held:
                        break  # refused (and said why) once: not once per copy
            out.carry_over(c.queued, c.queued_owners)
            out.dropped = c.dropped
            taken.append(conn)
        self._next_id = max([self._next_id, *(c.id + 1 for c in state.clients)])
        return taken

    def _check_snapshot(self, state: handover.State) -> None:
        """Refuse a snapshot this core cannot take as a whole (`HandoverError`), before
        it takes any of it: a damaged one must not leave half its clients behind."""
        if state.sep != self.sep:
            raise handover.HandoverError(f"the predecessor used the separator {state.sep!r}")
        if not all(type(v) is int for v in state.counters.values()):
            raise handover.HandoverError("the snapshot's counters are not numbers")
        seen: set[int] = set()
        for c in state.clients:
            if type(c.id) is not int or not 0 < c.id < 1 << 62 or c.id in seen:
                raise handover.HandoverError(f"client id {c.id!r} is repeated or invalid")
            seen.add(c.id)
            try:
                Soft(c.soft), Hard(c.hard), Order(c.order)
            except ValueError as exc:
                raise handover.HandoverError(f"client {c.id}: {exc}") from None
            if not all(type(p) is bytes and type(n) is int and 0 < n <= RESTORED_COPIES
                       for p, n in c.patterns) or \
                    not all(type(q) is bytes for q in c.queued) or \
                    not (c.queued_owners is None or
                         len(c.queued_owners) == len(c.queued) and
                         all(o is None or type(o) is int and 0 <= o < protocol.OWNER_LIMIT
                             for o in c.queued_owners)) or \
                    type(c.dropped) is not int or c.dropped < 0 or \
                    not (c.owner is None or
                         (type(c.owner) is int and 0 <= c.owner < protocol.OWNER_LIMIT)):
                raise handover.HandoverError(f"client {c.id}'s state is damaged")

    # -- reporting ---------------------------------------------------------------------

    def connections_of(self, uid: int | None) -> list[Client]:
        """The connections of *uid* (of everyone for None), oldest first."""
        if uid is not None:
            return list(self._by_uid.get(uid, {}).values())
        return list(self.connections.values())

    def status(self) -> str:
        paused = sum(len(c.paused) for c in self.connections.values())
        return (f"{len(self.connections)} clients, {self.subscription_count} subscriptions, "
                f"{self.published} published, {self.delivered} delivered, "
                f"{self.dropped} dropped, {paused} publishers paused")
