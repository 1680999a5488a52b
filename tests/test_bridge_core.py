"""The bridge's pure parts: key/pattern translation (topics.py) and what crosses, marked and
counted (core.py).  The I/O is in test_bridge.py."""

from __future__ import annotations

import re

import paho.mqtt._packet as paho_packet
import pytest
from hypothesis import given
from hypothesis import strategies as st
from paho.mqtt.client import topic_matches_sub

from sbus.bridge.core import BridgeCore, Rule, covers
from sbus.bridge.shell import Retry
from sbus.bridge.topics import ConfigError, Mapping, to_filter, topic_problem
from sbus.routing import matches

IDENT = Mapping()


@pytest.mark.parametrize(("pattern", "mqtt", "exact"), [
    (b"", "#", True),
    (b"a/*/c", "a/+/c", True),
    (b"*", "+", True),
    (b"a/*", "a/+", True),
    (b"a//b", "a//b", True),
    (b"a/", "a/#", False),        # MQTT's a/# also matches a
    (b"a/*/", "a/+/#", False),
    (b"a/foo*/c", "a/+/c", False),  # foo* is checked locally
    (b"caf\xc3\xa9/*", "caf\u00e9/+", True),
])
def test_pattern_to_filter(pattern: bytes, mqtt: str, exact: bool) -> None:
    f = to_filter(pattern, IDENT)
    assert (f.mqtt, f.exact) == (mqtt, exact)


def test_filter_under_a_prefix_mapping() -> None:
    m = Mapping.parse("remote/=site/")
    assert to_filter(b"remote/*/sensors/", m).mqtt == "site/+/sensors/#"
    assert to_filter(b"remote/", m).mqtt == "site/#"
    assert m.to_local(b"site/b/sensors/t") == b"remote/b/sensors/t"
    assert m.to_local(b"other/x") is None


@pytest.mark.parametrize(("pattern", "why"), [
    (b"a*b/c", "never match"),
    (b"a/x+y", "'+' or '#'"),
    (b"a/#", "'+' or '#'"),
    (b"a/\xff", "UTF-8"),
    (b"!/cred////", "secret"),
    (b"a/!/b", "reserved"),
    (b"other/x", "not under the local prefix"),
])
def test_import_patterns_refused(pattern: bytes, why: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(why)):
        to_filter(pattern, Mapping.parse("=") if why != "not under the local prefix"
                  else Mapping.parse("mine/=site/"))


@pytest.mark.parametrize(("text", "why"), [
    ("sensors=site/", "must be empty or end with '/'"),
    ("a/=b", "must be empty or end with '/'"),
    ("a/*/=b/", "cannot hold"),
    ("=a+/", "'+'"),
    ("!/cred/1/2/3/=x/", "secret"),
    ("nothing", "LOCAL=REMOTE"),
])
def test_mappings_refused(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(why)):
        Mapping.parse(text)


@pytest.mark.parametrize(("topic", "why"), [
    (b"", "empty"),
    (b"a/+/b", "'+'"),
    (b"a/#", "'#'"),
    (b"a/\xff\xfe", "UTF-8"),
    (b"a/\x1b[2J", "'\\x1b'"),
    (b"a\x7f", "'\\x7f'"),
    (b"a\xc2\x85", "'\\x85'"),           # C1 control (NEL)
    ("a\ufffe".encode(), "'\\ufffe'"),   # non-character
    ("a\U0001ffff".encode(), "cannot be sent"),
    (b"$SYS/x", "reserved"),
    (b"x" * 65536, "65536 bytes"),
    (b"a/" * 128 + b"y", "129 levels"),  # brokers close the connection on deeper ones
])
def test_topics_mqtt_cannot_carry(topic: bytes, why: str) -> None:
    problem = topic_problem(topic)
    assert problem is not None and why in problem


@pytest.mark.parametrize("topic", [b"a", b"/", b"a//b/", "caf\u00e9/\u263a".encode(),
                                   b"x" * 65535, b"a$b", b"!important",
                                   b"a/" * 127 + b"y"])
def test_topics_mqtt_carries(topic: bytes) -> None:
    assert topic_problem(topic) is None


_seg = st.sampled_from(["", "a", "b", "ab", "foo", "foobar"])
_pat_seg = st.sampled_from(["", "a", "b", "ab", "foo", "*", "foo*", "a*"])


@given(st.lists(_pat_seg, min_size=1, max_size=4), st.booleans(),
       st.lists(_seg, min_size=1, max_size=5))
def test_filter_covers_pattern_and_exact_means_equal(segs, tail, keysegs) -> None:
    """Every key the sbus pattern matches is a topic the MQTT filter matches (so nothing
    is missed); where the translation says exact, the two agree on every key."""
    pattern = "/".join(segs).encode() + (b"/" if tail else b"")
    key = "/".join(keysegs).encode()
    f = to_filter(pattern, IDENT)
    sbus_match = matches(pattern, key)
    mqtt_match = topic_matches_sub(f.mqtt, key.decode())
    if sbus_match:
        assert mqtt_match, (pattern, key, f)
    if f.exact:
        assert sbus_match == mqtt_match, (pattern, key, f)


# -- the core ----------------------------------------------------------------------------

def core(**kw) -> BridgeCore:
    kw.setdefault("client_id", "me")
    return BridgeCore(kw.pop("exports", [b""]), kw.pop("imports", [b""]), **kw)


def test_export_maps_and_refuses_what_mqtt_cannot_carry() -> None:
    c = core(exports=[b"sensors/"], export_map=Mapping.parse("sensors/=site/a/sensors/"))
    assert c.from_bus(b"sensors/t1", b"20") == "site/a/sensors/t1"
    assert c.from_bus(b"sensors/a+b", b"x") is None
    assert c.from_bus(b"sensors/\xff", b"x") is None
    assert c.from_bus(b"!/cred/1/2/3/x", b"s") is None     # never, even if it got here
    assert c.from_bus(b"elsewhere/x", b"x") is None        # not under the prefix
    assert c.counters.refused == 4 and c.counters.exported == 0
    assert len(c.refusals) == 4 and "'sensors/a+b'" in c.refusals[0]
    assert "secret" in c.refusals[2]


