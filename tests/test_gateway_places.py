"""The gateway's TLS handshake places (`sbus.gateway.places`) as a pure object: fewest
held first, a newcomer displaces the address holding the most, no place leaks however
holders and waiters are cancelled."""

from __future__ import annotations

import random

import trio
import trio.testing

from sbus.gateway.places import Places


def test_a_freed_place_goes_to_the_address_holding_fewest():
    async def main():
        places = Places(total=3, per_address=3)
        got: list[str] = []
        release = {a: trio.Event() for a in "abc"}

        async def holder(address: str, stop: trio.Event) -> None:
            async with places.hold(address):
                got.append(address)
                await stop.wait()

        async with trio.open_nursery() as nursery:
            for address in "abc":
                nursery.start_soon(holder, address, release[address])
                await trio.testing.wait_all_tasks_blocked()
            assert places.used == 3
            late = trio.Event()
            nursery.start_soon(holder, "a", late)  # a waits first: it holds 1
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(holder, "d", late)  # d holds none, arrives later; no
            await trio.testing.wait_all_tasks_blocked()  # address holds 2 to displace
            assert got == ["a", "b", "c"] and places.waiting() == 2
            release["b"].set()
            await trio.testing.wait_all_tasks_blocked()
            assert got[-1] == "d" and places.waiting() == 1 and places.displaced == 0
            release["c"].set()
            await trio.testing.wait_all_tasks_blocked()
            assert got[-1] == "a" and places.waiting() == 0
            release["a"].set()
            late.set()
        assert places.used == 0 and places.waiting() == 0 and not places._addresses

    trio.run(main)


def test_a_newcomer_displaces_the_oldest_place_of_the_address_holding_most():
    async def main():
        places = Places(total=4, per_address=4)
        outcomes: list[tuple[str, int, bool]] = []

        async def stall(address: str, n: int) -> None:
            async with places.hold(address) as place:
                with place.scope:
                    await trio.sleep_forever()
                outcomes.append((address, n, place.displaced))

        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(stall, "x", n)
                await trio.testing.wait_all_tasks_blocked()
            assert places.held("x") == 4
            nursery.start_soon(stall, "y", 0)  # holds 0 < 4 - 1: displaces x's oldest
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == [("x", 0, True)] and places.held("y") == 1
            nursery.start_soon(stall, "z", 0)  # 0 vs x's 3
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes[-1] == ("x", 1, True)
            assert (places.held("x"), places.held("y"), places.held("z")) == (2, 1, 1)
            nursery.start_soon(stall, "w", 0)  # 0 vs x's 2: still two fewer
            await trio.testing.wait_all_tasks_blocked()
            assert (places.held("x"), places.used, places.displaced) == (1, 4, 3)
            nursery.start_soon(stall, "v", 0)  # 0 vs 1: equal shares wait, never churn
            await trio.testing.wait_all_tasks_blocked()
            assert places.displaced == 3 and places.waiting() == 1
            nursery.cancel_scope.cancel()
        assert places.used == 0 and not places._addresses

    trio.run(main)


def test_no_place_leaks_whatever_is_cancelled_when():
    """Random holders and waiters of a few addresses, cancelled at random moments (while
    waiting, just after being granted, while holding): the places in use always match
    the holders, never over the bounds, and all come back."""
    rng = random.Random(7)

    async def main():
        places = Places(total=5, per_address=3)
        holding: dict[str, int] = {}

        async def client(address: str, patience: float, hold_for: float) -> None:
            with trio.move_on_after(patience):
                async with places.hold(address) as place:
                    with place.scope:
                        holding[address] = holding.get(address, 0) + 1
                        assert places.held(address) <= places.per_address
                        assert places.used <= places.total
                        try:
                            await trio.sleep(hold_for)
                        finally:
                            holding[address] -= 1

        async with trio.open_nursery() as nursery:
            for _ in range(400):
                nursery.start_soon(client, rng.choice("abcdef"), rng.random() * 0.02,
                                   rng.random() * 0.02)
                if rng.random() < 0.3:
                    await trio.sleep(rng.random() * 0.002)
        assert places.used == 0 and places.waiting() == 0 and not places._addresses
        assert not any(holding.values())
        assert places.displaced > 0

    trio.run(main)
