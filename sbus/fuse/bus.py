"""The mount's connections to the broker, each an `sbus.client.AsyncClient`.

* one *monitor* subscribed to everything (and the mount's own secrets) with the
  ``discard`` flood policy: it only teaches the `KnownTree` which names are live;
* one shared *publisher* for all writes (``blocking/publisher/nowait``, so a slow
  subscriber cannot stall the writers of every user);
* one connection per open readable file, subscribed before ``open()`` returns (the
  client's ``subscribe`` waits for the broker's whoami barrier, or raises its
  refusal).  A pump task moves its messages into the handle's `Outbox`; it stops
  receiving while the outbox is full, so a slow reader pushes back on the broker,
  whose flood policy then applies.

Every client has ``reconnect=True``: when the broker goes away, it opens again with
its session's opening (policy, patterns, barrier), backing off with the session's
`Backoff` (socket activation keeps the socket while the broker restarts), and readers
simply go on.  The mount adds one thing, a deadline: a reader whose connection stays
down for ``reconnect_timeout`` seconds gets EIO, and so does a write.
"""

from __future__ import annotations

import errno
import logging
import time

import pyfuse3
import trio
from pyfuse3 import FUSEError
from trio.lowlevel import ParkingLot

from .. import protocol
from ..client import AsyncClient
from ..display import brief
from ..errors import ConnectError, ConnectionLost, InvalidRequest, Refused, SbusError
from ..keys import Credentials
from ..limits import LogAllowance
from ..protocol import Publish
from ..session import CONFIRM_EVERY, Dropped, Refusal, Unconfirmed
from . import mapping
from .framing import Outbox, dropped_frame, frame
from .shares import Account, Accounts, UserShare

log = logging.getLogger("sbus.fuse")

#: A reader's pump stops receiving from the broker above this many waiting bytes...
OUTBOX_HIGH = 4 * 1024 * 1024
#: ...and starts again below this.
OUTBOX_LOW = 1024 * 1024
#: Messages a pump takes per batch.
PUMP_BATCH = 512
#: The broker has to answer a subscription's whoami round trip within this time.
SUBSCRIBE_TIMEOUT = 5.0
#: Messages the monitor takes before pausing; during floods it learns from a sample
#: (the broker discards the rest for it) instead of competing with readers for CPU.
MONITOR_BATCH = 64
MONITOR_PAUSE = 0.05
#: The monitor's cache of keys already split into paths: at most this many, and this
#: many bytes by `mapping.raw_key_cost` (each a path as the tree's own keys cost).
SEEN_KEYS = 4096
SEEN_BYTES = 4 * 1024 * 1024
#: A pump that found only a few messages waits this long before looking again, so a
#: steady stream is handled in batches (fewer wakeups, fewer FUSE round trips) at the
#: price of at most this much latency; the first message after a quiet spell goes
#: through at once.
PUMP_COALESCE = 0.002
PUMP_SMALL = 32


class Reader:
    """One open readable file: its subscription, waiting bytes and waiting callers."""

    def __init__(self, pattern: bytes, fmt: str, uid: int = 0,
                 account: Account | None = None) -> None:
        self.pattern = pattern
        self.fmt = fmt
        self.uid = uid  # whose share its waiting bytes are charged to
        self.account = account
        self.charged = 0  # bytes of `out` charged to the account
        self.client: AsyncClient | None = None
        self.out = Outbox(one_per_read=fmt == "raw")
        self.lot = ParkingLot()  # read() calls waiting for data
        self.space: trio.Event | None = None  # set when the pump may receive again
        self.poll_handle: pyfuse3.PollHandle | None = None
        self.failed = False
        self.refused: Refusal | None = None  # the broker refused its subscription
        self.down: float | None = None  # since when its connection is lost
        self.scope = trio.CancelScope()  # its pump
        self.watch: trio.CancelScope | None = None  # its deadline, while down

    def wake(self) -> None:
        self.lot.unpark_all()
        ph, self.poll_handle = self.poll_handle, None
        if ph is not None:
            try:
                ph.notify()
            except OSError as exc:
                log.debug("poll notify failed: %s", exc)

    def settle(self) -> None:
        """Charge the account what `out` holds now (after a push or a take)."""
        a = self.account
        if a is not None:
            n = self.out.nbytes
            a.queued += n - self.charged
            self.charged = n

    def close(self) -> None:
        self.scope.cancel()
        a, self.account = self.account, None
        if a is not None:
            a.queued -= self.charged
            a.paused.discard(self)
        self.charged = 0
        if self.watch is not None:
            self.watch.cancel()

    def on_drop(self, count: int) -> None:
        log.warning("the broker dropped %d messages for a reader of %s (it was too slow)",
                    count, brief(self.pattern))

    def on_refusal(self, event: Refusal) -> None:
        log.warning("the broker refused a packet of the reader of %s: %s",
                    brief(self.pattern), brief(event.reason.encode(), 200))
        if event.verb == "sub":  # the client passes it here, it raises nothing: the
            # open fails (`MountBus.start_reader`), or, re-subscribing after a
            # reconnect, the reads do, instead of waiting for nothing
            self.refused = event
            self.failed = True
            self.wake()