@pytest.mark.parametrize("pattern", [b"!/cred////", b"!/cred/1/2/3/x"])
def test_secret_export_patterns_refused(pattern: bytes) -> None:
    with pytest.raises(ConfigError, match="never leave the host"):
        core(exports=[pattern])


def test_export_pattern_must_be_under_its_prefix() -> None:
    with pytest.raises(ConfigError, match="not under the local prefix"):
        core(exports=[b"other/"], export_map=Mapping.parse("sensors/=x/"))


def test_import_maps_filters_and_refuses() -> None:
    c = core(exports=[b"local/"], imports=[b"remote/*/sensors/foo*"],
             import_map=Mapping.parse("remote/=site/"))
    assert c.mqtt_filters() == ["site/+/sensors/+"]
    assert c.from_mqtt(b"site/b/sensors/foo1", b"v", None) == b"remote/b/sensors/foo1"
    assert c.from_mqtt(b"site/b/sensors/bar", b"v", None) is None   # foo* locally
    assert c.from_mqtt(b"elsewhere/x", b"v", None) is None          # a stale subscription
    assert c.counters.filtered == 2
    c2 = core(imports=[b""])
    assert c2.from_mqtt(b"!/cred/1/2/3/x", b"v", None) is None  # "" never matches secrets
    assert c2.from_mqtt(b"a/!/b", b"v", None) is None
    assert (c2.counters.filtered, c2.counters.refused) == (1, 1)


def test_own_marker_is_a_loop() -> None:
    c = core()
    assert c.from_mqtt(b"x", b"v", "me") is None
    assert c.from_mqtt(b"x", b"v", "another-bridge") == b"x"
    assert c.counters.looped == 1


def test_imports_do_not_echo_back_out() -> None:
    c = core(exports=[b""], imports=[b""])
    assert c.from_mqtt(b"k", b"one", "peer") == b"k"
    assert c.from_mqtt(b"k", b"two", "peer") == b"k"
    # a local publisher's message with the same key but other bytes still goes out
    assert c.from_bus(b"k", b"local") == "k"
    assert c.from_bus(b"k", b"one") is None
    assert c.from_bus(b"k", b"two") is None
    assert c.from_bus(b"k", b"one") == "k"   # the echo was taken once: this one is new
    assert c.counters.looped == 2


def test_echoes_the_broker_dropped_are_forgotten_when_a_later_one_returns() -> None:
    c = core(exports=[b""], imports=[b""])
    for i in range(5):
        c.from_mqtt(b"k%d" % i, b"v", "peer")
    c.bus_dropped(3)                            # the broker reports drops: k0..k4 may be gone
    c.from_mqtt(b"k5", b"v", "peer")            # made after the report: not forgettable
    c.from_mqtt(b"k6", b"v", "peer")
    assert c.from_bus(b"k3", b"v") is None      # k0..k2 were dropped by the broker
    assert c.from_bus(b"k0", b"v") == "k0"      # so this is a new local message
    assert c.from_bus(b"k6", b"v") == "k6"      # k5's echo must come first: a local one
    assert c.from_bus(b"k5", b"v") is None      # k4 may be gone (it was there at the report)
    assert c.from_bus(b"k6", b"v") is None
    assert c.counters.dropped == 3


def test_a_local_message_like_a_later_import_is_no_echo() -> None:
    """Two hosts publish the same key and payload at once (issue 25: 1,003 instead of
    1,000): with no drop reported, only the oldest remembered import can be echoed, so a
    local twin of a later one goes out and every real echo is still recognised."""
    c = core(exports=[b""], imports=[b""])
    for i in range(3):
        assert c.from_mqtt(b"k", b"%d" % i, "peer") == b"k"
    assert c.from_bus(b"k", b"2") == "k"        # local, published before the echoes came
    for i in range(3):
        assert c.from_bus(b"k", b"%d" % i) is None
    assert c.counters.looped == 3


def test_full_echo_memory_drops_rather_than_risk_a_loop() -> None:
    c = core(exports=[b"x/"], imports=[b""], echo_limit=3)
    for i in range(3):
        assert c.from_mqtt(b"x/%d" % i, b"v", "peer") is not None
    assert c.from_mqtt(b"x/9", b"v", "peer") is None
    assert c.from_mqtt(b"y/9", b"v", "peer") == b"y/9"   # not exported: needs no entry
    assert c.counters.dropped == 1
    c.bus_reset()
    assert c.from_mqtt(b"x/9", b"v", "peer") == b"x/9"


def test_echo_memory_is_bounded_in_bytes_too() -> None:
    c = core(exports=[b"x/"], imports=[b""], echo_bytes=100)
    assert c.from_mqtt(b"x/" + b"a" * 60, b"v", "peer") is not None
    assert c.from_mqtt(b"x/" + b"b" * 60, b"v", "peer") is None     # 124 bytes > 100
    assert c.from_bus(b"x/" + b"a" * 60, b"v") is None               # its echo frees room
    assert c.from_mqtt(b"x/" + b"b" * 60, b"v", "peer") is not None
    assert c.counters.dropped == 1


def test_status_line_counts() -> None:
    c = core()
    c.exported()
    c.imported()
    c.dropped(5)
    c.refused_by_broker()
    assert c.status() == ("exported 1 (0 B), imported 1 (0 B), dropped 5, refused 1, "
                          "looped 0, filtered 0, resent 0, duplicates 0, missing 0, "
                          "redelivered 0")
    c.exported(10)
    assert c.status().startswith("exported 2 (10 B)")


def test_backoff_doubles_caps_and_starts_over_after_a_stable_connection() -> None:
    b = Retry(1.0, 8.0, stable=10.0)
    delays = [b.failed(0.0) for _ in range(6)]
    for d, base in zip(delays, [1, 2, 4, 8, 8, 8], strict=True):
        assert base / 2 <= d <= base
    b.up(100.0)
    assert b.failed(105.0) >= 4.0      # up only 5 s: keeps growing
    b.up(200.0)
    assert b.failed(215.0) <= 1.0      # up 15 s: starts over
    assert b.next_at >= 215.0


