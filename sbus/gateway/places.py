"""TLS handshake places shared fairly between client addresses.

A stalled handshake holds memory no other bound counts (OpenSSL keeps a partial
ClientHello), so the gateway lets only ``total`` handshakes be in progress at once and
``per_address`` of one address.  First come, first served is not enough: many addresses
that each stall a handshake keep the places full, and a new address waits behind every
one of their redials.  So a place goes by max-min fairness:

* a freed place goes to the waiting address that holds the fewest places (of equals,
  the one that has waited longest at that count);
* when every place is taken, a newcomer whose address holds at least two fewer than the
  address holding the most displaces that address's oldest handshake at once (its scope
  is cancelled; the handshake is closed and counted by its owner).  Two fewer, not one,
  so handshakes of addresses with equal shares never displace each other in a loop.

Pure bookkeeping over trio primitives: no sockets, tested directly
(``tests/test_gateway_places.py``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

__all__ = ["Places"]


class Place:
    """One handshake's place: its scope is cancelled if a newcomer displaces it."""

    __slots__ = ("address", "scope", "displaced", "released")

    def __init__(self, address: str) -> None:
        self.address = address
        self.scope = trio.CancelScope()
        self.displaced = False
        self.released = False


class _Waiter:
    __slots__ = ("event", "place")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.place: Place | None = None


class _Address:
    __slots__ = ("held", "waiting")

    def __init__(self) -> None:
        self.held: deque[Place] = deque()  # oldest first
        self.waiting: deque[_Waiter] = deque()


class Places:
    """*total* places, at most *per_address* of one address, shared as the module says."""

    def __init__(self, total: int, per_address: int) -> None:
        self.total = total
        self.per_address = per_address
        self.used = 0
        self.displaced = 0  # handshakes displaced by a newcomer, in all
        self._addresses: dict[str, _Address] = {}
        # [n]: addresses holding n places (n < per_address) with a waiter, in order of
        # arrival at that count: the first of the lowest non-empty one is served next
        self._ready: list[OrderedDict[str, None]] = [OrderedDict()
                                                     for _ in range(per_address)]
        # [n]: addresses holding n >= 1 places, in order of arrival at that count: the
        # first of the highest non-empty one is displaced from
        self._holding: list[OrderedDict[str, None]] = [OrderedDict()
                                                       for _ in range(per_address + 1)]

    def held(self, address: str) -> int:
        entry = self._addresses.get(address)
        return len(entry.held) if entry else 0

    def waiting(self) -> int:
        return sum(len(a.waiting) for a in self._addresses.values())

    @asynccontextmanager
    async def hold(self, address: str) -> AsyncIterator[Place]:
        """Wait for a place for *address*, then hold it for the block.  Run the
        handshake inside ``place.scope``: it is cancelled if the place is displaced
        (``place.displaced``)."""
        place = await self._take(address)
        try:
            yield place
        finally:
            self._release(place)

    # -- bookkeeping ------------------------------------------------------------------

    async def _take(self, address: str) -> Place:
        await trio.lowlevel.checkpoint()
        entry = self._addresses.setdefault(address, _Address())
        waiter = _Waiter()
        entry.waiting.append(waiter)
        self._mark(address)
        self._serve()
        if waiter.place is not None:
            return waiter.place
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.place is not None:  # granted, but cancelled before it ran
                self._release(waiter.place)
            else:
                self._unmark(address)
                entry.waiting.remove(waiter)
                self._mark(address)
                self._forget(address)
            raise
        assert waiter.place is not None
        return waiter.place

    def _serve(self) -> None:
        """Hand places to waiters, the address holding fewest first, displacing from
        the address holding most when none is free (the module's rule)."""
        while True:
            count = next((n for n, bucket in enumerate(self._ready) if bucket), None)
            if count is None:
                return
            if self.used >= self.total and not self._displace_above(count + 1):
                return
            bucket = self._ready[count]
            address = next(iter(bucket))
            entry = self._addresses[address]
            self._unmark(address)
            waiter = entry.waiting.popleft()
            waiter.place = place = Place(address)
            entry.held.append(place)
            self.used += 1
            self._mark(address)
            waiter.event.set()

    def _displace_above(self, least: int) -> bool:
        """Free the oldest place of the address holding the most, if that is more than
        *least*: whether one was freed."""
        for count in range(self.per_address, least, -1):
            if self._holding[count]:
                address = next(iter(self._holding[count]))
                victim = self._addresses[address].held[0]
                victim.displaced = True
                victim.scope.cancel()
                self.displaced += 1
                self._free(victim)  # now: its task may not run before the newcomer's
                return True
        return False

    def _release(self, place: Place) -> None:
        if not place.released:
            self._free(place)
            self._serve()

    def _free(self, place: Place) -> None:
        place.released = True
        address = place.address
        self._unmark(address)
        self._addresses[address].held.remove(place)
        self.used -= 1
        self._mark(address)
        self._forget(address)

    # an address's place in the buckets follows its held count and its waiters
    def _unmark(self, address: str) -> None:
        n = len(self._addresses[address].held)
        self._holding[n].pop(address, None)
        if n < self.per_address:
            self._ready[n].pop(address, None)

    def _mark(self, address: str) -> None:
        entry = self._addresses[address]
        n = len(entry.held)
        if n:
            self._holding[n][address] = None
        if n < self.per_address and entry.waiting:
            self._ready[n][address] = None

    def _forget(self, address: str) -> None:
        entry = self._addresses[address]
        if not entry.held and not entry.waiting:
            del self._addresses[address]
