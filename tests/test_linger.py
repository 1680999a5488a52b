"""Adaptive coalescing (`sbus.linger`), as a pure object."""

from __future__ import annotations

import pytest

from sbus.linger import RUN, Linger


def test_a_slow_steady_rate_never_waits() -> None:
    pace = Linger(0.001)  # waits only above 2,000 msg/s
    waits = [pace.after(i * 0.001, 1) for i in range(1000)]  # 1,000 msg/s, one per turn
    assert waits == [0.0] * 1000


def test_a_fast_rate_waits_every_turn_and_stays_engaged() -> None:
    pace = Linger(0.001)
    assert pace.after(0.0, 1) == 0.0  # the first message after a quiet spell: at once
    assert pace.after(0.000125, 1) == 0.001  # the next 125 µs later: 8,000 msg/s
    now = 0.000125
    for _ in range(100):  # each wait gathers ~9 messages: the rate stays above
        now += 0.001 + 0.000125
        assert pace.after(now, 9) == 0.001


def test_the_rate_falling_ends_the_waits() -> None:
    pace = Linger(0.001)
    pace.after(0.0, 1)
    assert pace.after(0.0001, 1) == 0.001
    assert pace.after(0.0012, 1) == 0.0  # one message in 1.1 ms: 900 msg/s
    assert pace.after(0.00225, 2) == 0.0  # two in 1.05 ms: under 2,000 msg/s


def test_a_turn_that_took_nothing_never_waits() -> None:
    pace = Linger(0.001)
    pace.after(0.0, 5)
    assert pace.after(0.0, 0) == 0.0
    assert pace.after(0.0, 3) == 0.001  # the same instant: as fast as can be


def test_a_burst_is_never_slowed() -> None:
    pace = Linger(0.001)
    pace.after(0.0, 1)
    assert pace.after(0.0001, RUN - 1) == 0.001
    assert pace.after(0.0002, RUN) == 0.0  # a run already: the next turn at once
    assert pace.after(0.0003, 256) == 0.0


def test_off() -> None:
    pace = Linger(0)
    assert all(pace.after(i * 1e-6, 100) == 0.0 for i in range(10))
    with pytest.raises(ValueError):
        Linger(-0.001)