class MountBus:
    """Every broker connection of one mount.  Call `start` inside a nursery first."""

    def __init__(self, address: str, fmt: str, tree: mapping.KnownTree, max_message: int,
                 reconnect_timeout: float, share: UserShare | None = None) -> None:
        """*max_message*: the broker's packet limit, which the publisher checks;
        *share*: what each user's readers may hold (`UserShare`)."""
        self.accounts = Accounts(share or UserShare())
        self.refusals = LogAllowance()  # lines about users' refused requests (`refused`)
        self.address = address
        self.fmt = fmt
        self.tree = tree
        self.max_message = max_message
        self.reconnect_timeout = reconnect_timeout
        self.own: mapping.Path | None = None  # (GID, UID, PID) the broker sees for us
        self.cred: Credentials | None = None
        self.closing = False
        self.nursery: trio.Nursery | None = None
        self.readers: set[Reader] = set()
        self._publisher: AsyncClient | None = None
        self._unconfirmed: Unconfirmed | None = None  # the publisher's (`_confirming`)
        self._wrote = trio.Event()  # set by a write: `_confirming` wakes only for writes
        self._publish_lock = trio.Lock()
        #: a `publish_for` packet went out cut short (a cancelled send): whose share the
        #: broker counts is unknown until the next one is sent whole
        self._owner_unsure = False

    def _client(self, **options) -> AsyncClient:
        return AsyncClient(self.address, reconnect=True, **options)

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Learn our credentials, start the monitor and the publisher; raises
        `ConnectError` if there is no broker."""
        self.nursery = nursery
        monitor = self._client(on_connection=self._monitor_connection,
                               on_refusal=lambda e: log.warning("monitor refused: %s",
                                                                e.reason),
                               on_drop=lambda n: None)  # it learns from a sample
        await monitor.open()
        with trio.fail_after(SUBSCRIBE_TIMEOUT):
            cred = await monitor.whoami(SUBSCRIBE_TIMEOUT)
        try:
            self.cred = Credentials.parse(cred, mapping.SEP)
            self.own = tuple(cred.split(mapping.SEP)[2:5])
        except ValueError:
            log.warning("the broker's whoami answer %s is not a credentials path; "
                        "secret keys are not reachable through this mount", brief(cred))
        await monitor.set_flood(soft="discard")
        await monitor.subscribe(b"", wait=False)
        if self.own is not None:
            await monitor.subscribe(b"!/cred/" + b"/".join(self.own) + b"/", wait=False)
        publisher = self._client(on_connection=self._publisher_connection,
                                 on_refusal=self._publisher_refused,
                                 max_message=self.max_message)
        await publisher.open()
        await publisher.send_packet(publisher.session.publisher_nowait())
        self._publisher = publisher
        self._unconfirmed = Unconfirmed(publisher.session)
        nursery.start_soon(self._monitor, monitor)
        nursery.start_soon(self._confirming, publisher, self._unconfirmed)
        nursery.start_soon(self._publisher_answers, publisher)

    def shutdown(self) -> None:
        """Unmounting: blocked reads end (EOF) instead of holding up the main loop."""
        self.closing = True
        for r in list(self.readers):
            r.wake()

    def _monitor_connection(self, up: bool, line: str) -> None:
        log.warning("monitor: %s", line)

    def _publisher_connection(self, up: bool, line: str) -> None:
        if not up and self._unconfirmed is not None:  # what a crashed broker took with it
            line = self._unconfirmed.said(line)
        log.warning("publisher: %s", line)

    def _publisher_refused(self, event: Refusal) -> None:
        """A write the broker refused after the writer was told it succeeded (the mount
        checks what it can first): logged, rationed as users' refusals are."""
        held = self.refusals.take(("publisher", event.verb))
        if held is not None:
            log.warning("the broker refused a write: %s%s",
                        brief(event.reason.encode(), 200),
                        f" ({held} more not logged)" if held else "")

    def _written(self) -> None:
        self._unconfirmed.sent += 1
        self._wrote.set()

    async def _confirming(self, publisher: AsyncClient, count: Unconfirmed) -> None:
        """While writes go, ask the broker a few times a second to confirm them: a lost
        connection then says how many writes at most it took with it (`Unconfirmed`; a
        write returns once the socket has the message).  Once no write came for a round
        it sleeps until the next (an answer still due is taken when it counts)."""
        while True:
            await self._wrote.wait()  # (an idle mount is not woken)
            self._wrote = trio.Event()
            await trio.sleep(CONFIRM_EVERY)
            question = count.question(time.monotonic())
            if question is not None:
                if publisher.send_nowait(question):
                    self._wrote.set()  # a round more: the answer, or the next question
                else:
                    count.unsent()  # a reconnect, or a full socket: the next write asks
            elif count.asked_at is None and count.sent > count.confirmed:
                self._wrote.set()  # not due yet: the next round asks

    async def _publisher_answers(self, publisher: AsyncClient) -> None:
        """Read the publisher's connection: the answers to `_confirming`'s questions are
        taken (by the client) as they come, refusals go to `_publisher_refused`, and a
        broker that goes away is found at once, by this wait, which reconnects and says
        what the lost connection took with it (not at the next write, as before: the
        audit of 2026-11-28 found the line never said by a mount idle after a crash)."""
        while True:
            try:
                await publisher.receive_batch()  # (the publisher subscribes to nothing)
            except SbusError as exc:  # a packet no broker sends: skip it
                log.warning("publisher: %s", exc)
    async def _monitor(self, monitor: AsyncClient) -> None:
        """Learn live keys: everything public, and our own secrets."""
        tree = self.tree
        learn, fits, raw_cost = tree.learn, tree.fits, mapping.raw_key_cost
        seen: dict[bytes, mapping.Path | None] = {}  # parsed keys, bounded as the tree is
        seen_bytes = 0
        while True:
            try:
                events = await monitor.receive_batch(MONITOR_BATCH)
            except SbusError as exc:  # a packet no broker sends: skip it, learn on
                log.warning("monitor: %s", exc)
                continue
            for event in events:
                if type(event) is not Publish:
                    continue
                key = event.key
                if key in seen:
                    path = seen[key]
                else:
                    cost = raw_cost(key)
                    if not fits(cost):  # too large to remember: not even split
                        continue
                    if len(seen) >= SEEN_KEYS or seen_bytes + cost > SEEN_BYTES:
                        seen.clear()
                        seen_bytes = 0
                    path = seen[key] = mapping.key_segments(key)
                    seen_bytes += cost
                if path is not None:
                    learn(path)
            await trio.sleep(MONITOR_PAUSE)

    # -- readers -------------------------------------------------------------------

    async def start_reader(self, r: Reader) -> None:
        """Subscribe *r* (in force on return) and start its pump; FUSEError otherwise."""
        client = self._client(on_connection=lambda up, line: self._reader_connection(
                                  r, up, line), on_drop=r.on_drop, on_refusal=r.on_refusal)
        try:
            await client.open()
        except ConnectError as exc:
            log.error("cannot subscribe to %s: %s", brief(r.pattern), exc)
            raise FUSEError(errno.EIO) from None
        try:
            with trio.fail_after(SUBSCRIBE_TIMEOUT):
                await client.subscribe(r.pattern)  # waits for the broker's barrier
                if r.refused is not None:  # it came before the barrier's answer
                    raise r.refused.error()
        except (Refused, InvalidRequest) as exc:
            await client.aclose()
            log.info("cannot subscribe to %s: %s", brief(r.pattern), exc)
            # the broker's per-user limits (sbus/limits.py) say "the limit"
            over = isinstance(exc, Refused) and "the limit" in exc.reason
            raise FUSEError(errno.EDQUOT if over else errno.EACCES) from None
        except (SbusError, OSError, trio.TooSlowError, TimeoutError) as exc:
            await client.aclose()
            why = exc if str(exc) else f"no answer within {SUBSCRIBE_TIMEOUT:g} s"
            log.error("cannot subscribe to %s at %s: %s", brief(r.pattern), self.address,
                      why)
            raise FUSEError(errno.EIO) from None
        except BaseException:  # cancelled: the caller was interrupted
            await client.aclose()
            raise
        r.client = client
        self.readers.add(r)
        assert self.nursery is not None
        self.nursery.start_soon(self._pump, r)

    def _reader_connection(self, r: Reader, up: bool, line: str) -> None:
        log.warning("reader of %s: %s", brief(r.pattern), line)
        if up:  # what was published meanwhile it missed: the reader learns of it there
            if r.fmt == "jsonl":
                r.out.push(dropped_frame(None, time.time()))
            else:
                r.out.push_gap(None)
            r.settle()
            r.wake()
            r.down = None
            if r.watch is not None:
                r.watch.cancel()
                r.watch = None
        elif r.down is None and self.nursery is not None:
            r.down = time.monotonic()
            r.watch = trio.CancelScope()
            self.nursery.start_soon(self._deadline, r, r.watch)

    async def _pump(self, r: Reader) -> None:
        client = r.client
        assert client is not None
        fmt, push = r.fmt, r.out.push
        lines = fmt == "lines"
        packet = self.max_message
        try:
            with r.scope:
                while True:
                    a = r.account
                    room = self.accounts.share.queued - a.queued if a else OUTBOX_HIGH
                    if r.out.nbytes >= OUTBOX_HIGH or room <= 0:
                        r.space = trio.Event()
                        if a is not None:
                            a.paused.add(r)
                        await r.space.wait()
                        continue
                    # at most about *room* bytes: one packet over the share per reader
                    events = await client.receive_batch(
                        max(1, min(PUMP_BATCH, room // packet)))
                    now = time.time()
                    for event in events:
                        if type(event) is Publish:
                            payload = event.payload
                            if lines:  # the common case, without a call
                                push(payload if payload[-1:] == b"\n" else payload + b"\n")
                            else:
                                push(frame(fmt, event.key, payload, now))
                        elif type(event) is Dropped:  # where they were (also logged)
                            if fmt == "jsonl":
                                push(dropped_frame(event.count, now))
                            else:
                                r.out.push_gap(event.count)
                        # refusals went to the reader's callback
                    r.settle()
                    r.wake()
                    if len(events) >= PUMP_SMALL:
                        await trio.lowlevel.checkpoint()
                    else:
                        await trio.sleep(PUMP_COALESCE)
        except (ConnectionLost, SbusError) as exc:
            log.error("reader of %s: %s", brief(r.pattern), exc)
            r.failed = True
            r.wake()
        except Exception:  # one reader's bug must not end the mount for everyone
            log.exception("reader of %s failed; its reads get EIO", brief(r.pattern))
            r.failed = True
            r.wake()
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def _deadline(self, r: Reader, watch: trio.CancelScope) -> None:
        """EIO for a reader whose connection stays down for `reconnect_timeout`."""
        with watch:
            await trio.sleep(self.reconnect_timeout)
            if not self.closing:
                log.error("no broker at %s for %.0f s: readers of %s get EIO",
                          self.address, self.reconnect_timeout, brief(r.pattern))
            r.failed = True
            r.wake()

    def refused(self, msg: str, uid: int, *args: object) -> None:
        """Log that a request of *uid* was refused (a share of its is used up): rationed
        per user and kind of refusal (*msg*; `LogAllowance`: 10 lines, then one a
        minute, saying how many of that kind were not logged), so that retrying refused
        requests does not flood the log (the audit of 2026-11-28: 1,400 lines a second)
        and each share a user runs into is still named."""
        held = self.refusals.take((uid, msg))
        if held is not None:
            log.info(msg + (f" ({held} more not logged)" if held else ""), uid, *args)

    def reader_for(self, pattern: bytes, fmt: str, uid: int) -> Reader:
        """A reader charged to *uid*'s share; EMFILE when it holds all it may."""
        a = self.accounts[uid]
        if a.readers >= self.accounts.share.readers:
            self.refused("uid %d holds %d open readers (its share); answering EMFILE",
                         uid, a.readers)
            raise FUSEError(errno.EMFILE)
        a.readers += 1
        return Reader(pattern, fmt, uid, a)

    def took(self, r: Reader) -> None:
        """A read took bytes from *r*: let its user's paused pumps take more from the
        broker once there is room again."""
        r.settle()
        if r.account is not None:
            self._room_again(r.account)

    def _room_again(self, a: Account) -> None:
        if not a.paused or a.queued >= self.accounts.share.queued:
            return  # (with any room, a pump takes only about that much: no hysteresis)
        for p in list(a.paused):
            if p.space is None:
                a.paused.discard(p)
            elif p.out.nbytes < OUTBOX_LOW:
                p.space.set()
                p.space = None
                a.paused.discard(p)

    def close_reader(self, r: Reader) -> None:
        """Forget *r* and give back its share (also for one whose subscribe failed)."""
        a = r.account
        r.close()
        self.readers.discard(r)
        if a is not None:
            a.readers -= 1
            self._room_again(a)
            self.accounts.tidy(r.uid)

    # -- publishing ------------------------------------------------------------------

    def _owner(self, publisher: AsyncClient, uid: int) -> int | None | bool:
        """Whose share of full queues a message *uid* writes takes at the broker: *uid*'s
        own (`Session.publish_for`), so that one writer flooding a slow subscriber
        through the mount loses its own messages, not the other writers'.  Only a root
        mount may say so (the broker trusts no one else with it).  False: no change."""
        if self.cred is None or self.cred.uid != 0:
            return False
        owner = None if uid == self.cred.uid else uid
        same = publisher.session.publishing_for == owner and not self._owner_unsure
        return False if same else owner

    def publish_nowait(self, packet: bytes, uid: int) -> bool:
        """Send one ``MSG`` packet that user *uid* wrote now if nothing waits to go
        before it, it is the same user's as the last, and the socket takes it: the common
        case, without a timer or a checkpoint.  False: nothing was sent (a full socket, a
        reconnect, an error, another user), `publish` it."""
        publisher = self._publisher
        sent = (publisher is not None and not self._publish_lock.locked()
                and self._owner(publisher, uid) is False and publisher.send_nowait(packet))
        if sent:
            self._written()
        return sent

    async def publish(self, packet: bytes, uid: int) -> None:
        """One ``MSG`` packet that user *uid* wrote (checked against the broker's limit by
        the caller) on the shared publisher, in order; EMSGSIZE if refused as too large,
        EIO if no broker comes back within `reconnect_timeout`."""
        publisher = self._publisher
        if publisher is None:
            raise FUSEError(errno.EIO)
        lock = self._publish_lock
        try:
            try:
                lock.acquire_nowait()  # the common case, without a checkpoint
            except trio.WouldBlock:
                await lock.acquire()
            try:
                with trio.fail_after(self.reconnect_timeout or 0.001):
                    owner = self._owner(publisher, uid)
                    if owner is not False:  # (said again by the session after a reconnect)
                        self._owner_unsure = True  # until sent whole: a cancel leaves it
                        await publisher.send_packet(publisher.session.publish_for(owner))
                        self._owner_unsure = False
                    await publisher.send_packet(packet)
                    self._written()
            finally:
                lock.release()
        except InvalidRequest as exc:
            log.info("cannot publish %s: %s", brief(protocol.publish_key(packet) or b""), exc)
            raise FUSEError(errno.EMSGSIZE) from None
        except (trio.TooSlowError, SbusError, OSError) as exc:
            log.error("cannot publish: no broker at %s (%s)", self.address,
                      str(exc) or type(exc).__name__)  # (an outage's error may say nothing)
            raise FUSEError(errno.EIO) from None
