"""The broker's I/O shell: one readiness loop moving bytes between sockets and the core.

All decisions are in `sbus.core.BrokerCore`; this module only waits, reads, writes
and closes.  One ``epoll`` set holds the listener and every client that wants
something (to be read, or to be written to once its kernel buffer has room), and the
signal wake-up descriptor; the loop waits in ``epoll_wait`` (its timeout is the next
timer: STATUS=, the watchdog, exit-on-idle) and then serves each ready client a turn.
No task per client (two trio tasks each were most of an idle client's 10 KB) and no
event-loop library: the loop's cost per round is one ``epoll_wait`` whatever the number
of clients, and a restarting broker's successor serves ~90 ms sooner without importing
trio (docs/performance.md, "Restart under load").

Speed comes from doing as little as possible per packet: a readable client's packets
are received up to 64 per system call (`PacketBatch`, ``recvmmsg``), and the core
hands each run of packets with the same targets to each target's kernel with one
non-blocking ``sendmmsg`` straight from the receive buffer (docs/performance.md).

Fairness: a client's turn is at most `READS_PER_WAKE` batches or `TURN_SECONDS`, a
writer's at most `core.WRITES_PER_TURN` packets, a round of accepts at most
`ACCEPTS_PER_TURN`; epoll is level-triggered, so whoever still has work is served
again in the next round, after everyone else that is ready.  A user (UID) whose
clients took `USER_SHARE` of a round is served no more in it (`limits.TimeShare`; its
fan-outs have a share of their own, so a user's large fan-out does not keep its other
clients waiting): a round lasts about two shares per busy user, not one turn per
connection, so opening many connections buys no more of the loop.  epoll reports ready
clients in the same order round after round, so the clients a share left waiting are
served first in the next rounds, longest waiting first: each of a user's clients gets
its turn.  The UIDs exempt from the limits (root) are exempt from the share too.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import pwd
import select
import socket
import struct
import termios
import time
from collections.abc import Callable

from . import handover
from .core import FAILED, FULL, GONE, TOO_BIG, TURN_SECONDS, WRITE_RUN, BrokerCore, Client
from .defaults import MAX_MESSAGE, QUEUE_LIMIT, SEPARATOR
from .flood import DEFAULT_POLICY, Hard, Order, Soft
from .keys import Credentials
from .limits import Limits, TimeShare
from .packetio import HAS_SEND_EACH, PacketBatch, PacketSender

log = logging.getLogger("sbus.broker")

#: Seconds a shutdown without a successor spends at most reading what clients had sent.
CLOSING_SECONDS = 1.0
#: ... and then waiting for room to tell clients what of their queues is lost.
REPORT_SECONDS = 0.25

#: Packets received with one system call (fewer when they are large: see `batch_slots`).
#: As many as `cbroker -m`'s: 64 took 5-10 % less CPU per delivery than 32 in S1, S3
#: and S5, in two runs (docs/performance.md).
BATCH_SLOTS = 64
#: Memory for one batch of packets at most (it is reserved, and used as packets need it):
#: all `BATCH_SLOTS` at the default largest packet (a slot is one byte more than that:
#: a bound of a flat power of two held one packet fewer, and bursts came in two reads).
BATCH_MEMORY = BATCH_SLOTS * (MAX_MESSAGE + 1)
#: Batches read from one client in one turn.
READS_PER_WAKE = 4
#: Clients accepted per round: a storm of connections waits in the backlog (and is
#: refused by the kernel when that is full) instead of crowding out the clients
#: already served.
ACCEPTS_PER_TURN = 16
#: Seconds the backlog waits after the kernel had no memory for an accept.
ACCEPT_PAUSE = 0.1
#: Targets sent their queue right after a client's turn, at most (`_drain_early`).
EARLY_DRAINS = 64
#: Readiness events taken per round.
EVENTS_PER_ROUND = 1024
#: Seconds of one round a user's clients may take together before the user's other
#: ready clients wait for the next round (and its fan-outs, apart): one client's turn,
#: so a user with one connection is served as before.
USER_SHARE = TURN_SECONDS
#: Receive buffers held by fan-outs in progress at most (`core.Fanout`); beyond them a
#: costly batch is delivered at once, and its publisher read fewer packets at a time.
HELD_BATCHES = 8

_ucred = struct.Struct("3i")
_HANGUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_EITHER = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR


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


#: What an error of a write or send to a client means to the core (`core.FULL`...).
_OUTCOMES = {errno.EAGAIN: FULL, errno.EPIPE: GONE, errno.ECONNRESET: GONE,
             errno.EBADF: GONE, errno.EMSGSIZE: TOO_BIG}
_failures_told: set[int] = set()


def _outcome(exc: OSError) -> int:
    outcome = _OUTCOMES.get(exc.errno, FAILED)
    if outcome == FAILED and exc.errno not in _failures_told:  # once per kind
        _failures_told.add(exc.errno)
        log.warning("sending to a client failed: %s (it is dropped)", exc)
    return outcome


def _link_write(fd: int, packet, write=os.write) -> int:
    """The core's ``write`` port: bytes taken, or what an error means (`_OUTCOMES`)."""
    try:
        return write(fd, packet)
    except OSError as exc:
        return _outcome(exc)


