"""The broker core is total: no byte string any client sends can raise out of it.

Hypothesis drives `BrokerCore` (with the fake kernel of test_core.py) with packets from
several clients of several users: every verb and every control word with arbitrary
arguments, garbage, full kernels, hang-ups and writable events, in any order.  After
each step nothing has raised, and once every client has gone the per-user accounting is
back to nothing: what a client made the broker hold was charged and given back.
"""

from __future__ import annotations

import json
from collections import Counter
from unittest.mock import patch

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core import Batch, Bus

from sbus import core as core_module
from sbus import handover, introspect, protocol
from sbus.keys import Credentials
from sbus.limits import Limits

WORDS = [protocol.WHOAMI, protocol.DROPPED, protocol.REFUSED + b"/sub",
         protocol.PUBLISHER_NOWAIT, protocol.STATUS, protocol.CLIENT_STATUS,
         protocol.SOFT + b"/queue", protocol.SOFT + b"/block", protocol.SOFT + b"/error",
         protocol.SOFT + b"/discard", protocol.HARD + b"/block", protocol.HARD + b"/error",
         protocol.ORDER + b"/stack", protocol.ORDER + b"/random", protocol.ORDER + b"/x",
         protocol.SOFT, b"blocking/", b"!/cred/0/0/0", b"",
         *(protocol.SOFT + b"/" + w for w in (b"block", b"queue")),
         protocol.HARD + b"/discard", protocol.ORDER + b"/queue", b"blocking.soft.block",
         b"broker.status", b"!.cred.whoami"]
KEYS = [b"a", b"a/b", b"a/b/c", b"!/cred/1000/1000/110/x", b"!/cred//", b"", b"*",
        b"a/*", b"a/", b"!", b"a/!/b", b"\xff\xfe/\x1b[2J", b"a*b", b"/"]

_text = st.binary(max_size=40)
_key = st.one_of(st.sampled_from([b"a", b"a/b"]), st.sampled_from(KEYS), _text)
FLOOD = [protocol.SOFT + b"/block", protocol.HARD + b"/block", protocol.SOFT + b"/discard",
         protocol.SOFT + b"/error", protocol.ORDER + b"/random", protocol.PUBLISHER_NOWAIT]
_json_after = st.one_of(
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.none(), st.lists(st.integers(), max_size=3)).map(
        lambda v: json.dumps({"after": v}).encode())
_nested = st.integers(1000, 5000).map(lambda n: b"[" * n + b"]" * n)
_payload = st.one_of(st.none(), _text, _json_after, _nested,
                     st.sampled_from([b'{"after": 1e999}', b'{"after": -1e999}',
                                      b'{"after": NaN}', b"\xff" * 10]))


@st.composite
def _packet(draw) -> bytes:
    kind = draw(st.sampled_from(["MSG", "SUB", "UNSUB", "CMSG", "WORD", "raw"]))
    if kind == "raw":
        return draw(st.binary(max_size=60))
    if kind in ("CMSG", "WORD"):
        key = draw(st.sampled_from(WORDS) if kind == "WORD" else _key)
        payload = draw(_payload)
        return b"CMSG " + key + (b"" if payload is None else b"\0" + payload)
    if kind == "MSG":
        return b"MSG " + draw(_key) + b"\0" + draw(_text)
    return kind.encode() + b" " + draw(_key)


_step = st.tuples(
    st.sampled_from(["send"] * 8 + ["hold"] * 3 + ["step"] * 2 + ["close", "eof"] * 2 +
                    ["burst", "writable"] * 3 + ["full", "room", "hangup", "connect", "advance"]),
    st.integers(0, 5), st.lists(_packet(), min_size=1, max_size=6))


def _limits() -> Limits:
    return Limits(connections_per_user=3, subscriptions_per_user=8,
                  subscription_bytes_per_user=4096, queued_bytes_per_user=4096,
                  cache_bytes=8192, cache_bytes_per_user=2048)


def _check_accounts(core) -> None:
    """Per-user counts agree with the clients the core holds (the departing included)."""
    by_uid = Counter(c.cred.uid for c in core.connections.values())
    assert by_uid == +core.accounts.connections
    for uid, budget in core.accounts.budgets.items():
        assert budget.queued >= 0, (uid, budget.queued)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_step, min_size=1, max_size=40), st.booleans(),
       st.lists(st.tuples(st.sampled_from(FLOOD), st.integers(0, 3)), min_size=4,
                max_size=4), st.booleans())
