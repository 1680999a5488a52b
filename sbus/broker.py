"""The broker: a thin trio shell around the pure protocol, routing and flood modules.

Speed comes from doing as little as possible per packet: trio is used only to
wait for readiness; once a socket is readable, its packets are received up to 32
per system call (`PacketBatch`, ``recvmmsg``), routed, and each run of packets with
the same targets is handed to each target's kernel with one non-blocking
``sendmmsg`` (a ``write`` for a run of one or two), straight from the receive
buffer.  Only when a target's kernel buffer is full does its `OutQueue` and writer
task come into play (docs/performance.md has the measurements).

Each client is a task pair in its own nursery: a reader (everything the client
sends) and a writer (only busy while packets wait).  A failing client is
cancelled through its own cancel scope and never disturbs another one.

No client can hold the loop: every packet's work is bounded (patterns are limited in
shape, lookups probe once per prefix length, cache invalidation is amortised, order
changes re-sort at most a few hundred packets), and a reader yields to the others
once its turn has run `TURN_SECONDS`.  Everything a client makes the broker keep is
charged to its UID (sbus/limits.py).  A refused packet is answered with
``CMSG refused/VERB\0reason`` and logged within the UID's allowance.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import pwd
import select
import socket
import struct
import time

import trio
from trio.lowlevel import ParkingLot, wait_readable, wait_writable

from . import handover, introspect, protocol
from .defaults import MAX_MESSAGE, QUEUE_LIMIT
from .display import brief
from .flood import PACKET_OVERHEAD, Hard, Order, OutQueue, Soft, Verdict, parse_control
from .keys import Credentials, KeyRefused, KeyRules
from .limits import Limits, LogAllowance, UserAccounts
from .packetio import PacketBatch
from .routing import RouteCache, RoutingIndex, pattern_cost

log = logging.getLogger("sbus.broker")

#: Packets received with one system call (fewer when they are large: see `batch_slots`).
BATCH_SLOTS = 32
#: Memory for one batch of packets at most (it is reserved, and used as packets need it).
BATCH_MEMORY = 8 * 1024 * 1024
#: Batches read from one socket before letting other tasks run.
READS_PER_WAKE = 4
#: Packets for one target from which one `sendmmsg` beats a `write` each.
SEND_BATCH_MIN = 3
#: A reader that has run this long yields to the other clients before reading more.
TURN_SECONDS = 0.002
#: Packets a writer sends from a queue before yielding to the other clients.
WRITES_PER_TURN = 1024
#: Subscriptions of a departed client dropped before yielding to the other clients.
REMOVALS_PER_TURN = 512
#: Packets read at once from a new client; it earns more (up to the batch) by packets
#: that prove cheap, and a batch that overran its turn makes it read fewer: a client
#: whose packets are expensive (a fan-out to thousands, a lookup through a wide trie)
#: is served one packet per turn.
FIRST_SLOTS = 4
#: Clients accepted before yielding: a storm of connections waits in the backlog (and
#: is refused by the kernel when that is full) instead of crowding out the clients
#: already served.
ACCEPTS_PER_TURN = 16
DROPPED = b"CMSG " + protocol.DROPPED + b"\0"
REFUSED = b"CMSG " + protocol.REFUSED + b"/"

_ucred = struct.Struct("3i")
_HANGUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR


def _spare_fd() -> int:
    return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)


def _refuse_one(listener: socket.socket, spare: int) -> tuple[bool, int]:
    """At the descriptor limit: use the spare to accept one client and hang up on it.

    Returns whether a client was waiting (Linux reports EMFILE before it looks at the
    backlog, so an empty backlog looks the same as a full one until we try) and the
    new spare descriptor.
    """
    if spare >= 0:
        os.close(spare)
    try:
        sock, _ = listener.accept()
        sock.close()
        waiting = True
    except OSError:
        waiting = False
    try:
        return waiting, _spare_fd()
    except OSError:
        return waiting, -1  # someone took it meanwhile: try again at the next refusal


def _at_eof(sock: socket.socket) -> bool:
    """After a 0-byte read: did the peer hang up, or send an empty packet?"""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLRDHUP)
    return any(ev & _HANGUP for _, ev in poller.poll(0))


def peer_credentials(sock: socket.socket) -> Credentials:
    pid, uid, gid = _ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _ucred.size))
    return Credentials(gid=gid, uid=uid, pid=pid)


class Connection:
    """One client: its socket, identity, waiting packets and the tasks serving it."""

    __slots__ = ("id", "sock", "fd", "cred", "out", "writer_lot", "paused", "closed",
                 "scope", "subscriptions", "subscription_bytes", "nowait",
                 "may_pause_others", "held", "slots", "__weakref__")

    def __init__(self, cid: int, sock: socket.socket, cred: Credentials, queue_limit: int):
        self.id = cid
        self.sock = sock
        self.fd = sock.fileno()  # -1 once closed, so a reused fd number is never written to
        self.cred = cred
        self.out = OutQueue(queue_limit)
        self.writer_lot = ParkingLot()  # the writer waits here for packets
        self.paused = ParkingLot()  # publishers wait here while this client blocks them
        self.closed = False
        self.scope: trio.CancelScope | None = None
        self.subscriptions = 0
        self.subscription_bytes = 0
        self.nowait = False  # asked never to be paused as a publisher (a shared connection)
        self.may_pause_others = False  # its `block` may pause other users' publishers
        self.held = 0  # bytes it sent beyond full queues while paused, charged to its user
        self.slots = FIRST_SLOTS  # packets read at once: fewer while its packets cost much

    def __repr__(self) -> str:
        c = self.cred
        return f"client {self.id} (pid {c.pid} uid {c.uid} gid {c.gid})"


class Broker:
    def __init__(
        self,
        *,
        sep: bytes = b"/",
        max_message: int = MAX_MESSAGE,
        queue_limit: int = QUEUE_LIMIT,
        limits: Limits | None = None,
        defaults: tuple[Soft, Hard, Order] = (Soft.QUEUE, Hard.DISCARD, Order.QUEUE),
    ) -> None:
        self.sep = sep
        self.defaults = defaults
        self.rules = KeyRules(sep)
        limits = limits or Limits()
        self.index: RoutingIndex[Connection] = RoutingIndex(
            sep, RouteCache(sep, limits.cache_bytes, limits.cache_bytes_per_user))
        self._whoami = protocol.WHOAMI.replace(b"/", sep)  # either spelling is answered
        self.max_message = max_message
        self.queue_limit = queue_limit
        # one buffer for all readers: a batch is handled without yielding to other tasks
        slot = max_message + 1  # one more, to see an oversized packet (the kernel truncates)
        self._batch = PacketBatch(max(1, min(BATCH_SLOTS, BATCH_MEMORY // slot)), slot)
        self._head_slices: dict[int, list[slice]] = {}  # for `_same_head`, by head length
        self.accounts = UserAccounts(limits)
        self.allowance = LogAllowance()
        self.connections: set[Connection] = set()
        self._by_uid: dict[int, dict[int, Connection]] = {}  # uid -> id -> connection
        self.subscription_count = 0
        self.empty_since: float | None = time.monotonic()  # no client since (None: some)
        self.handing_over = False  # clients keep their sockets and state for a successor
        self._adopted: list[Connection] = []  # restored from a predecessor, to be served
        self._ids = itertools.count(1)
        # counters (read by STATUS= and monitoring)
        self.published = 0
        self.delivered = 0
        self.dropped = 0
        self.disconnects = 0
        self.started = time.monotonic()

    # -- accepting -----------------------------------------------------------

    async def serve(self, listener: socket.socket, *, task_status=trio.TASK_STATUS_IGNORED):
        """Accept clients on *listener* (a listening SEQPACKET socket) until cancelled.

        Out of file descriptors, the broker keeps serving its clients and refuses new
        ones at once: it frees a spare descriptor kept for this, accepts, closes (the
        client reads end-of-file instead of hanging in the backlog) and takes the spare
        back.  One log line per episode, not one per refusal.
        """
        listener.setblocking(False)
        spare = _spare_fd()
        exhausted, refused = False, 0
        try:
            async with trio.open_nursery() as nursery:
                for conn in self._adopted:
                    nursery.start_soon(self._serve_client, conn)
                self._adopted = []
                task_status.started()
                while True:
                    await wait_readable(listener)
                    turn_ends = time.perf_counter() + TURN_SECONDS
                    for _ in range(ACCEPTS_PER_TURN):
                        if time.perf_counter() > turn_ends:
                            break
                        try:
                            sock, _ = listener.accept()
                        except BlockingIOError:
                            break
                        except OSError as exc:
                            if exc.errno in (errno.EMFILE, errno.ENFILE):
                                if not exhausted:
                                    exhausted = True
                                    log.error("out of file descriptors (%s): refusing new "
                                              "clients, serving the %d connected", exc.strerror,
                                              len(self.connections))
                                waiting, spare = _refuse_one(listener, spare)
                                if not waiting:
                                    break
                                refused += 1
                                continue
                            if exc.errno in (errno.ENOBUFS, errno.ENOMEM):
                                await trio.sleep(0.1)  # memory pressure: the backlog waits
                                break
                            if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                                continue
                            raise
                        if exhausted:
                            log.warning("accepting clients again after refusing %d", refused)
                            exhausted, refused = False, 0
                        conn = self._admit(sock)
                        if conn is not None:
                            nursery.start_soon(self._serve_client, conn)
        finally:
            if spare >= 0:
                os.close(spare)

    def _admit(self, sock: socket.socket, cid: int | None = None) -> Connection | None:
        sock.setblocking(False)
        try:
            # room in the kernel for the largest packet we forward
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.max_message + 4096)
            cred = peer_credentials(sock)
        except OSError as exc:
            log.warning("dropping a new client: %s", exc)
            sock.close()
            return None
        conn = Connection(next(self._ids) if cid is None else cid, sock, cred, self.queue_limit)
        for setting in self.defaults:
            conn.out.apply(setting)
        refusal = self.accounts.connect(conn)
        if refusal:
            self._log(conn, f"connection refused: {refusal}")
            sock.close()
            return None
        conn.out.budget = self.accounts.budget(conn)
        conn.may_pause_others = self._trusted(cred.uid)
        self.connections.add(conn)
        self.empty_since = None
        self._by_uid.setdefault(cred.uid, {})[conn.id] = conn
        log.debug("%r connected", conn)
        return conn

    async def _serve_client(self, conn: Connection) -> None:
        try:
            async with trio.open_nursery() as nursery:
                conn.scope = nursery.cancel_scope
                nursery.start_soon(self._writer, conn)
                await self._reader(conn)
                nursery.cancel_scope.cancel()
        finally:
            # handing over, its socket and state go to the successor (`snapshot`)
            if not self.handing_over or conn.closed:
                conn.closed = True  # nothing is delivered to it from now on
                with trio.CancelScope(shield=True):
                    # a client with many subscriptions leaves a few hundred at a time
                    while self._unsubscribe_some(conn, REMOVALS_PER_TURN):
                        await trio.lowlevel.checkpoint()
                self._forget(conn)

    def _unsubscribe_some(self, conn: Connection, n: int) -> bool:
        """Drop up to *n* of a departed client's patterns; whether any are left."""
        removed, left = self.index.remove_some(conn, n)
        self.subscription_count -= removed
        return left

    def _forget(self, conn: Connection) -> None:
        conn.closed = True
        self._release_held(conn)
        self.subscription_count -= self.index.remove_client(conn)
        self.accounts.disconnect(conn)
        self.connections.discard(conn)
        if not self.connections:
            self.empty_since = time.monotonic()
        mine = self._by_uid.get(conn.cred.uid)
        if mine is not None:
            mine.pop(conn.id, None)
            if not mine:
                del self._by_uid[conn.cred.uid]
        conn.out.clear()
        conn.paused.unpark_all()
        conn.fd = -1
        conn.sock.close()
        self.disconnects += 1
        log.debug("%r disconnected", conn)

    def _drop(self, conn: Connection, why: str, level: int = logging.WARNING) -> None:
        """Disconnect *conn* (from any task, synchronously) and say why."""
        if not conn.closed:
            conn.closed = True
            log.log(level, "disconnecting %r: %s", conn, why)
            if conn.scope is not None:
                conn.scope.cancel()
            conn.paused.unpark_all()

    def _trusted(self, uid: int) -> bool:
        """Whether subscribers of *uid* may pause other users' publishers."""
        limits = self.accounts.limits
        if limits.may_pause_others(uid):
            return True
        names = {t for t in limits.trusted if isinstance(t, str)}
        return bool(names) and _user_name(uid) in names

    def _log(self, conn: Connection, what: str) -> None:
        """A warning about *conn*, within its UID's allowance (see `LogAllowance`).

        *what* must quote client input only through `display.brief`."""
        held = self.allowance.take(conn.cred.uid)
        if held is None:
            return
        more = f" ({held} more lines about uid {conn.cred.uid} were not logged)" if held else ""
        log.warning("%r: %s%s", conn, what, more)

    def refuse(self, conn: Connection, verb: bytes, why: str) -> None:
        """Tell *conn* that its packet was refused, and log it within its allowance."""
        self._log(conn, f"{verb.decode()} refused: {why}")
        self.reply(conn, REFUSED + verb + b"\0" + why.encode("utf-8", "backslashreplace"))

    # -- reading ---------------------------------------------------------------

    async def _reader(self, conn: Connection) -> None:
        """Read what *conn* sends, a batch of packets per system call, and yield to the
        other clients after `READS_PER_WAKE` batches or `TURN_SECONDS`."""
        sock = conn.sock
        fd = conn.fd
        batch = self._batch
        out = conn.out
        clock = time.perf_counter
        while True:
            await wait_readable(sock)
            turn_ends = clock() + TURN_SECONDS
            for _ in range(READS_PER_WAKE):
                started = clock()
                try:
                    n = batch.receive(fd, limit=conn.slots)
                except BlockingIOError:
                    break
                except OSError as exc:
                    if not conn.closed:
                        log.info("%r: read failed: %s", conn, exc)
                    return
                blocked, done = self._handle(conn, n)
                spent = clock() - started
                if spent > TURN_SECONDS:  # expensive packets: read fewer at once
                    conn.slots = max(1, int(n * TURN_SECONDS / spent))
                elif n == conn.slots and conn.slots < batch.slots and \
                        spent * 4 < TURN_SECONDS:
                    conn.slots = min(batch.slots, conn.slots * 2)
                if blocked:
                    await self._wait_for(conn, blocked)
                if not conn.closed and (out.nbytes > out.limit or out.budget is not None
                                        and out.budget.queued > out.budget.limit):
                    # replies it does not read: it is not read from until it does
                    await self._wait_for_own_queue(conn)
                if done or conn.closed:
                    return
                if n < conn.slots or clock() > turn_ends:
                    break  # drained, or its turn is over

    def _handle(self, conn: Connection, n: int) -> tuple[list[Connection] | None, bool]:
        """Act on the *n* packets *conn* sent that are in the batch buffer.

        Consecutive publishes with the same targets form a run, delivered together
        (`_deliver`): the targets then take a run of packets back to back, with one
        system call each.  Any other packet first flushes the runs before it, so
        replies and subscriptions keep their place in the client's order.  Returns
        the targets that ask *conn* to wait, and whether *conn* is gone.
        """
        batch = self._batch
        buf, offsets, lengths = batch.buffer, batch.offsets, batch.lengths
        max_message = self.max_message
        cache = self.index.cache.entries
        owner = conn.cred.uid
        blocked: list[Connection] | None = None
        published = 0
        runs: list[tuple[int, int, tuple[Connection, ...]]] = []  # (start, end, targets)
        run_start, run_targets = 0, ()  # the open run: [run_start, i), same targets
        head, head_len = None, 0  # b"MSG key\0" of the open run, to spot the same key
        done = False
        misses = 0  # packets in a row whose head was not the open run's
        for i in range(n):
            size = lengths[i]
            at = offsets[i]
            if head_len:
                if head_len <= size <= max_message and buf[at:at + head_len] == head:
                    published += 1
                    misses = 0
                    continue
                misses += 1
            targets = ()  # None below: a publish refused
            nul = buf.find(b"\0", at, at + size) if 4 < size <= max_message else -1
            if nul > 0:
                head = buf[at:nul + 1]
                if head[:4] == b"MSG ":
                    key = head[4:-1]
                    targets = cache.get(key)
                    if targets is None and not (b"!" in key and
                                                not self._key_allowed(conn, key)):
                        targets = self.index.match(key, owner)
                    if targets is not None:
                        published += 1
                        if targets is not run_targets:
                            if run_targets:
                                runs.append((run_start, i, run_targets))
                            run_start, run_targets = i, targets
                        # keys that change at every packet (many keys in turn): stop
                        # comparing heads for the rest of the batch
                        head_len = len(head) if misses < 2 else 0
                        if published == 1 and self._same_head(head, i + 1, n):
                            published += n - i - 1  # the usual batch: one key throughout
                            break
                        continue
            # not a publish (or a refused one): deliver what came before, then act on it
            if run_targets:
                runs.append((run_start, i, run_targets))
            if runs:
                blocked = self._deliver(conn, runs, blocked)
                runs = []
            run_start, run_targets, head, head_len = i + 1, (), None, 0
            if targets is None:
                continue  # refused, and said why
            if size == 0:
                if _at_eof(conn.sock):
                    done = True
                    break
                self.refuse(conn, b"packet", "empty packet")
            elif size > max_message:
                self.refuse(conn, b"packet", f"over the {max_message}-byte limit")
            else:
                self._other(conn, batch.copy(i))
                if conn.closed:
                    done = True
                    break
        if run_targets:  # still open: it runs to the end of the batch
            runs.append((run_start, n, run_targets))
        if runs:
            blocked = self._deliver(conn, runs, blocked)
        # what was read was published, even if the publisher is gone now
        self.published += published
        return blocked, done

    def _same_head(self, head: bytes, start: int, end: int) -> bool:
        """Whether batch packets ``start .. end-1`` are all publishes that begin with *head*.

        Checked with a few calls that loop in C, rather than packet by packet.
        """
        if end - start < 2:
            return False
        batch = self._batch
        buf, size = batch.buffer, len(head)
        at = batch.offsets[end - 1]
        if buf[at:at + size] != head:
            return False
        lengths = batch.lengths[start:end]
        if min(lengths) < size or max(lengths) > self.max_message:
            return False
        slices = self._head_slices.get(size)
        if slices is None:
            if len(self._head_slices) > 256:
                self._head_slices.clear()
            slices = self._head_slices[size] = [slice(at, at + size) for at in batch.offsets]
        return list(map(buf.__getitem__, slices[start:end])).count(head) == end - start

    def _key_allowed(self, conn: Connection, key: bytes) -> bool:
        try:
            self.rules.check_key(key)
        except KeyRefused as exc:
            self.refuse(conn, b"msg", str(exc))
            return False
        return True

    def _deliver(self, publisher: Connection, runs, blocked):
        """Hand each run's batch packets ``start .. end-1`` to each of its targets.

        What a target's kernel buffer does not take goes to its queue under its flood
        policy.  Returns *blocked* plus the targets that now ask the publisher to wait:
        the publisher is paused after the whole batch, so a blocking queue can be over
        its limit by at most one batch; what it holds beyond the limit is charged to the
        publisher's user (`Connection.held`), and once that user's budget is spent the
        target loses the packet instead (counted, reported).  Only a target of the
        publisher's own UID, or a trusted one, may pause it (`Limits.trusted`), and never
        a publisher that asked not to be paused (`protocol.PUBLISHER_NOWAIT`).
        """
        pub_uid = publisher.cred.uid
        pub_budget = publisher.out.budget
        pausable = not publisher.nowait
        batch = self._batch
        buf, offsets, lengths = batch.buffer, batch.offsets, batch.lengths
        copies: dict[int, bytes] = {}
        sent = 0
        write = os.write
        for start, end, targets in runs:
            if end - start == 1 and len(targets) == 1:  # many keys: one packet, one target
                t = targets[0]
                if not t.out.items and not t.closed:
                    at = offsets[start]
                    try:
                        write(t.fd, buf[at:at + lengths[start]])
                        sent += 1
                        continue
                    except BlockingIOError:
                        pass  # it waits in the queue: below
                    except OSError as exc:
                        self._send_failed(t, exc)
                        continue
            for t in targets:
                if t.closed:
                    continue
                i = start
                if not t.out.items:
                    while i < end:
                        try:
                            if end - i >= SEND_BATCH_MIN:
                                i += batch.send(t.fd, i, end - i)
                                if i < end:
                                    break  # the kernel took what it could
                            else:
                                packet = copies.get(i)
                                if packet is None:
                                    packet = copies[i] = batch.copy(i)
                                write(t.fd, packet)
                                i += 1
                        except BlockingIOError:
                            break
                        except OSError as exc:
                            self._send_failed(t, exc)
                            if t.closed:
                                break
                            i += 1  # that packet could not be delivered (and is counted)
                            sent -= 1
                    sent += i - start
                    if i == end or t.closed:
                        continue
                out = t.out
                may_block = pausable and (t.cred.uid == pub_uid or t.may_pause_others)
                for j in range(i, end):
                    packet = copies.get(j)
                    if packet is None:
                        packet = copies[j] = batch.copy(j)
                    over = may_block and out.nbytes >= out.limit
                    if over and pub_budget is not None and \
                            pub_budget.queued + len(packet) > pub_budget.limit:
                        over = may_block = False  # its user cannot hold more: drop
                    verdict = out.offer(packet, may_block)
                    if verdict is Verdict.DROPPED:
                        self.dropped += 1
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
                        self._drop(t, "its flood policy is 'error' and it could not take "
                                      "a message")
                        break
                t.writer_lot.unpark()
        self.delivered += sent
        return blocked

    def _send_failed(self, conn: Connection, exc: OSError) -> None:
        if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF):  # it hung up: normal
            self._drop(conn, "it hung up", logging.DEBUG)
        elif exc.errno == errno.EMSGSIZE:
            self._log(conn, f"a {exc.strerror} message could not be delivered: dropped")
            conn.out.dropped += 1
            self.dropped += 1
        else:
            self._drop(conn, f"send failed: {exc}")

    async def _wait_for(self, conn: Connection, blocked: list[Connection]) -> None:
        """Pause the publisher *conn* until every target in *blocked* lets it go on."""
        try:
            for t in blocked:
                while not t.closed and not t.out.publisher_may_continue():
                    await t.paused.park()
        finally:
            self._release_held(conn)

    def _release_held(self, conn: Connection) -> None:
        if conn.held:
            if conn.out.budget is not None:
                conn.out.budget.queued -= conn.held
            conn.held = 0

    async def _wait_for_own_queue(self, conn: Connection) -> None:
        """A client whose queue (or whose user's queues together) is over its limit, e.g.
        because of the broker's own replies (it asks and does not read), is not read
        from until its queue is back to half its limit, or empty."""
        out = conn.out
        budget = out.budget
        while not conn.closed and out.items and (
                out.nbytes > out.limit // 2
                or budget is not None and budget.queued > budget.limit):
            conn.writer_lot.unpark()
            await conn.paused.park()

    def _other(self, conn: Connection, packet: bytes) -> None:
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

    def subscribe(self, conn: Connection, pattern: bytes) -> None:
        try:
            pattern = self.rules.check_pattern(pattern, conn.cred)
        except KeyRefused as exc:
            self.refuse(conn, b"sub", str(exc))
            return
        refusal = self.accounts.subscribe(conn, pattern_cost(pattern, self.sep))
        if refusal:
            self.refuse(conn, b"sub", f"{brief(pattern)}: {refusal}")
            return
        self.index.subscribe(conn, pattern)
        self.subscription_count += 1

    def unsubscribe(self, conn: Connection, pattern: bytes) -> None:
        try:
            pattern = self.rules.check_pattern(pattern, conn.cred)
        except KeyRefused as exc:
            self.refuse(conn, b"unsub", str(exc))
            return
        if self.index.unsubscribe(conn, pattern):
            self.accounts.unsubscribe(conn, pattern_cost(pattern, self.sep))
            self.subscription_count -= 1
        else:
            self.refuse(conn, b"unsub", f"not subscribed to {brief(pattern)}")

    def control(self, conn: Connection, key: bytes, payload: bytes | None) -> None:
        if key == protocol.WHOAMI or key == self._whoami:
            self.reply(conn, b"CMSG " + key + b"\0" + conn.cred.path(self.sep))
            return
        plain = key.replace(self.sep, b"/")
        if plain == protocol.PUBLISHER_NOWAIT:
            conn.nowait = True
            return
        if plain == protocol.STATUS:
            self.reply(conn, introspect.answer(self, conn, payload))
            return
        setting = parse_control(plain)
        if setting is not None:
            conn.out.apply(setting)
            conn.paused.unpark_all()  # paused publishers re-check under the new policy
            log.debug("%r: flood control %s", conn, setting)
            return
        self.refuse(conn, b"cmsg", f"control message {brief(key)} not understood")

    def reply(self, conn: Connection, packet: bytes) -> None:
        """Send the broker's own packet to *conn*, whatever its flood policy."""
        if not conn.out.items:
            try:
                os.write(conn.fd, packet)
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                self._send_failed(conn, exc)
                return
        conn.out.force(packet)
        conn.writer_lot.unpark()

    # -- writing ---------------------------------------------------------------

    async def _writer(self, conn: Connection) -> None:
        """Send what waits in *conn*'s queue as the kernel takes it; report drops."""
        out = conn.out
        write = os.write
        while True:
            if not out.items and not out.dropped:
                await conn.writer_lot.park()
                continue
            await wait_writable(conn.sock)
            try:
                turn = WRITES_PER_TURN
                while out.items and turn:
                    try:
                        write(conn.fd, out.peek())
                    except BlockingIOError:
                        break
                    out.pop()
                    self.delivered += 1
                    turn -= 1
                if not out.items and out.dropped:
                    write(conn.fd, DROPPED + b"%d" % out.dropped)
                    out.take_dropped()
            except BlockingIOError:
                pass
            except OSError as exc:
                self._send_failed(conn, exc)
                if conn.closed:
                    return
            if out.publisher_may_continue():
                conn.paused.unpark_all()  # cheap when nobody waits; never miss a waiter

    # -- handing over to a successor (sbus/handover.py) ------------------------------------

    def snapshot(self) -> tuple[handover.State, dict[int, socket.socket]]:
        """Every connected client's state and socket, once its tasks have stopped in
        `handing_over` mode (they then neither read nor write)."""
        clients, socks = [], {}
        for conn in sorted(self.connections, key=lambda c: c.id):
            if conn.closed:
                continue
            out = conn.out
            if isinstance(out.items, list):  # largest first: a heap of (-size, seq, packet)
                queued = [p for _, _, p in sorted(out.items, key=lambda item: item[1])]
            else:
                queued = list(out.items)
            clients.append(handover.ClientState(
                conn.id, sorted(self.index.patterns(conn).items()), out.soft.value,
                out.hard.value, out.order.value, conn.nowait, queued, out.dropped))
            socks[conn.id] = conn.sock
        counters = {"published": self.published, "delivered": self.delivered,
                    "dropped": self.dropped, "disconnects": self.disconnects}
        return handover.State(self.sep, counters, clients), socks

    def restore(self, state: handover.State, socks: dict[int, socket.socket]) -> int:
        """Take over a predecessor's clients (served once `serve` starts); returns how
        many.  Credentials are asked of the kernel again; a client the limits now refuse,
        or whose socket is missing, is let go (it sees end-of-file, as after an ordinary
        restart)."""
        if state.sep != self.sep:
            raise handover.HandoverError(f"the predecessor used the separator {state.sep!r}")
        for name in ("published", "delivered", "dropped", "disconnects"):
            setattr(self, name, state.counters.get(name, 0))
        taken = 0
        for c in state.clients:
            sock = socks.pop(c.id, None)
            if sock is None:
                continue
            conn = self._admit(sock, c.id)
            if conn is None:
                continue
            out = conn.out
            out.apply(Soft(c.soft))
            out.apply(Hard(c.hard))
            out.apply(Order(c.order))
            conn.nowait = c.nowait
            for pattern, count in c.patterns:
                for _ in range(count):
                    self.subscribe(conn, pattern)
            for packet in c.queued:
                out.force(packet)
            out.dropped = c.dropped
            self._adopted.append(conn)
            taken += 1
        for sock in socks.values():  # named, but not in the snapshot
            sock.close()
        self._ids = itertools.count(max([0, *(c.id for c in state.clients)]) + 1)
        return taken

    def release_buffers(self) -> None:
        """Return the pages large packets left in the batch buffer (called between
        batches: the buffer holds nothing then)."""
        self._batch.release()

    # -- reporting ---------------------------------------------------------------

    def connections_of(self, uid: int | None):
        """The connections of *uid* (of everyone for None), oldest first."""
        if uid is not None:
            return list(self._by_uid.get(uid, {}).values())
        return sorted(self.connections, key=lambda c: c.id)

    def status(self) -> str:
        paused = sum(len(c.paused) for c in self.connections)
        return (f"{len(self.connections)} clients, {self.subscription_count} subscriptions, "
                f"{self.published} published, {self.delivered} delivered, "
                f"{self.dropped} dropped, {paused} publishers paused")


@functools.lru_cache(maxsize=4096)
def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
