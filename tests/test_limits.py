"""`sbus.limits` as pure bookkeeping (the attacks through real processes are in
test_user_limits.py and test_attacks_broker.py)."""

from __future__ import annotations

from sbus.limits import TimeShare


def test_a_user_that_had_its_share_waits_for_the_next_round() -> None:
    share = TimeShare(0.002)
    assert not share.over(1000)
    share.charge(1000, 0.0015)
    assert not share.over(1000)  # under its share: another of its clients is served
    share.charge(1000, 0.0006)
    assert share.over(1000)
    assert not share.over(1001)  # each user has a share of its own
    share.charge(1001, 0.0001)
    share.begin()
    assert not share.over(1000) and not share.over(1001)
    assert share.spent == {}


def test_an_exempt_user_never_waits() -> None:
    share = TimeShare(0.002, exempt=frozenset({0}))
    share.charge(0, 1.0)
    assert not share.over(0)
    share.charge(1000, 1.0)
    assert share.over(1000)
