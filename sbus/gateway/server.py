"""The network gateway: remote clients publish and subscribe on the bus over TCP or TLS.

The component behind `sbus gateway` (its launcher, `sbus.cmd.gateway`, owns the
command line, secret file, listeners, limits and signals).  A thin trio shell:
`codec` turns bytes into frames, `Outbox` bounds what waits for each client,
`admission` caps connections and shared byte pools, `Bridge` holds the one shared
bus connection and the routing index of remote subscriptions.  Each remote client
is a reader and a writer task in a cancel scope whose deadline is the idle timeout,
pushed forward by every read and write; anything abnormal cancels
that scope and nothing else.

Decisions where the design leaves room (see docs/gateway.md, "Refusals"):

* a refused frame that is well formed (a subscription to a secret or malformed
  pattern or over the client's budget; a publish before authenticating or to a
  refused key) is dropped, counted and logged (rationed per peer address), and the
  connection stays: clients that reconnect at once after a disconnect (the
  getlantern/pubsub Go client) would otherwise turn one refusal into a storm;
* a wrong secret or a stream that is not MessagePack frames closes the connection
  after a delay (`--refusal-delay`), reading nothing meanwhile: each guess costs a
  slot of the per-address cap for that long, so reconnecting at once gains nothing;
* secret keys are spelled with the broker's separator (``!/`` or ``!.``), learned
  from its whoami answer;
* unsubscribing from a topic one is not subscribed to is ignored (harmless);
  subscribing twice to the same topic is one subscription;
* a client that subscribes to `notices.TOPIC` is told in its stream what it missed
  (messages discarded for it, the bus away, the broker dropping for the gateway); the
  others see the protocol unchanged.
"""

from __future__ import annotations

import errno
import hmac
import logging
import math
import os
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

import trio
from trio.lowlevel import ParkingLot

from ..display import brief, printable
from ..keys import KeyRules
from ..limits import LogAllowance
from ..linger import LINGER, WAKE_BYTES, Linger
from ..routing import pattern_cost
from . import codec, notices
from .admission import Caps, Peer, Pool, Tarpit, peer_of
from .bridge import BUS_SUBSCRIPTION_BYTES, BUS_WAIT, TURN, Bridge
from .checks import FrameRefused, SharesFull, check_key, check_pattern
from .codec import DEFAULT_MAX_FRAME, UNPACKER_BYTES, FrameDecoder, FrameError
from .outbox import CAUSES, OWN, POOL, SHARE, STALLED, Outbox, Shared, make_room

log = logging.getLogger("sbus.gateway")

__all__ = ["Gateway"]

#: Bytes read from a client at once (also the codec's chunk size).
READ_SIZE = 65536
#: Distinct topics one remote client may hold; more are refused.
MAX_SUBSCRIPTIONS = 4096
#: How long a closing connection may take to say goodbye (TLS close_notify).
CLOSE_GRACE = 1.0
#: Bytes decoded at once (a slice of a read): decoding is one step that cannot yield.
FEED_SIZE = 8192
#: Bytes of an incomplete frame an unauthenticated connection may hold between reads.
UNAUTHENTICATED_HOLD = 16 * 1024
#: What incomplete frames may hold between reads, all connections together (charged
#: their bytes and `codec.UNPACKER_BYTES` each), and those of one address (a sixteenth):
#: `--max-frame` bounds one connection only, and 1,024 authenticated connections of 4
#: addresses held 292 MB so (the audit of 2026-11-27; 2.8 GB at `--max-clients`).
HALF_FRAMES_POOL = 256 * 1024 * 1024
# `TURN` (the loop's turn) also bounds the work for one client's input.  The
# connections of one address take their turns one at a time (`Peer.turn`), so an
# address with hundreds of busy connections gets about one turn while every other
# address gets one, not one per connection.
#: How much later than the idle timeout an idle connection may be closed (a fraction of
#: it: `Remote.touch` moves its deadline only when it would come sooner).
IDLE_SLACK = 1 / 64
#: Bytes of publishes held back (on plain TCP, while more input waits) to go to the bus
#: as one run.
RUN_BYTES = 64 * 1024
#: Keys published to whose packet heads are kept (`Gateway._head`), and their bytes.
HEADS, HEADS_BYTES = 1024, 256 * 1024
#: Seconds between two log lines about connections refused at the caps.
CAP_LOG_INTERVAL = 10.0
#: Seconds between two log lines about the messages discarded for one address's clients,
#: and the addresses said apart each time at most (the rest in one line).
DISCARD_LOG_INTERVAL = 10.0
DISCARD_LINES = 16
#: Seconds between two rounds of the bus's notices to the clients subscribed to them
#: (`notices`), at least: a broker that keeps dropping for the gateway says so in every
#: report, and each round is a frame per such client.
NOTICE_EVERY = 1.0
#: Bus notices held for the next round, at most: an outage's away, back and the counts
#: of publishes it may have taken (outages come and go faster than a round only in a
#: broker that restarts in a loop; the oldest go first).
NOTICES_HELD = 12
#: Outage notices a client's buffer may hold beyond the bound of forced frames (its
#: keep-alives' echoes fill that): a client still further behind cannot be told of an
#: outage, and is disconnected instead, which is the protocol's own word.
OUTAGE_ROOM = 2 * NOTICES_HELD

#: Defaults of the bounds (docs/gateway.md, docs/security.md).
MAX_CLIENTS = 10000
MAX_CLIENTS_PER_ADDRESS = 256
SUBSCRIPTION_BYTES = 256 * 1024
SUBSCRIPTION_POOL = 64 * 1024 * 1024
BUFFER_POOL = 256 * 1024 * 1024
ROUTE_CACHE = 4 * 1024 * 1024
REFUSAL_DELAY = 5.0
#: TLS handshakes (`Gateway.handshake`): one not done this long after it began is dropped
#: (`--tls-handshake-timeout`); at most HANDSHAKES_PER_ADDRESS of one address are in
#: progress at once, the others wait unread (up to the idle timeout) for their turn.  A
#: client may send at most HANDSHAKE_BYTES before its handshake is done (`_Bounded`):
#: OpenSSL holds a stalled ClientHello of up to 128 KiB (~300 KB of RSS each, measured),
#: which no other bound counted (256 of one address took 77 MB, 5,000 of 20 addresses
#: 1.5 GB).  With that bound a handshake holds about twice an idle connection, so there
#: is no cap on handshakes in all (a cap of 512 let many addresses that each stalled one
#: keep a new client waiting for any place: 19-26 s, the audit of 2026-11-27).
TLS_HANDSHAKE_TIMEOUT = 5.0
#: What serves one admitted connection (`Gateway.accept`): stream, host, peer.
Handler = Callable[[trio.abc.Stream, str, str], Awaitable[None]]
#: Connections taken from a listener per turn of the loop (`Gateway._accept_from`).
ACCEPT_RUN = 64
#: After an accept failed for want of descriptors or memory: seconds before the next.
ACCEPT_PAUSE = 0.1
ACCEPT_LATER = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: The connection went before it was taken (or the network under it): the next one.
ACCEPT_SKIP = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN,
                         errno.ENETUNREACH, errno.EHOSTDOWN, errno.EHOSTUNREACH})
HANDSHAKES_PER_ADDRESS = 8
#: Log lines about peers in all (`LogAllowance` *overall*): a burst, then one per interval.
LOG_OVERALL = (200, 0.2)
#: Bytes a client may send before its TLS handshake is done, and the most one of its
#: handshake messages may claim: a ClientHello is a few hundred bytes to a few KiB
#: (post-quantum key shares ~1.2 KiB), the rest less.
HANDSHAKE_BYTES, HANDSHAKE_MESSAGE = 32 * 1024, 16 * 1024
#: Connections over the caps one address may have held in the tarpit, per slot of its
#: cap (a host redialing 1,000 clients against a cap of 256 has them all held).
TARPIT_PER_CAP = 4
#: Shares of one peer address (all its connections together): of the broker's budget
#: for the gateway (`--bus-subscription-bytes`) and of the gateway's subscription pool
#: (`--subscription-pool`) one address may take 1/16, all unauthenticated clients
#: together 1/2 of each, so 8 addresses are needed to fill the unauthenticated half and
#: a client with the key always finds room.  (The pool is charged per client: 256
#: clients of one address holding the same 256 KiB of patterns filled all 64 MiB.)
ADDRESS_SHARE, UNAUTHENTICATED_SHARE = 16, 2
BUFFER_BYTES_PER_ADDRESS = 32 * 1024 * 1024