def test_no_packet_raises_and_accounting_returns_to_nothing(steps, limited, setup, runs):
    """Also with fan-outs held over steps (`HOLD_FROM` made tiny), publishers paused by
    blocking readers and flood settings changed meanwhile: the first clients subscribe
    ``a`` under a flood setting each, with kernels of a few packets; queues drained a
    packet at a time or in runs (the ``write_run`` port)."""
    bus = Bus(runs=runs, limits=_limits()) if limited else Bus(runs=runs)
    uids = [0, 1000, 1001, 1002]
    clients = [c for c in (bus.connect(uid=u, room=room)
                           for u, (_, room) in zip(uids, setup, strict=True)) if c]
    for c, (word, _) in zip(clients, setup, strict=False):
        bus.send(c, b"CMSG " + word, b"SUB a", b"SUB a/b")
    now = 0.0
    with patch.object(core_module, "HOLD_FROM", 2):
        for action, who, packets in steps:
            alive = [c for c in clients if c.read_on]
            if action == "connect" or not alive:
                c = bus.connect(uid=uids[who % len(uids)], room=who)
                if c is not None:
                    clients.append(c)
                continue
            c = alive[who % len(alive)]
            if action == "burst":  # one user's run in its subscribers' queues (`front`)
                action, packets = "send", [b"MSG a\0%d" % i for i in range(12)]
            if action in ("send", "hold"):
                if c.wants_read:
                    bus.core.receive(c, Batch(bus.kernel, packets), len(packets),
                                     hold=action == "hold")
            elif action == "step":
                if bus.core.fanouts:
                    bus.core.step(bus.core.fanouts[who % len(bus.core.fanouts)], who + 1)
            elif action == "writable":
                bus.read(c)
                if c.wants_write:
                    bus.core.writable(c)
            elif action == "full":
                bus.kernel.room[c.link] = 0
            elif action == "room":
                bus.kernel.room[c.link] = 1000
            elif action == "hangup":
                bus.kernel.hung_up.add(c.link)
                bus.core.hangup(c, "test")
            elif action == "close":  # the core finds out when it writes to it, or reads
                bus.kernel.hung_up.add(c.link)
            elif action == "eof" and c.wants_read:  # (an empty packet if not closed)
                bus.core.receive(c, Batch(bus.kernel, [b""]), 1)
            elif action == "advance":
                now += 1.0
                bus.core.advance(now)
            bus.core.tidy()
            bus.core.take_gone(), bus.core.take_logs(), bus.core.take_freed()
            _check_accounts(bus.core)
        for c in clients:
            if c.read_on:
                bus.core.hangup(c, "end")
        bus.core.finish_fanouts()
    while bus.core.tidy():
        pass
    accounts = bus.core.accounts
    assert not accounts.connections and not accounts.subscriptions
    assert not accounts.subscription_bytes and not accounts.budgets
    assert bus.core.subscription_count == 0
    assert not bus.core.connections and not bus.core.fanouts


@given(_payload)
def test_a_status_request_never_raises(payload):
    assert type(introspect._after(payload)) is int


def test_the_two_status_payloads_that_ended_the_broker():
    """int(inf) raised OverflowError and deep nesting RecursionError, past the handler."""
    bus = Bus()
    c = bus.connect()
    for payload in (b'{"after": 1e999}', b"[" * 100000 + b"]" * 100000):
        bus.send(c, b"CMSG broker/status\0" + payload)
        [answer] = bus.read(c)
        assert answer.startswith(b"CMSG broker/status\0")
        assert json.loads(answer.split(b"\0", 1)[1])["broker"]["clients"] == 1


# -- a predecessor's snapshot: taken whole, or refused with HandoverError --------------

_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
              st.binary(max_size=12), st.text(max_size=6)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12)
_flood = st.one_of(st.sampled_from([b"queue", b"discard", b"block", b"error", b"stack",
                                    b"random"]), _value)
_client_state = st.lists(st.one_of(
    st.integers(-2, 8), _value,
    st.lists(st.tuples(st.one_of(_key, _value),
                       st.one_of(st.integers(-1, 3), st.just(2**40), _value)), max_size=3),
    _flood, st.booleans(), st.lists(st.one_of(st.binary(max_size=20), _value), max_size=3)),
    min_size=0, max_size=9)
