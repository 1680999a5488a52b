"""Per-user accounting: one user's clients can exhaust only that user's share.

Like dbus-broker, the broker charges resources to the UID of the connecting
process (kernel-verified) rather than to connections, which any user can open
in numbers.  Pure bookkeeping; the broker asks before it grants.

What one UID can make the broker hold, at most (docs/security.md has the figures):
its connections (``connections_per_user`` x about 1.5 KB each), its subscriptions
(``subscription_bytes_per_user``, charged by `routing.pattern_cost`), the packets
queued for its clients plus what its paused publishers had already sent
(``queued_bytes_per_user``, each packet with its overhead) and its share of the
route cache (``cache_bytes_per_user``), and a share of the loop's time in each round
(`TimeShare`).  Root is exempt: many system services run as root, and they are served
as before, a turn for each connection.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from .flood import Budget

__all__ = ["Limits", "UserAccounts", "LogAllowance", "TimeShare"]


@dataclass(frozen=True)
class Limits:
    #: Connections one UID may hold at once (`sbus serve` lowers it to a share of its
    #: descriptors: `rlimits.connections_per_user_for`).
    connections_per_user: int = 1024
    #: Subscriptions (duplicates counted) one UID may hold at once.
    subscriptions_per_user: int = 65536
    #: Bytes of broker memory one UID's subscriptions may cost (`routing.pattern_cost`).
    subscription_bytes_per_user: int = 16 * 1024 * 1024
    #: Bytes queued in the broker for all of one UID's connections together, plus what
    #: its paused publishers had sent beyond a full queue.
    queued_bytes_per_user: int = 64 * 1024 * 1024
    #: Bytes of the route cache in all.
    cache_bytes: int = 16 * 1024 * 1024
    #: Bytes of the route cache one UID's publishes may fill.
    cache_bytes_per_user: int = 2 * 1024 * 1024
    #: UIDs exempt from the limits (root by default: it can raise them anyway).
    exempt: frozenset[int] = frozenset({0})
    #: UIDs whose subscribers may pause other users' publishers (`block`); root always may.
    trusted: frozenset[int | str] = field(default_factory=frozenset)

    def may_pause_others(self, uid: int) -> bool:
        return uid == 0 or uid in self.trusted


class UserAccounts:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.connections: Counter[int] = Counter()
        self.subscriptions: Counter[int] = Counter()
        self.subscription_bytes: Counter[int] = Counter()
        self.budgets: dict[int, Budget] = {}

    def budget(self, conn) -> Budget | None:
        """The queued-bytes budget the connection shares with its user's other ones."""
        uid = conn.cred.uid
        if uid in self.limits.exempt:
            return None
        budget = self.budgets.get(uid)
        if budget is None:
            budget = self.budgets[uid] = Budget(self.limits.queued_bytes_per_user)
        return budget

    def connect(self, conn) -> str | None:
        """Charge a new connection; a reason string if it is refused."""
        uid = conn.cred.uid
        if uid not in self.limits.exempt and \
                self.connections[uid] >= self.limits.connections_per_user:
            return f"uid {uid} already holds {self.connections[uid]} connections (the limit)"
        self.connections[uid] += 1
        return None

    def disconnect(self, conn) -> None:
        uid = conn.cred.uid
        self.connections[uid] -= 1
        self.subscriptions[uid] -= conn.subscriptions
        self.subscription_bytes[uid] -= conn.subscription_bytes
        for counter in (self.connections, self.subscriptions, self.subscription_bytes):
            if counter[uid] <= 0:
                del counter[uid]
        if uid not in self.connections:
            self.budgets.pop(uid, None)

    def subscribe(self, conn, cost: int) -> str | None:
        """Charge a subscription costing *cost* bytes; a reason string if it is refused."""
        uid = conn.cred.uid
        if uid not in self.limits.exempt:
            if self.subscriptions[uid] >= self.limits.subscriptions_per_user:
                return (f"uid {uid} already holds {self.subscriptions[uid]} subscriptions "
                        "(the limit)")
            if self.subscription_bytes[uid] + cost > self.limits.subscription_bytes_per_user:
                return (f"uid {uid}'s subscriptions would cost "
                        f"{self.subscription_bytes[uid] + cost} bytes "
                        f"(the limit is {self.limits.subscription_bytes_per_user})")
        self.subscriptions[uid] += 1
        self.subscription_bytes[uid] += cost
        conn.subscriptions += 1
        conn.subscription_bytes += cost
        return None

    def unsubscribe(self, conn, cost: int) -> None:
        uid = conn.cred.uid
        self.subscriptions[uid] -= 1
        self.subscription_bytes[uid] -= cost
        conn.subscriptions -= 1
        conn.subscription_bytes -= cost

    def cache_owner(self, conn) -> int:
        """Whose share of the route cache a lookup for *conn* is charged to."""
        return conn.cred.uid


