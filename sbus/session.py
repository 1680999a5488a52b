"""The client side of the sbus protocol, sans-IO: intents in, packets out; packets in,
events out.

One `Session` per logical client, across as many connections as reconnects make.  It
holds what a client must remember because the broker keeps nothing for it (patterns
to subscribe again, its flood policy), checks every request with the broker's own
rules before it becomes bytes (`InvalidRequest`, nothing sent), and turns each packet
from the broker into one event:

=============  ==============================================================
`Publish`      a message (``.key``, ``.payload``)
`Dropped`      ``CMSG blocking/dropped``: the broker lost ``.count`` messages for us
`Whoami`       the answer to ``CMSG !/cred/whoami``: this connection's credentials
`Refusal`      ``CMSG refused/VERB``: the broker refused one of our packets
`Control`      any other control message from the broker
=============  ==============================================================

The whoami question doubles as a barrier: the broker answers packets in order, so
when the answer to a question comes, every packet sent before the question has been
acted on, and any refusal of them has arrived.  `asked` counts the questions in
flight; the I/O shells (`sbus.client`) wait on it.

The session also holds the reconnect plan, so the shells only carry it out: after a
lost connection they wait `retry_in` seconds between attempts (its one `Backoff`), send
what `connected` returns on the new connection, read until the barrier is answered
(``asked == 0``), then call `restored`.  `decode` turns a batch of packets (one buffer,
offsets and lengths, as `sbus.packetio.PacketBatch` receives them) into events, messages
by a fast path.  `new_inbox` / `reply_to` are the requester's half of request/reply
(`sbus.request`), and a `RequestRound` says when one request goes out, across reconnects;
`Unconfirmed` how many messages a lost connection may have taken with it.

A connection may also outlive the process that opened it: kept in the service manager's
fd store, it is taken up by the next process of the same program (`adopt`), with the
patterns the broker still holds for it and whatever the broker queued meanwhile.  The
answers to the earlier process's questions may still come; a reach question on a key
of the session's own, sent first, marks where they end (`adopting`), so none of them
passes the new process's barrier.

`Backoff` is the one reconnect policy every component uses.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from . import protocol
from .defaults import MAX_MESSAGE
from .display import brief
from .errors import InvalidRequest, NoResponders, Refused
from .keys import Credentials, KeyRules
from .protocol import DROPPED, REACH, REFUSED, WHOAMI, Control, Publish, Subscribe
from .request import inbox_root, make_request

__all__ = ["Session", "Backoff", "RequestRound", "Unconfirmed", "Dropped", "Whoami",
           "Refusal", "Reach", "Event", "Publish", "Control", "FLOOD_VALUES", "REACH_RETRY"]

#: The keys of the questions that mark the end of an earlier process's answers (`adopt`).
ADOPTED = b"/sbus/adopted/"

#: What each flood setting accepts (docs/protocol.md, sbus/flood.py).
FLOOD_VALUES: dict[str, tuple[str, ...]] = {
    "soft": ("queue", "discard", "block", "error"),
    "hard": ("discard", "block", "error"),
    "order": ("queue", "stack", "random"),
}
_FLOOD_KEYS = {"soft": protocol.SOFT, "hard": protocol.HARD, "order": protocol.ORDER}


@dataclass(frozen=True, slots=True)
class Dropped:
    """The broker dropped *count* messages for this client (between the message before
    this report and the one after)."""

    count: int


@dataclass(frozen=True, slots=True)
class Whoami:
    """The broker's answer to whoami: ``!/cred/GID/UID/PID`` (or nested)."""

    path: bytes


@dataclass(frozen=True, slots=True)
class Refusal:
    """The broker refused one of our packets; *verb* is ``sub``, ``unsub``, ``msg``,
    ``cmsg`` or ``packet``, *reason* one line."""

    verb: str
    reason: str

    def error(self) -> Refused:
        return Refused(self.verb, self.reason)


@dataclass(frozen=True, slots=True)
class Reach:
    """The broker's answer to `Session.ask_reach`: a message on *key* would reach
    *count* subscribers; None when the broker will not say (another's secret key)."""

    key: bytes
    count: int | None


