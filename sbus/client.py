"""Client library: a blocking `Client` and an async `AsyncClient` (trio or asyncio, via anyio).

Both are thin I/O shells around one `sbus.session.Session`, which checks every request
with the broker's own rules (`InvalidRequest`, nothing sent), holds the opening and the
reconnect plan, and turns packets into events.  Messages arrive as `Publish` (``.key``,
``.payload``); the broker's drop reports as `Dropped` (also counted in ``dropped`` and
passed to *on_drop*); other control messages as `Control`.  A refusal from the broker
(``CMSG refused/VERB``) raises `Refused` where it is noticed: `sync`, `subscribe` (which
waits for the broker by default), `receive` or iteration.  Keys, patterns and payloads
are bytes; `str` is accepted and encoded as UTF-8.

Packets are received many per system call (`sbus.packetio.PacketBatch`) and decoded by
the session in one pass (`Session.decode`): `receive_batch` hands a fast reader a whole
batch of events at once.

With ``reconnect=True`` a lost broker is waited for (the session's `Backoff`) and the
new connection gets the flood policy and every subscription again; messages published
meanwhile are lost, as on any pubsub bus.  One driver does this for both shells
(`_Shell._reopening`); the shells only do its waiting, blocking or async.  Connecting
never blocks a shell either (`connecting`): a broker that does not accept (its accept
backlog full: stopped, or its loop busy) is tried again after a short sleep, up to
`CONNECT_TIMEOUT` for a first connection and at the `Backoff`'s pace when reconnecting,
so the event loop of an `AsyncClient` serves its other tasks meanwhile.
*on_connection(up, line)* hears of each change of state (else it is logged).  A program
that would rather hear of refusals than catch them passes *on_refusal* (a `Refusal`
event each, nothing raised).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import select
import socket
import stat
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Iterator
from typing import NamedTuple, TypeVar

import anyio

from . import protocol
from .defaults import ANSWER_TIMEOUT, MAX_MESSAGE, RECV_BUFFER, SEND_BUFFER, default_address
from .display import LOG_QUOTE, brief
from .errors import ConnectError, ConnectionLost, InvalidRequest, NoResponders, Refused, SbusError
from .keys import Credentials
from .packetio import (
    PacketBatch,
    PacketSender,
    discard,
    peek_offset,
    peek_past,
    start_peeking,
    take_heads,
)
from .protocol import Control, Publish
from .session import Backoff, Dropped, Event, Reach, Refusal, RequestRound, Session, Whoami

__all__ = ["Client", "AsyncClient", "SbusError", "ConnectError", "ConnectionLost",
           "NoResponders", "default_address", "wait_for_broker", "Publish", "Control",
           "Dropped", "RECV_BUFFER", "Frames"]

log = logging.getLogger("sbus.client")

#: Errors of a send or receive that mean the connection is gone.
_GONE = frozenset((errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.ECONNREFUSED,
                   errno.EBADF))
#: ... of which these mean the broker closed it: a send finds it reset (it had unread
#: packets of ours) or closed; a receive reads what it sent first (`_recv_one`).
_CLOSED = frozenset((errno.EPIPE, errno.ECONNRESET))
#: Packets taken per receive call at most (each slot holds one packet of up to
#: `RECV_BUFFER` bytes; the mapping's pages are only touched as packets reach them).
SLOTS = 64
#: Bytes of one receive slot: a page more than `RECV_BUFFER`, so a packet that fills its
#: slot is known to have been cut by the kernel (a broker with a larger --max-message
#: forwards such): it is never handed out cut, but counted in `Client.cut`.
SLOT_BYTES = RECV_BUFFER + 4096
#: What a raw reader gets instead of a cut packet: the broker's report of one drop.
_CUT_REPORT = protocol.encode(Control(protocol.DROPPED, b"1"))
#: A drop report's bytes before its count, and the bytes `skip_again` reads of each
#: packet it takes off (a drop report is shorter: counted; a message: only its verb).
_DROP_REPORT = _CUT_REPORT[:-1]
_HEAD_BYTES = 64
#: A batch holding a packet larger than this gives its pages back once decoded.
RELEASE_FROM = 64 * 1024
#: A wait this long or longer is no limit: ``poll`` counts milliseconds in a C int.
POLL_FOREVER = (2**31 - 1) / 1000
#: Seconds a new connection has to answer its opening before it counts as failed.
OPENING_TIMEOUT = 5.0

#: Seconds a first connection waits for room in the broker's full accept backlog (a
#: listener that does not accept: stopped, or its loop busy) before `ConnectError`.
CONNECT_TIMEOUT = 5.0
#: The first pause between two tries on a full backlog (it doubles, with jitter, up to
#: `CONNECT_RETRY_MAX`): a unix socket cannot be polled for room, only tried again.
CONNECT_RETRY = 0.005
CONNECT_RETRY_MAX = 0.05

#: What the reconnect driver asks its shell to wait for.
_READ, _WRITE, _SLEEP = "read", "write", "sleep"
#: A step generator (`connecting`, `_Shell._reopening`): what to wait for, and its result.
_T = TypeVar("_T")
Steps = Generator[tuple[str, object], None, _T]

Received = Publish | Dropped | Control


class Frames(NamedTuple):
    """One received batch as the buffer holds it (`Client.receive_frames`), for a reader
    that splits messages itself.  Packet ``i < count`` is ``batch.buffer[batch.offsets[i]:
    batch.offsets[i] + batch.lengths[i]]``, valid until the next receive."""

    #: Events received earlier and kept (while syncing or reconnecting): they come first.
    kept: list[Received]
    batch: PacketBatch
    count: int
    #: The packets that are not messages, as the session took them in (None: consumed,
    #: e.g. a whoami answer or a refusal); every other packet starts with `MSG_VERB`.
    others: dict[int, Received | None]


def wait_for_broker(address: str | None = None, timeout: float = 10.0,
                    alive: Callable[[], bool] | None = None) -> None:
    """Wait until a broker accepts connections at *address*: for scripts and tests that
    start one.  *alive* (e.g. a child process's liveness) ends the wait early."""
    address = address or default_address()
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            s.connect(address)  # non-blocking: a full backlog is a "not yet" (EAGAIN)
            return
        except OSError:
            if alive is not None and not alive():
                raise SbusError(f"the broker for {address} exited before it listened") from None
            if time.monotonic() > deadline:
                raise SbusError(f"no broker on {address} after {timeout} s") from None
            time.sleep(0.02)
        finally:
            s.close()


def _connect_error(address: str, why: str, advice: bool = True) -> ConnectError:
    """The one wording of a failed connect; with *advice*, how to get a broker there
    (none where a file of another kind is in the way: ``sbus serve`` would not touch it)."""
    line = f"cannot connect to the sbus broker at {address}: {why}"
    other = _not_a_socket(address) if advice else None
    if other is not None:
        return ConnectError(f"cannot connect to the sbus broker at {address}: it is "
                            f"{other}, not a socket. Give the broker's socket with "
                            "--address or SBUS_ADDRESS.")
    if advice:
        line += (f". Start one with 'sbus serve --address {address}' (or 'systemctl start "
                 "sbus.socket'), or set SBUS_ADDRESS.")
    return ConnectError(line)


def _not_a_socket(address: str) -> str | None:
    """What is at *address* if it is there and is not a socket (else None)."""
    try:
        mode = os.stat(address).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISSOCK(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) \
        else "a special file"


def connecting(address: str, timeout: float | None = None) -> Steps[socket.socket]:
    """Connect to the broker at *address* without ever blocking: the one place a bus
    connection is made.  A step generator (as `_Shell._reopening`): it yields
    ``(_SLEEP, seconds)`` while the broker's accept backlog is full and returns the
    connected socket (non-blocking); `ConnectError` with advice if there is no broker,
    or the backlog stays full for *timeout* seconds (default `CONNECT_TIMEOUT`; 0: one
    try).  Linux answers a non-blocking unix connect to a full backlog with EAGAIN, not
    EINPROGRESS: there is no pending connection to poll for, only a later try."""
    limit = CONNECT_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + limit
    pause = Backoff(CONNECT_RETRY, CONNECT_RETRY_MAX)
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC
                             | socket.SOCK_NONBLOCK)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            sock.connect(address)
            return sock
        except BlockingIOError:  # EAGAIN: listening, but its accept backlog is full
            sock.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _connect_error(address, f"it has not accepted the connection in "
                                              f"{limit:g} s (its accept backlog is full: is "
                                              "it stopped or overloaded?)", False) from None
        except OSError as exc:
            sock.close()
            raise _connect_error(address, exc.strerror or str(exc)) from None
        yield _SLEEP, min(left, pause.next())