def test_overlapping_filters_subscribe_once_with_the_higher_qos() -> None:
    """The broker sends one copy per matching subscription: a covered filter is left out."""
    c = core(exports=[], imports=[b"a/", b"a/*/c", b"b/x"],
             import_rules=(Rule((b"b/*",), Mapping(), 0), Rule((b"a/x",), Mapping(), 1)))
    assert c.mqtt_subscriptions() == [("a/#", 1), ("b/+", 1)]
    assert covers("#", "a") and covers("a/#", "a") and not covers("a/+", "a/#")
    assert not covers("a/+", "a") and covers("+/+", "a/b") and not covers("a", "a/#")


def test_several_maps_per_direction_each_with_its_qos() -> None:
    c = core(exports=[], imports=[],
             export_rules=(Rule((b"s/",), Mapping.parse("s/=site/h/s/"), 1),
                           Rule((b"log/",), Mapping.parse("log/=site/h/log/"), 0)),
             import_rules=(Rule((b"fleet/",), Mapping.parse("fleet/=site/"), 1),
                           Rule((b"cmd/",), Mapping.parse("cmd/=ctl/h/"), 0)))
    assert (c.from_bus(b"s/t", b"1"), c.last_qos) == ("site/h/s/t", 1)
    assert (c.from_bus(b"log/x", b"1"), c.last_qos) == ("site/h/log/x", 0)
    assert c.from_mqtt(b"site/b/s/t", b"1", None) == b"fleet/b/s/t"
    assert c.from_mqtt(b"ctl/h/go", b"1", None) == b"cmd/go"
    assert c.from_mqtt(b"ctl/other/go", b"1", None) is None
    assert c.mqtt_subscriptions() == [("site/#", 1), ("ctl/h/#", 0)]


# -- nothing from MQTT raises (issue 28 item 4) -------------------------------------------

_topic_bytes = st.one_of(
    st.binary(max_size=40),
    st.lists(st.sampled_from([b"a", b"in", b"site", b"!", b"+", b"#", b"\xff", b"", b"\x00",
                              b"$SYS", b"x" * 300]), max_size=6).map(b"/".join))


@given(_topic_bytes, st.binary(max_size=64), st.one_of(st.none(), st.text(max_size=8)))
def test_from_mqtt_never_raises_and_imports_only_what_it_may(topic, payload, marker) -> None:
    c = core(exports=[b"in/"], imports=[b"in/", b"a/*/x"],
             import_rules=(Rule((b"site/",), Mapping.parse("site/=remote/"), 0),))
    key = c.from_mqtt(topic, payload, marker)
    counted = sum(vars(c.counters).values())
    if key is None:
        assert counted == 1          # filtered, refused, looped or dropped: counted once
    else:
        assert any(matches(p, key) for p in (b"in/", b"a/*/x", b"site/"))
        assert not key.startswith(b"!/") and counted == 0


@given(st.lists(st.tuples(st.binary(max_size=80), st.binary(max_size=40),
                          st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12)),
                                   max_size=3)), max_size=20))
