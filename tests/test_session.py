"""The client session as a pure object: intents -> packets, packets -> events."""

from __future__ import annotations

import pytest

from sbus.errors import InvalidRequest, NoResponders, Refused
from sbus.protocol import Control, ProtocolError, Publish
from sbus.session import (
    CONFIRM_EVERY,
    LOOK_AGAIN,
    REACH_RETRY,
    Backoff,
    Dropped,
    Reach,
    Refusal,
    RequestRound,
    Session,
    Unconfirmed,
    Whoami,
)


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
    assert s.publish_for(2001) == b"CMSG blocking/publisher/for\x002001"
    s.ask()  # lost with the old connection
    assert s.connected() == [b"CMSG blocking/hard/error", b"CMSG blocking/publisher/nowait",
                             b"CMSG blocking/publisher/for\x002001",
                             b"SUB x", b"SUB x", b"SUB y/", b"CMSG !/cred/whoami"]
    assert s.asked == 1  # only the new question counts
    assert s.connections == 2
    assert s.publish_for(None) == b"CMSG blocking/publisher/for\x00"
    assert b"CMSG blocking/publisher/for" not in b" ".join(s.connected())
    s.ask_for_trust = True  # a carrier asks again in every opening, its own number
    assert b"CMSG blocking/publisher/for\x00" in s.connected()
    with pytest.raises(InvalidRequest, match="not a user number"):
        s.publish_for(-1)


def test_a_connection_taken_up_ignores_the_earlier_processs_answers_until_its_mark():
    s = Session()
    (mark,) = s.adopt([b"a/", b"b"])  # a connection left in the fd store, its patterns
    assert mark.startswith(b"CMSG broker/reach\0/sbus/adopted/")
    assert s.patterns == {b"a/": 1, b"b": 1} and s.connections == 1
    key = mark.split(b"\0", 1)[1]
    s.ask()  # this process's barrier, sent after the mark
    answer = b"CMSG !/cred/whoami\0!/cred/0/0/1"
    assert s.receive(answer) == Whoami(b"!/cred/0/0/1")  # the earlier process asked it
    assert (s.asked, s.answers) == (1, 0)  # ... so it passes no barrier of this one
    assert s.receive(b"MSG a/x\0queued meanwhile") == Publish(b"a/x", b"queued meanwhile")
    assert s.receive(b"CMSG broker/reach\0/sbus/adopted/other\x000") == Reach(
        b"/sbus/adopted/other", 0)  # another's mark (the earlier process's): still before
    assert s.adopting == key
    assert s.receive(b"CMSG broker/reach\0" + key + b"\x000") == Reach(key, 0)
    assert s.adopting is None
    s.receive(answer)  # now this process's answer
    assert (s.asked, s.answers) == (0, 1)
    s.adopt([b"c"])
    assert s.opening()[0] == b"SUB c" and s.adopting is None  # a reconnect: a fresh start


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
    # what is not bytes or text is a TypeError, not bytes(7) = seven NULs sent
    for key, payload in ((b"k", 7), (b"k", [1, 2]), (5, b"x"), (b"k", {1: 2})):
        with pytest.raises(TypeError, match="bytes or str, not"):
            s.publish(key, payload)
    with pytest.raises(TypeError):
        s.subscribe(3)
    assert s.publish(bytearray(b"k"), memoryview(b"v")) == s.publish("k", "v")
    with pytest.raises(InvalidRequest, match="NUL"):  # a reach question checks its key too
        s.ask_reach(b"a\0b")


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


def test_backoff_makes_an_attempt_by_the_time_it_is_told():
    now = [100.0]
    b = Backoff(0.1, 5.0, rand=lambda lo, hi: hi, clock=lambda: now[0])
    b.failures = 6  # the next delay: 5 s
    b.try_by = 102.0
    assert b.next() == pytest.approx(2.0)  # cut to reach it
    now[0] = 101.9
    assert b.next() == pytest.approx(0.1)
    now[0] = 102.0  # reached: the delays go on as before
    assert b.next() == pytest.approx(5.0)
    b.try_by = 110.0
    assert b.next() == pytest.approx(5.0)  # no cut where the delay ends before it