def connect_socket(address: str, timeout: float | None = None) -> socket.socket:
    """`connecting`, carried out blocking: a connected (blocking) SEQPACKET socket to the
    broker at *address*, or `ConnectError` with advice."""
    sock = _carry_out(connecting(address, timeout))
    sock.setblocking(True)
    return sock


def _carry_out(steps: Steps[_T]) -> _T:
    """Wait, blocking, for what a step generator asks; its result."""
    try:
        while True:
            try:
                what, arg = next(steps)
            except StopIteration as done:
                return done.value
            if what is _SLEEP:
                time.sleep(arg)  # type: ignore[arg-type]
            else:
                _wait(arg, what is _READ, OPENING_TIMEOUT)  # type: ignore[arg-type]
    finally:
        steps.close()  # interrupted (a signal's exception): its socket is closed now


async def _carry_out_async(steps: Steps[_T]) -> _T:
    """Wait, with anyio, for what a step generator asks (other tasks run meanwhile); its
    result.  Cancelled, the generator is closed (it closes its half-made socket)."""
    try:
        while True:
            try:
                what, arg = next(steps)
            except StopIteration as done:
                return done.value
            if what is _SLEEP:
                await anyio.sleep(arg)  # type: ignore[arg-type]
            else:
                with anyio.move_on_after(OPENING_TIMEOUT):
                    if what is _READ:
                        await anyio.wait_readable(arg)  # type: ignore[arg-type]
                    else:
                        await anyio.wait_writable(arg)  # type: ignore[arg-type]
    finally:
        steps.close()


def _recv_one(sock: socket.socket, into: memoryview, flags: int) -> int:
    """One packet into *into*, past a reset: the broker's close, when it had packets of
    ours unread, is reported once before the packets it sent, which are still there to
    read (`packetio` does the same for batches)."""
    try:
        return sock.recv_into(into, 0, flags)
    except ConnectionResetError:
        return sock.recv_into(into, 0, flags)


def _why(exc: OSError) -> str:
    """How a lost connection reads in a message."""
    if exc.errno in _CLOSED:
        return "closed the connection"
    if exc.errno == errno.EBADF:  # ours, closed when a reconnect was given up on
        return "was not back when an earlier call gave up waiting"
    return f"failed: {exc.strerror or exc}"


def _packet_of(event: Received) -> bytes:
    """The packet an event kept by the shell came in (for `receive_packets`)."""
    if type(event) is Dropped:
        return protocol.encode(Control(protocol.DROPPED, b"%d" % event.count))
    if type(event) is Reach:
        count = b"?" if event.count is None else b"%d" % event.count
        return protocol.encode(Control(protocol.REACH, event.key + b"\0" + count))
    return protocol.encode(event)


class _Gone(Exception):
    """Internal: the connection ended (the text says how); the shell reconnects or raises."""