def test_the_shell_takes_any_mqtt_message_without_raising(messages) -> None:
    """The paho callback with any topic bytes (not UTF-8 too), payload and user properties:
    it never raises (paho would end the loop) and counts each message exactly once."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from sbus.bridge.shell import BridgeShell, Broker, MqttSettings

    c = core(exports=[b""], imports=[b""])
    shell = BridgeShell(c, "/nonexistent", MqttSettings([Broker("127.0.0.1", 1)]))
    for topic, payload, user in messages:
        msg = mqtt.MQTTMessage(1, topic)
        msg.payload = payload
        msg.properties = Properties(PacketTypes.PUBLISH)
        if user:
            msg.properties.UserProperty = user
        shell._on_message(shell.mq, None, msg)
    n = c.counters
    assert n.filtered + n.refused + n.looped + n.dropped + n.imported == len(messages)


def test_a_stamp_seen_before_is_a_duplicate() -> None:
    """A bridge's spooled exports carry EPOCH.SEQ; what it sends again after a crash or a
    reconnect (numbers not above the last seen) is dropped here and counted."""
    c = core(exports=[], imports=[b""])
    assert c.from_mqtt(b"k", b"1", "a", f"e1.{1:016x}") == b"k"
    assert c.from_mqtt(b"k", b"2", "a", f"e1.{2:016x}") == b"k"
    assert c.from_mqtt(b"k", b"1", "a", f"e1.{1:016x}") is None     # sent again
    assert c.from_mqtt(b"k", b"2", "a", f"e1.{2:016x}") is None
    assert c.from_mqtt(b"k", b"1", "b", f"e1.{1:016x}") == b"k"     # another sender
    assert c.from_mqtt(b"k", b"0", "a", f"e2.{0:016x}") == b"k"     # a new spool
    assert c.from_mqtt(b"k", b"x", "a", "garbage") == b"k"          # unreadable: kept
    assert c.from_mqtt(b"k", b"x", None, f"e1.{1:016x}") == b"k"    # no sender: kept
    assert c.counters.duplicates == 2 and c.counters.imported == 0


def _stamp(seq: int, epoch: str = "e1") -> str:
    return f"{epoch}.{seq:016x}"


def test_gaps_in_a_senders_stamps_are_counted_as_missing() -> None:
    """A receiver that imports everything the sender stamps (its scope) counts each number
    skipped exactly once; a new epoch whose numbers went back (a new spool) is new,
    without gaps counted, and so is a sender heard for the first time."""
    c = core(exports=[], imports=[b"seq/"])
    scope = ("seq/#",)
    got = [c.from_mqtt(b"seq/x", b"%d" % n, "a", _stamp(n), scope) for n in (7, 8, 9, 12)]
    assert got == [b"seq/x"] * 4 and c.counters.missing == 2            # 10 and 11
    assert c.from_mqtt(b"seq/x", b"20", "a", _stamp(20), scope) and c.counters.missing == 9
    assert c.from_mqtt(b"seq/x", b"12", "a", _stamp(12), scope) is None  # a copy
    assert c.from_mqtt(b"seq/x", b"0", "a", _stamp(0, "e2"), scope)      # a new spool
    assert c.from_mqtt(b"seq/x", b"1", "a", _stamp(1, "e2"), scope)
    assert c.from_mqtt(b"seq/x", b"5", "b", _stamp(5), scope)            # first from b
    assert c.from_mqtt(b"seq/x", b"3", "a", _stamp(3, "e2"), scope)
    assert c.from_mqtt(b"seq/x", b"6", "b", _stamp(6), scope)            # b's own go on
    assert c.from_mqtt(b"seq/x", b"8", "b", _stamp(8), scope)            # 7 missing
    assert (c.counters.missing, c.counters.duplicates) == (10, 1)
    assert "duplicates 1, missing 10" in c.status()


def test_each_run_of_a_sender_numbers_in_its_own_epoch() -> None:
    """A sender's runs each have an epoch and its numbers go on across them; what an
    earlier run spooled keeps its stamp when a later one sends it again, and stays a copy
    after restarts in a row.  A run whose numbers went back (its spool did: a power loss,
    an older copy put back) is new: under one epoch its exports were taken for copies."""
    c = core(exports=[], imports=[b""])
    scope = ("#",)

    def take(n: int, epoch: str) -> bool:
        return c.from_mqtt(b"k", b"%d" % n, "a", _stamp(n, epoch), scope) == b"k"

    assert all(take(n, "e1") for n in range(5))
    assert not take(3, "e1") and not take(4, "e1")        # run 2 sends run 1's again
    assert take(5, "e2") and take(6, "e2")                # then its own, going on
    assert not take(6, "e2") and take(7, "e3")            # run 3: the same
    assert not take(6, "e2") and not take(4, "e1")        # run 4 sends run 2's again
    assert c.counters.duplicates == 5 and c.counters.missing == 0
    assert take(3, "e5") and take(4, "e5")                # a spool that went back: new
    assert not take(4, "e5") and c.counters.duplicates == 6
    assert take(10, "e6") and c.counters.missing == 2     # a gap across runs: 8, 9
    assert take(9, "e6") and c.counters.missing == 1      # late: no longer missing
    saved = c.senders_saved()
    again = core(exports=[], imports=[b""])
    again.restore_senders(saved)
    assert again.from_mqtt(b"k", b"4", "a", _stamp(4, "e5"), scope) is None  # remembered
    again.restore_senders([[s[:5] for s in saved][0]])   # as older bridges saved it
    assert again.senders_saved()[0][5] == []


def test_restarts_in_a_row_each_sending_every_earlier_runs_records_again() -> None:
    """A sender whose PUBACKs never come restarts again and again: each run sends again
    every record left by the runs before it, in their epochs, and adds its own.  All of
    them are copies but the first, for as many runs as `EPOCHS_KEPT`; an epoch older
    than that must not make the newer ones forgotten (after five restarts every record
    came three times)."""
    from sbus.bridge.core import EPOCHS_KEPT

    c = core(exports=[], imports=[b""])
    scope = ("#",)
    runs = EPOCHS_KEPT + 3
    for run in range(runs):
        for earlier in range(run + 1):  # the earlier runs' records, then its own
            for seq in (2 * earlier, 2 * earlier + 1):
                c.from_mqtt(b"k", b"x", "a", _stamp(seq, f"e{earlier}"), scope)
    copies = sum(2 * run for run in range(runs))  # the first of each record is new
    passed = copies - c.counters.duplicates
    assert passed <= 2 * (runs - EPOCHS_KEPT), (passed, c.counters)  # the oldest ones only
    assert c.counters.missing == 0


def test_a_number_that_arrives_late_is_imported_not_taken_for_a_copy() -> None:
    """Out of order (a lower number after a higher one, e.g. through another node of a
    cluster): the stamp was never seen, so it is imported and no longer missing; only a
    second copy of it is a duplicate."""
    c = core(exports=[], imports=[b""])
    scope = ("#",)
    for n in (1, 2, 6):
        assert c.from_mqtt(b"k", b"%d" % n, "a", _stamp(n), scope) == b"k"
    assert c.counters.missing == 3                                       # 3, 4, 5
    assert c.from_mqtt(b"k", b"4", "a", _stamp(4), scope) == b"k"        # late: new
    assert c.from_mqtt(b"k", b"4", "a", _stamp(4), scope) is None        # then a copy
    assert c.from_mqtt(b"k", b"3", "a", _stamp(3), scope) == b"k"
    assert c.from_mqtt(b"k", b"2", "a", _stamp(2), scope) is None
    assert (c.counters.missing, c.counters.duplicates) == (1, 2)        # 5 still missing
    assert c.from_mqtt(b"k", b"5", "a", _stamp(5), scope) == b"k"
    assert c.counters.missing == 0


def test_no_gaps_counted_for_a_sender_we_import_only_part_of() -> None:
    """Numbers run over all of a sender's QoS 1 exports: a receiver whose imports do not
    cover the sender's scope sees gaps that are no loss and counts none; a late number is
    still imported, not taken for a copy.  No scope (an older bridge): none counted."""
    c = core(exports=[], imports=[b"seq/a/", b"other/"])
    for n, topic in enumerate([b"seq/a/x", b"seq/a/x", b"seq/a/x"]):
        assert c.from_mqtt(topic, b"", "a", _stamp(n * 5), ("seq/#",)) == topic
    assert c.from_mqtt(b"seq/a/x", b"", "a", _stamp(7), ("seq/#",)) == b"seq/a/x"
    assert c.from_mqtt(b"seq/a/x", b"", "b", _stamp(0)) == b"seq/a/x"
    assert c.from_mqtt(b"seq/a/x", b"", "b", _stamp(9)) == b"seq/a/x"
    assert (c.counters.missing, c.counters.duplicates) == (0, 0)
    # covered by the two filters together, and one filter at a time
    assert c._covers(("seq/a/#", "other/+/x")) and not c._covers(("seq/+/x",))
    assert not c._covers(("x",) * 2000)                                   # too long


def test_the_scope_a_sender_names_covers_its_qos1_exports() -> None:
    c = core(exports=[], imports=[],
             export_rules=(Rule((b"s/", b"s/x/", b"s/foo*/y"), Mapping.parse("s/=site/h/s/"), 1),
                           Rule((b"log/",), Mapping.parse("log/=site/h/log/"), 0),
                           Rule((b"t/*/z",), Mapping(), 1)))
    assert c.stamp_scope() == ["site/h/s/#", "t/+/z"]
    many = core(exports=[b"p%03d/" % i for i in range(200)], imports=[])
    assert many.stamp_scope() == ["#"]                                  # too long: coarser
    assert core(exports=[b"a/"], imports=[], export_qos=0).stamp_scope() == []


def test_what_a_receiver_remembers_of_senders_is_bounded(monkeypatch) -> None:
    """At most STAMP_SENDERS senders and STAMP_BYTES of their ids (a hostile peer can
    send any id), GAP_RANGES gaps each: a forgotten sender starts over (uncounted), a
    forgotten gap's numbers stay missing and arriving late are taken for copies."""
    import sbus.bridge.core as core_module

    monkeypatch.setattr(core_module, "STAMP_SENDERS", 3)
    monkeypatch.setattr(core_module, "STAMP_BYTES", 3000)
    c = core(exports=[], imports=[b""])
    for name in ("a", "b", "c", "d"):
        c.from_mqtt(b"k", b"", name, _stamp(1), ("#",))
    assert [s for s, _ in c._stamps] == ["b", "c", "d"]
    c.from_mqtt(b"k", b"", "x" * 2000, _stamp(1), ("#",))
    c.from_mqtt(b"k", b"", "y" * 2000, _stamp(1), ("#",))
    assert list(c._stamps) == [("y" * 2000, 1)] and c._stamp_bytes == 2000  # oldest first
    assert c.from_mqtt(b"k", b"", "a", _stamp(1), ("#",)) == b"k"      # forgotten: anew
    for n in range(3, 3 + 2 * (core_module.GAP_RANGES + 1), 2):        # 17 gaps of one
        c.from_mqtt(b"k", b"", "a", _stamp(n), ("#",))
    assert c.counters.missing == core_module.GAP_RANGES + 1
    assert c.from_mqtt(b"k", b"", "a", _stamp(2), ("#",)) is None       # gap forgotten
    assert c.from_mqtt(b"k", b"", "a", _stamp(4), ("#",)) == b"k"
    assert c.counters.missing == core_module.GAP_RANGES