Event = Publish | Dropped | Whoami | Refusal | Reach | Control


def _b(value: bytes | str) -> bytes:
    """A key, pattern or payload as bytes: text is UTF-8; anything else that is not
    bytes-like is a TypeError (``bytes(7)`` would be seven NULs, ``bytes([1])`` one)."""
    if type(value) is bytes:  # the usual case, first: no copy, no other check
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"keys, patterns and payloads are bytes or str, not "
                    f"{type(value).__name__}")


def _encode(event: protocol.Event) -> bytes:
    try:
        return protocol.encode(event)
    except protocol.ProtocolError as exc:
        raise InvalidRequest(str(exc)) from None


def _flood(name: str, value: bytes) -> bytes:
    return _encode(Control(_FLOOD_KEYS[name] + b"/" + value))


class Session:
    """One client's protocol state; see the module docstring.  Every method that returns
    bytes has already updated the state as if they were sent."""

    def __init__(self, *, sep: bytes = b"/", max_message: int = MAX_MESSAGE,
                 backoff: Backoff | None = None) -> None:
        self.rules = KeyRules(sep)
        self.max_message = max_message
        #: Patterns in force, with multiplicity (two SUB x need two UNSUB x).
        self.patterns: Counter[bytes] = Counter()
        #: Flood settings asked for ("soft"/"hard"/"order" -> value), re-sent on reconnect.
        self.flood: dict[str, bytes] = {}
        self.nowait = False
        #: The user whose share the messages take, if not this connection's (`publish_for`).
        self.publishing_for: int | None = None
        #: Ask in every opening whether the broker lets this connection name users (a
        #: carrier that follows the broker's trust across restarts): a refusal says no.
        self.ask_for_trust = False
        #: Whoami questions sent and not yet answered (the barrier).
        self.asked = 0
        #: Whoami questions answered on this connection (so the answer to one question
        #: is known among others: `Unconfirmed`).
        self.answers = 0
        #: The last whoami answer, and its parse when it is a credentials path.
        self.whoami: bytes | None = None
        self.cred: Credentials | None = None
        #: Messages the broker reported dropping for us, in total.
        self.dropped = 0
        #: Connections made (1 after the first `connected`).
        self.connections = 0
        #: The reconnect plan's delays (`retry_in`), reset once a connection is restored.
        self.backoff = backoff or Backoff()
        #: The key of the reach question that ends an earlier process's answers on a
        #: connection taken up (`adopt`); None once its answer came, or on a fresh one.
        self.adopting: bytes | None = None

    # -- intents -> packets ------------------------------------------------------

    def connected(self) -> list[bytes]:
        """A new connection is up: what to send first.  On a reconnect that is the flood
        policy and every pattern again, then a whoami question (the barrier after which
        the subscriptions are in force again); on the first connection, nothing."""
        self.connections += 1
        if self.connections == 1:
            return []
        return self.opening()

    def opening(self) -> list[bytes]:
        """Everything this session asked for, as the first packets of a fresh connection:
        the flood policy, every pattern, and a whoami question (the barrier)."""
        self.asked = self.answers = 0  # an old connection's questions: never answered
        self.adopting = None
        out = self._policy()
        out += [_encode(Subscribe(p)) for p, n in self.patterns.items() for _ in range(n)]
        out.append(self.ask())
        return out

    def adopt(self, held: Iterable[bytes]) -> list[bytes]:
        """Take up a connection an earlier process of this program opened and left to
        this one (the service manager's fd store), on which the broker holds the patterns
        *held*: what to send first.  That is a reach question on a key of the session's
        own: the answers that come before its answer were asked by the earlier process,
        and do not count for this one's questions (`control_event`)."""
        self.connections += 1
        self.patterns = Counter(dict.fromkeys(held, 1))
        self.adopting = ADOPTED + secrets.token_hex(8).encode()
        return [_encode(Control(REACH, self.adopting))]

    def retry_in(self, give_up_at: float | None = None) -> float:
        """Seconds to wait before the next attempt to reconnect.  With *give_up_at* (a
        time of the backoff's clock at which the reconnect gives up), one last attempt is
        made `LAST_TRY` before it, not a whole backoff step earlier."""
        return self.backoff.next(None if give_up_at is None else give_up_at - LAST_TRY)

    def restored(self) -> None:
        """The new connection's opening is answered: the next loss starts the delays
        afresh."""
        self.backoff.reset()

    def _policy(self) -> list[bytes]:
        out = [_flood(name, value) for name, value in self.flood.items()]
        if self.nowait:
            out.append(_encode(Control(protocol.PUBLISHER_NOWAIT)))
        if self.publishing_for is not None or self.ask_for_trust:
            out.append(self._for(self.publishing_for))
        return out

    def subscribe(self, pattern: bytes | str) -> bytes:
        pattern = _b(pattern)
        packet = _encode(Subscribe(pattern))
        self.rules.check_pattern(pattern, self.cred)
        self.patterns[pattern] += 1
        return packet

    def unsubscribe(self, pattern: bytes | str) -> bytes:
        pattern = _b(pattern)
        if self.patterns[pattern] <= 0:
            del self.patterns[pattern]
            raise InvalidRequest(f"not subscribed to {brief(pattern)}")
        self.patterns[pattern] -= 1
        if not self.patterns[pattern]:
            del self.patterns[pattern]
        return _encode(protocol.Unsubscribe(pattern))

    def publish(self, key: bytes | str, payload: bytes | str = b"") -> bytes:
        key = _b(key)
        packet = _encode(Publish(key, _b(payload)))
        self.rules.check_key(key)
        if len(packet) > self.max_message:
            raise self.too_large(key, len(packet))
        return packet

    def publish_head(self, key: bytes | str) -> bytes:
        """*key* checked once, for a publisher of many messages on it: each packet is this
        head + the payload (`publish` for one message)."""
        key = _b(key)
        try:
            head = protocol.publish_head(key)
        except protocol.ProtocolError as exc:
            raise InvalidRequest(str(exc)) from None
        self.rules.check_key(key)
        return head

    def too_large(self, key: bytes, size: int) -> InvalidRequest:
        """The error for a message of *size* bytes with its header over the limit."""
        return InvalidRequest(
            f"the message to {brief(key)} is {size} bytes with its header, over "
            f"the broker's limit of {self.max_message} (sbus serve --max-message)")

    def set_flood(self, soft: str | None = None, hard: str | None = None,
                  order: str | None = None) -> list[bytes]:
        """The packets that ask for a flood policy (docs/protocol.md); each setting is
        remembered and asked for again after a reconnect."""
        asked = {"soft": soft, "hard": hard, "order": order}
        for name, value in asked.items():
            if value is not None and value not in FLOOD_VALUES[name]:
                raise InvalidRequest(f"{name} flood setting {value!r} is not one of "
                                     + ", ".join(FLOOD_VALUES[name]))
        out = []
        for name, value in asked.items():
            if value is not None:
                self.flood[name] = value.encode()
                out.append(_flood(name, value.encode()))
        return out

    def publisher_nowait(self) -> bytes:
        """Ask never to be paused as a publisher (a connection publishing for many)."""
        self.nowait = True
        return _encode(Control(protocol.PUBLISHER_NOWAIT))

    def publish_for(self, owner: int | None) -> bytes:
        """Name the user whose share of full queues the next messages take (a trusted
        connection carrying many users' messages: a mount's writers); None: this
        connection's own again.  Remembered, and said again after a reconnect."""
        if owner is not None and not 0 <= owner < protocol.OWNER_LIMIT:
            raise InvalidRequest(f"publishing for {owner}: not a user number")
        self.publishing_for = owner
        return self._for(owner)

    @staticmethod
    def _for(owner: int | None) -> bytes:
        return _encode(Control(protocol.PUBLISHER_FOR, b"" if owner is None else b"%d" % owner))

    def ask(self) -> bytes:
        """A whoami question: its answer is also the barrier for everything before it."""
        self.asked += 1
        return _encode(Control(WHOAMI))

    def unask(self) -> None:
        """The question `ask` made last was not sent: no answer is awaited for it."""
        self.asked = max(0, self.asked - 1)

    def control(self, key: bytes | str, payload: bytes | str | None = None) -> bytes:
        """Any other control message (e.g. ``broker/status``), as it is."""
        key = _b(key)
        if key == WHOAMI:
            return self.ask()
        return _encode(Control(key, None if payload is None else _b(payload)))

    def ask_reach(self, key: bytes | str) -> bytes:
        """Ask how many subscribers a message on *key* would reach (answered by a
        `Reach` event; a broker that does not know the question refuses the CMSG)."""
        key = _b(key)
        _encode(Publish(key, b""))  # the key as a publish on it is checked (no NUL)
        self.rules.check_key(key)
        return _encode(Control(REACH, key))

    # -- request/reply (sbus.request) --------------------------------------------

    def new_inbox(self) -> bytes:
        """A fresh private reply key under this connection's credentials (`whoami` must
        have been answered: the key is a secret key of this process)."""
        if self.whoami is None:
            raise InvalidRequest("a reply inbox needs the broker's whoami answer first")
        return inbox_root(self.whoami) + secrets.token_hex(8).encode()

    def request(self, key: bytes | str, payload: bytes | str, inbox: bytes) -> bytes:
        """The request packet: a message on *key* asking for its reply on *inbox*."""
        return self.publish(key, make_request(inbox, _b(payload)))

    def reply_to(self, event: Event, inbox: bytes) -> bytes | None | bool:
        """While waiting on *inbox*: the reply's payload if *event* is it; False for a
        late reply to one of our earlier inboxes (dropped); None for anything else (kept
        for the program)."""
        if type(event) is Publish and self.whoami is not None:
            if event.key == inbox:
                return event.payload
            if event.key.startswith(inbox_root(self.whoami)):
                return False
        return None

    # -- packets -> events -------------------------------------------------------

    def decode(self, buf, offsets, lengths) -> tuple[list[Event], list[int]]:
        """The events of a batch, and the indices of those that are not messages: packet
        *i* is ``buf[offsets[i]:offsets[i] + lengths[i]]`` (*buf* bytes or an mmap).
        Messages take `protocol.parse_batch`'s fast path and are returned as they are;
        control messages are taken in as by `receive` (drop counts, whoami, refusals).
        Raises `protocol.ProtocolError` as `receive` does."""
        others: list[int] = []
        events = protocol.parse_batch(buf, offsets, lengths, others)
        for i in others:
            events[i] = self._classify(events[i], buf[offsets[i]:offsets[i] + 24])
        return events, others

    def receive(self, packet: bytes) -> Event:
        """The event one packet from the broker carries.  Raises `protocol.ProtocolError`
        for a packet no broker sends (malformed, or a client-only verb)."""
        event = protocol.parse(packet)
        if type(event) is Publish:
            return event
        return self._classify(event, packet)

    def _classify(self, event: protocol.Event, packet: bytes) -> Event:
        if type(event) is not Control:
            raise protocol.ProtocolError(f"a client-only packet from the broker: "
                                         f"{brief(packet, 24)}")
        return self.control_event(event.key, event.payload or b"")

    def control_event(self, key: bytes, payload: bytes) -> Event:
        """`receive` for a control message already split (for readers with their own
        fast path for messages)."""
        if key == DROPPED:
            count = int(payload) if payload.isdigit() else 0
            self.dropped += count
            return Dropped(count)
        if key == WHOAMI:
            if self.adopting is not None:  # the earlier process's question (`adopt`)
                return Whoami(payload)
            if self.asked:
                self.asked -= 1
                self.answers += 1
            self.whoami = payload
            try:
                self.cred = Credentials.parse(payload, payload[1:2] or b"/")
            except ValueError:
                self.cred = None
            if payload[:1] == b"!" and len(payload) > 1 and payload[1:2] != self.rules.sep:
                self.rules = KeyRules(payload[1:2])  # a broker of another dialect
            return Whoami(payload)
        if key == REACH:
            asked, _, count = payload.rpartition(b"\0")
            if self.adopting is not None and asked == self.adopting:
                self.adopting = None  # the earlier process's answers end here
            return Reach(asked, int(count) if count.isdigit() else None)
        if key.startswith(REFUSED + b"/"):
            return Refusal(key[len(REFUSED) + 1:].decode("utf-8", "replace"),
                           payload.decode("utf-8", "replace"))
        return Control(key, payload)