_run_sender = PacketSender(WRITE_RUN)


def _link_write_run(fd: int, packets: list[bytes]) -> int:
    """The core's ``write_run`` port: queued *packets* in one ``sendmmsg``, as many as
    the kernel takes now (`FULL` if none), or what the first one's error means."""
    try:
        return _run_sender.send(fd, packets) or FULL
    except OSError as exc:
        return _outcome(exc)


def _link_write_each(batch: PacketBatch, picks: list[int], fds: list[int],
                     write=os.write) -> int:
    """The core's ``write_each`` port: packet ``picks[k]`` to ``fds[k]``, each in turn,
    in one loop in C (`map`), until a write fails; how many were taken before it (the
    core retries that one through `_link_write` and learns why).  ``list.extend`` keeps
    what the iterator gave before it raised."""
    buf, offsets, lengths = batch.buffer, batch.offsets, batch.lengths
    packets = [buf[offsets[i]:offsets[i] + lengths[i]] for i in picks]
    taken: list[int] = []
    try:
        taken.extend(map(write, fds, packets))
    except OSError:
        pass  # EAGAIN, a peer gone: for the core to see packet by packet
    return len(taken)


def _link_send_each(batch: PacketBatch, picks: list[int], fds: list[int]) -> int:
    """The ``write_each`` port through sbus/_sendeach.c, where it was built: the same
    as `_link_write_each`, in one C loop of ``send`` calls (no Python between them)."""
    return batch.send_each(picks, fds)


def _link_send(batch: PacketBatch, fd: int, start: int, count: int) -> int:
    """The core's ``send`` port: packets of *batch* taken, or what an error means."""
    try:
        return batch.send(fd, start, count)
    except OSError as exc:
        return _outcome(exc)


def _at_eof(fd: int) -> bool:
    """After a 0-byte read: did the peer hang up, or send an empty packet?"""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLRDHUP)
    return any(ev & _HANGUP for _, ev in poller.poll(0))


def _shut_reading(fd: int) -> None:
    """Take no more packets on *fd*: the peer's next send fails, what it sent before
    stays to be read (then empty packets, as at an end of file)."""
    sock = socket.socket(fileno=fd)
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:  # (gone already: its end is read as before)
        pass
    finally:
        sock.detach()


def _unread(fd: int) -> bool:
    """Does *fd* hold packets not read yet (bytes of them: ``SIOCINQ``)?"""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] > 0
    except OSError:
        return False


def peer_credentials(sock: socket.socket) -> Credentials:
    pid, uid, gid = _ucred.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _ucred.size))
    return Credentials(gid=gid, uid=uid, pid=pid)


@functools.lru_cache(maxsize=4096)
def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