def test_qos0_exports_are_numbered_only_when_handed_over() -> None:
    """The QoS 0 numbering (STAMP0) is the sender's own: an epoch of this run, and a
    number taken only by an export the MQTT client accepted, so a receiver sees no gap
    for what the sender counted as dropped (no double counting)."""
    a = core(exports=[b"seq/"], imports=[], export_qos=0, client_id="a")
    assert core(exports=[], imports=[]).epoch0 != a.epoch0 and len(a.epoch0) == 8
    b = core(exports=[], imports=[b"seq/"], client_id="b")
    scope = tuple(a.stamp_scope(0))
    assert scope == ("seq/#",) and a.stamp_scope(1) == []
    wire = []   # what reached the receiver
    for n in range(10):
        assert a.from_bus(b"seq/x", b"%d" % n) == "seq/x"
        if n in (3, 4):
            a.dropped()                  # paho had no connection: no number used
            continue
        stamp = f"{a.epoch0}.{a.next0:016x}"
        a.exported(6, numbered=True)
        if n != 7:                       # lost on the way (TCP's buffers)
            wire.append((b"%d" % n, stamp))
    assert (a.next0, a.counters.exported, a.counters.dropped) == (8, 8, 2)
    for payload, stamp in wire:
        assert b.from_mqtt(b"seq/x", payload, "a", stamp, scope, 0) == b"seq/x"
    assert (b.counters.missing, b.counters.duplicates) == (1, 0)   # 7 only, not 3 and 4


def test_qos0_numbers_are_apart_from_the_spools() -> None:
    """A sender's QoS 0 and QoS 1 numberings are counted apart: the same number in each
    is no copy, and a gap in one is counted with that numbering's scope."""
    c = core(exports=[], imports=[b"seq/"])
    q1, q0 = ("seq/#",), ("seq/log/#",)
    for n in (0, 1, 2):
        assert c.from_mqtt(b"seq/x", b"", "a", _stamp(n), q1, 1) == b"seq/x"
        assert c.from_mqtt(b"seq/log/x", b"", "a", _stamp(n, "f0"), q0, 0) == b"seq/log/x"
    assert c.from_mqtt(b"seq/log/x", b"", "a", _stamp(6, "f0"), q0, 0) == b"seq/log/x"
    assert c.from_mqtt(b"seq/log/x", b"", "a", _stamp(6, "f0"), q0, 0) is None
    assert c.from_mqtt(b"seq/x", b"", "a", _stamp(3), q1, 1) == b"seq/x"
    assert (c.counters.missing, c.counters.duplicates) == (3, 1)
    assert c.from_mqtt(b"seq/log/x", b"", "a", _stamp(4, "f0"), q0, 0) == b"seq/log/x"
    assert c.counters.missing == 2                                       # late: taken off
    part = core(exports=[], imports=[b"seq/log/"])   # only the QoS 0 topics of a
    for n in (0, 5):
        part.from_mqtt(b"seq/log/x", b"", "a", _stamp(n, "f0"), q0, 0)
        part.from_mqtt(b"seq/log/x", b"", "a", _stamp(n * 2), q1, 1)
    assert part.counters.missing == 4                                    # QoS 0's only


def test_the_scope_of_each_numbering() -> None:
    c = core(exports=[], imports=[],
             export_rules=(Rule((b"s/",), Mapping.parse("s/=site/h/s/"), 1),
                           Rule((b"log/", b"log/x/"), Mapping.parse("log/=site/h/log/"), 0),
                           Rule((b"t/*/z",), Mapping(), 0)))
    assert c.stamp_scope(1) == ["site/h/s/#"]
    assert c.stamp_scope(0) == ["site/h/log/#", "t/+/z"]