class Disconnect(Exception):
    """Something abnormal: the connection is closed after the refusal delay."""


class BusAway(Disconnect):
    """Publishes of this client were dropped: the bus stayed away longer than the gateway
    waits for it.  The protocol has no error frame: closing (after the refusal delay, so
    a client that redials at once does not storm) is how the client is told."""


class Remote:
    """One remote client: its stream, subscriptions, outgoing buffer and idle deadline."""

    __slots__ = ("stream", "host", "peer", "account", "outbox", "lot", "scope",
                 "authenticated", "topics", "sub_bytes", "idle", "reason",
                 "refused", "doomed", "fd", "parked", "told", "unsaid", "__weakref__")

    def __init__(self, stream: trio.abc.Stream, host: str, peer: str, account: Peer,
                 outbox: Outbox, idle: float) -> None:
        self.stream = stream
        self.host = host
        self.peer = peer
        self.account = account  # what its address holds, all its connections together
        self.outbox = outbox
        self.lot = ParkingLot()  # the writer waits here for frames
        self.scope: trio.CancelScope | None = None
        self.authenticated = False
        self.topics: dict[bytes, int] = {}  # its patterns and what each was charged
        self.sub_bytes = 0  # what its subscriptions are charged (routing.pattern_cost)
        self.idle = idle
        self.reason = ""
        self.refused = 0  # frames refused on this connection
        self.doomed = False  # to be closed after the refusal delay (`Gateway._doom`)
        self.fd = _plain_fd(stream)  # None: TLS (or closed)
        #: Its writer waits at `lot` with nothing in hand: `Gateway._flush` may write for it.
        self.parked = False
        #: Subscribed to `notices.TOPIC`: the discards it was told of, by cause (None: not).
        self.told: list[int] | None = None
        #: Messages the broker dropped for the gateway that it is to be told of when its
        #: buffer has drained (`Gateway._tell_missed`).
        self.unsaid = 0

    def touch(self) -> None:
        """Any read or write resets the idle timeout: the connection is closed between
        `idle` and `idle` + 1/64 of it after the last one (moving a deadline costs ~2 µs,
        so a busy connection moves it only that often)."""
        scope = self.scope
        if scope is not None:
            due = trio.current_time() + self.idle
            if scope.deadline < due:
                scope.deadline = due + self.idle * IDLE_SLACK

    def __repr__(self) -> str:
        return f"remote {self.peer}"


def _causes(counts: list[int], gw: Gateway | None = None) -> str:
    """*counts* of discards by `outbox.CAUSES`, said (with the bounds, given *gw*)."""
    bounds = ("", "", "")
    if gw is not None:
        bounds = (f" (--buffer-messages {gw.buffer_messages}, --buffer-bytes "
                  f"{gw.buffer_bytes})", f" ({gw.caps.queue_limit} bytes)",
                  f" ({gw.buffers.limit} bytes)")
    said = zip(counts, CAUSES, bounds, strict=True)
    return ", ".join(f"{n} {cause}{bound}" for n, cause, bound in said if n)


def _socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType:
    """The TCP socket under *stream* (a `trio.SocketStream`, or TLS over one)."""
    return getattr(stream, "transport_stream", stream).socket


class HandshakeTooLarge(Exception):
    """A client sent more than `HANDSHAKE_BYTES` before its TLS handshake was done, or a
    handshake message claiming more than `HANDSHAKE_MESSAGE`."""


#: The random of a ServerHello that is a TLS 1.3 HelloRetryRequest (RFC 8446, 4.1.3).
HELLO_RETRY = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")


class _Frames:
    """One layer of TLS framing, read as bytes come: a header of *size* bytes whose
    bytes [*at*, *size*) are the big-endian length of the body after it."""

    __slots__ = ("size", "at", "head", "left")

    def __init__(self, size: int, at: int) -> None:
        self.size, self.at = size, at
        self.head = bytearray()  # a header not yet whole
        self.left = 0  # bytes of the current body still to come

    def pieces(self, data: bytes) -> Iterator[tuple[bytes | None, bytes]]:
        """(a whole header, b"") as each completes, (None, a piece of body) as it comes."""
        at, end = 0, len(data)
        while at < end:
            if self.left:
                body = data[at:at + self.left]
                at += len(body)
                self.left -= len(body)
                yield None, body
                continue
            got = data[at:at + self.size - len(self.head)]
            self.head += got
            at += len(got)
            if len(self.head) == self.size:
                head = bytes(self.head)
                self.head.clear()
                self.left = int.from_bytes(head[self.at:], "big")
                yield head, b""


class HandshakeGuard:
    """The TLS records a client sends before its handshake is done, read as OpenSSL will
    read them: a handshake message claiming more than *limit* bytes is refused before
    OpenSSL sees its header, since OpenSSL makes room for what the header claims when
    it comes (a ClientHello may claim 128 KiB: ~300 KB of RSS per stalled handshake,
    measured).  Only a ClientHello may claim that much (OpenSSL bounds each later message
    by what it expects: a TLS 1.2 key exchange 2 KiB, a Finished 64 bytes), and the
    client's records are looked into only until the server sends its ServerHello
    (`sent`): after it a TLS 1.2 client's Finished is an encrypted handshake record,
    which read as a header would claim anything.  A HelloRetryRequest is no ServerHello
    here: the client answers it with a second ClientHello, in plaintext.  Pure: bytes
    in, `HandshakeTooLarge` out."""

    __slots__ = ("limit", "_records", "_messages", "_type", "_stopped")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._records = _Frames(5, 3)  # content type, version, length
        self._messages = _Frames(4, 1)  # handshake type, length
        self._type = 0  # the current record's content type
        self._stopped = False  # the server has sent its ServerHello

    def sent(self, data: bytes | bytearray | memoryview) -> None:
        """What the server sends: a record of a ServerHello that is not a
        HelloRetryRequest ends the looking (OpenSSL sends whole records, the first
        of a flight first)."""
        head = bytes(data[:11 + len(HELLO_RETRY)])
        if len(head) == 11 + len(HELLO_RETRY) and head[0] == 22 and head[5] == 2 and \
                head[11:] != HELLO_RETRY:
            self._stopped = True

    def feed(self, data: bytes) -> None:
        if self._stopped:
            return
        for head, body in self._records.pieces(data):
            if head is not None:
                self._type = head[0]
            elif self._type == 22:  # handshake
                for message, _ in self._messages.pieces(body):
                    if message is None:
                        continue
                    claimed = int.from_bytes(message[1:], "big")
                    if claimed > self.limit:
                        raise HandshakeTooLarge(f"a handshake message claiming {claimed} "
                                                f"bytes, over {self.limit}")


class _Bounded(trio.abc.HalfCloseableStream):
    """The TCP stream under a TLS one: until `done` (the handshake made), OpenSSL is
    given at most `HANDSHAKE_BYTES` of the client's, and no handshake message claiming
    more than `HANDSHAKE_MESSAGE` (`HandshakeGuard`), so a stalled handshake holds
    about what any connection does."""

    __slots__ = ("inner", "left", "guard")

    def __init__(self, inner: trio.SocketStream) -> None:
        self.inner = inner
        self.left: int | None = HANDSHAKE_BYTES
        self.guard = HandshakeGuard(HANDSHAKE_MESSAGE)

    @property
    def socket(self) -> trio.socket.SocketType:
        return self.inner.socket

    def done(self) -> None:
        self.left = None

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.left is None:
            return await self.inner.receive_some(max_bytes)
        if self.left <= 0:
            raise trio.BrokenResourceError("handshake too large") from HandshakeTooLarge(
                f"over {HANDSHAKE_BYTES // 1024} KiB sent before the handshake was done")
        data = await self.inner.receive_some(min(max_bytes or self.left, self.left))
        self.left -= len(data)
        try:
            self.guard.feed(data)
        except HandshakeTooLarge as exc:
            self.left = 0
            raise trio.BrokenResourceError("handshake too large") from exc
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.left is not None:
            self.guard.sent(data)
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _shrink(stream: trio.abc.Stream) -> None:
    """Make a held connection's kernel receive buffer small: it is never read."""
    try:
        _socket_of(stream).setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    except OSError:
        pass


