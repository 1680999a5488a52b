"""The client session as a pure object: intents -> packets, packets -> events."""

from __future__ import annotations

import pytest

from sbus.errors import InvalidRequest, Refused
from sbus.protocol import Control, ProtocolError, Publish
from sbus.session import Backoff, Dropped, Refusal, Session, Whoami


def test_requests_become_packets_and_are_remembered():
    s = Session()
    assert s.connected() == []  # a first connection sends nothing of itself
    assert s.subscribe("a/*") == b"SUB a/*"
    assert s.subscribe(b"a/*") == b"SUB a/*"
    assert s.set_flood(soft="discard", order="stack") == [b"CMSG blocking/soft/discard",
                                                           b"CMSG order/stack"]
    assert s.publish("k", "v") == b"MSG k\0v"
    assert s.unsubscribe(b"a/*") == b"UNSUB a/*"
    assert s.patterns == {b"a/*": 1}  # two SUB need two UNSUB


def test_a_reconnect_restores_policy_patterns_then_asks():
    s = Session()
    s.connected()
    s.subscribe(b"x")
    s.subscribe(b"x")
    s.subscribe(b"y/")
    s.set_flood(hard="block")
    s.set_flood(hard="error")  # the most recent setting wins
    s.publisher_nowait()
    s.ask()  # lost with the old connection
    assert s.connected() == [b"CMSG blocking/hard/error", b"CMSG blocking/publisher/nowait",
                             b"SUB x", b"SUB x", b"SUB y/", b"CMSG !/cred/whoami"]
    assert s.asked == 1  # only the new question counts
    assert s.connections == 2


@pytest.mark.parametrize("pattern, why", [
    (b"a/!/b", "reserved"),
    (b"!/cred/a/0/1/", "not decimal"),
    (b"!/cred/*/0/1/", "wildcard"),
    (b"!/cred/1/2", "truncated"),
    (b"a\0b", "NUL"),
    (b"/".join([b"x"] * 300), "segments"),
])
def test_patterns_are_checked_with_the_brokers_rules(pattern, why):
    s = Session()
    with pytest.raises(InvalidRequest, match=why):
        s.subscribe(pattern)
    assert not s.patterns  # nothing remembered, nothing to send


def test_own_credentials_are_checked_once_known():
    s = Session()
    assert s.subscribe(b"!/cred/1/2/3/x") == b"SUB !/cred/1/2/3/x"  # unknown yet: the broker says
    s.ask()
    assert s.receive(b"CMSG !/cred/whoami\0!/cred/1/2/4") == Whoami(b"!/cred/1/2/4")
    with pytest.raises(InvalidRequest, match="names PID 3, subscriber has 4"):
        s.subscribe(b"!/cred/1/2/3/x")


def test_keys_sizes_and_flood_values_are_checked():
    s = Session(max_message=100)
    with pytest.raises(InvalidRequest, match="reserved"):
        s.publish(b"a/!/b", b"x")
    with pytest.raises(InvalidRequest, match="104 bytes with its header, over .* 100"):
        s.publish(b"k", b"x" * 98)
    assert len(s.publish(b"k", b"x" * 94)) == 100
    with pytest.raises(InvalidRequest, match="'bogus' is not one of queue, discard"):
        s.set_flood(soft="bogus")
    with pytest.raises(InvalidRequest, match="not subscribed"):
        s.unsubscribe(b"never")
    assert not s.flood and not s.patterns


def test_packets_become_events():
    s = Session()
    assert s.receive(b"MSG k\0\0pay") == Publish(b"k", b"\0pay")
    assert s.receive(b"CMSG blocking/dropped\x0012") == Dropped(12)
    assert s.receive(b"CMSG blocking/dropped\x003") == Dropped(3)
    assert s.dropped == 15
    refusal = s.receive(b"CMSG refused/sub\0'!/x' misuses '!'")
    assert refusal == Refusal("sub", "'!/x' misuses '!'")
    assert isinstance(refusal.error(), Refused)
    assert str(refusal.error()) == "the broker refused the SUB: '!/x' misuses '!'"
    assert s.receive(b"CMSG broker/status\0{}") == Control(b"broker/status", b"{}")
    with pytest.raises(ProtocolError):
        s.receive(b"SUB x")  # a broker never sends client verbs
    with pytest.raises(ProtocolError):
        s.receive(b"HELLO")


def test_the_whoami_barrier_counts_questions():
    s = Session()
    s.ask()
    s.ask()
    assert s.asked == 2
    s.receive(b"CMSG !/cred/whoami\0!/cred/1/2/3")
    assert s.asked == 1 and s.whoami == b"!/cred/1/2/3" and s.cred.pid == 3
    s.receive(b"CMSG !/cred/whoami\0!/cred/1/2/3")
    s.receive(b"CMSG !/cred/whoami\0!/cred/1/2/3")  # unasked: never below zero
    assert s.asked == 0


def test_the_answer_teaches_the_early_draft_separator():
    s = Session()
    s.receive(b"CMSG !/cred/whoami\0!.cred.1.2.3")
    assert s.rules.sep == b"." and s.cred.uid == 2
    assert s.subscribe(b"!.cred.1.2.3.x") == b"SUB !.cred.1.2.3.x"
    with pytest.raises(InvalidRequest):
        s.subscribe(b"a.!.b")


def test_backoff_doubles_to_its_cap_with_jitter():
    for failures, base in [(0, 1), (1, 2), (2, 4), (5, 32), (6, 60), (100, 60)]:
        delays = []
        for _ in range(200):
            b = Backoff(1.0, 60.0)
            b.failures = failures
            delays.append(b.next())
        assert base / 2 <= min(delays) and max(delays) <= base
        assert max(delays) - min(delays) > base / 10  # jittered, not fixed
    b = Backoff(0.1, 1.0, rand=lambda lo, hi: hi)
    assert [b.next() for _ in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    b.reset()
    assert b.next() == pytest.approx(0.1)