class _Shell:
    """What `Client` and `AsyncClient` share: the session, the reconnect driver, the batch
    receive and the handling of events."""

    sock: socket.socket | None

    def __init__(self, address: str | None, reconnect: bool,
                 on_drop: Callable[[int], None] | None,
                 on_connection: Callable[[bool, str], None] | None, max_message: int,
                 backoff: Backoff | None,
                 on_refusal: Callable[[Refusal], None] | None = None) -> None:
        self.address = address or default_address()
        self.session = Session(max_message=max_message, backoff=backoff)
        self.reconnect = reconnect
        self.on_drop = on_drop
        self.on_connection = on_connection
        self.on_refusal = on_refusal
        #: Called on each whoami answer taken while receiving (one that waits on a
        #: question it asked itself: the bridge's imports, `sbus.bridge.shell`).
        self.on_answer: Callable[[], None] | None = None
        #: Messages too large to receive whole (over `SLOT_BYTES`: cut by the kernel, never
        #: handed out; reported as a drop of one), and the key of the last one.
        self.cut, self.cut_key = 0, b""
        self.sock = None
        self._batch: PacketBatch | None = None  # made at the first receive
        self._one: memoryview | None = None  # for `recv_packet`
        self._ended: str | None = None  # an end of file seen after a batch's last packet
        self._pending: deque[Received] = deque()
        self._refusals: list[Refusal] = []
        #: While set (monotonic seconds), reconnecting gives up at that time
        #: (`_giving_up_in`: a request's, a sync's, the client's own timeout).
        self._give_up_at: float | None = None
        #: a reconnect was abandoned (cancelled): the next one goes on with the same
        #: outage (its line says so: nothing gave up)
        self._abandoned = False
        #: Receives leave their packets on the socket until they are dealt with
        #: (`AsyncClient`'s *confirm_reads*): the socket they were left on, how many.
        self._confirming = False
        self._peek_sock: socket.socket | None = None
        self._peeked = 0
        #: Packets an earlier process had received on a connection taken up (`adopt`)
        #: without confirming them, read again here; the bytes of them still to come.
        self.read_again = 0
        self._again_bytes = 0

    @contextlib.contextmanager
    def _giving_up_in(self, timeout: float | None) -> Iterator[None]:
        """Within: a reconnect gives up (`ConnectionLost`) once it cannot be made within
        *timeout* seconds (None: no bound of its own), or by an outer bound if sooner."""
        outer = self._give_up_at
        if timeout is not None:
            at = time.monotonic() + timeout
            self._give_up_at = at if outer is None else min(outer, at)
        try:
            yield
        finally:
            self._give_up_at = outer

    @property
    def backoff(self) -> Backoff:
        """The session's reconnect delays."""
        return self.session.backoff

    @property
    def dropped(self) -> int:
        """Messages the broker reported dropping for this client, in total."""
        return self.session.dropped

    @property
    def connections(self) -> int:
        """Connections made so far (1 until the first reconnect)."""
        return self.session.connections

    @property
    def kept(self) -> int:
        """Events read while waiting for an answer (a sync, a reconnect's opening) and
        not yet returned: the next receive returns them first, whatever the socket holds
        (a reader that polls the socket itself looks here first)."""
        return len(self._pending)

    def _say(self, up: bool, line: str) -> None:
        if self.on_connection is not None:
            self.on_connection(up, line)
        else:
            log.warning("%s", line)

    def _lost(self, why: str) -> ConnectionLost:
        return ConnectionLost(f"the broker at {self.address} {why}")

    def _sent_error(self, exc: OSError) -> SbusError:
        if exc.errno == errno.EMSGSIZE:
            return InvalidRequest(f"the packet is too large for the connection to "
                                  f"{self.address}: {exc.strerror}")
        return self._lost(_why(exc))

    def _closing(self, sock: socket.socket) -> None:
        """*sock* is about to be closed (the async shell wakes whoever waits on it)."""

    def _attach(self, sock: socket.socket) -> None:
        """Make *sock* this shell's connection (each shell sets its blocking mode)."""
        self.sock = sock
        self._ended = None

    def _restored(self, packet: bytes, made: int) -> bool:
        """Whether *packet*, whose send failed while `Session.connections` was *made*, is
        not to be sent again on the connection a reconnect brought: a SUB of a pattern
        the session holds and any UNSUB, when that connection's opening (which restores
        the session's patterns, made after the packet) already did what they do.  Sent
        again, the broker would hold the pattern twice, or refuse the UNSUB."""
        if self.session.connections == made:
            return False
        try:
            event = protocol.parse(packet)
        except protocol.ProtocolError:
            return False
        if type(event) is protocol.Subscribe:
            return self.session.patterns[event.pattern] > 0
        return type(event) is protocol.Unsubscribe

    # -- the one reconnect driver -----------------------------------------------------

    def _reopening(self, why: str) -> Steps[None]:
        """Replace the lost connection; the session's plan, carried out.

        A generator: it does every non-blocking step itself and yields what to wait for
        -- ``(_READ, sock)``, ``(_WRITE, sock)``, ``(_SLEEP, seconds)`` -- for its shell
        to wait blocking or async.  On its end the new connection is attached and the
        opening answered (flood policy, nowait, every subscription in force).  Given up
        (a request's or a sync's deadline), the closed socket stays: the next use fails on
        it, as on any lost connection, and reconnects (or raises) then."""
        if self.sock is not None and self.sock.fileno() >= 0:
            self._closing(self.sock)
            self.sock.close()
        self._ended = None
        # said each time: *on_connection* learns from it that the socket changed (the
        # gateway's receiver stops waiting on the old one)
        self._say(False, f"the broker at {self.address} " + (
            "is still away (an earlier wait for it was cancelled)" if self._abandoned
            else why) + "; reconnecting")
        self._abandoned = True  # until it is made (cancelled in a wait: the same outage)
        while True:
            sock = None
            try:
                # one try: a full backlog is a failed attempt, waited out by the Backoff
                sock = yield from connecting(self.address, 0)
                self._ended = None  # what an earlier attempt's end left behind
                for packet in self.session.connected():
                    while True:
                        try:
                            sock.send(packet)
                            break
                        except BlockingIOError:
                            yield _WRITE, sock
                deadline = time.monotonic() + OPENING_TIMEOUT
                while self.session.asked:
                    if time.monotonic() > deadline:
                        raise TimeoutError(errno.ETIMEDOUT, "the opening was not answered")
                    try:  # a packet at a time: what follows the barrier stays unread
                        events = self._read(sock, 1)
                    except BlockingIOError:
                        yield _READ, sock
                        continue
                    except _Gone as gone:
                        raise ConnectionResetError(errno.ECONNRESET, str(gone)) from None
                    for event in events:
                        self._settle(event)
                break
            except (ConnectError, OSError):
                if sock is not None:
                    sock.close()
                delay = self.session.retry_in(self._give_up_at)
                if self._give_up_at is not None and time.monotonic() + delay > self._give_up_at:
                    self._abandoned = False  # given up, and said so: the next says why
                    raise self._lost(f"{why}, and did not come back in time") from None
                yield _SLEEP, delay
            except BaseException:  # abandoned mid-attempt (cancelled, a signal's exception)
                if sock is not None:
                    sock.close()
                raise
        self._abandoned = False
        self.session.restored()
        self._attach(sock)
        self._say(True, f"reconnected to the broker at {self.address}" + (
            " (messages published while it was away were not received)"
            if self.session.patterns else ""))

    # -- receiving: batches -> events ---------------------------------------------------

    def _receive_into(self, sock: socket.socket, limit: int, wait: bool = False) -> int:
        """Packets waiting on *sock* into the batch buffer, without blocking: how many
        (BlockingIOError when none; `_Gone` at the end of the connection).  With *wait*
        (a blocking socket) the call blocks for the first packet, up to the socket's
        ``SO_RCVTIMEO`` (then BlockingIOError; a signal: InterruptedError)."""
        if self._ended is not None:
            raise _Gone(self._ended)
        batch = self._batch or self._batch_of(SLOTS)
        peek = self._confirming and self._peeking(sock)
        try:
            n = batch.receive(sock.fileno(), wait, max(1, min(limit, batch.slots)), peek)
        except (BlockingIOError, InterruptedError):
            raise
        except OSError as exc:
            if exc.errno in _GONE or exc.errno in _CLOSED:
                raise _Gone(_why(exc)) from None
            raise self._lost(_why(exc)) from None
        lengths = batch.lengths
        if 0 in lengths:  # the broker sends no empty packet: the end of the connection
            n = lengths.index(0)
            del lengths[n:]
            if not n:
                raise _Gone("closed the connection")
            self._ended = "closed the connection"
        if peek:
            cut = -1
            if max(lengths) >= batch.slot_size:  # cut: the packets after it are its rest
                cut = next(i for i, size in enumerate(lengths) if size >= batch.slot_size)
                peek_past(sock.fileno(), lengths, cut, batch.slot_size)
                n = cut + 1
                del lengths[n:]
            self._peeked += n
            if self._again_bytes > 0:
                self._count_again(lengths)
            if cut >= 0:
                lengths[cut] = batch.slot_size  # (as cut as a plain receive leaves it)
        return n

    # -- confirmed reads (`AsyncClient`'s *confirm_reads*) -------------------------------

    def _peeking(self, sock: socket.socket) -> bool:
        """Before a receive on *sock*: take off it what earlier receives left there and
        that has been dealt with (`confirm_reads`); on a socket not read from before,
        read from its first packet (`start_peeking`).  False where the kernel cannot
        leave packets on it (said once; received as by any client from then on)."""
        if sock is self._peek_sock:
            if self._peeked and not self._pending:
                self.confirm_reads()
            return True
        try:
            start_peeking(sock.fileno())
        except OSError as exc:
            self._confirming = False
            log.warning("receiving from the broker at %s: packets cannot be left on the "
                        "socket until they are dealt with (%s); a crash may lose a batch",
                        self.address, exc.strerror)
            return False
        self._peek_sock, self._peeked = sock, 0
        return True

    def confirm_reads(self) -> None:
        """Take off the socket what the receives so far returned, now dealt with: until
        then a process killed with them leaves them to the one that takes its connection
        up (`AsyncClient.adopt`), which reads them again.  Nothing is taken while events
        read meanwhile are kept for the next receive (not dealt with yet).  The next
        receive does this too; a reader that waits for the socket to be readable calls
        it first (else what it was given keeps the socket readable)."""
        sock = self.sock
        if not self._peeked or self._pending or sock is None or sock is not self._peek_sock:
            return
        try:
            discard(sock.fileno(), self._peeked)
        except OSError:
            pass  # the connection is ending: the next receive finds out
        self._peeked = 0

    @property
    def rereading(self) -> bool:
        """Is what an earlier process left unconfirmed on this connection (`adopt`)
        still to be received again?"""
        return self._again_bytes > 0

    def skip_again(self) -> int:
        """Take what an earlier process left unconfirmed on this connection (`adopt`)
        off the socket unread, instead of receiving it again: for a program that has
        reason to think it is what killed that process.  Returns how many messages went;
        the broker's drop reports among it are counted as any are (*on_drop*), its
        answers go."""
        again, self._again_bytes = self._again_bytes, 0
        if again <= 0 or self.sock is None:
            return 0
        skipped = 0
        for head in take_heads(self.sock.fileno(), again, _HEAD_BYTES):
            if head.startswith(protocol.MSG_VERB):
                skipped += 1
            elif len(head) < _HEAD_BYTES and head.startswith(_DROP_REPORT):  # (whole)
                self._take(self.session.control_event(protocol.DROPPED,
                                                      head[len(_DROP_REPORT):]))
        return skipped

    def _count_again(self, lengths: list[int]) -> None:
        """Count the packets of *lengths* that an earlier process had read (`adopt`)."""
        for size in lengths:
            if self._again_bytes <= 0:
                break
            self._again_bytes -= size
            self.read_again += 1
        if self._again_bytes <= 0:
            log.warning("the connection to the broker at %s that this process took up held "
                        "%d packets its earlier process had received without dealing with "
                        "them (it was killed): read again, so what they carried may be "
                        "dealt with twice", self.address, self.read_again)

    def _batch_of(self, slots: int) -> PacketBatch:
        """The receive buffer, made (or made again, between batches) with at least *slots*
        slots: a reader that asks for larger batches gets them."""
        batch = self._batch
        if batch is None or batch.slots < slots:
            batch = self._batch = PacketBatch(max(slots, SLOTS), SLOT_BYTES)
        return batch

    def _decode(self, sock: socket.socket, limit: int) -> tuple[list[Event], list[int]]:
        """The events of what waits on *sock* (see `_receive_into`), and the indices of
        those that are not messages (`Session.decode`)."""
        self._receive_into(sock, limit)
        batch = self._batch
        try:
            events, others = self.session.decode(batch.buffer, batch.offsets, batch.lengths)
            if max(batch.lengths, default=0) >= SLOT_BYTES:
                for i, size in enumerate(batch.lengths):
                    if size >= SLOT_BYTES:  # cut by the kernel: a loss, said as a drop
                        events[i] = self._was_cut(batch.copy(i))
                        others.append(i)
            return events, others
        except protocol.ProtocolError as exc:
            raise SbusError(f"the broker at {self.address} sent a malformed packet: "
                            f"{exc}") from None
        finally:
            self._unpin(batch)

    def _was_cut(self, packet: bytes) -> Dropped:
        """A packet the kernel cut to its slot (a broker with a larger --max-message):
        counted, and lost as a drop of one is (`on_drop`, or a log line)."""
        self.cut += 1
        self.cut_key = packet[4:packet.find(b"\0", 4)][:LOG_QUOTE]
        return Dropped(1)

    def _raw_cut(self, packet: bytes) -> bytes:
        """For raw readers: a cut packet becomes the report of one dropped message."""
        self._was_cut(packet)
        return _CUT_REPORT

    @staticmethod
    def _unpin(batch: PacketBatch) -> None:
        """After a batch with large packets (copied out by now): hand the pages they
        touched back, so a burst of large messages does not stay resident."""
        if max(batch.lengths, default=0) > RELEASE_FROM:
            batch.release()

    def _read(self, sock: socket.socket, limit: int) -> list[Event]:
        """The events of what waits on *sock*."""
        return self._decode(sock, limit)[0]

    def _raw(self, sock: socket.socket, limit: int) -> list[bytes]:
        """The packets that wait on *sock*, as bytes, up to *limit* (several receive calls
        if need be; see `_receive_into`); what the shell kept comes first, alone (so
        after a reconnect's opening too)."""
        if self._pending:
            return self._kept_packets(limit)
        out: list[bytes] = []
        while len(out) < limit:
            try:
                n = self._receive_into(sock, limit - len(out))
            except (BlockingIOError, _Gone) as exc:
                if not out:
                    raise
                if isinstance(exc, _Gone):
                    self._ended = str(exc)  # said after these packets are taken
                break
            batch = self._batch
            asked = min(limit - len(out), batch.slots)
            if max(batch.lengths, default=0) >= SLOT_BYTES:  # cut ones: as drop reports
                out += [self._raw_cut(batch.copy(i)) if size >= SLOT_BYTES else batch.copy(i)
                        for i, size in enumerate(batch.lengths)]
            else:
                copy = batch.copy
                out += [copy(i) for i in range(n)]
            self._unpin(batch)
            if n < asked:
                break  # the kernel gave all it had: asking again would only say EAGAIN
        return out

    def _events(self, sock: socket.socket, limit: int) -> list[Received]:
        """`_read`, taken: what a program receives (whoami answers consumed, drops
        reported, refusals raised after the batch is kept)."""
        events, others = self._decode(sock, limit)
        if not others and not self._pending:
            return events  # the fast path: messages only
        for event in events:
            self._settle(event)
        out = list(self._pending)
        self._pending.clear()
        self._refused_later(out)
        return out

    def _kept_packets(self, limit: int) -> list[bytes]:
        """Up to *limit* events kept by `sync` or a reconnect's opening, as the packets
        they came in: `receive_packets` returns them before anything newer (drops in them
        are counted by the session already)."""
        out: list[bytes] = []
        while self._pending and len(out) < limit:
            out.append(_packet_of(self._pending.popleft()))
        return out

    def _refused_later(self, out: list[Received]) -> None:
        """Raise a refusal collected while taking *out*, keeping *out* for later."""
        if self._refusals:
            self._pending.extend(out)
            out.clear()
            self._refused()

    def _take(self, event: Event) -> Received | None:
        """What `receive` returns for *event*; None for what it consumes (whoami answers)."""
        if type(event) is Publish:
            return event
        if type(event) is Dropped:
            if self.on_drop is not None:
                self.on_drop(event.count)
            else:  # never silent: a program that did not ask still gets a log line
                log.warning("the broker at %s dropped %d messages for this client",
                            self.address, event.count)
            return event
        if type(event) is Whoami:
            if self.on_answer is not None:
                self.on_answer()
            return None
        if type(event) is Refusal:
            if self.on_refusal is not None:
                self.on_refusal(event)
                return None
            raise event.error()
        return event  # type: ignore[return-value]

    def _settle(self, event: Event) -> None:
        """Keep what `receive` should return later, collect refusals."""
        if type(event) is Refusal and self.on_refusal is None:
            self._refusals.append(event)
            return
        taken = self._take(event)
        if taken is not None:
            self._pending.append(taken)

    def _refused(self) -> None:
        if self._refusals:
            first, more = self._refusals[0], len(self._refusals) - 1
            self._refusals.clear()
            error = first.error()
            if more:
                error.args = (f"{error.args[0]} (and {more} more refusals)",)
            raise error

    def _whoami(self) -> bytes:
        return self.session.whoami or b""

    # -- request/reply: one round of the requester's loop ------------------------------

    def _reply(self, event: Received, inbox: bytes, kept: list) -> bytes | None:
        """The reply if *event* is it; anything else is kept for the program."""
        got = self.session.reply_to(event, inbox)
        if got is None:
            kept.append(event)
            return None
        return got if got is not False else None

    def _keep(self, kept: list) -> None:
        self._pending.extendleft(reversed(kept))  # they came before whatever is pending

    @staticmethod
    def _not_understood(exc: Refused) -> bool:
        """A broker older than `protocol.REACH` refused the question: wait as before."""
        return exc.verb == "cmsg" and protocol.REACH.decode() in exc.reason

    def _silent_for(self, timeout: float) -> TimeoutError:
        return TimeoutError(f"no message from the broker at {self.address} within "
                            f"{timeout:g} s")

    @staticmethod
    def _timed_out(key: bytes, timeout: float, held: bool = False) -> TimeoutError:
        """*held*: the request waited for a replier to come back (`RequestRound`)."""
        if held:
            return TimeoutError(f"nobody subscribed to {brief(key)} again within {timeout:g} "
                                "s after the broker came back: the request was not sent again")
        return TimeoutError(f"no reply to the request on {brief(key)} within {timeout:g} s")