def _plain_fd(stream: trio.abc.Stream) -> int | None:
    """The descriptor of a plain TCP connection, which the reader and the writer use
    directly (a trio stream call takes a turn of the loop every time); None for TLS."""
    if type(stream) is trio.SocketStream:
        return stream.socket.fileno()
    return None


def _wake_at(stream: trio.SocketStream, size: int) -> bool:
    """Have the kernel report the connection readable only once *size* bytes wait
    (``SO_RCVLOWAT``; a read still takes what is there); False where it cannot."""
    try:
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, size)
    except OSError:
        return False
    return True


class _Split:
    """Which of a fan-out's clients are at their message bound (`Gateway._deliver`),
    judged once and valid while `Outbox.crossings` stays as it was; how many messages
    those clients missed since (counted into theirs by `Gateway._settle`)."""

    __slots__ = ("targets", "full", "room", "crossings", "missed")

    def __init__(self, targets: tuple[Remote, ...]) -> None:
        self.targets = targets
        self.crossings = Outbox.crossings
        self.full = [rc for rc in targets if len(rc.outbox.frames) >= rc.outbox.max_messages]
        self.room = [rc for rc in targets if len(rc.outbox.frames) < rc.outbox.max_messages] \
            if self.full else targets
        self.missed = 0


class Gateway:
    def __init__(
        self,
        secret: bytes,
        *,
        address: str | None = None,
        idle_timeout: float = 70.0,
        buffer_messages: int = 100,
        buffer_bytes: int = 1 << 20,
        buffer_pool: int = BUFFER_POOL,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_clients: int = MAX_CLIENTS,
        max_clients_per_address: int = MAX_CLIENTS_PER_ADDRESS,
        subscription_bytes: int = SUBSCRIPTION_BYTES,
        subscription_pool: int = SUBSCRIPTION_POOL,
        route_cache: int = ROUTE_CACHE,
        refusal_delay: float = REFUSAL_DELAY,
        subscription_bytes_per_address: int | None = None,
        buffer_bytes_per_address: int = BUFFER_BYTES_PER_ADDRESS,
        bus_subscription_bytes: int = BUS_SUBSCRIPTION_BYTES,
        linger: float = LINGER,
        bus_wait: float = BUS_WAIT,
        tls_handshake_timeout: float = TLS_HANDSHAKE_TIMEOUT,
    ) -> None:
        if not secret:
            raise ValueError("the authentication secret is empty")
        self.secret = secret
        self.idle_timeout = idle_timeout
        self.linger = linger  # `sbus.linger.Linger` of each plain-TCP reader (0: none)
        self.buffer_messages = buffer_messages
        self.buffer_bytes = buffer_bytes
        self.max_frame = max_frame
        self.subscription_bytes = subscription_bytes
        self.refusal_delay = refusal_delay
        self.tls_handshake_timeout = tls_handshake_timeout
        self.subscription_bytes_per_address = (
            bus_subscription_bytes // ADDRESS_SHARE if subscription_bytes_per_address is None
            else subscription_bytes_per_address)
        self.caps = Caps(max_clients, max_clients_per_address, buffer_bytes_per_address)
        self.tarpit = Tarpit(max_clients, TARPIT_PER_CAP * max_clients_per_address)
        self.buffers = Pool(buffer_pool)
        self.half_frames = Pool(HALF_FRAMES_POOL)
        self.subscriptions = Pool(subscription_pool)  # the gateway's own memory
        self.pool_per_address = subscription_pool // ADDRESS_SHARE
        self.unauthenticated_pool = Pool(subscription_pool // UNAUTHENTICATED_SHARE)
        #: Unauthenticated clients together may take at most half of the broker's budget
        #: for the gateway: a subscriber with the key always finds room.
        self.unauthenticated = Pool(bus_subscription_bytes // UNAUTHENTICATED_SHARE)
        self._unauth_patterns: Counter[bytes] = Counter()  # held by unauthenticated clients
        self.bridge = Bridge(address, self._deliver, self._refused_by_broker, self._flush,
                             cache_bytes=route_cache, on_separator=self._separator_changed,
                             budget=bus_subscription_bytes, bus_wait=bus_wait,
                             on_bus=self._bus_notice, on_taken=self._taken_notice)
        self._nursery: trio.Nursery | None = None
        self.clients: set[Remote] = set()
        self.noticed: set[Remote] = set()  # subscribed to `notices.TOPIC`
        #: for them, at the next round: frames for all, and (in their place among them)
        #: how many of each one's publishes a lost bus connection may have taken
        self._bus_notices: list[bytes | dict[Remote, int]] = []
        self._bus_dropped = 0  # reported by the broker since the last round
        self._notice_due = trio.Event()
        self._dirty: list[Remote] = []  # queued for by `_deliver`, to `_flush`
        self._split: _Split | None = None  # the last fan-out's judgement (`_deliver`)
        self._heads: dict[bytes, bytes] = {}  # checked keys -> packet heads (`_head`)
        self._heads_bytes = 0
        #: Log lines about remote peers, rationed per address (reconnecting buys none).
        # per address, and all together (addresses cost an attacker little)
        self.allowance = LogAllowance(burst=10, interval=10.0, overall=LOG_OVERALL)
        self._cap_unlogged = 0
        self._cap_logged_at = -CAP_LOG_INTERVAL
        # counters
        self.accepted = 0
        self.delivered = 0  # frames queued for remote clients
        self.dropped = 0  # frames discarded: a buffer, an address's share or the pool full
        self.refused = 0  # frames refused (connection kept)
        self.closed = 0  # connections closed for a wrong key or malformed input
        self.handshakes_expired = 0  # TLS handshakes not done in time
        self.crashes = 0  # clients dropped because their handling raised (a bug)
        self._crash_places: set[tuple[str, str, int]] = set()

    @property
    def rules(self) -> KeyRules:
        """The broker's key rules (its separator), learned when the bridge connected."""
        return self.bridge.rules

    # -- log lines about peers ---------------------------------------------------------

    def say(self, host: str, level: int, msg: str, *args: object) -> None:
        """Log a line about a peer, rationed per peer address."""
        held = self.allowance.take(host)  # type: ignore[arg-type]
        if held is None:
            return
        if held:
            msg += f" ({held} earlier lines about {host} not logged)"
        others = self.allowance.said_overall()
        if others:
            msg += f" ({others} lines about any address not logged before this one)"
        log.log(level, msg, *args)

    # -- admission ------------------------------------------------------------------------

    def admit(self, stream: trio.abc.Stream) -> tuple[str, str] | str:
        """(host, peer) if *stream* may be served (its slot taken), else its host."""
        host, peer = peer_of(stream)
        why = self.caps.admit(host)
        if why is None:
            return host, peer
        self._cap_unlogged += 1
        now = time.monotonic()
        if now - self._cap_logged_at >= CAP_LOG_INTERVAL:
            log.warning("refused %d connection(s) since the last such line, %s "
                        "(latest from %s)", self._cap_unlogged, why, host)
            self._cap_unlogged = 0
            self._cap_logged_at = now
        return host

    def turn_away(self, stream: trio.abc.Stream, host: str,
                  nursery: trio.Nursery) -> None:
        """A connection over the caps: held open and unread for the refusal delay (in the
        bounded `Tarpit`: judged here, in the order connections came), then closed, so a
        client that redials at once costs one accept per delay; nothing of it is read,
        no TLS handshake is made.  Past the tarpit's bounds: closed at once."""
        if self.tarpit.take(host):
            _shrink(stream)
            nursery.start_soon(self._hold, stream, host)
        else:
            _socket_of(stream).close()

    async def _hold(self, stream: trio.abc.Stream, host: str) -> None:
        try:
            await trio.sleep(self.refusal_delay)
        finally:
            self.tarpit.give(host)
            await trio.aclose_forcefully(stream)

    async def handshake(self, stream: trio.abc.Stream, host: str, peer: str) -> bool:
        """Make the TLS handshake of an admitted connection before anything else (else
        it happens inside the first read, bounded by the idle timeout only): whether it
        was made.  It waits, unread, for one of its address's places
        (`HANDSHAKES_PER_ADDRESS`) up to the idle timeout, then has
        `tls_handshake_timeout`; a handshake not made in time is closed at once, one
        that fails (plaintext on the TLS port, over `HANDSHAKE_BYTES`) after the refusal
        delay, keeping its place meanwhile."""
        if not isinstance(stream, trio.SSLStream):
            return True
        # a place is for a client that has begun: one that sent nothing held a place
        # for up to the idle timeout, and 1,000 /64s of such made every new TLS client
        # wait 69 s (the audit)
        with trio.move_on_after(self.tls_handshake_timeout) as silent:
            await trio.lowlevel.wait_readable(_socket_of(stream))
        if silent.cancelled_caught:
            self.handshakes_expired += 1
            self.say(host, logging.INFO, "%s: nothing sent in %g s to begin TLS; closed",
                     peer, self.tls_handshake_timeout)
            await trio.aclose_forcefully(stream)
            return False
        account = self.caps.peer(host)
        mine = account.handshakes
        if mine is None:
            mine = account.handshakes = trio.Semaphore(HANDSHAKES_PER_ADDRESS)
        failed: BaseException | None = None
        began = False
        with trio.move_on_after(self.idle_timeout) as waited:
            async with mine:
                began = True
                with trio.move_on_after(self.tls_handshake_timeout):
                    try:
                        await stream.do_handshake()
                        stream.transport_stream.done()  # type: ignore[attr-defined]
                        return True
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        failed = exc
                why = getattr(failed, "__cause__", None)
                if isinstance(why, ssl.SSLError | HandshakeTooLarge):
                    self.closed += 1
                    self.say(host, logging.WARNING, "disconnecting %s in %g s: TLS failed: %s",
                             peer, self.refusal_delay, why)
                    await trio.sleep(self.refusal_delay)
                elif failed is None:
                    self.handshakes_expired += 1
                    self.say(host, logging.INFO, "%s: TLS handshake not done in %g s; closed",
                             peer, self.tls_handshake_timeout)
        if waited.cancelled_caught and not began:
            self.handshakes_expired += 1
            self.say(host, logging.INFO, "%s: no turn for its TLS handshake in %g s (its "
                     "address's other handshakes); closed", peer, self.idle_timeout)
        await trio.aclose_forcefully(stream)
        return False

    # -- fan-out from the bus ---------------------------------------------------------

    def _deliver(self, targets: tuple[Remote, ...], messages: list[tuple[bytes, bytes]],
                 until: float = math.inf) -> int:
        """Offer *messages* (key, payload: a run of messages that match the same clients),
        in order, to every one of *targets* (`_offer`); how many were offered: at least
        one, and no more once the clock (`time.perf_counter`) passed *until*.

        Clients at their message bound (`Outbox.max_messages`: those that do not read)
        are judged full once, and the judgement kept (`_Split`) for the runs to the
        same clients that follow while no outbox crosses its bound (`Outbox.crossings`):
        each message is counted as discarded for them (settled in `_settle`), and they
        are not visited per message nor per run.  So a thousand clients that never read
        no longer slow every message down for everyone (before: a Python step per such
        client and message: the gateway fell 8 s behind the bus in the audit)."""
        if len(messages) == 1 and (self._split is None or self._split.targets is not targets):
            self._offer(targets, *messages[0])
            return 1
        split = self._split
        if split is None or split.targets is not targets \
                or split.crossings != Outbox.crossings:
            self._settle()
            split = self._split = _Split(targets)
        clock = time.perf_counter
        room = split.room
        done = 0
        for key, payload in messages:
            if room:
                self._offer(room, key, payload)
            done += 1
            if clock() > until:
                break
        split.missed += done
        self.dropped += done * len(split.full)
        return done

    def _settle(self) -> None:
        """Count what the clients judged full missed (`_deliver`) where it is read: before
        the judgement is made anew, a discard line and a client's last line."""
        split = self._split
        if split is not None and split.missed:
            for rc in split.full:
                rc.outbox.dropped_by[OWN] += split.missed
                rc.outbox.peer.dropped[OWN] += split.missed
            split.missed = 0

    def _offer(self, targets: tuple[Remote, ...] | list[Remote], key: bytes,
               payload: bytes) -> None:
        """Offer one frame to every matching client.  The pool is charged the frame's
        bytes once (what is really held), however many clients queue it.  While it is
        full, the frame is discarded for clients holding more than a fair part of it
        themselves (the pool over the clients connected); for another, room is made (once
        per frame) by discarding the oldest frames of the address holding the most
        (`outbox.make_room`).  Only queued here: a plain-TCP client whose writer waits
        is written to by `_flush`, after the batch, with no task switch."""
        frame = Shared(codec.publish(key, payload))
        size = len(frame.data)
        pool = self.buffers
        tight = pool.used + size > pool.limit
        fair = pool.limit // max(1, self.caps.peers())
        mine = pool.limit // max(1, len(self.clients))  # a client's fair part of it
        tried = False  # to make room for this frame, and failed
        dirty = self._dirty
        dropped = 0
        for rc in targets:
            out = rc.outbox
            if len(out.frames) >= out.max_messages:  # full (`Outbox.offer`, inline: a
                out.dropped_by[OWN] += 1  # client that never reads comes here for
                rc.account.dropped[OWN] += 1  # every message)
                dropped += 1
                continue
            if tight and not frame.refs:  # not charged yet: room is needed for it
                # room is made once per frame at most (a failed try is not made again
                # for each target), and for a client holding less than its fair part
                # itself (its address's copies of shared frames are no measure of that)
                ok = out.size < mine and out.fits(size) and not tried
                if ok and not make_room(pool, size, self.caps.accounts, fair):
                    tried, ok = True, False
                if not ok:
                    out.discard(POOL)
                    dropped += 1
                    continue
                out.offer(frame)
                frame.hold(pool)
                queued = 1 if len(out) == 1 else 2
            else:
                queued = out.offer(frame)
            if queued == 1:  # only the writer of an empty outbox waits
                if rc.parked and rc.fd is not None:
                    dirty.append(rc)
                else:
                    rc.lot.unpark()
            elif not queued:
                dropped += 1
        if frame.refs and frame.pool is None:
            frame.hold(pool)
        self.delivered += len(targets) - dropped
        self.dropped += dropped

    async def _flush(self) -> None:
        """Write what `_deliver` queued for plain-TCP clients whose writers wait, one
        write each (what the batch brought them, together), in the forwarding task: no
        wake-up and task switch per message and client.  What the socket does not take,
        or one write does not hold, is left to the writer, woken for it.  The others get
        a turn every `TURN` (a fan-out to thousands of clients is thousands of writes)."""
        dirty, self._dirty = self._dirty, []
        clock = time.perf_counter
        start = clock()
        for i, rc in enumerate(dirty):
            fd = rc.fd
            out = rc.outbox
            if not rc.parked or fd is None or not out:  # its writer took over meanwhile
                continue
            data = out.peek()
            try:
                sent = os.write(fd, data)
            except OSError:  # full (the writer waits for room), or broken (it says so)
                sent = 0
            if sent:
                out.done(sent)
                rc.touch()
            if not out and rc.told is not None:
                self._tell_missed(rc)  # (queued: the writer, woken below, writes it)
            if out:  # what the socket did not take, or more than one `peek`: the writer's
                rc.lot.unpark()  # (else nobody writes it: later messages find the queue
                # not empty and wake nobody)
            if not i % 64 and clock() - start > TURN:
                await trio.lowlevel.checkpoint()
                start = clock()

    def _refused_by_broker(self, pattern: bytes, reason: str) -> None:
        """The broker refused the SUB of *pattern*: every client holding it loses it (its
        state matches the bus's) and, the protocol having no error frame, is disconnected
        after the refusal delay (its library subscribes again when it reconnects)."""
        for rc in [rc for rc in self.clients if pattern in rc.topics]:
            self._drop_topic(rc, pattern)
            self.bridge.forget(rc, pattern)
            rc.refused += 1
            self.refused += 1
            self.say(rc.host, logging.WARNING, "the broker refused %r's subscription to %s "
                     "(%s); disconnecting it in %g s", rc, brief(pattern), brief(
                         reason.encode(), 200), self.refusal_delay)
            self._doom(rc, "the broker refused a subscription")

    def _doom(self, rc: Remote, reason: str) -> None:
        """Close *rc* after the refusal delay (once), serving it meanwhile: the protocol
        has no error frame, and a client that redials at once must wait that long."""
        if rc.doomed:
            return
        rc.doomed = True
        if self._nursery is None:
            self._close(rc, reason)
        else:
            self._nursery.start_soon(self._close_later, rc, reason)

    async def _close_later(self, rc: Remote, reason: str) -> None:
        await trio.sleep(self.refusal_delay)
        self._close(rc, reason)

    def _drop_topic(self, rc: Remote, topic: bytes) -> None:
        """Give back what *rc*'s subscription to *topic* was charged (not the bus's part:
        `Bridge` charges that per distinct pattern)."""
        cost = rc.topics.pop(topic)  # as charged (the separator may have changed since)
        rc.sub_bytes -= cost
        self._release_shares(rc, topic, cost)

    def _release_shares(self, rc: Remote, topic: bytes, cost: int) -> None:
        """*rc* no longer holds *topic*: the pool and its address's and (unauthenticated)
        the unauthenticated clients' parts of it give back what *rc* was charged; its
        address's share of the bus budget (charged once per distinct pattern its clients
        hold) and the unauthenticated clients' one (the same, over all of them) give it
        back with the last holder."""
        account = rc.account
        self.subscriptions.give(cost)
        account.pool_bytes -= cost
        if not rc.authenticated:
            self.unauthenticated_pool.give(cost)
        account.patterns[topic] -= 1
        if not account.patterns[topic]:
            del account.patterns[topic]
            account.sub_bytes -= cost
        if not rc.authenticated:
            held = self._unauth_patterns
            held[topic] -= 1
            if not held[topic]:
                del held[topic]
                self.unauthenticated.give(cost)

    def _separator_changed(self, sep: bytes) -> None:
        self._heads.clear()  # checked by the rules of the old separator
        self._heads_bytes = 0
        for rc in list(self.clients):
            for topic in list(rc.topics):  # the bridge's new index holds none of them
                self._drop_topic(rc, topic)
            self._close(rc, "the broker's separator changed; reconnect")

    # -- one remote client --------------------------------------------------------------

    @staticmethod
    def turn_of(account: Peer) -> trio.Lock:
        """The turn the connections of *account*'s address take one at a time (made at
        its first read: `Peer.turn`)."""
        if account.turn is None:
            account.turn = trio.Lock()
        return account.turn  # type: ignore[return-value]

    async def handle(self, stream: trio.abc.Stream, host: str, peer: str) -> None:
        """Serve one remote client (admitted: its slot taken) until it leaves, misbehaves
        or idles out."""
        try:
            if await self.handshake(stream, host, peer):
                await self._serve(stream, host, peer)
        except Exception as exc:  # the one top-level guard: see `crashed`
            self.crashed(peer, exc)
        finally:
            self.caps.release(host)

    def crashed(self, peer: str, exc: Exception) -> None:
        """What escaped one client's handling (a bug: every error the gateway can name is
        handled where it arises): that client is dropped (its handler has cleaned up
        and closed it) and the others are served.  Logged with its traceback once per
        place it was raised, counted in `STATUS=` always."""
        self.crashes += 1
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = (type(exc).__name__, tb.tb_frame.f_code.co_filename if tb else "",
                 tb.tb_lineno if tb else 0)
        if where in self._crash_places or len(self._crash_places) >= 100:
            log.debug("%s: handling raised %s again", peer, where[0])
            return
        self._crash_places.add(where)
        log.error("the handling of %s raised; that client is dropped, the others are "
                  "served (logged once per place)", peer, exc_info=exc)

    async def _serve(self, stream: trio.abc.Stream, host: str, peer: str) -> None:
        account = self.caps.peer(host)
        rc = Remote(stream, host, peer, account,
                    Outbox(self.buffer_messages, self.buffer_bytes, account),
                    self.idle_timeout)
        if rc.fd is not None:  # (only a plain-TCP client's frames are written in parts)
            rc.outbox.cut = lambda: self._cut(rc)
        self.accepted += 1
        self.clients.add(rc)
        account.boxes.append(rc.outbox)
        log.debug("%r connected", rc)
        try:
            with trio.CancelScope(deadline=trio.current_time() + self.idle_timeout) as scope:
                rc.scope = scope
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, rc)
                    await self._reader(rc)
                    nursery.cancel_scope.cancel()
            if scope.cancelled_caught and not rc.reason:
                rc.reason = f"idle for {self.idle_timeout:g} s"
                log.debug("disconnecting %r: %s", rc, rc.reason)  # routine: not rationed
        finally:
            self.clients.discard(rc)
            self.noticed.discard(rc)
            rc.fd = None  # (`_flush` writes to no closed or reused descriptor)
            rc.sub_bytes = 0
            for topic, cost in rc.topics.items():
                self._release_shares(rc, topic, cost)
            with trio.CancelScope(shield=True):
                await self.bridge.remove_client(rc)
                # only now: it is matched until the bridge forgets its last pattern, and
                # what was queued for it after a clear would hold the pool for ever
                rc.outbox.clear()
                account.boxes.remove(rc.outbox)
                with trio.move_on_after(CLOSE_GRACE):
                    try:
                        await stream.aclose()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
            self._settle()
            if rc.outbox.dropped or rc.refused:
                self.say(host, logging.INFO, "%r: %d messages were discarded for it (%s), "
                         "%d of its frames refused", rc, rc.outbox.dropped,
                         _causes(rc.outbox.dropped_by), rc.refused)
            log.debug("%r disconnected: %s", rc, rc.reason or "closed by peer")

    def _cut(self, rc: Remote) -> None:
        """*rc*'s socket took nothing for `outbox.STALLED` seconds, and the unwritten end
        of a frame it holds is needed in the full buffer pool: its queue is freed now and
        its connection ends (the stream cannot go on mid-frame), said."""
        out = rc.outbox
        out.clear()
        out.max_messages = 0  # nothing more is queued for it (`_offer`, `force`)
        rc.fd = None  # nor written by `_flush`
        reason = (f"it read nothing for {STALLED:g} s and held the unwritten end of a "
                  f"message in the full buffer pool ({self.buffers.limit} bytes)")
        self.say(rc.host, logging.WARNING, "disconnecting %r: %s", rc, reason)
        self._close(rc, reason)

    def _close(self, rc: Remote, reason: str) -> None:
        """End *rc*'s session now (from its reader or writer) and say why."""
        if not rc.reason:
            rc.reason = reason
            log.debug("%r: %s", rc, reason)  # routine (peer gone, broker changed)
        if rc.scope is not None:
            rc.scope.cancel()

    async def _refuse_and_close(self, rc: Remote, reason: str, junk: bool = True) -> None:
        """A wrong key or a broken stream (*junk*: counted as such), or publishes dropped:
        log (rationed), read nothing for the refusal delay, then close; a client that
        reconnects at once waits that long first."""
        self.closed += junk
        rc.reason = reason
        self.say(rc.host, logging.WARNING, "disconnecting %r in %g s: %s", rc,
                 self.refusal_delay, reason)
        await trio.sleep(self.refusal_delay)
        if rc.scope is not None:
            rc.scope.cancel()

    async def _reader(self, rc: Remote) -> None:
        decoder: FrameDecoder | None = FrameDecoder(self.max_frame, read_size=READ_SIZE)
        junk = True
        try:
            await self._read(rc, decoder)
            return
        except BusAway as exc:
            reason, junk = str(exc), False
        except FrameError as exc:
            reason = f"malformed input: {exc}"
        except Disconnect as exc:
            reason = str(exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if not isinstance(exc.__cause__, ssl.SSLError):
                self._close(rc, f"read failed: {exc.__cause__ or exc}")
                return
            reason = f"TLS failed: {exc.__cause__}"  # e.g. plaintext: a misconfigured client
        decoder = None  # what it buffered is not kept through the delay  # noqa: F841
        await self._refuse_and_close(rc, reason, junk)

    async def _read(self, rc: Remote, decoder: FrameDecoder) -> None:
        receive = rc.stream.receive_some
        clock = time.perf_counter
        publish_packets = self.bridge.publish_packets
        owner = rc.account.owner
        heads = self._heads
        Publish = codec.Publish  # noqa: N806
        fd = _plain_fd(rc.stream)
        turn = self.turn_of(rc.account)
        turning = False  # this connection holds its address's turn
        start = clock()  # since the last turn the others had
        # publishes go to the bus as runs (one system call each), in stream order: any
        # other frame, a turn for the others, a wait for input or RUN_BYTES send the run
        # first; so on plain TCP a run gathers what several reads found waiting
        run: list[bytes] = []
        held = 0  # bytes in run
        pace = Linger(self.linger)
        frames = 0  # frames since the reader last waited
        lowat = False  # the socket wakes the reader at WAKE_BYTES, not at one byte

        bridge = self.bridge
        half = 0  # what its incomplete frame is charged (`_charge_half_frame`)

        waited = False  # the turn was let go while a run waited (`send_run`)

        def waiting() -> None:
            """A run waits for the bus (its lock, room in it, or the bus itself): this
            address's other connections are served meanwhile (the audit of 2026-11-28:
            one publisher held them for a whole outage of a stopped broker)."""
            nonlocal turning, waited
            if turning:
                turn.release()
                turning = False
                waited = True

        async def send_run() -> None:
            nonlocal run, held, turning, waited
            packets, run, held = run, [], 0  # taken first: a cancelled send is not redone
            sent = await publish_packets(packets, owner, rc, waiting)
            if sent < len(packets) and not bridge.up:
                raise BusAway(f"{len(packets) - sent} publishes dropped: the bus has been "
                              f"away for more than {bridge.bus_wait:g} s")
            if waited:
                waited = False
                await turn.acquire()
                turning = True

        async def next_turn() -> None:
            """The other addresses, and then this one's other busy connections, first."""
            nonlocal turning
            turn.release()
            turning = False
            await turn.acquire()  # (a checkpoint even when nobody else waits)
            turning = True

        try:
            while True:
                # before authenticating, small reads: what one read allocates is bounded
                size = READ_SIZE if rc.authenticated else UNAUTHENTICATED_HOLD
                if fd is None:
                    if turning:
                        turn.release()
                        turning = False
                    data = await receive(size)
                else:  # plain TCP: what waits is read at once, with no turn of the loop
                    try:
                        data = os.read(fd, size)
                    except BlockingIOError:
                        if run:
                            await send_run()
                        # coming fast: the next read takes what gathers meanwhile, or a
                        # run's worth if that is in sooner
                        wait = pace.after(clock(), frames)
                        frames = 0
                        if wait and not lowat:
                            lowat = _wake_at(rc.stream, WAKE_BYTES)
                        elif not wait and lowat:  # (if it cannot be undone: timed waits)
                            lowat = not _wake_at(rc.stream, 1)
                        timeout = wait or (pace.delay if lowat else 0)
                        if turning:  # its siblings may work while it waits
                            turn.release()
                            turning = False
                        if timeout:
                            with trio.move_on_after(timeout):
                                await trio.lowlevel.wait_readable(fd)
                        else:
                            await trio.lowlevel.wait_readable(fd)
                        continue
                    except OSError as exc:
                        raise trio.BrokenResourceError(exc) from exc
                if not turning:
                    try:
                        turn.acquire_nowait()  # no turn of the loop when nobody waits
                    except trio.WouldBlock:
                        await turn.acquire()  # after the address's other busy connections
                    turning = True
                    start = clock()
                if not data:
                    if not decoder.idle:
                        self.say(rc.host, logging.INFO, "%r closed in the middle of a frame",
                                 rc)
                    return
                rc.touch()
                # decoded in slices: 64 KiB of tiny frames takes ~10 ms to decode at once
                for offset in range(0, len(data), FEED_SIZE):
                    piece = data if len(data) <= FEED_SIZE else data[offset:offset + FEED_SIZE]
                    # frames decoded before a bad one are not acted upon: the stream is bad
                    # (those of earlier pieces were: the run is sent before the error ends
                    # the connection)
                    for frame in decoder.feed(piece):
                        frames += 1
                        if type(frame) is Publish and rc.authenticated:
                            head = heads.get(frame.topic)
                            if head is None:
                                try:
                                    head = self._head(frame.topic)
                                except FrameRefused as exc:
                                    self._refused(rc, exc)
                            if head is not None:
                                packet = head + frame.body
                                run.append(packet)
                                held += len(packet)
                                if held > RUN_BYTES:
                                    await send_run()
                        else:
                            if run:
                                await send_run()
                            try:
                                await self._frame(rc, frame)
                            except FrameRefused as exc:
                                self._refused(rc, exc)
                        if clock() - start > TURN:
                            if run:
                                await send_run()
                            await next_turn()  # others get a turn
                            start = clock()
                    if fd is None and run:  # the next read takes a turn: not held over it
                        await send_run()
                    if clock() - start > TURN:
                        if run:
                            await send_run()
                        await next_turn()
                        start = clock()
                del data, piece
                held = decoder.held
                if not rc.authenticated and held > UNAUTHENTICATED_HOLD:
                    raise FrameError(f"an incomplete frame holds {held} bytes, over "
                                     f"the {UNAUTHENTICATED_HOLD} allowed before "
                                     "authenticating")
                if held or half:
                    half = self._charge_half_frame(rc, half, held + UNPACKER_BYTES
                                                   if held else 0)
        finally:
            self.half_frames.give(half)
            rc.account.half_frames -= half
            if turning:
                turn.release()
                turning = False
            if run:  # what came before the end of the stream, a bad frame or a broken read
                with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_GRACE):
                    try:
                        await send_run()
                    except BusAway:
                        pass  # (counted, and said when the bus is back; the end stands)

    def _charge_half_frame(self, rc: Remote, was: int, now: int) -> int:
        """Charge *rc*'s incomplete frame *now* bytes instead of *was* (`HALF_FRAMES_POOL`):
        what it is charged then; a frame that grows past its address's share or the pool
        is refused (`FrameError`: closed after the refusal delay)."""
        account, pool = rc.account, self.half_frames
        mine, everyone = account.half_frames + now - was, pool.used + now - was
        if now > was and (mine > pool.limit // ADDRESS_SHARE or everyone > pool.limit):
            raise FrameError(f"incomplete frames would hold {mine} bytes for this address "
                             f"({everyone} in all), over the {pool.limit // ADDRESS_SHARE} "
                             f"allowed per address or the {pool.limit} in all")
        account.half_frames, pool.used = mine, everyone
        return now

    def _head(self, topic: bytes) -> bytes:
        """The start of every bus packet publishing to *topic*, once `check_key` accepted
        it; kept (`HEADS` keys, `HEADS_BYTES` bytes: then all are forgotten), so a
        publisher's next message to it costs a lookup."""
        self.check_key(topic)
        head = self.bridge.bus.session.publish_head(topic)
        if len(self._heads) >= HEADS or self._heads_bytes + len(head) > HEADS_BYTES:
            self._heads.clear()
            self._heads_bytes = 0
        self._heads[topic] = head
        self._heads_bytes += len(head)
        return head

    def _refused(self, rc: Remote, exc: FrameRefused) -> None:
        """A well-formed frame refused: counted, logged (rationed), the connection kept
        unless a shared budget is full (then closed after the delay, see `_doom`)."""
        rc.refused += 1
        self.refused += 1
        full = isinstance(exc, SharesFull) and not rc.doomed
        self.say(rc.host, logging.WARNING, "%r: %s%s", rc, exc,
                 f"; disconnecting it in {self.refusal_delay:g} s (it may "
                 "subscribe again then)" if full else "")
        if full:
            self._doom(rc, "a subscription over a full share")

    async def _frame(self, rc: Remote, frame: codec.Frame) -> None:
        kind = type(frame)
        if kind is codec.Publish:
            if not rc.authenticated:
                raise FrameRefused(f"publish to {brief(frame.topic)} before authenticating "
                              "dropped")
            self.check_key(frame.topic)
            await self.bridge.publish(frame.topic, frame.body, rc.account.owner, rc)
        elif kind is codec.KeepAlive:
            rc.outbox.force(codec.KEEPALIVE)
            rc.lot.unpark()
        elif kind is codec.Subscribe:
            topic = frame.topic
            if topic in rc.topics:
                return
            if topic == notices.TOPIC:
                if rc.told is None:
                    self._settle()  # told from now on: not what it lost before
                    rc.told = list(rc.outbox.dropped_by)
                    rc.unsaid = -self._bus_dropped  # (nor the broker's drops before)
                    self.noticed.add(rc)
                return
            self.check_pattern(topic)
            if len(rc.topics) >= MAX_SUBSCRIPTIONS:
                raise FrameRefused(f"subscription to {brief(topic)} ignored: it holds "
                              f"{MAX_SUBSCRIPTIONS} already")
            cost = pattern_cost(topic, self.rules.sep)
            self._check_shares(rc, topic, cost)
            self.subscriptions.take(cost)
            account = rc.account
            account.pool_bytes += cost
            if not account.patterns[topic]:
                account.sub_bytes += cost
            account.patterns[topic] += 1
            if not rc.authenticated:
                self.unauthenticated_pool.take(cost)
                if not self._unauth_patterns[topic]:
                    self.unauthenticated.take(cost)
                self._unauth_patterns[topic] += 1
            rc.sub_bytes += cost
            rc.topics[topic] = cost
            await self.bridge.subscribe(rc, topic, cost)
        elif kind is codec.Unsubscribe:
            topic = frame.topic
            if topic == notices.TOPIC:
                rc.told, rc.unsaid = None, 0
                self.noticed.discard(rc)
            elif topic in rc.topics:
                self._drop_topic(rc, topic)
                await self.bridge.unsubscribe(rc, topic)
        elif kind is codec.Authenticate:
            if not hmac.compare_digest(frame.secret, self.secret):
                raise Disconnect("wrong authentication secret")
            if not rc.authenticated:
                for topic, cost in rc.topics.items():  # trusted with the whole budget now
                    held = self._unauth_patterns
                    held[topic] -= 1
                    if not held[topic]:
                        del held[topic]
                        self.unauthenticated.give(cost)
                self.unauthenticated_pool.give(rc.sub_bytes)
                rc.authenticated = True
                log.debug("%r authenticated", rc)

    def _check_shares(self, rc: Remote, topic: bytes, cost: int) -> None:
        """Refuse a subscription over any share it draws on: the client's (`FrameRefused`:
        its own doing, the connection stays); its address's and the unauthenticated
        clients' shares of the broker's budget for the gateway, each charged once per
        distinct pattern held (the bus holds each once: many clients behind one address
        subscribing to the same topics cost its share once), their shares of the
        gateway's memory (the pool, charged per client: each holds its own entries),
        that memory and that budget themselves (`SharesFull`: the client is disconnected
        after the delay, and retries).  So the broker never has to refuse what the
        gateway accepted."""
        what = f"subscription to {brief(topic)} ignored"
        if rc.sub_bytes + cost > self.subscription_bytes:
            raise FrameRefused(f"{what}: over its {self.subscription_bytes}-byte subscription "
                          "budget")
        account = rc.account
        if not account.patterns[topic] \
                and account.sub_bytes + cost > self.subscription_bytes_per_address:
            raise SharesFull(f"{what}: its address holds {len(account.patterns)} patterns "
                             f"costing {account.sub_bytes} bytes, its share is "
                             f"{self.subscription_bytes_per_address} bytes")
        if not rc.authenticated and not self._unauth_patterns[topic] \
                and not self.unauthenticated.fits(cost):
            raise SharesFull(f"{what}: unauthenticated clients hold their whole share "
                          f"({self.unauthenticated.limit} bytes) of the broker's budget")
        if account.pool_bytes + cost > self.pool_per_address:
            raise SharesFull(f"{what}: its address's clients hold {account.pool_bytes} "
                             "bytes of the gateway's subscription pool, its share is "
                             f"{self.pool_per_address} bytes")
        if not rc.authenticated and not self.unauthenticated_pool.fits(cost):
            raise SharesFull(f"{what}: unauthenticated clients hold their whole share "
                             f"({self.unauthenticated_pool.limit} bytes) of the gateway's "
                             "subscription pool")
        if not self.subscriptions.fits(cost):
            raise SharesFull(f"{what}: the gateway's {self.subscriptions.limit}-byte "
                          "subscription pool is full")
        if not self.bridge.fits(topic, cost):
            raise SharesFull(f"{what}: the gateway's share of the broker's subscription "
                          f"budget ({self.bridge.budget.limit} bytes, "
                          f"{self.bridge.max_patterns} patterns) is full")

    async def _writer(self, rc: Remote) -> None:
        out = rc.outbox
        send_all = rc.stream.send_all
        fd = rc.fd
        try:
            while True:
                if not out:
                    if rc.told is not None and self._tell_missed(rc):
                        continue
                    rc.parked = True
                    try:
                        await rc.lot.park()  # the others' turn: this loop ends at every park
                    finally:
                        rc.parked = False
                    continue
                if fd is not None:  # plain TCP: what the socket takes now, without a turn
                    data = out.peek()  # (what waits for room stays queued, and charged)
                    try:
                        sent = os.write(fd, data)
                    except BlockingIOError:
                        sent = 0
                    except OSError as exc:
                        raise trio.BrokenResourceError(exc) from exc
                    if sent:
                        out.done(sent)
                        rc.touch()
                    if sent < len(data):
                        await trio.lowlevel.wait_writable(fd)
                else:
                    await send_all(out.take())
                    rc.touch()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._close(rc, f"write failed: {exc.__cause__ or exc}")

    def check_pattern(self, topic: bytes) -> None:
        check_pattern(self.rules, topic)

    def check_key(self, topic: bytes) -> None:
        check_key(self.rules, topic)

    # -- serving --------------------------------------------------------------------------

    def status(self) -> str:
        b = self.bridge
        return (f"{len(self.clients)} clients, {len(b.patterns)} patterns, "
                f"{b.published} published, {self.delivered} delivered, "
                f"{self.dropped} discarded (a buffer or the pool full), "
                f"{b.lost} lost (the bus away too long, or too large), "
                f"{b.missed_outages} outages of the bus missed by subscribers, "
                f"{b.unconfirmed_lost} sent but perhaps lost with the bus's connection, "
                f"{self.refused} frames refused, {self.closed} closed (wrong key, junk), "
                f"{self.handshakes_expired} TLS handshakes not done in time, "
                f"{self.crashes} dropped on an internal error, "
                f"{self.caps.refused} connections refused at the caps "
                f"({self.tarpit.held} held, {self.tarpit.overflow} closed at once), "
                f"bus {'up' if b.up else 'DOWN'}")

    async def serve(self, listeners: list[trio.SocketListener],
                    ssl_context: ssl.SSLContext | None = None, *,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the bus bridge and accept clients on *listeners* (TLS with *ssl_context*)
        until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.bridge.run)
            await nursery.start(self.accept, listeners, self.handle, ssl_context)
            nursery.start_soon(self._say_discards)
            nursery.start_soon(self._tell_bus_notices)
            task_status.started()

    async def accept(self, listeners: list[trio.SocketListener],
                     handler: Handler,
                     ctx: ssl.SSLContext | None = None, *, https_compatible: bool = False,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve each connection to *listeners* that the caps admit with *handler* (over
        TLS with *ctx*) in a task of its own, until cancelled (the stream closed after
        it); those they do not are turned away (`turn_away`)."""
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept_from, listener, handler, ctx,
                                   https_compatible, nursery)
            task_status.started(listeners)

    async def _accept_from(self, listener: trio.SocketListener,
                           handler: Handler,
                           ctx: ssl.SSLContext | None, https_compatible: bool,
                           nursery: trio.Nursery) -> None:
        """Take the connections waiting on *listener*, up to `ACCEPT_RUN` per turn of the
        loop, and admit them in the order they came (`admit`; their tasks run in any
        order).  One per turn, as trio's own listener takes them, made a new client wait
        behind every connection queued before it, one per turn of a loop that hundreds
        of busy clients made slow: 3.5 s behind 256 clients churning subscriptions (the
        audit; 0.1 s now)."""
        with listener.socket, socket.socket(fileno=os.dup(listener.socket.fileno())) as raw:
            raw.setblocking(False)
            while True:
                await trio.lowlevel.wait_readable(raw)
                for _ in range(ACCEPT_RUN):
                    try:
                        conn, _ = raw.accept()
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno in ACCEPT_SKIP:
                            continue
                        if exc.errno not in ACCEPT_LATER:
                            raise
                        self.say("listener", logging.ERROR, "cannot accept a connection "
                                 "(%s): trying again in %g s", exc.strerror, ACCEPT_PAUSE)
                        await trio.sleep(ACCEPT_PAUSE)
                        break
                    stream: trio.abc.Stream = trio.SocketStream(
                        trio.socket.from_stdlib_socket(conn))
                    if ctx is not None:
                        stream = trio.SSLStream(_Bounded(stream), ctx, server_side=True,
                                                https_compatible=https_compatible)
                    admitted = self.admit(stream)
                    if isinstance(admitted, str):
                        self.turn_away(stream, admitted, nursery)
                    else:
                        nursery.start_soon(_handle_and_close, handler, stream, *admitted)
                await trio.lowlevel.checkpoint()

    # -- notices to the clients subscribed to them ---------------------------------------

    def _tell_missed(self, rc: Remote) -> bool:
        """*rc*'s buffer has drained: queue the notices of what it missed since it was
        last told, if anything (`notices.discarded`, `notices.bus_dropped`); whether
        one was.  One at a time, each when the buffer has drained, so a client that does
        not read holds none of them."""
        split = self._split
        if split is not None and split.missed and split.crossings != Outbox.crossings:
            self._settle()  # (it may have been judged full: its discards are counted there)
            self._split = None  # (stale anyway: `_deliver` would judge anew)
        told, now = rc.told, rc.outbox.dropped_by
        if told is None:
            return False
        if told != now:
            frame = notices.discarded([a - b for a, b in zip(now, told, strict=True)])
            rc.told = list(now)
        elif rc.unsaid > 0:
            frame = notices.bus_dropped(rc.unsaid)
            rc.unsaid = 0
        else:
            return False
        return rc.outbox.force(frame)

    def _bus_notice(self, event: str, value: float) -> None:
        """What the bridge says remote subscribers miss: held for the next round of
        `_tell_bus_notices` (the broker's drop reports summed)."""
        if event == "bus-dropped":
            self._bus_dropped += int(value)
        else:
            self._hold_notice(notices.bus_away() if event == "bus-away"
                              else notices.bus_back(value))
        self._notice_due.set()

    def _hold_notice(self, item: bytes | dict[Remote, int]) -> None:
        """Hold an outage's notice for the next round.  Past `NOTICES_HELD` (a broker in
        a restart loop) the outages held are told as one: away, each client's counts
        summed, and back (unless the bus is away again), so no count is lost and each
        follows its away (the audit of 2026-11-28 saw counts dropped with the oldest)."""
        held = self._bus_notices
        if type(item) is dict and held and type(held[-1]) is dict:  # (after a merge)
            counts = Counter(held[-1])
            counts.update(item)
            held[-1] = dict(counts)
            return
        held.append(item)
        if len(held) <= NOTICES_HELD:
            return
        counts: Counter[Remote] = Counter()
        frames = []
        for x in held:
            if type(x) is dict:
                counts.update(x)
            else:
                frames.append(x)
        away = notices.bus_away()
        merged: list[bytes | dict[Remote, int]] = [away]
        if counts:
            merged.append(dict(counts))
        if frames and frames[-1] != away:
            merged.append(frames[-1])  # back, after the last outage
        held[:] = merged

    def _taken_notice(self, taken: Counter) -> None:
        """The bridge lost its connection, which may have taken *taken[rc]* of each
        remote client's publishes: told, at the next round, to those that subscribe to
        the notices (the log says the total)."""
        own = {rc: n for rc, n in taken.items() if rc in self.noticed}
        if own:
            self._hold_notice(own)  # (after its bus-away: `Bridge._connection` said it)
            self._notice_due.set()

    async def _tell_bus_notices(self) -> None:
        """Queue the bus's notices for every client subscribed to them, a round at most
        every `NOTICE_EVERY` seconds (the others get a turn every `TURN`).  An outage's
        are queued past a full buffer (`Outbox.force`, itself bounded: outages are the
        broker's, rare); the broker's drop counts are added up for a client whose
        buffer holds anything, and told when it has drained (`_tell_missed`)."""
        clock = time.perf_counter
        while True:
            await self._notice_due.wait()
            self._notice_due = trio.Event()
            frames, self._bus_notices = self._bus_notices, []
            dropped, self._bus_dropped = self._bus_dropped, 0
            start = clock()
            for i, rc in enumerate(list(self.noticed)):
                if rc not in self.noticed:  # gone (or unsubscribed) during a turn
                    continue
                for item in frames:
                    if type(item) is bytes:
                        frame = item
                    elif rc in item:
                        frame = notices.unconfirmed(item[rc])
                    else:
                        continue
                    if not rc.outbox.force(frame, OUTAGE_ROOM):
                        self.say(rc.host, logging.WARNING, "disconnecting %r: its buffer "
                                 "is too full to be told of the bus's outage", rc)
                        self._close(rc, "could not be told of the bus's outage")
                        break
                rc.unsaid += dropped
                if rc.outbox:
                    rc.lot.unpark()
                elif self._tell_missed(rc):  # idle: nothing else would tell it
                    rc.lot.unpark()
                if not i % 64 and clock() - start > TURN:
                    await trio.lowlevel.checkpoint()
                    start = clock()
            await trio.sleep(NOTICE_EVERY)

    async def _say_discards(self) -> None:
        """Every `DISCARD_LOG_INTERVAL`, one line per address for which messages were
        discarded meanwhile, with their counts by cause (the lines rationed per address
        as the others): a loss is said while it happens, not only at disconnect."""
        while True:
            await trio.sleep(DISCARD_LOG_INTERVAL)
            self._say_discarded()

    def _say_discarded(self) -> None:
        """The lines of `_say_discards`: `DISCARD_LINES` addresses said apart at most,
        those that lost to a shared bound (the pool, their address's share) first and,
        among them, those that lost fewest: the clients that never read lose the most,
        by their own bound, and were named first when they connected first (the
        prompt reader they made lose was in the line for the rest)."""
        self._settle()
        said = more = more_count = 0
        lost = [account for account in self.caps.accounts() if any(account.dropped)]
        lost.sort(key=lambda a: (not (a.dropped[POOL] or a.dropped[SHARE]), sum(a.dropped)))
        for account in lost:
            counts = account.dropped
            account.dropped = [0, 0, 0]
            if said >= DISCARD_LINES:  # many addresses: one line for the rest
                more += 1
                more_count += sum(counts)
                continue
            said += 1
            self.say(account.host, logging.WARNING, "%s: %d messages discarded for its "
                     "%d client(s) in %g s (%s)", printable(account.host), sum(counts),
                     account.conns, DISCARD_LOG_INTERVAL, _causes(counts, self))
        if more:
            log.warning("and %d messages discarded for the clients of %d more addresses "
                        "in %g s", more_count, more, DISCARD_LOG_INTERVAL)


async def _handle_and_close(handler: Handler, stream: trio.abc.Stream, host: str,
                            peer: str) -> None:
    try:
        await handler(stream, host, peer)
    finally:
        await trio.aclose_forcefully(stream)