def test_a_reconnect_bound_gets_a_last_attempt_just_before_it():
    """A reconnect that gives up at a time (a request's timeout) tries once more
    `LAST_TRY` before it, rather than giving up a whole step early; the backoff's own
    `try_by` (the gateway's) is kept."""
    from sbus.session import LAST_TRY

    now = [0.0]
    s = Session(backoff=Backoff(1.0, 1.0, rand=lambda lo, hi: hi, clock=lambda: now[0]))
    assert s.retry_in(give_up_at=2.5) == pytest.approx(1.0)
    now[0] = 2.0
    assert s.retry_in(give_up_at=2.5) == pytest.approx(0.5 - LAST_TRY)
    assert s.backoff.try_by is None
    s.backoff.try_by = 2.1
    assert s.retry_in(give_up_at=2.5) == pytest.approx(0.1)  # the sooner of the two
    assert s.backoff.try_by == 2.1


def test_a_batch_decodes_messages_fast_and_controls_as_receive_does():
    s = Session()
    s.ask()
    packets = [b"MSG a\0one", b"CMSG blocking/dropped\x004", b"MSG b/c\0\0two\0",
               b"CMSG !/cred/whoami\0!/cred/1/2/3", b"MSG \0", b"CMSG x/y\0z"]
    slot = 64  # as `PacketBatch` lays them out: one packet per slot, stale bytes between
    buf = bytearray(b"#" * slot * len(packets))
    for i, p in enumerate(packets):
        buf[i * slot:i * slot + len(p)] = p
    offsets = [i * slot for i in range(len(packets) + 3)]  # more slots than packets
    events, others = s.decode(bytes(buf), offsets, [len(p) for p in packets])
    assert events == [Publish(b"a", b"one"), Dropped(4), Publish(b"b/c", b"\0two\0"),
                      Whoami(b"!/cred/1/2/3"), Publish(b"", b""), Control(b"x/y", b"z")]
    assert others == [1, 3, 5]
    assert s.dropped == 4 and s.asked == 0 and s.cred.pid == 3
    with pytest.raises(ProtocolError):
        s.decode(b"MSG nonul", [0], [9])
    with pytest.raises(ProtocolError):
        s.decode(b"SUB x", [0], [5])


def test_the_reconnect_plan_backs_off_until_restored():
    s = Session(backoff=Backoff(0.1, 1.0, rand=lambda lo, hi: hi))
    assert s.connected() == []
    s.subscribe(b"k")
    assert [s.retry_in() for _ in range(3)] == pytest.approx([0.1, 0.2, 0.4])
    opening = s.connected()
    assert opening == [b"SUB k", b"CMSG !/cred/whoami"] and s.asked == 1
    s.receive(b"CMSG !/cred/whoami\0!/cred/1/2/3")
    assert s.asked == 0  # the opening is answered: the shell calls `restored`
    s.restored()
    assert s.retry_in() == pytest.approx(0.1)  # the next loss starts afresh


def test_request_inboxes_and_reach_answers():
    s = Session()
    with pytest.raises(InvalidRequest, match="whoami"):
        s.new_inbox()  # the inbox is a secret key: the credentials come first
    s.receive(b"CMSG !/cred/whoami\0!/cred/1/2/3")
    inbox = s.new_inbox()
    assert inbox.startswith(b"!/cred/1/2/3/inbox/") and len(inbox) == 19 + 16
    assert s.new_inbox() != inbox
    assert s.request(b"svc", b"body", inbox) == b"MSG svc\0" + inbox + b"\0body"
    assert s.reply_to(Publish(inbox, b"yes"), inbox) == b"yes"
    assert s.reply_to(Publish(b"!/cred/1/2/3/inbox/old", b"late"), inbox) is False
    assert s.reply_to(Publish(b"svc", b"other"), inbox) is None
    assert s.ask_reach(b"svc") == b"CMSG broker/reach\0svc"
    with pytest.raises(InvalidRequest):
        s.ask_reach(b"a/!/b")
    assert s.receive(b"CMSG broker/reach\0svc\0" + b"2") == Reach(b"svc", 2)
    assert s.receive(b"CMSG broker/reach\0!/cred/9/9/9/x\0?") == Reach(b"!/cred/9/9/9/x", None)