_snapshot = st.one_of(
    st.binary(max_size=80),
    st.tuples(st.one_of(st.just(handover.FORMAT), _value),
              st.one_of(st.just(b"/"), st.just(b"."), _value),
              st.one_of(st.dictionaries(st.sampled_from(["published", "dropped", "x"]),
                                        st.one_of(st.integers(0, 9), _value)), _value),
              st.lists(st.one_of(_client_state, _value), max_size=4)).map(
        lambda parts: msgpack.packb(list(parts), use_bin_type=True)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_snapshot, st.booleans())
def test_a_damaged_snapshot_is_refused_whole_never_anything_else(data, limited):
    """Whatever a snapshot holds, `handover.decode` and `BrokerCore.restore` either take
    it or raise `HandoverError`; a refused one leaves no client behind, and every client
    taken is accounted for as if it had connected."""
    bus = Bus(limits=_limits()) if limited else Bus()
    try:
        state = handover.decode(data)
        peers = {}
        for i, c in enumerate(state.clients):
            link = 100 + i
            bus.kernel.buffers[link], bus.kernel.room[link] = [], 10
            peers[c.id] = (Credentials(gid=1000 + i % 2, uid=(0, 1000)[i % 2], pid=i), link)
        taken = bus.core.restore(state, peers)
    except handover.HandoverError:
        assert not bus.core.connections and not bus.core.accounts.connections
        return
    assert len(taken) == len(bus.core.connections)
    for c in taken:
        bus.drain(c)  # what it was refused (a pattern the rules refuse) reaches it
        bus.core.hangup(c, "end")
    while bus.core.tidy():
        pass
    assert not bus.core.accounts.connections and not bus.core.accounts.subscriptions
    assert bus.core.subscription_count == 0


def test_a_snapshot_of_a_working_core_is_taken_whole():
    """The property above is not vacuous: a real snapshot round-trips."""
    bus = Bus()
    c = bus.connect()
    bus.send(c, b"SUB a/b", b"SUB a/b", b"CMSG blocking/soft/discard")
    state = handover.decode(handover.encode(bus.core.snapshot()))
    other = Bus()
    other.kernel.buffers[7], other.kernel.room[7] = [], 10
    [taken] = other.core.restore(state, {c.id: (c.cred, 7)})
    assert taken.subscriptions == 2 and taken.out.soft.value == b"discard"
    for bad in (b"\x93\x01\x02", msgpack.packb([handover.FORMAT, b"/", {}, [[1, [], 5]]]),
                msgpack.packb([handover.FORMAT, b"/", {"a": 1e999}, []]),
                msgpack.packb([handover.FORMAT, 10**9, {}, []])):
        try:
            handover.decode(bad)
        except handover.HandoverError:
            continue
        raise AssertionError(f"{bad!r} was taken")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["send", "read", "big"]),
                          st.integers(0, 70)), min_size=1, max_size=30))
def test_a_queue_drained_in_runs_delivers_what_single_writes_do(steps):
    """The ``write_run`` port is only a faster way to the same result: once drained, the
    same messages in the same order, the same drops reported and the same counters as a
    write each, whatever the kernel's room and the packets too large for the socket.
    (Where a report goes may differ: a run stops where a write each went on to the
    large packet and found it too large a turn sooner.  For the same reason an order
    change or a full queue would act on other contents: runs are for the plain queue.)"""
    outcomes = []
    for runs in (False, True):
        bus = Bus(runs=runs, queue_limit=1 << 20)  # (no room taken from the next: timing)
        sub, pub = bus.connect(room=0), bus.connect()
        bus.send(sub, b"SUB k")
        bus.kernel.largest[sub.link] = 40
        got, n = [], 0
        for action, k in steps:
            if action == "send":
                bus.send(pub, *[b"MSG k\0%d" % (n + i) for i in range(k)])
                n += k
            elif action == "big":
                bus.send(pub, b"MSG k\0" + b"x" * (40 + k))
            else:
                bus.kernel.room[sub.link] = k
                if sub.wants_write:
                    bus.core.writable(sub)
                got += bus.read(sub)
                bus.kernel.room[sub.link] = 0
        bus.kernel.room[sub.link] = 1 << 20
        got += bus.drain(sub)  # (a run stops where a write each went on to a large one)
        reports = [p for p in got if p.startswith(protocol.encode(
            protocol.Control(protocol.DROPPED, b"")))]
        outcomes.append(([p for p in got if p not in reports],
                         sum(int(p.split(b"\0")[1]) for p in reports),
                         bus.core.delivered, bus.core.dropped))
    assert outcomes[0] == outcomes[1]
