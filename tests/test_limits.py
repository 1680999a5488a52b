"""`sbus.limits` as pure bookkeeping (the attacks through real processes are in
test_user_limits.py and test_attacks_broker.py)."""

from __future__ import annotations

from sbus.limits import LogAllowance, TimeShare


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


def test_log_allowance_overall_bounds_lines_about_many_keys():
    """Each key has its own allowance, and with *overall* all together have one too: a
    thousand fresh keys (a gateway's peer addresses cost an attacker little) get 5 lines
    written, the rest counted and handed to the next line written."""
    now = [0.0]
    allowance = LogAllowance(burst=3, interval=10.0, clock=lambda: now[0], overall=(5, 1.0))
    written = [k for k in range(1000) if allowance.take(k) is not None]
    assert written == [0, 1, 2, 3, 4]
    assert allowance.said_overall() == 995 and allowance.said_overall() == 0
    now[0] += 2.0  # two lines' worth of the overall allowance back
    assert [allowance.take(k) for k in (7, 8, 9)] == [0, 0, None]
    assert allowance.said_overall() == 1
    plain = LogAllowance(burst=3, interval=10.0, clock=lambda: now[0])
    assert sum(plain.take(k) is not None for k in range(1000)) == 1000