def _round(no_responders: bool = True) -> tuple[Session, RequestRound]:
    s = Session()
    s.receive(b"CMSG !/cred/whoami\0!/cred/0/0/7")
    return s, RequestRound(s, b"svc", b"body", s.new_inbox(), no_responders)


def test_a_request_goes_at_once_on_its_first_connection_and_nobody_is_no_responders():
    s, r = _round()
    ask, request = s.ask_reach(b"svc"), s.request(b"svc", b"body", r.inbox)
    assert r.connected(1) == [ask, request] and r.connected(1) == []
    with pytest.raises(NoResponders):
        r.reach(Reach(b"svc", 0), 0.0)
    s, r = _round(no_responders=False)
    assert r.connected(1) == [s.request(b"svc", b"body", r.inbox)]
    assert r.reach(Reach(b"svc", 0), 0.0) == []  # (not its question: no verdict)


def test_after_a_reconnect_a_request_waits_until_someone_subscribes_again():
    s, r = _round()
    ask, request = s.ask_reach(b"svc"), s.request(b"svc", b"body", r.inbox)
    r.connected(1)
    assert r.reach(Reach(b"svc", 1), 0.0) == []
    assert r.connected(2) == [ask] and r.held  # the replier may not be back yet
    assert r.reach(Reach(b"other", 0), 1.0) == []
    assert r.reach(Reach(b"svc", 0), 1.0) == [] and r.retry_at == 1.0 + REACH_RETRY
    assert r.wake_at(1.0, 9.0) == 1.0 + REACH_RETRY and r.wake_at(1.0, 1.01) == 1.01
    assert r.timer(1.0) == [] and r.timer(1.0 + REACH_RETRY) == [ask]
    assert r.wake_at(5.0, 9.0) == 5.0 + LOOK_AGAIN  # (a reconnect is seen that soon)
    assert r.reach(Reach(b"svc", 2), 2.0) == [request] and not r.held
    assert r.reach(Reach(b"svc", 0), 3.0) == []  # a late answer: the request is out
    assert r.connected(3) == [ask] and r.reach(Reach(b"svc", None), 4.0) == [request]
    assert r.connected(4) == [ask] and r.not_understood() == [request]  # an older broker


def test_unconfirmed_counts_what_a_lost_connection_may_have_taken():
    s = Session()
    u = Unconfirmed(s)
    answer = b"CMSG !/cred/whoami\0!/cred/0/0/7"
    assert u.question(0.0) is None  # nothing sent: nothing to confirm
    u.sent = 10
    s.ask()  # another question before it (the gateway's, after a SUB)
    assert u.question(1.0) == s.ask() and s.asked == 3 and u.asked_at == 10
    s.receive(answer)  # the other's answer
    u.sent = 15
    assert u.question(1.1) is None  # not yet due
    assert u.question(1.0 + CONFIRM_EVERY) is None and u.confirmed == 0  # no answer yet
    s.receive(answer)  # its own: everything before it was acted on
    assert u.question(1.0 + 1.5 * CONFIRM_EVERY) is None and u.confirmed == 10
    s.receive(answer)  # (the test's own question after it)
    u.sent = 20
    assert u.question(1.0 + 2 * CONFIRM_EVERY) is not None
    assert (u.confirmed, u.asked_at) == (10, 20)
    assert u.said("gone") == ("gone (up to 10 message(s) sent since the broker last "
                              "confirmed may be lost with the connection)")
    assert u.said("still gone") == "still gone"  # counted once


def test_unconfirmed_says_whose_messages_a_lost_connection_may_have_taken():
    s = Session()
    u = Unconfirmed(s)
    answer = b"CMSG !/cred/whoami\0!/cred/0/0/7"
    u.add(3, "a")
    u.add(2, "b")
    assert u.question(0.0) is not None
    u.add(4, "a")  # after the question: not confirmed by its answer
    s.receive(answer)
    u.add(1, "c")
    assert u.lost() == 5 and u.taken == {"a": 4, "c": 1}
    u.add(2, "b")
    assert u.question(1.0) is not None
    u.unsent()  # never sent: what it would have confirmed is still unconfirmed
    u.add(1, "b")
    assert u.lost() == 3 and u.taken == {"b": 3} and s.asked == 0
    assert u.lost() == 0 and not u.taken