class Broker:
    """`BrokerCore` served on a listening SEQPACKET socket by one readiness loop."""

    def __init__(
        self,
        *,
        sep: bytes = SEPARATOR,
        max_message: int = MAX_MESSAGE,
        queue_limit: int = QUEUE_LIMIT,
        limits: Limits | None = None,
        defaults: tuple[Soft, Hard, Order] = DEFAULT_POLICY,
    ) -> None:
        self.max_message = max_message
        # one buffer for all clients: a batch is handled before the next is read
        slot = max_message + 1  # one more, to see an oversized packet (the kernel truncates)
        self._batch = PacketBatch(max(1, min(BATCH_SLOTS, BATCH_MEMORY // slot)), slot)
        self._spare_batches: list[PacketBatch] = []  # for while fan-outs hold others
        self._held = 0  # batches the core holds (`core.Fanout`)
        self.core = BrokerCore(_link_write, _at_eof, send=_link_send,
                               write_each=_link_send_each if HAS_SEND_EACH
                               else _link_write_each, write_run=_link_write_run, sep=sep,
                               max_message=max_message,
                               queue_limit=queue_limit, limits=limits, defaults=defaults,
                               batch_slots=self._batch.slots, user_name=_user_name,
                               now=time.monotonic())
        self.core.debug = log.isEnabledFor(logging.DEBUG)
        self._epoll = select.epoll()
        self._clients: dict[int, Client] = {}  # fd -> client
        self._masks: dict[int, int] = {}  # fd -> what epoll watches it for (none: absent)
        self.handing_over = False  # clients keep their sockets and state for a successor
        self.faults = 0  # internal errors caught (`_fault`): each cost one client
        exempt = (limits or Limits()).exempt
        self._share = TimeShare(USER_SHARE, exempt)  # of each round: clients
        self._fanout_share = TimeShare(USER_SHARE, exempt)  # and fan-outs, per user
        self._fault_kinds: set[tuple[str, str, int]] = set()

    # the figures server.py reports
    empty_since = property(lambda self: self.core.empty_since)
    published = property(lambda self: self.core.published)
    disconnects = property(lambda self: self.core.disconnects)
    connections = property(lambda self: self.core.connections)

    def status(self) -> str:
        return self.core.status()

    # -- the loop ----------------------------------------------------------------

    def serve(self, listener: socket.socket, *, wakeup: int = -1,
              tick: Callable[[], bool] | None = None, every: float = 1.0) -> None:
        """Serve clients and accept new ones on *listener* until the descriptor *wakeup*
        (the signal wake-up fd, `signal.set_wakeup_fd`) becomes readable or *tick*,
        called every *every* seconds (reports, the watchdog, exit-on-idle), returns true.
        It returns between two rounds, with every client's state whole: the caller may
        then hand them over, or `close_all`.

        Out of file descriptors, the broker keeps serving its clients and refuses new
        ones at once: it frees a spare descriptor kept for this, accepts, closes (the
        client reads end-of-file instead of hanging in the backlog) and takes the spare
        back.  One log line per episode, not one per refusal.
        """
        listener.setblocking(False)
        lfd = listener.fileno()
        ep, core, clients = self._epoll, self.core, self._clients
        ep.register(lfd, _IN)
        if wakeup >= 0:
            ep.register(wakeup, _IN)
        self._spare = _spare_fd()
        self._exhausted, self._refused = False, 0
        self._accept_again = 0.0  # when to accept again after ENOBUFS (0: accepting)
        clock = time.monotonic
        timer = time.perf_counter
        share, fanout_share = self._share, self._fanout_share
        # clients a share left waiting, longest first: served first in the next round
        waiting: dict[int, None] = {}
        next_tick = clock() + every
        try:
            self._flush()
            while True:
                share.begin()
                fanout_share.begin()
                if core.fanouts:
                    self._fan_out()
                busy = core.tidy() or bool(core.fanouts)
                self._flush()
                now = clock()
                if now >= next_tick:
                    if tick is not None and tick():
                        return
                    next_tick = now + every
                if busy:
                    timeout = 0.0
                elif self._accept_again:
                    timeout = max(0.0, min(next_tick, self._accept_again) - now)
                else:
                    timeout = next_tick - now
                events = ep.poll(timeout, EVENTS_PER_ROUND)
                if self._accept_again and clock() >= self._accept_again:
                    self._accept_again = 0.0
                    ep.register(lfd, _IN)
                if not events:
                    continue
                core.advance(clock())
                if waiting:
                    ready = dict(events)
                    waiting = {fd: None for fd in waiting if fd in ready}
                    events = [(fd, ready.pop(fd)) for fd in waiting] + list(ready.items())
                stop = False
                for fd, ev in events:
                    if fd == lfd:
                        self._accept(listener)
                        continue
                    c = clients.get(fd)
                    if c is None:
                        stop = stop or fd == wakeup
                        continue
                    uid = c.cred.uid
                    if share.over(uid):
                        waiting.setdefault(fd)  # reported again next round
                        continue
                    if waiting:
                        waiting.pop(fd, None)
                    started = timer()
                    try:
                        if ev & _OUT or (ev & _EITHER and c.wants_write):
                            core.writable(c)
                        if ev & _EITHER and c.wants_read:
                            self._read(c)
                            if core.dirty:
                                self._drain_early(c)
                    except Exception as exc:  # noqa: BLE001 - see _fault
                        self._fault(c, exc)
                    share.charge(uid, timer() - started)
                    if core.gone or core.logs:
                        self._flush()
                if stop:
                    return
        finally:
            if not self._accept_again:
                ep.unregister(lfd)
            if wakeup >= 0:
                ep.unregister(wakeup)
            if self._spare >= 0:
                os.close(self._spare)
                self._spare = -1

    def _fault(self, c: Client, exc: Exception) -> None:
        """A bug that one client's bytes reached: that client goes, everyone else is
        served on.  The first fault of each kind is logged with its traceback, later ones
        as a count (a client reconnecting to repeat it must not flood the log)."""
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        kind = (type(exc).__name__, where.tb_frame.f_code.co_filename if where else "",
                where.tb_lineno if where else 0)
        self.faults += 1
        if kind not in self._fault_kinds and len(self._fault_kinds) < 64:
            self._fault_kinds.add(kind)
            log.error("internal error while serving %r; dropping that client",
                      c, exc_info=exc)
        else:
            log.error("internal error %s while serving %r (%d so far); dropping that client",
                      type(exc).__name__, c, self.faults)
        try:
            if c.read_on:
                self.core.hangup(c, None)
            self._flush()
        except Exception:  # noqa: BLE001 - the core's state of c is broken: close it here
            log.exception("could not forget %r after an internal error", c)
            self._close(c)

    def close_all(self) -> None:
        """Disconnect every client (shutting down without a successor), once what they
        had sent is read (for `CLOSING_SECONDS` at most) and delivered or queued, and
        what their sockets take of their queues written; the rest is lost, and said so
        (counted in ``dropped``).  What a client sends once this began fails (EPIPE, as
        after the close), so a reconnecting client sends it again to the next broker:
        nothing is taken without being read."""
        core = self.core
        clients = list(self._clients.values())
        for c in clients:  # from here a send fails (EPIPE), where it would vanish unread
            if c.read_on:
                _shut_reading(c.link)
        ends = time.monotonic() + CLOSING_SECONDS
        clock = time.monotonic
        while clock() < ends:  # what they sent before the end reaches the others
            published = core.published
            for c in clients:  # paused publishers too: what they sent is counted then
                if c.read_on and not c.fanout:
                    self._read(c, shut=True)
                    if clock() >= ends:
                        break
            core.finish_fanouts()
            if core.published == published:
                break
        for c in clients:
            if c.wants_write:
                core.writable(c)  # without waiting: as much as its socket takes now
        # queued, or dropped on the way and not yet reported to them
        left = [len(c.out) + c.out.dropped for c in clients
                if not c.closed and (len(c.out) or c.out.dropped)]
        if left:
            told = self._say_what_is_lost([c for c in clients if not c.closed])
            log.warning("shutting down with %d messages for %d clients that had not read "
                        "them: lost, and said to %d of them (a hand-over keeps them: "
                        "SIGUSR2, or systemctl restart)", sum(left), len(left), told)
        unread = [c for c in clients if c.read_on and _unread(c.link)]
        if unread:  # still sending when CLOSING_SECONDS ran out
            log.warning("shutting down with packets of %d clients unread: lost",
                        len(unread))
        for c in clients:
            self._close(c)

    def _say_what_is_lost(self, clients: list[Client]) -> int:
        """At a stop without a successor, what waits in *clients*' queues is lost: count
        it with their drops, and send each the drop report (``CMSG blocking/dropped``)
        as soon as its socket has room, for `REPORT_SECONDS` at most (a subscriber that
        reads hears of it; one that does not, does not hold the stop up).  How many were
        told.  Without the report the loss was in the broker's log only, and a
        reconnecting subscriber knew of what was published while it was away, not of
        what had waited for it (the audit of 2026-11-28)."""
        core = self.core
        for c in clients:
            lost = len(c.out)
            c.out.clear()
            c.out.dropped += lost
            core.dropped += lost
        waiting = {c.link: c for c in clients if c.out.dropped}
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLOUT)
        ends = time.monotonic() + REPORT_SECONDS
        told = 0
        while waiting:
            for fd, c in list(waiting.items()):
                core.writable(c)
                if c.closed or not c.out.dropped:  # gone, or told
                    told += not c.closed
                    del waiting[fd]
                    poller.unregister(fd)
            left = ends - time.monotonic()
            if not waiting or left <= 0:
                break
            poller.poll(left * 1000)
        return told

    def _read(self, c: Client, shut: bool = False) -> None:
        """One turn of *c*: up to `READS_PER_WAKE` batches or `TURN_SECONDS`.  *shut*:
        its socket no longer takes packets (`close_all`), so the empty packets that end
        a batch are its end of what it sent, not a hang-up."""
        core, batch = self.core, self._batch
        clock = time.perf_counter
        turn_ends = clock() + TURN_SECONDS
        for _ in range(READS_PER_WAKE):
            started = clock()
            try:
                n = batch.receive(c.link, limit=c.slots)
            except BlockingIOError:
                break
            except OSError as exc:
                core.hangup(c, f"read failed: {exc}")
                break
            if shut:
                lengths = batch.lengths
                while n and not lengths[n - 1]:
                    n -= 1
                if not n:
                    break
            job = core.receive(c, batch, n, hold=self._held < HELD_BATCHES)
            core.turn_taken(c, n, clock() - started)
            if job is not None:  # the core keeps the batch (served in `_fan_out`)
                batch.trim(n)  # it holds its packets' pages only, as charged
                self._held += 1
                self._batch = self._spare_batches.pop() if self._spare_batches else \
                    PacketBatch(batch.slots, batch.slot_size)
                break
            if not c.wants_read or n < c.slots or clock() > turn_ends:
                break  # paused or gone, drained, or its turn is over

    def _fan_out(self) -> None:
        """A turn for each fan-out in progress (`core.Fanout`), oldest first, charged to
        its publisher's user's share of fan-outs."""
        core, share = self.core, self._fanout_share
        clock = time.perf_counter
        for job in list(core.fanouts):
            uid = job.publisher.cred.uid
            if share.over(uid):
                continue
            started = clock()
            turn_ends = started + TURN_SECONDS
            while not core.step(job) and clock() < turn_ends:
                pass
            share.charge(uid, clock() - started)

    def _drain_early(self, reader: Client) -> None:
        """After *reader*'s turn, try at once to send what it queued for its targets.

        Waiting for EPOLLOUT instead would leave queues in use while their clients keep
        up: Linux reports a socket writable only once its send buffer is three-quarters
        empty, so a queue that waits for that is refilled first, and every packet is
        then copied and written singly (S4: 40,000 writes instead of 500 per 300,000
        messages).  A target whose kernel is still full costs one failed write, so at
        most `EARLY_DRAINS` targets are tried per turn (a fan-out to thousands of
        clients that do not read must not double the turn)."""
        core = self.core
        targets = [t for t in core.dirty if t.wants_write and t is not reader]
        for t in targets[:EARLY_DRAINS]:
            core.writable(t)

    def _flush(self) -> None:
        """Do what the core decided: log, close the departed, watch what clients want."""
        core = self.core
        if core.freed:
            freed = core.take_freed()
            self._held -= len(freed)
            self._spare_batches += freed
        if core.logs:
            for level, line in core.take_logs():
                log.log(level, "%s", line)
        if core.gone:
            for c in core.take_gone():
                self._close(c)
        if core.dirty:
            for c in core.take_dirty():
                self._watch(c)

    def _watch(self, c: Client) -> None:
        """Have epoll report what *c* wants now (and nothing while it wants nothing: a
        paused client that hung up must not be reported again and again)."""
        if not c.read_on:
            return
        mask = (_IN if c.wants_read else 0) | (_OUT if c.wants_write else 0)
        fd = c.link
        was = self._masks.get(fd, 0)
        if mask == was:
            return
        if not was:
            self._epoll.register(fd, mask)
        elif not mask:
            self._epoll.unregister(fd)
        else:
            self._epoll.modify(fd, mask)
        if mask:
            self._masks[fd] = mask
        else:
            del self._masks[fd]

    def _close(self, c: Client) -> None:
        """Close *c*'s socket, once (the core never writes to a closed client, so the
        fd number may be reused at once)."""
        fd = c.link
        if self._clients.get(fd) is not c:
            return  # closed already (and the number perhaps someone else's now)
        if self._masks.pop(fd, 0):
            self._epoll.unregister(fd)
        del self._clients[fd]
        if not self.handing_over:
            os.close(fd)

    # -- accepting -----------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
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
                    if not self._exhausted:
                        self._exhausted = True
                        log.error("out of file descriptors (%s): refusing new clients, "
                                  "serving the %d connected", exc.strerror,
                                  len(self.core.connections))
                    waiting, self._spare = _refuse_one(listener, self._spare)
                    if not waiting:
                        break
                    self._refused += 1
                    continue
                if exc.errno in (errno.ENOBUFS, errno.ENOMEM):
                    # memory pressure: the backlog waits, the clients are served
                    self._epoll.unregister(listener.fileno())
                    self._accept_again = time.monotonic() + ACCEPT_PAUSE
                    break
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                raise
            if self._exhausted:
                log.warning("accepting clients again after refusing %d", self._refused)
                self._exhausted, self._refused = False, 0
            self._admit(sock)
        self._flush()

    def take_backlog(self, listener: socket.socket) -> int:
        """Admit every connection waiting in *listener*'s backlog, unserved (a stop,
        once no more can come: the socket file is gone), so that `close_all` reads what
        they sent like everyone else's: their sends had succeeded, and were lost with
        the listener (the audit of 2026-11-28: a client reconnecting as the broker
        stopped).  How many."""
        listener.setblocking(False)
        taken = 0
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # none left (or no descriptor for it: it is reset, as before)
                break
            taken += self._admit(sock) is not None
        self._flush()
        return taken

    def _admit(self, sock: socket.socket, cid: int | None = None) -> Client | None:
        peer = self._peer(sock)
        if peer is None:
            return None
        c = self.core.connect(*peer, cid)
        if c is None:
            os.close(peer[1])
            return None
        self._clients[c.link] = c
        return c

    def _peer(self, sock: socket.socket) -> tuple[Credentials, int] | None:
        """A new client's credentials and descriptor (the socket object is let go)."""
        sock.setblocking(False)
        try:
            # room in the kernel for the largest packet we forward
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.max_message + 4096)
            cred = peer_credentials(sock)
        except OSError as exc:
            log.warning("dropping a new client: %s", exc)
            sock.close()
            return None
        return cred, sock.detach()

    # -- handing over to a successor (sbus/handover.py) ------------------------------------

    def snapshot(self) -> tuple[handover.State, dict[int, socket.socket]]:
        """Every connected client's state and socket, taken between two rounds of the loop
        once the fan-outs in progress are delivered: the state is whole."""
        self.core.finish_fanouts()
        self._flush()
        state = self.core.snapshot()
        links = {c.id: self.core.connections[c.id].link for c in state.clients}
        return state, {cid: socket.socket(fileno=fd) for cid, fd in links.items()}

    def restore(self, state: handover.State, socks: dict[int, socket.socket]) -> int:
        """Take over a predecessor's clients (served once `serve` starts); returns how
        many.  Credentials are asked of the kernel again; a client the limits now refuse,
        or whose socket is missing, is let go (it sees end-of-file, as after an ordinary
        restart)."""
        peers = {}
        for cid, sock in socks.items():
            peer = self._peer(sock)
            if peer is not None:
                peers[cid] = peer
        try:
            taken = self.core.restore(state, peers)
        except handover.HandoverError:
            for _, fd in peers.values():
                os.close(fd)
            raise
        for c in taken:
            self._clients[c.link] = c
        kept = {c.link for c in taken}
        for _, fd in peers.values():
            if fd not in kept:
                os.close(fd)
        self._flush()
        return len(taken)

    def release_buffers(self) -> None:
        """Return the pages large packets left in the batch buffer (called between
        batches: the buffer holds nothing then; a spare holds nothing either)."""
        self._batch.release()
        for spare in self._spare_batches:
            spare.release()