#: Seconds between two questions whether anyone subscribes to a request's key again,
#: after a reconnect (`RequestRound`): a replier reconnects on its own back-off.
REACH_RETRY = 0.05
#: Seconds a requester waits at most before it looks whether its client reconnected
#: meanwhile (the shells reconnect inside their receive, which goes on waiting).
LOOK_AGAIN = 0.1


class RequestRound:
    """When one request goes out, across reconnects (pure: `Client.request` and
    `AsyncClient.request` carry out what it returns).

    On the first connection the request goes at once, after the question whether anyone
    subscribes to its key (with *no_responders*: nobody is `NoResponders`).  After a
    reconnect the replier must reconnect too, and a request published before it has
    subscribed again reaches nobody, silently: so the request waits, the question is asked
    every `REACH_RETRY` seconds (`retry_at`, `timer`), and the request goes once the
    answer names someone (or the broker will not say).  ``held`` tells a timeout that the
    request was waiting for a replier to come back.  The shells wait until `wake_at` and
    then call `connected` and `timer`."""

    def __init__(self, session: Session, key: bytes, payload: bytes, inbox: bytes,
                 no_responders: bool) -> None:
        self.session, self.key = session, key
        self.payload, self.inbox = payload, inbox
        self.no_responders = no_responders
        self.connection = 0  # the connection the request went out on (0: none yet)
        self.held = False
        self.retry_at: float | None = None
        self._first_question = False  # asked with the first sending: its answer may end it

    def connected(self, connections: int) -> list[bytes]:
        """What to send on connection number *connections* (nothing if already done)."""
        if connections == self.connection:
            return []
        first, self.connection, self.retry_at = not self.connection, connections, None
        ask = self.session.ask_reach(self.key)
        if not first:
            self.held, self._first_question = True, False
            return [ask]
        self._first_question = self.no_responders
        return ([ask] if self.no_responders else []) + [self._request()]

    def reach(self, event: Reach, now: float) -> list[bytes]:
        """The broker's answer to the question (events on other keys are not ours)."""
        if event.key != self.key:
            return []
        if not self.held:
            first, self._first_question = self._first_question, False
            if first and event.count == 0:
                raise NoResponders(f"no responders for {brief(self.key)}")
            return []
        if event.count == 0:
            self.retry_at = now + REACH_RETRY
            return []
        return self._release()

    def wake_at(self, now: float, deadline: float) -> float:
        """When the shell should stop waiting for an event and call `connected` and
        `timer` (the time of the next question, and a reconnect seen within `LOOK_AGAIN`)."""
        return min(deadline, now + LOOK_AGAIN,
                   math.inf if self.retry_at is None else self.retry_at)

    def timer(self, now: float) -> list[bytes]:
        """Called at `retry_at`: the question again."""
        if self.retry_at is None or now < self.retry_at:
            return []
        self.retry_at = None
        return [self.session.ask_reach(self.key)]

    def not_understood(self) -> list[bytes]:
        """A broker that does not know the question: the request goes as it is."""
        return self._release() if self.held else []

    def _release(self) -> list[bytes]:
        self.held, self.retry_at = False, None
        return [self._request()]

    def _request(self) -> bytes:
        return self.session.request(self.key, self.payload, self.inbox)