def _refilled(tokens: float, elapsed: float, burst: int, interval: float) -> float:
    """A bucket's tokens after *elapsed* seconds: one more per *interval*, *burst* at most."""
    return min(burst, tokens + elapsed / interval)


class LogAllowance:
    """Log lines about clients, rationed per UID (not per connection: reconnecting must not
    buy a new allowance).  A UID gets `burst` lines, then one per `interval` seconds; what
    was held back is counted and said in the next line it may write.

    With *overall* (burst, interval), all keys together get that too: keys that cost
    nothing to make (a gateway's peer addresses) would each bring a fresh allowance,
    and more of them than `users` are forgotten.  Lines held back by it are counted in
    `held_overall`, for the next line written to say."""

    def __init__(self, burst: int = 10, interval: float = 60.0, users: int = 4096,
                 clock=time.monotonic, overall: tuple[int, float] | None = None) -> None:
        self.burst = burst
        self.interval = interval
        self.users = users
        self.clock = clock
        self._state: OrderedDict[Hashable, list] = OrderedDict()  # uid -> [tokens, at, held]
        self._overall = overall
        self._tokens = float(overall[0]) if overall else 0.0
        self._at = clock()
        self.held_overall = 0

    def take(self, uid: Hashable) -> int | None:
        """None if a line about *uid* must not be written now; else how many were held back
        since the last one (to say so in it).  (*uid* may be any key a line is rationed
        by: a peer address, a user and the kind of line.)"""
        now = self.clock()
        state = self._state.get(uid)
        if state is None:
            state = self._state[uid] = [float(self.burst), now, 0]
            if len(self._state) > self.users:
                self._state.popitem(last=False)
        else:
            self._state.move_to_end(uid)
            state[0] = _refilled(state[0], now - state[1], self.burst, self.interval)
            state[1] = now
        if state[0] < 1:
            state[2] += 1
            return None
        if self._overall is not None:
            self._tokens = _refilled(self._tokens, now - self._at, *self._overall)
            self._at = now
            if self._tokens < 1:
                self.held_overall += 1
                return None
            self._tokens -= 1
        state[0] -= 1
        held, state[2] = state[2], 0
        return held

    def said_overall(self) -> int:
        """Lines held back by the overall bound since this was last asked."""
        held, self.held_overall = self.held_overall, 0
        return held


class TimeShare:
    """The loop's time in one round, per user: a user whose clients took *share* seconds
    of this round is served no more in it.

    A client's turn is bounded, but a user with a thousand connections would get a
    thousand turns in every round, and everyone else would wait for all of them.  With a
    share, a round lasts about one share per busy user, however many connections each
    holds.  The shell charges what it measured and skips the clients of users who had
    their share; epoll is level-triggered, so a skipped client is reported again in the
    next round, where the shell serves it before its user's other clients."""

    __slots__ = ("share", "spent", "exempt")

    def __init__(self, share: float, exempt: frozenset[int] = frozenset()) -> None:
        self.share = share
        self.spent: dict[int, float] = {}
        self.exempt = exempt  # UIDs never made to wait (`Limits.exempt`)

    def begin(self) -> None:
        """A new round: every user may be served again."""
        if self.spent:
            self.spent.clear()

    def over(self, uid: int) -> bool:
        """Whether *uid* had its share of this round."""
        return self.spent.get(uid, 0.0) >= self.share

    def charge(self, uid: int, seconds: float) -> None:
        if uid not in self.exempt:
            self.spent[uid] = self.spent.get(uid, 0.0) + seconds
