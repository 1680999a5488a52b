"""Per-user accounting: one user's clients can exhaust only that user's share.

Like dbus-broker, the broker charges resources to the UID of the connecting
process (kernel-verified) rather than to connections, which any user can open
in numbers.  Pure bookkeeping; the broker asks before it grants.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .flood import Budget

__all__ = ["Limits", "UserAccounts"]


@dataclass(frozen=True)
class Limits:
    #: Connections one UID may hold at once.
    connections_per_user: int = 4096
    #: Subscriptions (duplicates counted) one UID may hold at once.
    subscriptions_per_user: int = 65536
    #: Bytes queued in the broker for all of one UID's connections together.
    queued_bytes_per_user: int = 64 * 1024 * 1024
    #: UIDs exempt from the limits (root by default: it can raise them anyway).
    exempt: frozenset[int] = frozenset({0})


class UserAccounts:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.connections: Counter[int] = Counter()
        self.subscriptions: Counter[int] = Counter()
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
        for counter in (self.connections, self.subscriptions):
            if counter[uid] <= 0:
                del counter[uid]
        if uid not in self.connections:
            self.budgets.pop(uid, None)

    def subscribe(self, conn) -> str | None:
        uid = conn.cred.uid
        if uid not in self.limits.exempt and \
                self.subscriptions[uid] >= self.limits.subscriptions_per_user:
            return f"uid {uid} already holds {self.subscriptions[uid]} subscriptions (the limit)"
        self.subscriptions[uid] += 1
        return None

    def unsubscribe(self, conn) -> None:
        self.subscriptions[conn.cred.uid] -= 1
