"""The routing index against the brute-force reference under random operation sequences.

A hypothesis state machine subscribes, unsubscribes (known and unknown
patterns, duplicates), removes clients and publishes, over a tiny alphabet so
that wildcards, separators, ``!`` and secret prefixes collide often.  After
every step the index must agree with `reference.Bus`: the same clients per key,
each once, the same pattern multisets, and no dead trie nodes once empty.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from fuzz_profiles import fuzz_settings
from hypothesis import given
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from reference import Bus, reference_match

from sbus.routing import RoutingIndex, matches

CLIENTS = st.integers(0, 4)


def keys(sep: bytes) -> st.SearchStrategy[bytes]:
    """Keys and patterns from a tiny alphabet, often starting with a secret prefix."""
    atoms = [b"a", b"b", b"ab", b"*", sep, b"!", b"cred", b"1", b""]
    body = st.lists(st.sampled_from(atoms), max_size=7).map(b"".join)
    secret = st.tuples(st.sampled_from([b"1", b"2", b""]), body).map(
        lambda t: sep.join([b"!", b"cred", t[0], t[0], t[0]]) + sep + t[1])
    return st.one_of(body, secret, st.binary(max_size=6))


def make_machine(sep: bytes):
    class RoutingMachine(RuleBasedStateMachine):
        """Random subscribe/unsubscribe/publish/remove against the reference model."""

        patterns = Bundle("patterns")

        def __init__(self) -> None:
            super().__init__()
            self.index: RoutingIndex[int] = RoutingIndex(sep)
            self.model = Bus(sep)

        @rule(target=patterns, pattern=keys(sep))
        def new_pattern(self, pattern: bytes) -> bytes:
            return pattern

        @rule(client=CLIENTS, pattern=patterns)
        def subscribe(self, client: int, pattern: bytes) -> None:
            self.index.subscribe(client, pattern)
            self.model.subscribe(client, pattern)

        @rule(client=CLIENTS, pattern=st.one_of(patterns, keys(sep)))
        def unsubscribe(self, client: int, pattern: bytes) -> None:
            assert self.index.unsubscribe(client, pattern) == \
                self.model.unsubscribe(client, pattern)

        @rule(client=CLIENTS, pattern=consumes(patterns))
        def unsubscribe_all_copies(self, client: int, pattern: bytes) -> None:
            while self.model.unsubscribe(client, pattern):
                assert self.index.unsubscribe(client, pattern)
            assert not self.index.unsubscribe(client, pattern)

        @rule(client=CLIENTS)
        def remove_client(self, client: int) -> None:
            assert self.index.remove_client(client) == self.model.remove_client(client)

        @rule(key=st.one_of(patterns, keys(sep)))
        def publish(self, key: bytes) -> None:
            got = self.index.match(key)
            assert len(got) == len(set(got)), f"a client got {key!r} twice: {got}"
            assert set(got) == self.model.match(key), key
            # a second lookup comes from the cache and must agree too
            assert set(self.index.match(key)) == set(got)

        @precondition(lambda self: len(self.model) > 0)
        @rule(data=st.data())
        def publish_to_a_subscribed_shape(self, data) -> None:
            """Keys derived from a live pattern, so matches are frequent, not luck."""
            client = data.draw(st.sampled_from(sorted(self.model.subs)))
            pattern = data.draw(st.sampled_from(sorted(self.model.subs[client])))
            fill = data.draw(st.sampled_from([b"", b"a", b"xyz"]))
            suffix = data.draw(st.sampled_from([b"", b"q", sep + b"q", sep]))
            key = pattern.replace(b"*", fill) + suffix
            assert set(self.index.match(key)) == self.model.match(key), (pattern, key)

        @invariant()
        def same_subscriptions(self) -> None:
            assert len(self.index) == len(self.model)
            for client in range(5):
                assert self.index.patterns(client) == self.model.patterns(client)
            assert set(self.index.clients()) == set(self.model.subs)

        @invariant()
        def no_dead_nodes_when_empty(self) -> None:
            if len(self.model) == 0:
                ix = self.index
                assert ix._public.empty() and ix._secret.empty(), "trie keeps dead branches"
                assert not ix._everything and not ix._never and not ix._exact

    RoutingMachine.TestCase.settings = fuzz_settings(stateful_step_count=60)
    return RoutingMachine


TestRoutingSlash = make_machine(b"/").TestCase
TestRoutingDot = make_machine(b".").TestCase


@fuzz_settings()
@given(pattern=keys(b"/"), key=keys(b"/"))
def test_pure_matcher_agrees_with_reference(pattern: bytes, key: bytes) -> None:
    assert matches(pattern, key) == reference_match(pattern, key)


def test_reference_matcher_follows_the_protocol_examples() -> None:
    """The model itself, checked on the protocol text's own examples."""
    assert reference_match(b"a/*/c/", b"a/b/c/")
    assert reference_match(b"a/*/c/", b"a/b/c/d/e")
    assert not reference_match(b"a/*/c/", b"a/b/c")
    assert not reference_match(b"a/*/c/", b"a/c/d")
    assert reference_match(b"", b"anything/at/all")
    assert not reference_match(b"", b"!/cred/1/2/3/x")
    # "!/" would match at this level: KeyRules refuses such truncated secret patterns
    assert not reference_match(b"*/", b"!/cred/1/2/3/x")
    assert reference_match(b"foo*", b"foobar")
    assert not reference_match(b"a*b", b"axb")
    model = Bus()
    model.subscribe(1, b"x")
    model.subscribe(1, b"x")
    assert model.unsubscribe(1, b"x") and model.match(b"x") == {1}
    assert Counter(model.patterns(1)) == Counter({b"x": 1})
