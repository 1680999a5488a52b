"""The gateway's one connection to the local bus, shared by all remote clients.

Why one shared connection rather than one per remote client: the broker charges
connections to the gateway's UID (4096 by default), so 10,000 remote clients
could not each have one; the broker would also send one packet per remote
subscriber instead of one per message, and every remote client would cost a
second socket and task pair.  Instead the gateway keeps its own `RoutingIndex`
of remote subscriptions and holds each distinct pattern once on the bus
(reference counted), so the broker sends each matching message once and the
gateway fans it out.

The bridge asks the broker who it is on every connect: the answer
(``!/cred/G/U/P``, or ``!.cred.G.U.P`` for a ``--separator .`` broker) tells the
separator, so the index routes and the secret-key checks refuse keys the way this
broker spells them.  It also sends ``CMSG blocking/publisher/nowait``: the broker then
never pauses this one shared publishing connection because one local subscriber is
slow (that subscriber loses the message instead), so remote publishers never stall
each other through it.

If the bus goes away (broker restart), remote clients stay connected: the
bridge reconnects with backoff and subscribes every pattern again.  Messages
published by remote clients while the bus is down are discarded and counted,
in line with the pubsub design's lack of delivery guarantees.
"""

from __future__ import annotations

import errno
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable

import anyio
import trio
from trio.lowlevel import wait_writable

from .. import protocol
from ..client import AsyncClient
from ..display import brief
from ..errors import SbusError
from ..keys import KeyRules
from ..limits import Limits, LogAllowance
from ..routing import CACHE_BYTES, RouteCache, RoutingIndex
from ..session import Backoff, Dropped, Refusal, Whoami
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
#: Seconds a SUB/UNSUB may wait for a busy broker before the connection is reset.
CONTROL_TIMEOUT = 10.0
#: Messages taken from the bus before the clients' writers get a turn: well under
#: the default per-client buffer, so a burst does not overflow a client that keeps up.
FORWARD_BATCH = 32
#: Seconds of fan-out (or of dropping a client's subscriptions) before other tasks get
#: a turn: the loop never runs much longer than this for any one cause.
TURN = 0.002


