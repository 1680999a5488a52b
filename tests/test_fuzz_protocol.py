"""Fuzzing the parser against the protocol text's regular expressions, and KeyRules.

* ``parse(encode(e)) == e`` for every event;
* any bytes either parse to exactly what the protocol's regular expressions say,
  or raise `ProtocolError` when none matches — never another exception;
* `KeyRules.check_pattern` never accepts a pattern that can match someone else's
  secret key (checked with the reference matcher, not the routing module).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from fuzz_profiles import fuzz_settings
from hypothesis import assume, example, given
from reference import reference_match, reference_parse

from sbus.keys import Credentials, KeyRefused, KeyRules
from sbus.protocol import Control, ProtocolError, Publish, Subscribe, Unsubscribe, encode, parse

no_nul = st.binary(max_size=40).map(lambda b: b.replace(b"\0", b"x"))
anything = st.binary(max_size=60)

events = st.one_of(
    st.builds(Subscribe, no_nul),
    st.builds(Unsubscribe, no_nul),
    st.builds(Publish, no_nul, anything),
    st.builds(Control, no_nul, st.one_of(st.none(), anything)),
)

VERBS = [b"SUB ", b"UNSUB ", b"MSG ", b"CMSG ", b"SUB", b"MSG", b"CMSG", b"UNSUB", b"SU",
         b"sub ", b"MSG\0", b" MSG ", b"CMSG  ", b"UNSUB\0", b""]
packets = st.one_of(
    anything,
    st.tuples(st.sampled_from(VERBS), anything).map(b"".join),
    st.tuples(st.sampled_from(VERBS), no_nul, st.sampled_from([b"", b"\0"]), anything)
    .map(b"".join),
)


@fuzz_settings()
@given(events)
def test_encode_then_parse_is_identity(event) -> None:
    assert parse(encode(event)) == event


@fuzz_settings()
@given(packets)
@example(b"")
@example(b"MSG ")
@example(b"CMSG ")
@example(b"UNSUB")
@example(b"SUB \0\0")
@example(b"MSG \0")
def test_parse_agrees_with_the_protocol_regexes(packet: bytes) -> None:
    expected = reference_parse(packet)
    if expected is None:
        with pytest.raises(ProtocolError):
            parse(packet)
    else:
        assert parse(packet) == expected


@fuzz_settings()
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_nothing_but_protocol_error(packet: bytes) -> None:
    try:
        event = parse(packet)
    except ProtocolError:
        return
    # what parses, encodes back to a packet that parses the same (trailers dropped)
    assert parse(encode(event)) == event


def test_encode_refuses_nul_in_keys() -> None:
    for event in (Subscribe(b"a\0b"), Publish(b"a\0", b"x"), Control(b"\0", None)):
        with pytest.raises(ProtocolError):
            encode(event)


# -- secret patterns -------------------------------------------------------------

FIELDS = [b"", b"1", b"2", b"12", b"01", b"*", b"1*", b"x"]
ME = Credentials(gid=1, uid=2, pid=12)


def secret_patterns(sep: bytes) -> st.SearchStrategy[bytes]:
    field = st.sampled_from(FIELDS)
    rest = st.lists(st.sampled_from([b"a", b"*", sep, b"!", b"cred", b"1"]), max_size=6)
    structured = st.tuples(st.sampled_from([b"!", b"*", b"!*", b""]), st.sampled_from(
        [b"cred", b"*", b"cre*"]), field, field, field, rest).map(
        lambda t: sep.join(t[:5]) + sep + b"".join(t[5]))
    truncated = structured.map(lambda p: p[: len(p) // 2])
    return st.one_of(structured, truncated, st.binary(max_size=12))


def secret_keys(sep: bytes) -> st.SearchStrategy[bytes]:
    num = st.sampled_from([b"1", b"2", b"12", b"0"])
    rest = st.lists(st.sampled_from([b"a", sep, b"!", b"cred", b"1"]), max_size=6)
    return st.tuples(num, num, num, rest).map(
        lambda t: sep.join([b"!", b"cred", *t[:3]]) + sep + b"".join(t[3]))


@pytest.mark.parametrize("sep", [b"/", b"."])
def test_check_pattern_never_lets_a_pattern_match_anothers_secret(sep: bytes) -> None:
    rules = KeyRules(sep)
    own_prefix = ME.path(sep) + sep

    @fuzz_settings()
    @given(pattern=secret_patterns(sep), keys=st.lists(secret_keys(sep), min_size=1, max_size=8))
    @example(pattern=b"", keys=[ME.path(sep) + sep + b"a"])
    @example(pattern=b"!" + sep, keys=[ME.path(sep) + sep + b"a"])
    @example(pattern=sep.join([b"!", b"cred", b"*", b"*", b"*", b""]),
             keys=[sep.join([b"!", b"cred", b"2", b"2", b"2", b"a"])])
    def check(pattern: bytes, keys: list[bytes]) -> None:
        try:
            accepted = rules.check_pattern(pattern, ME)
        except KeyRefused:
            return
        for key in keys:
            if reference_match(accepted, key, sep):
                assert key.startswith(own_prefix), (pattern, accepted, key)

    check()


@pytest.mark.parametrize("sep", [b"/", b"."])
def test_own_secret_patterns_are_accepted_and_filled(sep: bytes) -> None:
    """The positive side: the owner's own and empty fields are accepted and filled in."""
    rules = KeyRules(sep)

    @fuzz_settings()
    @given(g=st.sampled_from([b"", b"1"]), u=st.sampled_from([b"", b"2"]),
           p=st.sampled_from([b"", b"12"]), rest=st.sampled_from([b"", b"a", b"*", b"a" + sep]))
    def check(g: bytes, u: bytes, p: bytes, rest: bytes) -> None:
        pattern = sep.join([b"!", b"cred", g, u, p]) + sep + rest
        assert rules.check_pattern(pattern, ME) == ME.path(sep) + sep + rest

    check()


@fuzz_settings()
@given(key=st.one_of(secret_keys(b"/"), st.binary(max_size=20)))
def test_check_key_accepts_only_well_formed_secrets(key: bytes) -> None:
    """Anyone may publish a secret key, but only in the form !/cred/GID/UID/PID/…"""
    assume(key.startswith(b"!/"))
    rules = KeyRules()
    parts = key.split(b"/")
    well_formed = len(parts) >= 6 and parts[1] == b"cred" and all(
        f.isdigit() or f == b"" for f in parts[2:5])
    try:
        rules.check_key(key)
    except KeyRefused:
        assert not well_formed or b"!" in parts[5:], key
    else:
        assert well_formed, key