#: Seconds between two questions of an `Unconfirmed` count while messages go.
CONFIRM_EVERY = 0.25


class Unconfirmed:
    """How many of a publisher's messages a lost connection may have taken with it
    (pure: the shells send `question` when it returns one, take the answers as they read,
    and call `lost` when the connection is lost).

    What the broker has acted on it confirms by answering a whoami question (a barrier:
    the answer comes after everything sent before it).  A question goes at most every
    `CONFIRM_EVERY` seconds while messages go; when the connection is lost, those sent
    since the last confirmed question may never have been read by the broker: at most
    that many are lost with it (a kill -9 of the broker; a stop reads them first).  What
    the broker had read and still held for slow subscribers when it was killed is lost
    too, but not counted here: that is the subscribers' loss, not the connection's.

    Other questions may share the connection (the gateway asks one after each SUB): the
    open question's answer is known by its place among them (`Session.answers`).  A
    carrier of many publishers (the gateway) says whose each message is (`add`), and
    learns after a loss how many of each one's it may have taken (`taken`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.sent = self.confirmed = 0
        self.asked_at: int | None = None  # messages sent when the open question went
        self._answer = 0  # `Session.answers` once the open question is answered
        self.next_at = 0.0
        #: whose messages were sent before the open question, and since (`add`)
        self._before: Counter[Hashable] = Counter()
        self._since: Counter[Hashable] = Counter()
        #: whose messages the last lost connection may have taken, and how many (`lost`)
        self.taken: Counter[Hashable] = Counter()

    def add(self, n: int, by: Hashable) -> None:
        """*n* messages of *by*'s are being sent (`sent` counts the others)."""
        self.sent += n
        self._since[by] += n

    def answered(self) -> None:
        """Take the answer to the open question, if the shell has read it."""
        if self.asked_at is not None and self.session.answers >= self._answer:
            self.confirmed, self.asked_at = self.asked_at, None
            self._before.clear()

    def question(self, now: float) -> bytes | None:
        """The question to send now, if one is due (its answer, once read, confirms)."""
        self.answered()
        if now < self.next_at:
            return None
        self.next_at = now + CONFIRM_EVERY  # (the shells look no sooner either)
        if self.asked_at is not None or self.sent == self.confirmed:
            return None
        self.asked_at = self.sent
        question = self.session.ask()
        self._answer = self.session.answers + self.session.asked
        self._before, self._since = self._since, self._before  # (that one is empty)
        return question

    def unsent(self) -> None:
        """The question `question` returned could not be sent: as if never asked (and
        due again at once)."""
        if self.asked_at is not None:
            self.asked_at = None
            self.session.unask()
            self._since.update(self._before)
            self._before.clear()
        self.next_at = 0.0

    @property
    def pending(self) -> bool:
        """Is a question under way, or one due for what was sent since the last?"""
        return self.asked_at is not None or self.sent > self.confirmed

    def lost(self) -> int:
        """The connection is lost: how many messages may be lost with it (counted once;
        called before the reconnect forgets the old connection's questions)."""
        self.answered()
        n, self.confirmed, self.asked_at = self.sent - self.confirmed, self.sent, None
        self.taken = self._before + self._since
        self._before, self._since = Counter(), Counter()
        return n

    def said(self, line: str) -> str:
        """A lost connection's line, with how many messages may be lost with it."""
        n = self.lost()
        return line + (f" (up to {n} message(s) sent since the broker last confirmed may "
                       "be lost with the connection)" if n else "")