class Bridge:
    """Remote subscriptions (a routing index) and the bus connection that feeds them.

    *deliver(targets, key, payload)* is called for every message from the bus that
    matches remote subscriptions, with the matching clients; the server encodes the
    frame once and offers it to each client's outbox.
    """

    def __init__(self, address: str | None,
                 deliver: Callable[[tuple, bytes, bytes], None],
                 on_refused: Callable[[bytes, str], None],
                 cache_bytes: int = CACHE_BYTES,
                 on_separator: Callable[[bytes], None] | None = None,
                 budget: int = BUS_SUBSCRIPTION_BYTES,
                 max_patterns: int = BUS_PATTERNS) -> None:
        self.address = address
        self.deliver = deliver
        self.on_refused = on_refused  # (pattern, reason): the broker refused its SUB
        #: What the bus connection's distinct patterns may cost the broker (charged to the
        #: gateway's UID, `routing.pattern_cost`), and how many there may be.
        self.budget = Pool(budget)
        self.max_patterns = max_patterns
        self._costs: dict[bytes, int] = {}
        #: SUBs sent whose fate the broker has not told yet, oldest first.
        self._unconfirmed: deque[list] = deque()
        self._in_flight: Counter[bytes] = Counter()  # the same, by pattern
        self.cache_bytes = cache_bytes
        self.on_separator = on_separator  # called when a reconnected broker has another one
        self.sep = b"/"
        self.rules = KeyRules(self.sep)
        self.index: RoutingIndex[Hashable] = self._new_index()
        self._complaints = LogAllowance(burst=10, interval=60.0)
        self.connected_once = False  # a separator change after this disconnects clients
        self.patterns: Counter[bytes] = Counter()  # distinct remote patterns -> clients
        self._bus: AsyncClient | None = None
        self._queued = 0  # senders waiting for the bus socket to drain, in FIFO order
        self._lock = trio.Lock()
        self.connected = trio.Event()
        # counters
        self.published = 0  # remote publishes handed to the bus
        self.lost = 0  # remote publishes discarded because the bus was down
        self.received = 0  # messages from the bus
        self.bus_dropped = 0  # messages the broker reported dropping for us
        self.refused = 0  # distinct patterns the broker refused

    def _new_index(self) -> RoutingIndex[Hashable]:
        # one owner: the cache is bounded in bytes as a whole (keys come from the bus,
        # which does not say which remote client, if any, published them)
        return RoutingIndex(self.sep, RouteCache(self.sep, self.cache_bytes))

    def _set_separator(self, sep: bytes) -> None:
        if sep == self.sep:
            return
        log.log(logging.WARNING if self.connected_once else logging.INFO,
                "the broker's separator is %r: routing and secret checks follow it%s",
                sep.decode("latin-1"),
                " (remote clients are disconnected)" if self.connected_once else "")
        self.sep = sep
        self.rules = KeyRules(sep)
        self.index = self._new_index()
        self.patterns.clear()
        self._costs.clear()
        self.budget.used = 0
        if self.on_separator is not None:
            self.on_separator(sep)

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
            await self._subscribe_on_bus(pattern)

    async def _subscribe_on_bus(self, pattern: bytes) -> None:
        """SUB and a whoami question as one step: the broker answers a refused SUB before
        the answer to the question after it, so each refusal names its pattern."""
        bus = self._bus
        if bus is None:
            return  # `run` subscribes the current patterns when it reconnects
        self._unconfirmed.append([pattern, None])
        self._in_flight[pattern] += 1
        await self._control(protocol.encode(protocol.Subscribe(pattern)), bus.session.ask())

    def forget(self, client: Hashable, pattern: bytes) -> None:
        """Drop *client*'s route for a pattern the broker refused (no UNSUB: it holds none)."""
        self.index.unsubscribe(client, pattern)
        if self.patterns[pattern] <= 1:
            self.patterns.pop(pattern, None)
            self.budget.used -= self._costs.pop(pattern, 0)
        else:
            self.patterns[pattern] -= 1

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

    async def _release(self, pattern: bytes) -> None:
        self.patterns[pattern] -= 1
        if self.patterns[pattern] <= 0:
            del self.patterns[pattern]
            self.budget.used -= self._costs.pop(pattern, 0)
            await self._control(protocol.encode(protocol.Unsubscribe(pattern)))

    def _settle(self) -> None:
        """The broker answered the question after the oldest unconfirmed SUB: the SUB was
        refused (a refusal came before, its reason noted) or is in force.  A refused
        pattern leaves every remote client that holds it, so what the gateway routes is
        what the bus holds (no phantom subscription)."""
        if not self._unconfirmed:
            return
        pattern, refused = self._unconfirmed.popleft()
        self._in_flight[pattern] -= 1
        if not self._in_flight[pattern]:
            del self._in_flight[pattern]
        if refused is None or pattern not in self.patterns:
            return
        if pattern in self._in_flight:
            return  # subscribed again since: the later SUB decides
        self.refused += 1
        self.on_refused(pattern, refused)  # calls `forget` for each client holding it

    async def _control(self, *packets: bytes) -> None:
        """Send a SUB or UNSUB.  `patterns` is the truth: if the packet cannot be sent
        (cancelled while the broker was busy, or stuck for CONTROL_TIMEOUT), the bus
        connection is reset and `run` subscribes the current patterns afresh, so the
        broker's view of them never drifts from ours."""
        bus = self._bus
        if bus is None:
            return  # `run` subscribes the current patterns when it reconnects
        sent = False
        try:
            with trio.move_on_after(CONTROL_TIMEOUT):
                sent = await self._send(*packets)
        finally:
            if not sent and self._bus is bus:
                self._reset(bus, "a subscription change could not be sent; resubscribing")

    # -- publishing ---------------------------------------------------------------

    async def publish(self, key: bytes, payload: bytes) -> bool:
        """Hand a remote client's message to the bus; False if the bus is down."""
        if await self._send(b"MSG " + key + b"\0" + payload):
            self.published += 1
            return True
        self.lost += 1
        return False

    async def _send(self, *packets: bytes) -> bool:
        """Send packets in call order (those of one call back to back); waits
        (backpressure) while the broker is busy.  False if the bus is gone (or refused
        a packet as too large)."""
        bus = self._bus
        if bus is None:
            return False
        if not self._queued:
            try:
                while packets:
                    bus.sock.send(packets[0])
                    packets = packets[1:]
                return True
            except BlockingIOError:
                pass
            except OSError as exc:
                self._send_failed(bus, exc)
                return False
        self._queued += 1
        try:
            async with self._lock:
                while self._bus is bus:
                    try:
                        while packets:
                            bus.sock.send(packets[0])
                            packets = packets[1:]
                        return True
                    except BlockingIOError:
                        try:
                            await wait_writable(bus.sock)
                        except trio.ClosedResourceError:
                            return False  # reset meanwhile
                    except OSError as exc:
                        self._send_failed(bus, exc)
                        return False
                return False
        finally:
            self._queued -= 1

    def _send_failed(self, bus: AsyncClient, exc: OSError) -> None:
        if exc.errno == errno.EMSGSIZE:
            log.warning("the broker refused a packet as too large: %s", exc)
        else:
            self._reset(bus, f"lost the bus at {bus.address}: {exc}")

    def _reset(self, bus: AsyncClient, why: str) -> None:
        """Give up on *bus* (from any task): `run` closes it and connects again."""
        if self._bus is bus:
            log.warning("%s", why)
            self._bus = None
            self.connected = trio.Event()
            trio.lowlevel.notify_closing(bus.sock)  # wakes whoever waits on it

    # -- the bus connection --------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect, subscribe, forward messages; reconnect when the bus goes away."""
        backoff = Backoff(BUS_BACKOFF_FIRST, BUS_BACKOFF_MAX)
        started = False
        while True:
            try:
                bus = await AsyncClient.connect(self.address)
            except SbusError as exc:
                if not started:
                    raise  # a gateway that never reached its bus is misconfigured
                delay = backoff.next()
                log.warning("%s; retrying in %.1f s", exc, delay)
                await trio.sleep(delay)
                continue
            # never be paused as a publisher by one slow local subscriber; queue in the
            # broker rather than block local publishers when we lag (it tells us how
            # many it dropped); learn the separator from who the broker says we are
            session = bus.session
            try:
                for packet in [session.publisher_nowait(),
                               *session.set_flood(soft="queue", hard="discard")]:
                    bus.sock.send(packet)
                me = await bus.whoami(CONTROL_TIMEOUT)
                if not me.startswith(b"!") or len(me) < 2:
                    raise SbusError(f"the broker answered whoami with {brief(me)}")
            except (OSError, SbusError, TimeoutError, anyio.ClosedResourceError,
                    anyio.BrokenResourceError, anyio.EndOfStream) as exc:
                # a broker that went away just after accepting us
                if not started:
                    raise SbusError(f"the bus at {bus.address} did not answer: {exc}") from None
                log.warning("lost the bus at %s at once: %s; retrying", bus.address, exc)
                await bus.aclose()
                await trio.sleep(backoff.next())
                continue
            self._set_separator(me[1:2])
            self.connected_once = True
            backoff.reset()
            self._bus = bus
            self._unconfirmed.clear()  # questions on an old connection: never answered
            self._in_flight.clear()
            patterns = list(self.patterns)  # taken with no await since _bus was set
            self.connected.set()
            log.info("connected to the bus at %s (%d patterns)", bus.address, len(patterns))
            if not started:
                task_status.started()
                started = True
            try:
                for pattern in patterns:
                    if pattern in self.patterns and self._bus is bus:
                        await self._subscribe_on_bus(pattern)
                await self._forward(bus)
            except (SbusError, trio.ClosedResourceError, anyio.ClosedResourceError) as exc:
                if self._bus is bus:
                    log.warning("lost the bus: %s", exc)
            finally:
                if self._bus is bus:
                    self._bus = None
                    self.connected = trio.Event()
                trio.lowlevel.notify_closing(bus.sock)  # before closing: wakes any waiter
                with trio.CancelScope(shield=True):
                    await bus.aclose()

    async def _forward(self, bus: AsyncClient) -> None:
        index = self.index
        deliver = self.deliver
        secret = self.rules.secret_prefix
        clock = time.perf_counter
        receive = bus.session.receive
        while self._bus is bus:
            start = clock()
            for packet in await bus.receive_packets(FORWARD_BATCH):
                try:
                    event = receive(packet)
                except protocol.ProtocolError as exc:
                    raise SbusError(f"the bus sent a malformed packet: {exc}") from None
                if type(event) is protocol.Publish:
                    self.received += 1
                    key = event.key
                    if key.startswith(secret):
                        continue  # never forwarded, whatever the broker sent
                    targets = index.match(key)
                    if targets:
                        deliver(targets, key, event.payload)
                        if clock() - start > TURN:  # a wide fan-out: let the writers run
                            await trio.lowlevel.checkpoint()
                            start = clock()
                elif type(event) is Dropped:
                    self.bus_dropped += event.count
                    log.warning("the broker dropped %d messages for the gateway "
                                "(it could not keep up)", event.count)
                elif type(event) is Whoami:
                    self._settle()
                elif type(event) is Refusal:
                    if event.verb == "sub" and self._unconfirmed:
                        self._unconfirmed[0][1] = event.reason
                    held = self._complaints.take(0)
                    if held is not None:
                        log.warning("the broker refused the gateway's %s: %s%s",
                                    brief(event.verb.encode(), 16),
                                    brief(event.reason.encode(), 200),
                                    f" ({held} more not logged)" if held else "")
            await trio.lowlevel.checkpoint()

    @property
    def up(self) -> bool:
        return self._bus is not None