def test_a_receiver_restarted_cleanly_counts_what_came_meanwhile() -> None:
    """What a receiver remembers of senders is saved at a clean exit and taken back: the
    numbers a sender used while the receiver was away are missing, none is imported
    twice; a damaged saved memory is skipped item by item, never raising."""
    import json

    first = core(exports=[], imports=[b""])
    for n in (0, 1, 2, 5):
        first.from_mqtt(b"k", b"", "a", _stamp(n, "f0"), ("#",), 0)
    first.from_mqtt(b"k", b"", "a", _stamp(9), ("#",), 1)
    saved = json.loads(json.dumps(first.senders_saved()))
    again = core(exports=[], imports=[b""])
    again.counters.restore(first.counters.saved())
    again.restore_senders(saved)
    assert again.from_mqtt(b"k", b"", "a", _stamp(5, "f0"), ("#",), 0) is None  # seen
    assert again.from_mqtt(b"k", b"", "a", _stamp(3, "f0"), ("#",), 0) == b"k"  # late
    assert again.from_mqtt(b"k", b"", "a", _stamp(20, "f0"), ("#",), 0) == b"k"
    assert again.from_mqtt(b"k", b"", "a", _stamp(10), ("#",), 1) == b"k"
    assert (again.counters.missing, again.counters.duplicates) == (2 - 1 + 14, 1)
    damaged = [None, 3, "x", [1, 0, "e", 1, []], ["b", 2, "e", 1, []], ["b", 0, "e", -1, []],
               ["b", 0, "e", 5, [[1, 9, True]]], ["b", 0, "e", 5, "abc"],
               ["b", 0, "e" * 17, 5, []], ["b", 0, "e", 5, [[1, 2, 1]]], ["b", 0, "e", 5, {}],
               ["c", 0, "e", 5, [[1, 3, False]]]]
    fresh = core(exports=[], imports=[b""])
    fresh.restore_senders(damaged)
    fresh.restore_senders({"not": "a list"})
    assert list(fresh._stamps) == [("c", 0)]


def test_the_mqtt_socket_gets_tcp_nodelay() -> None:
    """paho sets no TCP_NODELAY: QoS 0 streams then wait on delayed ACKs (issue 26)."""
    import socket

    from sbus.bridge.shell import BridgeShell, Broker, MqttSettings

    shell = BridgeShell(core(), "/nonexistent", MqttSettings([Broker("127.0.0.1", 1)]))
    with socket.socket() as s:
        shell._on_socket_open(shell.mq, None, s)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_quick_properties_decode_as_paho_does() -> None:
    """`QuickProperties` (paho's tables built once) reads what paho's own reads, through
    paho's decoder, and is what that decoder builds in the bridge (issue 26)."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from sbus.bridge.buffered import QuickProperties, quick_properties

    sent = Properties(PacketTypes.PUBLISH)
    sent.UserProperty = [("sbus-bridge", "a"), ("sbus-seq", "e.0000000000000001")]
    sent.MessageExpiryInterval = 30
    raw = sent.pack()
    for props in (b"\0", raw):
        theirs, ours = Properties(PacketTypes.PUBLISH), QuickProperties(PacketTypes.PUBLISH)
        assert theirs.unpack(props + b"rest")[1] == ours.unpack(props + b"rest")[1]
        assert str(theirs) == str(ours) and theirs.pack() == ours.pack()
        ours.unpack(b"\0")  # cleared: nothing of the last packet left
        assert ours.isEmpty()
    quick_properties()
    packet = b"\0\x03a/b\0\x07" + raw + b"payload"  # topic, packet id, properties
    got = paho_packet.decode_publish(0x32, packet, 5)
    assert type(got.properties) is QuickProperties
    assert (got.topic, got.mid, got.payload) == (b"a/b", 7, b"payload")
    assert got.properties.UserProperty == sent.UserProperty


def test_buffered_client_reads_and_writes_in_runs() -> None:
    """paho's many small reads come from one read of the socket, and its writes go in one
    send at `push` (or wait, with the socket full); a closed socket drops the buffers."""
    import socket

    from paho.mqtt.enums import CallbackAPIVersion

    from sbus.bridge.buffered import BufferedClient

    mq = BufferedClient(CallbackAPIVersion.VERSION2, protocol=5)
    a, b = socket.socketpair()
    a.setblocking(False)
    mq._sock = a  # as paho's connect leaves it
    b.sendall(b"\x40\x02\x00\x07" * 3)
    assert mq._sock_recv(1) == b"\x40" and mq.pending() == 11
    assert mq._sock_recv(1) == b"\x02" and mq._sock_recv(2) == b"\x00\x07"
    assert mq._sock_recv(100) == b"\x40\x02\x00\x07\x40\x02\x00\x07" and mq.pending() == 0
    for _ in range(3):
        assert mq._sock_send(b"xyz") == 3
    assert mq.want_write()
    try:
        b.recv(100, socket.MSG_DONTWAIT)
        raise AssertionError("written before push")
    except BlockingIOError:
        pass
    mq.push()
    assert not mq.want_write() and b.recv(100) == b"xyz" * 3
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    while True:  # fill the socket: what does not go waits for the next push
        mq._sock_send(b"x" * 65536)
        mq.push()
        if mq.unsent():
            break
    held = mq.unsent()
    mq._sock_close()
    assert mq.unsent() == 0 and mq.pending() == 0 and held > 0
    b.close()


def test_buffered_client_takes_whole_success_pubacks_as_paho_would(monkeypatch) -> None:
    """The PUBACK short cut (`BufferedClient._packet_read`): 4-byte PUBACKs of success in
    the buffer reach on_publish as from paho's own reader, in order and once; a PUBACK
    with a reason code, one split across reads, a duplicate and the PUBLISH after them are
    paho's, and all of it comes out the same."""
    import socket

    from paho.mqtt.client import _ConnectionState
    from paho.mqtt.enums import CallbackAPIVersion

    from sbus.bridge.buffered import BufferedClient

    mq = BufferedClient(CallbackAPIVersion.VERSION2, protocol=5)
    a, b = socket.socketpair()
    a.setblocking(False)
    mq._sock = a
    mq._state = _ConnectionState.MQTT_CS_CONNECTED
    acked: list[tuple[int, int]] = []
    got: list[tuple[str, bytes]] = []
    mq.on_publish = lambda _c, _u, mid, reason, _p: acked.append((mid, reason.value))
    mq.on_message = lambda _c, _u, msg: got.append((msg.topic, msg.payload))
    decoded: list[int] = []  # PUBACKs paho's decoder saw
    decode = paho_packet.decode_puback
    monkeypatch.setattr(paho_packet, "decode_puback",
                        lambda *args: decoded.append(1) or decode(*args))
    mids = [mq.publish("t", b"%d" % i, qos=1).mid for i in range(5)]
    assert mids == [1, 2, 3, 4, 5]
    mq.push()
    b.recv(65536)  # (what the broker would have read)
    b.sendall(b"\x40\x02\x00\x01" b"\x40\x02\x00\x02"  # whole, success: the short cut
              b"\x40\x03\x00\x03\x80"  # a reason code (unspecified error): paho's
              b"\x40\x02\x00\x02"  # a duplicate: ignored, as paho does
              b"\x30\x06\x00\x01x\x00hi"  # a PUBLISH (QoS 0, no properties)
              b"\x40\x02\x00")  # the start of a PUBACK: the rest comes later
    while mq.loop_read() == 0 and mq.pending():
        pass
    assert acked == [(1, 0), (2, 0), (3, 0x80)] and got == [("x", b"hi")]
    b.sendall(b"\x04" b"\x40\x02\x00\x05")
    while mq.loop_read() == 0 and mq.pending():
        pass
    assert acked[3:] == [(4, 0), (5, 0)] and not mq._out_messages
    # paho decoded the one with a reason code and the split one; the short cut took the
    # others (the first of each read too: it reads when the buffer is empty)
    assert len(decoded) == 2
    b.close()
    a.close()