#: Seconds before a bound (`Backoff.try_by`) the last reconnect attempt is made: time for
#: its opening (milliseconds with a local broker).
LAST_TRY = 0.2


class Backoff:
    """Delays between reconnect attempts: *first* seconds doubling up to *maximum*, each
    between half and all of that ("equal jitter", so many clients of one restarted
    broker do not all come back in the same instant).  `reset` once connected.

    `try_by`, if set, is a time (of *clock*) by which one attempt is made: a delay that
    would pass it is cut to reach it (the last try before a request's timeout, or before
    the gateway's waiting publishers are dropped: a broker back just before then is found
    in time)."""

    def __init__(self, first: float = 0.05, maximum: float = 2.0,
                 rand: Callable[[float, float], float] = random.uniform,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first = first
        self.maximum = maximum
        self.failures = 0
        self._rand = rand
        self._clock = clock
        self.try_by: float | None = None

    def next(self, try_by: float | None = None) -> float:
        """The next delay; *try_by*: a bound of this call's own, beside `try_by`."""
        base = min(self.maximum, self.first * 2.0 ** min(self.failures, 60))
        self.failures += 1
        delay = base / 2 + self._rand(0, base / 2)
        bounds = [t for t in (self.try_by, try_by) if t is not None]
        if bounds:
            left = min(bounds) - self._clock()
            if 0 < left < delay:
                return left
        return delay

    def reset(self) -> None:
        self.failures = 0
