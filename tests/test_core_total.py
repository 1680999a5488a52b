"""The broker core is total: no byte string any client sends can raise out of it.

Hypothesis drives `BrokerCore` (with the fake kernel of test_core.py) with packets from
several clients of several users: every verb and every control word with arbitrary
arguments, garbage, full kernels, hang-ups and writable events, in any order.  After
each step nothing has raised, and once every client has gone the per-user accounting is
back to nothing: what a client made the broker hold was charged and given back.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core import Batch, Bus

from sbus import introspect, protocol
from sbus.limits import Limits

WORDS = [protocol.WHOAMI, protocol.DROPPED, protocol.REFUSED + b"/sub",
         protocol.PUBLISHER_NOWAIT, protocol.STATUS, protocol.CLIENT_STATUS,
         protocol.SOFT + b"/queue", protocol.SOFT + b"/block", protocol.SOFT + b"/error",
         protocol.SOFT + b"/discard", protocol.HARD + b"/block", protocol.HARD + b"/error",
         protocol.ORDER + b"/stack", protocol.ORDER + b"/random", protocol.ORDER + b"/x",
         protocol.SOFT, b"blocking/", b"!/cred/0/0/0", b""]
KEYS = [b"a", b"a/b", b"a/b/c", b"!/cred/1000/1000/110/x", b"!/cred//", b"", b"*",
        b"a/*", b"a/", b"!", b"a/!/b", b"\xff\xfe/\x1b[2J", b"a*b", b"/"]

_text = st.binary(max_size=40)
_key = st.one_of(st.sampled_from(KEYS), _text)
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
    st.sampled_from(["send"] * 8 + ["writable", "full", "room", "hangup", "connect",
                                    "advance"]),
    st.integers(0, 5), st.lists(_packet(), min_size=1, max_size=6))


def _limits() -> Limits:
    return Limits(connections_per_user=3, subscriptions_per_user=8,
                  subscription_bytes_per_user=4096, queued_bytes_per_user=4096,
                  cache_bytes=8192, cache_bytes_per_user=2048)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_step, min_size=1, max_size=40), st.booleans())
def test_no_packet_raises_and_accounting_returns_to_nothing(steps, limited):
    bus = Bus(limits=_limits()) if limited else Bus()
    uids = [0, 1000, 1001, 1002]
    clients = [c for c in (bus.connect(uid=u) for u in uids) if c is not None]
    now = 0.0
    for action, who, packets in steps:
        alive = [c for c in clients if not c.closed]
        if action == "connect" or not alive:
            c = bus.connect(uid=uids[who % len(uids)], room=who)
            if c is not None:
                clients.append(c)
            continue
        c = alive[who % len(alive)]
        if action == "send":
            if c.wants_read:
                bus.core.receive(c, Batch(bus.kernel, packets), len(packets))
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
        elif action == "advance":
            now += 1.0
            bus.core.advance(now)
        while bus.core.fanouts:
            bus.core.step(bus.core.fanouts[0])
        bus.core.tidy()
        bus.core.gone.clear()
        bus.core.logs.clear()
    for c in clients:
        if not c.closed:
            bus.core.hangup(c, "end")
    while bus.core.tidy():
        pass
    accounts = bus.core.accounts
    assert not accounts.connections and not accounts.subscriptions
    assert not accounts.subscription_bytes and not accounts.budgets
    assert bus.core.subscription_count == 0
    assert not bus.core.connections


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