def _publish_packet(topic: bytes, payload: bytes, qos: int = 0, mid: int = 0,
                    dup: bool = False, props: bytes = b"") -> bytes:
    from sbus.bridge.buffered import remaining_length
    body = (len(topic).to_bytes(2, "big") + topic + (mid.to_bytes(2, "big") if qos else b"")
            + remaining_length(len(props)) + props + payload)
    return bytes([0x30 | dup << 3 | qos << 1]) + remaining_length(len(body)) + body


def _user_property(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return b"\x26" + len(k).to_bytes(2, "big") + k + len(v).to_bytes(2, "big") + v


def _read_all(stream: bytes, quick: bool, cut: int | None = None, queued: bool = False,
              held: list[int] | None = None):
    """What a connected `BufferedClient` hands on for *stream* (in two reads if *cut*;
    with a SUBSCRIBE queued by paho first if *queued*; its PUBACKs held in *held* if
    given, then the first half of them released): (messages as (topic, payload, qos,
    dup, user properties), the bytes it writes, whether a read failed, how many
    messages paho decoded)."""
    import socket

    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    from sbus.bridge.buffered import BufferedClient

    mq = BufferedClient(CallbackAPIVersion.VERSION2, protocol=5)
    a, b = socket.socketpair()
    a.setblocking(False)
    mq._sock = a
    mq._state = mqtt._ConnectionState.MQTT_CS_CONNECTED
    mq.on_socket_register_write = lambda *_: None  # (queue, as the bridge has paho do)
    got: list[tuple] = []
    by_paho = []
    mq.on_message = lambda _c, _u, m: by_paho.append(1) or got.append(
        (m._topic, m.payload, m.qos, bool(m.dup),
         list(getattr(m.properties, "UserProperty", None) or [])))
    if quick:
        mq.on_quick_message = lambda *m: got.append((*m[:4], list(m[4])))
    if queued:
        mq.subscribe("s", qos=1)  # in paho's queue: the PUBACKs must go after it
    mq.held = held
    failed = False
    for part in (stream,) if cut is None else (stream[:cut], stream[cut:]):
        b.sendall(part)
        while True:
            rc = mq.loop_read()
            if rc != 0:
                failed = True
                break
            if not mq.pending():
                break
    b.setblocking(False)
    if held is not None:
        mq.flush()
        try:
            early = b.recv(65536)
        except BlockingIOError:
            early = b""
        assert b"\x40\x02" not in early and bool(early) == queued  # (the SUBSCRIBE)
        mq.release(len(held) // 2 + 1)
    mq.flush()
    try:
        written = b.recv(65536)
    except BlockingIOError:
        written = b""
    a.close()
    b.close()
    return got, written, failed, len(by_paho)


def test_buffered_client_takes_plain_publishes_as_paho_would() -> None:
    """The PUBLISH short cut (`BufferedClient._quick_publish`) hands on what paho's reader
    would (topic, payload, QoS, DUP, user properties) and writes the same PUBACKs, for
    QoS 0 and 1, with and without user properties, remaining lengths of 1 to 3 bytes (the
    bridge's Maximum Packet Size allows no more), in one read or cut anywhere; what it
    must leave to paho (QoS 2, another property, a malformed packet) paho takes, with the
    same outcome."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    stamps = _user_property("sbus-bridge", "b1") + _user_property("sbus-seq", "e.0001") \
        + _user_property("ключ", "значение")
    plain = [
        _publish_packet(b"a/b", b"hi"),
        _publish_packet(b"a/b", b"", qos=1, mid=1),
        _publish_packet("ä/ü".encode(), b"x" * 200, qos=1, mid=2, dup=True),
        _publish_packet(b"t", b"y" * 20000, qos=1, mid=3, props=stamps),
        _publish_packet(b"t", b"z" * 40_000, qos=0, props=stamps),
        _publish_packet(b"q", b"0", qos=1, mid=65535, props=_user_property("", "")),
    ]
    stream = b"".join(plain)
    want, acks, failed, decoded = _read_all(stream, quick=False)
    assert not failed and decoded == len(plain) and len(want) == len(plain)
    assert acks == b"".join(b"\x40\x02" + m.to_bytes(2, "big") for m in (1, 2, 3, 65535))
    assert _read_all(stream, quick=True)[:3] == (want, acks, False)
    assert _read_all(stream, quick=True)[3] == 0  # all of them by the short cut
    for cut in (1, 2, 5, len(plain[0]) + 3, len(stream) - 2):
        assert _read_all(stream, quick=True, cut=cut)[:3] == (want, acks, False), cut
    for quick in (False, True):  # held until released, in order, by either path
        held: list[int] = []
        got, written, _, _ = _read_all(stream, quick=quick, held=held)
        assert written == b"".join(b"\x40\x02" + m.to_bytes(2, "big") for m in (1, 2, 3))
        assert held == [65535]  # (not released yet)
        assert _read_all(stream, quick=quick, queued=True, held=[])[1] == written
    after = _read_all(stream, quick=False, queued=True)
    assert after[1].endswith(acks) and len(after[1]) > len(acks)  # the SUBSCRIBE first
    assert _read_all(stream, quick=True, queued=True)[:3] == after[:3]
    expiry = Properties(PacketTypes.PUBLISH)
    expiry.MessageExpiryInterval = 60
    paho_only = [
        _publish_packet(b"a", b"q2", qos=2, mid=9),
        _publish_packet(b"a", b"exp", qos=1, mid=10, props=expiry.pack()[1:]),
        _publish_packet(b"a", b"bad", qos=1, mid=11, props=b"\x26\x00\x02\xff\xfe\x00\x00"),
    ]
    for packet in paho_only:
        want = _read_all(packet, quick=False)
        assert _read_all(packet, quick=True) == want and want[3] <= 1
    malformed = [b"\x30\x04\x00\x09ab", b"\x32\x05\x00\x01a\x00\x00",
                 b"\x30\x05\x00\x01a\x05\x26"]
    for packet in malformed:
        want = _read_all(packet, quick=False)
        assert _read_all(packet, quick=True) == want, packet


class _Stamp:
    """What the shell's stamp gives `publish_now`: a user property, packed."""

    def pack(self) -> bytes:
        return b"\x0d\x26\x00\x01a\x00\x06e.0001"


def _connected_client():
    """A `BufferedClient` that takes itself for connected, on one end of a socket pair:
    (it, the other end)."""
    import socket

    from paho.mqtt.client import _ConnectionState
    from paho.mqtt.enums import CallbackAPIVersion

    from sbus.bridge.buffered import BufferedClient

    mq = BufferedClient(CallbackAPIVersion.VERSION2, protocol=5)
    a, b = socket.socketpair()
    a.setblocking(False)
    mq._sock, mq._state = a, _ConnectionState.MQTT_CS_CONNECTED
    return mq, b


def test_buffered_client_publishes_now_what_paho_would_send() -> None:
    """`BufferedClient.publish_now` writes the bytes paho's own publish and loop_write
    write, `record` then records the message as paho does (its PUBACK ends it), and it
    leaves to paho what must wait: no connection, the window full, messages or packets
    queued ahead."""
    from paho.mqtt.client import _ConnectionState, mqtt_ms_wait_for_puback

    Stamp, client = _Stamp, _connected_client
    theirs, their_peer = client()
    ours, our_peer = client()
    acked: list[int] = []
    records = []
    ours.on_publish = lambda _c, _u, mid, reason, _p: acked.append(mid)
    for topic, payload in ((b"a/b", b"x"), (b"t" * 200, b"y" * 70_000), (b"c", b"")):
        info = theirs.publish(topic.decode(), payload, 1, properties=Stamp())
        theirs.flush()
        mine = ours.publish_now(topic, payload, Stamp())
        ours.flush()
        assert mine is not None and mine not in ours._out_messages  # recorded after
        ours.record()
        assert (mine, 0) == (info.mid, info.rc)
        sent = their_peer.recv(100_000)
        assert our_peer.recv(100_000) == sent and sent[0] == 0x32
        msg = ours._out_messages[mine]
        assert (msg.topic, msg.payload, msg.qos, msg.state, msg.dup, msg.retain,
                msg.info.mid, msg.info.rc, msg.info.is_published()) == (
            topic.decode(), payload, 1, mqtt_ms_wait_for_puback, False, False, mine, 0,
            False)
        records.append(msg)
    assert ours._inflight_messages == theirs._inflight_messages == 3
    our_peer.sendall(b"\x40\x02\x00\x01")
    while ours.loop_read() == 0 and ours.pending():
        pass
    assert acked == [1] and ours._inflight_messages == 2 and 1 not in ours._out_messages
    assert [m.info.is_published() for m in records] == [True, False, False]

    ours.set_window(2)  # full: paho's path queues it, and what follows waits behind it
    assert ours.publish_now(b"late", b"1", Stamp()) is None
    queued = ours.publish("late", b"1", 1, properties=Stamp())
    assert queued.rc == 0 and ours._out_messages[queued.mid].state != mqtt_ms_wait_for_puback
    ours.set_window(10)
    assert ours.publish_now(b"later", b"2", Stamp()) is None  # behind the queued one
    ours._state = _ConnectionState.MQTT_CS_CONNECT_ASYNC
    fresh, _ = client()
    fresh._state = _ConnectionState.MQTT_CS_CONNECT_ASYNC
    assert fresh.publish_now(b"a", b"1", Stamp()) is None  # not connected yet
    fresh._state = _ConnectionState.MQTT_CS_CONNECTED
    fresh._out_packet.append({"command": 0xC0, "mid": 0, "qos": 0, "pos": 0,
                              "to_process": 2, "packet": b"\xc0\x00", "info": None})
    assert fresh.publish_now(b"a", b"1", Stamp()) is None  # a PINGREQ queued ahead
    for sock in (their_peer, our_peer, theirs._sock, ours._sock, fresh._sock):
        sock.close()


def test_buffered_client_publishes_qos0_now_what_paho_would_send() -> None:
    """`BufferedClient.publish0_now` writes the bytes paho's own QoS 0 publish and
    loop_write write, keeps nothing, and leaves to paho what must wait: no connection,
    packets queued ahead, a full write buffer."""
    from paho.mqtt.client import _ConnectionState

    from sbus.bridge.buffered import WRITE_CHUNK

    Stamp, client = _Stamp, _connected_client
    theirs, their_peer = client()
    ours, our_peer = client()
    for topic, payload in ((b"a/b", b"x"), (b"t" * 200, b"y" * 70_000), (b"c", b"")):
        assert theirs.publish(topic.decode(), payload, 0, properties=Stamp()).rc == 0
        theirs.flush()
        assert ours.publish0_now(topic, payload, Stamp())
        ours.flush()
        sent = their_peer.recv(100_000)
        assert our_peer.recv(100_000) == sent and sent[0] == 0x30
    assert not ours._out_messages and not ours._unrecorded and not ours._inflight_messages
    ours._out_packet.append({"command": 0xC0, "mid": 0, "qos": 0, "pos": 0,
                             "to_process": 2, "packet": b"\xc0\x00", "info": None})
    assert not ours.publish0_now(b"a", b"1", Stamp())  # a PINGREQ queued ahead
    ours._out_packet.clear()
    ours._wbuf += b"\0" * WRITE_CHUNK
    assert not ours.publish0_now(b"a", b"1", Stamp())  # the buffer full
    ours._wbuf.clear()
    ours._state = _ConnectionState.MQTT_CS_CONNECT_ASYNC
    assert not ours.publish0_now(b"a", b"1", Stamp())  # not connected
    for sock in (their_peer, our_peer, theirs._sock, ours._sock):
        sock.close()