class Client(_Shell):
    """A blocking connection to the broker.

    >>> with Client() as bus:                      # doctest: +SKIP
    ...     bus.subscribe("sensors/*/temp")
    ...     for msg in bus:
    ...         print(msg.key, msg.payload)

    *timeout* bounds each send and each receive that is not given its own (then
    ``TimeoutError``), and with *reconnect* each wait for a lost broker (then
    `ConnectionLost`); None waits as long as it takes.  Connecting never hangs: a broker
    whose accept backlog stays full is a `ConnectError` after `CONNECT_TIMEOUT` (or
    *timeout*, if shorter).  One thread per client: two reading one connection would
    take each other's replies.
    """

    sock: socket.socket

    def __init__(self, address: str | None = None, *, timeout: float | None = None,
                 reconnect: bool = False, on_drop: Callable[[int], None] | None = None,
                 on_connection: Callable[[bool, str], None] | None = None,
                 max_message: int = MAX_MESSAGE, backoff: Backoff | None = None,
                 on_refusal: Callable[[Refusal], None] | None = None) -> None:
        super().__init__(address, reconnect, on_drop, on_connection, max_message, backoff,
                         on_refusal)
        self._timeout = None if timeout is not None and timeout >= POLL_FOREVER else timeout
        self._rcvtimeo: tuple[socket.socket, int] | None = None  # `_receive_timeout`
        # the first connection must work (within `CONNECT_TIMEOUT`, or *timeout* if less)
        limit = CONNECT_TIMEOUT if timeout is None else min(timeout, CONNECT_TIMEOUT)
        self._attach(connect_socket(self.address, limit))
        self.session.connected()

    def _attach(self, sock: socket.socket) -> None:
        super()._attach(sock)
        sock.settimeout(self._timeout)

    def _reconnect(self, why: str) -> None:
        """Carry out `_reopening`, blocking; given up (`ConnectionLost`) once it cannot be
        made within the client's *timeout*, if it has one (each send and receive that
        waits for it is bounded so)."""
        with self._giving_up_in(self._timeout):
            _carry_out(self._reopening(why))

    def _gone(self, why: str) -> None:
        if not self.reconnect:
            raise self._lost(why)
        self._reconnect(why)

    # -- sending ---------------------------------------------------------------

    def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """Send one packet (``send(2)`` flags passed through); with *reconnect*, a lost
        broker is waited for and the packet sent on the new connection."""
        made = self.session.connections
        while True:
            try:
                self.sock.send(packet, flags)
                return
            except (BlockingIOError, TimeoutError):
                raise
            except OSError as exc:
                if not (self.reconnect and exc.errno in _GONE):
                    raise self._sent_error(exc) from None
                self._reconnect(_why(exc))
                if self._restored(packet, made):
                    return

    def subscribe(self, pattern: bytes | str, flags: int = 0, *, wait: bool = True) -> None:
        """Subscribe; with *wait* (the default), return once the broker has the
        subscription in force, raising `Refused` if it refused it."""
        self.send_packet(self.session.subscribe(pattern), flags)
        if wait:
            self.sync()

    def unsubscribe(self, pattern: bytes | str, flags: int = 0) -> None:
        self.send_packet(self.session.unsubscribe(pattern), flags)

    def publish(self, key: bytes | str, payload: bytes | str = b"", flags: int = 0) -> None:
        self.send_packet(self.session.publish(key, payload), flags)

    def control(self, key: bytes | str, payload: bytes | str | None = None,
                flags: int = 0) -> None:
        self.send_packet(self.session.control(key, payload), flags)

    def publisher(self, key: bytes | str) -> Callable[[bytes], None]:
        """A function publishing its argument (bytes) on *key*: the key is checked once,
        so a program sending many messages to one key pays only for the send."""
        head = self.session.publish_head(key)
        limit, send = self.session.max_message, self.send_packet

        def publish(payload: bytes) -> None:
            packet = head + payload
            if len(packet) > limit:
                raise self.session.too_large(head[4:-1], len(packet))
            send(packet)

        return publish

    def set_flood(self, soft: str | None = None, hard: str | None = None,
                  order: str | None = None) -> None:
        """Choose the broker's flood policy for this client (docs/protocol.md)."""
        for packet in self.session.set_flood(soft, hard, order):
            self.send_packet(packet)

    def sync(self, timeout: float | None = ANSWER_TIMEOUT) -> None:
        """Return once the broker has acted on everything sent before (a whoami round
        trip); raises `Refused` if it refused any of it.  Messages meanwhile are kept.
        *timeout* None waits as long as it takes (a publisher the broker paused); it
        bounds a reconnect on the way too (then `ConnectionLost`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._giving_up_in(timeout):  # (within a request's, around its whoami)
            self.send_packet(self.session.ask())
            while self.session.asked:  # a packet at a time: what follows stays unread
                for event in self._until(self._read, 1, deadline, timeout):
                    self._settle(event)
        self._refused()

    # -- receiving ---------------------------------------------------------------

    def _until(self, read: Callable[[socket.socket, int], list], limit: int,
               deadline: float | None, timeout: float | None) -> list:
        """What *read* takes from the connection (a non-empty list), waiting for it up to
        *deadline* and reconnecting as the client does; ``TimeoutError`` after that."""
        while True:
            try:
                out = read(self.sock, limit)
            except BlockingIOError:
                self._wait_readable(deadline, timeout)
                continue
            except _Gone as gone:
                self._gone(str(gone))
                continue
            if out:
                return out

    def recv_packet(self, flags: int = 0) -> bytes:
        """One raw packet (``recv(2)`` flags passed through, e.g. ``MSG_PEEK``).  End of the
        connection raises `ConnectionLost`, or with *reconnect* waits for the broker and
        reads from the new connection."""
        if self._one is None:
            self._one = memoryview(bytearray(SLOT_BYTES))
        while True:
            self._plain()
            try:
                n = _recv_one(self.sock, self._one, flags)
            except (BlockingIOError, TimeoutError):
                raise
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise self._lost(_why(exc)) from None
                self._gone(_why(exc))
                continue
            if n >= SLOT_BYTES:
                self._was_cut(self._one[:n].tobytes())
                return _CUT_REPORT
            if n:
                return self._one[:n].tobytes()
            self._gone("closed the connection")

    def receive_packets(self, limit: int = SLOTS, timeout: float | None = None) -> list[bytes]:
        """At least one raw packet, plus whatever else is ready (up to *limit*); waits up
        to *timeout* seconds (default: the client's), then ``TimeoutError``.  Messages
        kept by `sync` or a reconnect's opening come first."""
        return self._until(self._raw, limit, self._deadline(timeout), timeout)

    def receive_batch(self, limit: int = SLOTS, timeout: float | None = None
                      ) -> list[Received]:
        """At least one event, plus whatever else is ready (up to about *limit*): the
        cheapest way to keep up with a busy bus (one system call and one decoding pass
        per batch).  ``TimeoutError`` after *timeout* seconds (default: the client's)."""
        self._refused()
        if self._pending:
            out = list(self._pending)
            self._pending.clear()
            return out
        return self._until(self._events, limit, self._deadline(timeout), timeout)

    def receive_frames(self, limit: int = SLOTS, timeout: float | None = None) -> Frames:
        """One received batch of up to *limit* packets as the buffer holds them, for a
        reader that splits messages itself (the recorder's array columns): no object per
        message.  The session has taken in the other packets (drop reports counted and
        *on_drop*, whoami answers consumed, refusals to *on_refusal* or raised by the next
        call), so the reader needs only the messages.  Waits and reconnects as
        `receive_batch`; ``TimeoutError`` after *timeout* seconds (default: the client's)."""
        self._refused()
        batch = self._batch_of(limit)
        self._unpin(batch)  # the previous batch is the reader's no more
        deadline = self._deadline(timeout)
        while True:
            if self._pending:  # kept by `sync`, or by a reconnect's opening
                kept = list(self._pending)
                self._pending.clear()
                return Frames(kept, batch, 0, {})
            # A blocking socket waits inside the receive (one system call per batch): the
            # socket's receive timeout bounds the wait (set once for a reader that always
            # asks for the same *timeout*).
            blocking = self.sock.gettimeout() is None
            if blocking:
                self._receive_timeout(timeout)
            try:
                n = self._receive_into(self.sock, limit, blocking)
            except BlockingIOError:
                if blocking:
                    raise self._quiet(timeout) from None
                self._wait_readable(deadline, timeout)
                continue
            except InterruptedError:  # a signal: the reader looks at what it set
                return Frames([], batch, 0, {})
            except _Gone as gone:
                self._gone(str(gone))
                continue
            return Frames([], batch, n, self._others(batch, n))

    def _receive_timeout(self, seconds: float | None) -> None:
        """``SO_RCVTIMEO`` of the (blocking) socket, set only when it changes; None: none.
        `_plain` takes it off before a receive that must not time out."""
        usec = 0 if seconds is None else max(1, round(seconds * 1e6))
        if self._rcvtimeo != (self.sock, usec):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                 struct.pack("@ll", usec // 1_000_000, usec % 1_000_000))
            self._rcvtimeo = (self.sock, usec)

    def _plain(self) -> None:
        if self._rcvtimeo is not None and self._rcvtimeo[1]:
            self._receive_timeout(None)

    def _others(self, batch: PacketBatch, n: int) -> dict[int, Received | None]:
        """The packets of *batch* that are not messages, taken in by the session."""
        heads = batch.heads(0, n, 4)
        lengths = batch.lengths
        if heads.count(protocol.MSG_VERB) == n and min(lengths) > 4 and \
                max(lengths) < SLOT_BYTES:
            return {}  # messages only: the common case, three calls in C
        others: dict[int, Received | None] = {}
        for i, (head, size) in enumerate(zip(heads, lengths, strict=True)):
            if size >= SLOT_BYTES:  # cut by the kernel: never handed out, counted (the
                self._was_cut(batch.copy(i))  # frames' reader says it: not a drop here)
                others[i] = None
            elif head != protocol.MSG_VERB or size < 5:
                try:
                    event = self.session.receive(batch.copy(i))
                except protocol.ProtocolError as exc:
                    raise SbusError(f"the broker at {self.address} sent a malformed "
                                    f"packet: {exc}") from None
                if type(event) is Refusal and self.on_refusal is None:
                    self._refusals.append(event)  # raised by the next call
                    others[i] = None
                else:
                    others[i] = self._take(event)
        return others

    def _deadline(self, timeout: float | None) -> float | None:
        if timeout is None:
            timeout = self._timeout
        return None if timeout is None else time.monotonic() + timeout

    def _wait_readable(self, deadline: float | None, timeout: float | None) -> None:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not _wait(self.sock, True, left):
            raise self._quiet(timeout)

    def _quiet(self, timeout: float | None) -> TimeoutError:
        return self._silent_for(timeout if timeout is not None else self._timeout or 0.0)

    def receive(self, timeout: float | None = None, flags: int = 0) -> Received:
        """The next message, drop report or control message; ``TimeoutError`` after
        *timeout* seconds; `Refused` if the broker refused something sent before.

        It takes one packet at a time from the connection, so a program that waits with
        ``select``/``poll`` on the client (`fileno`) is told the truth about what is left;
        a reader that needs speed takes batches (`receive_batch`, iteration).  *flags*
        go to ``recv``: with ``MSG_DONTWAIT`` an empty connection raises
        ``BlockingIOError`` (a reader in its own ``select`` loop: the MQTT bridge)."""
        self._refused()
        if not self._pending:
            deadline = self._deadline(timeout)
            while not self._pending:
                taken = self._take(self._one_event(deadline, timeout, flags))
                if taken is not None:
                    self._pending.append(taken)
        return self._pending.popleft()

    def _one_event(self, deadline: float | None, timeout: float | None,
                   flags: int = 0) -> Event:
        """The event of the next packet (one ``recv``: the cheapest way to take exactly
        one); waits up to *deadline*, reconnects as `receive_batch`."""
        while True:
            if self._ended is not None:  # an end of file seen after a batch
                self._gone(self._ended)
                continue
            if deadline is not None:
                self._wait_readable(deadline, timeout)
            if self._one is None:
                self._one = memoryview(bytearray(SLOT_BYTES))
            self._plain()
            try:
                n = _recv_one(self.sock, self._one, flags)
            except BlockingIOError:
                raise  # MSG_DONTWAIT and nothing there: the caller's loop waits
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise self._lost(_why(exc)) from None
                self._gone(_why(exc))
                continue
            if not n:
                self._gone("closed the connection")
                continue
            if n >= SLOT_BYTES:
                return self._was_cut(self._one[:n].tobytes())
            try:
                return self.session.receive(self._one[:n].tobytes())
            except protocol.ProtocolError as exc:
                raise SbusError(f"the broker at {self.address} sent a malformed packet: "
                                f"{exc}") from None

    def receive_ready(self, limit: int = 1024) -> list[Received]:
        """Everything that can be read without blocking (up to *limit*): for fast consumers."""
        while len(self._pending) < limit:
            try:
                self._pending.extend(self._events(self.sock, limit - len(self._pending)))
            except BlockingIOError:
                break
            except _Gone as gone:
                if self._pending:
                    self._ended = self._ended or str(gone)
                    break
                self._gone(str(gone))
        self._refused()
        out = list(self._pending)
        self._pending.clear()
        return out

    def __iter__(self) -> Iterator[Publish]:
        """Messages, forever; drop reports (counted, *on_drop*) and control messages
        are skipped."""
        while True:
            for event in self.receive_batch():
                if type(event) is Publish:
                    yield event

    def whoami(self, timeout: float = ANSWER_TIMEOUT) -> bytes:
        """This connection's credentials path, e.g. ``b'!/cred/100/1000/1111'``, asked of the
        broker; messages arriving meanwhile are kept for `receive`."""
        if self.session.whoami is None:
            self.sync(timeout)
        return self._whoami()

    def reach(self, key: bytes | str, timeout: float = ANSWER_TIMEOUT) -> int | None:
        """How many subscribers a message on *key* would reach now (None: the broker will
        not say, or does not know the question); messages meanwhile are kept."""
        key = key.encode() if isinstance(key, str) else bytes(key)
        self.send_packet(self.session.ask_reach(key))
        deadline = time.monotonic() + timeout
        kept: list = []
        try:
            while True:
                try:
                    event = self.receive(max(0.0, deadline - time.monotonic()))
                except Refused as exc:
                    if self._not_understood(exc):
                        return None
                    raise
                if type(event) is Reach and event.key == key:
                    return event.count
                kept.append(event)
        finally:
            self._keep(kept)

    def request(self, key: bytes | str, payload: bytes | str = b"",
                timeout: float = ANSWER_TIMEOUT, *, no_responders: bool = True) -> bytes:
        """Publish a request on *key* and return the first reply's payload, received on a
        private inbox (`sbus.request`); ``TimeoutError`` after *timeout* seconds.

        With *no_responders* (the default) the broker is asked in the same round
        whether anyone subscribes to *key*: if nobody does, `NoResponders` at once.  With
        *reconnect*, a lost broker is waited for within *timeout* and the request sent
        again on the new connection once someone subscribes to *key* again (a replier
        reconnects too: `RequestRound`), so a replier may see it twice.  Other messages
        meanwhile are kept for `receive`; a late reply to an earlier request is dropped."""
        key = key.encode() if isinstance(key, str) else bytes(key)
        deadline = self._give_up_at = time.monotonic() + timeout
        kept: list = []
        inbox = None
        try:
            self.whoami(timeout)
            inbox = self.session.new_inbox()
            self.subscribe(inbox, wait=False)
            asking = RequestRound(self.session, key, payload, inbox, no_responders)
            out: list[bytes] = []
            while True:
                for packet in asking.connected(self.connections) + out:
                    self.send_packet(packet)
                wake = asking.wake_at(time.monotonic(), deadline)
                try:
                    event = self.receive(max(0.0, wake - time.monotonic()))
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise self._timed_out(key, timeout, asking.held) from None
                    out = asking.timer(time.monotonic())
                    continue
                except Refused as exc:
                    if not self._not_understood(exc):
                        raise
                    out = asking.not_understood()
                    continue
                if type(event) is Reach and event.key == key:
                    out = asking.reach(event, time.monotonic())
                    continue
                out = []
                got = self._reply(event, inbox, kept)
                if got is not None:
                    return got
        finally:
            self._keep(kept)
            if inbox is not None:
                try:  # (within the deadline still: a broker gone is not waited for here)
                    self.unsubscribe(inbox)
                except SbusError:  # the connection may be what failed
                    pass
            self._give_up_at = None

    def credentials(self, timeout: float = ANSWER_TIMEOUT) -> Credentials:
        return Credentials.parse(self.whoami(timeout))

    # -- plumbing ---------------------------------------------------------------

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait(sock: socket.socket, read: bool, timeout: float | None) -> bool:
    """Whether *sock* became readable (or writable) within *timeout* seconds (beyond
    what ``poll`` can count, e.g. ``math.inf``: as long as it takes)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN if read else select.POLLOUT)
    forever = timeout is None or timeout >= POLL_FOREVER
    return bool(poller.poll(None if forever else max(0, int(timeout * 1000 + 0.999))))


class AsyncClient(_Shell):
    """The async twin of `Client`, for trio or asyncio (readiness through anyio).

    ``async with AsyncClient(address) as bus:`` connects on entry (or ``bus = await
    AsyncClient.connect(address)``).  One task may send and one may receive at a time
    (waiting on the same socket from two tasks is an error under trio); tasks that
    share a client serialise their sends with a lock.  Either task may notice a lost
    broker: the reconnect happens once.

    With *confirm_reads*, what a receive returns stays on the socket (read with
    ``MSG_PEEK``) until it is dealt with: `confirm_reads`, or the next receive, takes it
    off.  For a program whose connection outlives it (the service manager's fd store,
    `adopt`): killed between a receive and what it does with the messages, it leaves
    them to its next process, which receives them again instead of their being lost.
    """

    def __init__(self, address: str | None = None, *, reconnect: bool = False,
                 on_drop: Callable[[int], None] | None = None,
                 on_connection: Callable[[bool, str], None] | None = None,
                 max_message: int = MAX_MESSAGE, backoff: Backoff | None = None,
                 on_refusal: Callable[[Refusal], None] | None = None,
                 confirm_reads: bool = False) -> None:
        super().__init__(address, reconnect, on_drop, on_connection, max_message, backoff,
                         on_refusal)
        self._confirming = confirm_reads
        self._reconnecting: anyio.Event | None = None
        self._sender: PacketSender | None = None  # made at the first `send_packets`

    @classmethod
    async def connect(cls, address: str | None = None, **options) -> AsyncClient:
        bus = cls(address, **options)
        await bus.open()
        return bus

    async def open(self, *, retry: bool = False) -> None:
        """Connect (the first connection must work: `ConnectError` otherwise, at the
        latest after `CONNECT_TIMEOUT` of a full accept backlog; other tasks run while it
        waits) unless *retry*: then a broker not there yet is waited for as a lost one is
        (the one reconnect driver, the session's `Backoff`; *on_connection* hears of it)."""
        try:
            sock = await _carry_out_async(connecting(self.address))
        except ConnectError:
            if not retry:
                raise
            await self._reconnect("cannot be reached yet", None)
            return
        self._attach(sock)
        self.session.connected()

    async def adopt(self, sock: socket.socket, held: Iterable[bytes]) -> None:
        """Take up *sock*, a connection to the broker that an earlier process of this
        program opened and left to this one (the service manager's fd store), on which
        the broker holds the patterns *held*: what it queued meanwhile is received as on
        any connection, and the earlier process's answers do not pass this one's barrier
        (`Session.adopt`).  A connection that has ended is replaced as a lost one is.
        With *confirm_reads*, what the earlier process had received without confirming
        it is received again (counted in `read_again`, and said)."""
        if self._confirming:
            with contextlib.suppress(OSError):  # (no peek offset: `_peeking` says so)
                self._again_bytes = peek_offset(sock.fileno())
        self._attach(sock)
        for packet in self.session.adopt(held):
            await self.send_packet(packet)

    def _attach(self, sock: socket.socket) -> None:
        super()._attach(sock)
        sock.setblocking(False)

    def _closing(self, sock: socket.socket) -> None:
        # a task waiting on a closed descriptor would otherwise never wake (trio, epoll)
        anyio.notify_closing(sock)

    async def _reconnect(self, why: str, lost: socket.socket | None) -> socket.socket:
        """Carry out `_reopening` with anyio; a second task that noticed the same loss
        waits for the first one's reconnect instead of making its own."""
        while self._reconnecting is not None:
            await self._reconnecting.wait()
        if self.sock is not lost and self.sock is not None:
            return self.sock  # someone else reconnected already
        done = self._reconnecting = anyio.Event()
        try:
            await _carry_out_async(self._reopening(why))
        finally:
            self._reconnecting = None
            done.set()
        return self._socket()

    async def _gone(self, why: str, lost: socket.socket) -> socket.socket:
        if self.sock is None:
            return self._socket()  # closed by `aclose`: says so
        if not self.reconnect:
            raise self._lost(why)
        return await self._reconnect(why, lost)

    def _socket(self) -> socket.socket:
        if self.sock is None:
            raise SbusError("this AsyncClient is not connected: use 'async with' or "
                            "AsyncClient.connect()")
        return self.sock

    async def send_packet(self, packet: bytes, flags: int = 0) -> None:
        """`Client.send_packet`: the reconnect may be another task's (a SUB or UNSUB made
        before its opening is not sent again either)."""
        made = self.session.connections
        sock = self._socket()
        while True:
            try:
                sock.send(packet, flags)
                return
            except BlockingIOError:
                try:
                    await anyio.wait_writable(sock)
                    continue
                except anyio.ClosedResourceError:  # another task is reconnecting
                    sock = await self._gone("closed the connection", sock)
            except OSError as exc:
                if not (self.reconnect and exc.errno in _GONE):
                    raise self._sent_error(exc) from None
                sock = await self._reconnect(_why(exc), sock)
            if self._restored(packet, made):
                return

    async def send_packets(self, packets: list[bytes]) -> None:
        """`send_packet` for each of *packets* in order, in as few system calls as the
        kernel takes them (``sendmmsg``): for a task with many ready at once (the
        gateway's publishes from one read).  What the kernel does not take at once goes
        through `send_packet` (waits for room, reconnects, errors)."""
        self._socket()  # (not connected: said at once)
        done = self.send_run_nowait(packets) if len(packets) > 1 else 0
        for packet in packets[done:]:
            await self.send_packet(packet)

    def send_run_nowait(self, packets: list[bytes]) -> int:
        """Send as many of *packets*, in order, as the kernel takes now, in one
        ``sendmmsg`` per `SLOTS`, never waiting nor reconnecting: how many went (for the
        bridge's imports of one read).  A failure is not raised: `send_packet` of the
        first one left names it."""
        sock = self.sock
        if sock is None or self._reconnecting is not None:
            return 0
        if len(packets) == 1:  # (a plain send: 1.6 µs less than one through ctypes)
            try:
                sock.send(packets[0])
            except OSError:
                return 0
            return 1
        sender = self._sender
        if sender is None:
            sender = self._sender = PacketSender(SLOTS)
        fd, done = sock.fileno(), 0
        try:
            while done < len(packets):
                n = sender.send(fd, packets, done)
                if not n:
                    break
                done += n
        except OSError:
            pass
        return done

    def send_nowait(self, packet: bytes) -> bool:
        """Send one packet if the connection is up and has room, never waiting nor
        reconnecting (that is the receiving task's to do): whether it was sent.  For a
        second task's periodic questions (sbus-top's status)."""
        sock = self.sock
        if sock is None or self._reconnecting is not None:
            return False
        try:
            sock.send(packet)
        except OSError:
            return False
        return True

    def control_nowait(self, key: bytes | str, payload: bytes | str | None = None) -> bool:
        """`send_nowait` of a control message."""
        return self.send_nowait(self.session.control(key, payload))

    async def subscribe(self, pattern: bytes | str, *, wait: bool = True) -> None:
        """Subscribe; with *wait*, return once it is in force (`Refused` if refused)."""
        await self.send_packet(self.session.subscribe(pattern))
        if wait:
            await self.sync()

    async def unsubscribe(self, pattern: bytes | str) -> None:
        await self.send_packet(self.session.unsubscribe(pattern))

    async def publish(self, key: bytes | str, payload: bytes | str = b"") -> None:
        await self.send_packet(self.session.publish(key, payload))

    async def control(self, key: bytes | str, payload: bytes | str | None = None) -> None:
        await self.send_packet(self.session.control(key, payload))

    async def set_flood(self, soft: str | None = None, hard: str | None = None,
                        order: str | None = None) -> None:
        for packet in self.session.set_flood(soft, hard, order):
            await self.send_packet(packet)

    async def sync(self, timeout: float | None = ANSWER_TIMEOUT) -> None:
        """`Client.sync`: the broker has acted on everything sent before, or `Refused`."""
        await self.send_packet(self.session.ask())
        try:
            with anyio.fail_after(timeout):
                while self.session.asked:
                    for event in await self._receiving(self._read, SLOTS):
                        self._settle(event)
        except TimeoutError:
            raise self._silent_for(timeout) from None
        self._refused()

    async def _receiving(self, read, limit: int, until: float = math.inf) -> list:
        """*read* (`_read`, `_raw` or `_events`) once something waits: waits, reconnects;
        [] when the time *until* (monotonic) comes while it waits for a packet (never
        in the middle of a reconnect, which the next wait would start over)."""
        sock = self._socket()
        while True:
            try:
                out = read(sock, limit)
            except BlockingIOError:
                try:
                    with anyio.move_on_after(until - time.monotonic()) as waited:
                        await anyio.wait_readable(sock)
                except anyio.ClosedResourceError:  # another task is reconnecting
                    sock = await self._gone("closed the connection", sock)
                    continue
                if waited.cancelled_caught:
                    return []
                continue
            except _Gone as gone:
                sock = await self._gone(str(gone), sock)
                continue
            if out:
                await anyio.lowlevel.checkpoint()  # a busy bus must not starve other tasks
                return out

    async def recv_packet(self) -> bytes:
        """One raw packet; see `receive_packets`."""
        return (await self.receive_packets(1))[0]

    async def receive(self) -> Received:
        """The next message, drop report or control message; `Refused` if the broker
        refused something sent before."""
        self._refused()
        if not self._pending:
            self._pending.extend(await self.receive_batch())
        return self._pending.popleft()

    async def _receive_until(self, until: float) -> Received | None:
        """`receive`, or None when the time *until* comes first (`_receiving`)."""
        self._refused()
        if not self._pending:
            self._pending.extend(await self._receiving(self._events, SLOTS, until))
        return self._pending.popleft() if self._pending else None

    async def receive_packets(self, limit: int = SLOTS) -> list[bytes]:
        """At least one raw packet, plus whatever else is ready (up to *limit*).

        No event objects, one wait per batch; the session does not see these packets
        (a drop report in them is the caller's to count).  End of connection raises
        `ConnectionLost` once the packets before it are taken (with *reconnect*:
        reconnects and goes on reading).  Messages kept by `sync` or a reconnect's
        opening come first.
        """
        return await self._receiving(self._raw, limit)

    async def receive_batch(self, limit: int = SLOTS) -> list[Received]:
        """At least one event, plus whatever else is ready (up to about *limit*)."""
        self._refused()
        if self._pending:
            out = list(self._pending)
            self._pending.clear()
            return out
        return await self._receiving(self._events, limit)

    def receive_ready(self, limit: int = SLOTS) -> list[Received]:
        """The events that can be read without waiting (up to about *limit*), as
        `receive_batch` returns them; [] when none wait, and when the connection ended or
        is being replaced (`receive_batch` then waits, reconnects or raises).  For a
        reader that waits on `fileno` itself: no turn of the loop per batch."""
        self._refused()
        if self._pending:
            out = list(self._pending)
            self._pending.clear()
            return out
        sock = self.sock
        if sock is None or self._reconnecting is not None:
            return []
        try:
            return self._events(sock, limit)
        except (BlockingIOError, _Gone):
            return []

    def receive_packets_ready(self, limit: int = SLOTS) -> list[bytes]:
        """The packets `receive_packets` would return that can be read without waiting;
        [] when none wait, and when the connection ended or is being replaced
        (`receive_packets` then waits, reconnects or raises).  For a reader that waits on
        `fileno` itself: no turn of the loop per batch."""
        sock = self.sock
        if sock is None or self._reconnecting is not None:
            return []
        try:
            return self._raw(sock, limit)
        except (BlockingIOError, _Gone):
            return []

    def __aiter__(self) -> AsyncIterator[Publish]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Publish]:
        while True:
            for event in await self.receive_batch():
                if type(event) is Publish:
                    yield event

    async def whoami(self, timeout: float = ANSWER_TIMEOUT) -> bytes:
        if self.session.whoami is None:
            await self.sync(timeout)
        return self._whoami()

    async def credentials(self, timeout: float = ANSWER_TIMEOUT) -> Credentials:
        return Credentials.parse(await self.whoami(timeout))

    async def request(self, key: bytes | str, payload: bytes | str = b"",
                      timeout: float = ANSWER_TIMEOUT, *, no_responders: bool = True) -> bytes:
        """`Client.request` for async code; ``TimeoutError`` after *timeout* seconds,
        `NoResponders` at once when nobody subscribes to *key*."""
        key = key.encode() if isinstance(key, str) else bytes(key)
        kept: list = []
        inbox = asking = None
        try:
            self._give_up_at = time.monotonic() + timeout
            with anyio.fail_after(timeout):  # the whoami is part of the wait
                await self.whoami(timeout)
                inbox = self.session.new_inbox()
                await self.subscribe(inbox, wait=False)
                asking = RequestRound(self.session, key, payload, inbox, no_responders)
                out: list[bytes] = []
                while True:  # as in `Client.request`
                    for packet in asking.connected(self.connections) + out:
                        await self.send_packet(packet)
                    out = []
                    try:
                        event = await self._receive_until(
                            asking.wake_at(time.monotonic(), math.inf))
                    except Refused as exc:
                        if not self._not_understood(exc):
                            raise
                        out = asking.not_understood()
                        continue
                    if event is None:
                        out = asking.timer(time.monotonic())
                        continue
                    if type(event) is Reach and event.key == key:
                        out = asking.reach(event, time.monotonic())
                        continue
                    got = self._reply(event, inbox, kept)
                    if got is not None:
                        return got
        except TimeoutError:
            raise self._timed_out(key, timeout, asking is not None and asking.held) from None
        finally:
            self._keep(kept)
            if inbox is not None:
                with anyio.CancelScope(shield=True):
                    try:  # (within the deadline still, as in `Client.request`)
                        await self.unsubscribe(inbox)
                    except SbusError:
                        pass
            self._give_up_at = None

    def fileno(self) -> int:
        return self._socket().fileno()

    async def aclose(self) -> None:
        if self.sock is not None:
            self._closing(self.sock)
            self.sock.close()
            self.sock = None

    async def __aenter__(self) -> AsyncClient:
        if self.sock is None:
            await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
