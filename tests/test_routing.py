"""The routing index against a brute-force matcher written straight from the protocol text."""

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sbus.routing import RoutingIndex, matches


def brute(pattern: bytes, key: bytes, sep: bytes = b"/") -> bool:
    """The protocol text, read literally, one byte at a time.

    '*' matches until the next separator (or the end); a pattern ending with the
    separator has that separator match a separator and any subsequent byte; the
    empty pattern matches everything.  Secret keys ('!/…') are only ever matched
    by secret patterns.
    """
    if key.startswith(b"!" + sep) and not pattern.startswith(b"!" + sep):
        return False
    if pattern == b"":
        return True
    p = k = 0
    while p < len(pattern):
        c = pattern[p : p + 1]
        if c == b"*":
            while k < len(key) and key[k : k + 1] != sep:
                k += 1
            p += 1
        elif c == sep and p == len(pattern) - 1:
            return key[k : k + 1] == sep
        elif key[k : k + 1] == c:
            p += 1
            k += 1
        else:
            return False
    return k == len(key)


TEXT_EXAMPLES = [
    (b"a/*/c/", b"a/b/c/", True),
    (b"a/*/c/", b"a/b/c/d/e", True),
    (b"a/*/c/", b"a/b/c", False),
    (b"a/*/c/", b"a/c/d", False),
    (b"", b"anything/at/all", True),
    (b"", b"", True),
    (b"a/*", b"a/", True),  # '*' may match nothing
    (b"a/*", b"a/b/c", False),
    (b"foo*", b"foobar", True),
    (b"foo*", b"fo", False),
    (b"a*b", b"ab", False),  # bytes after '*' in a segment never match
    (b"a*b", b"a*b", False),
    (b"*", b"", True),
    (b"a/b", b"a/b", True),
    (b"a/b", b"a/b/", False),
    (b"a//b", b"a//b", True),
    (b"/", b"/x", True),
    (b"", b"!/cred/1/2/3/x", False),
    (b"!/", b"!/cred/1/2/3/x", True),  # the matcher; the broker refuses such a SUB
    (b"*/cred/1/2/3/x", b"!/cred/1/2/3/x", False),
    (b"!/cred/1/2/3/", b"!/cred/1/2/3/x", True),
]


@pytest.mark.parametrize("pattern, key, expected", TEXT_EXAMPLES)
def test_examples(pattern, key, expected):
    assert brute(pattern, key) is expected
    assert matches(pattern, key) is expected
    index = RoutingIndex()
    index.subscribe("c", pattern)
    assert index.match(key) == (("c",) if expected else ())


def test_duplicates_counted_but_delivered_once():
    index = RoutingIndex()
    index.subscribe("c", b"x")
    index.subscribe("c", b"x")
    index.subscribe("c", b"*")
    assert index.match(b"x") == ("c",)
    assert index.unsubscribe("c", b"x")
    assert index.unsubscribe("c", b"*")
    assert index.match(b"x") == ("c",)  # one SUB x left
    assert index.unsubscribe("c", b"x")
    assert index.match(b"x") == ()
    assert not index.unsubscribe("c", b"x")  # not registered: no change
    assert len(index) == 0


def test_cache_invalidated_on_change():
    index = RoutingIndex()
    assert index.match(b"a/b") == ()
    index.subscribe("c", b"a/")
    assert index.match(b"a/b") == ("c",)
    index.remove_client("c")
    assert index.match(b"a/b") == ()


def test_pruned_after_unsubscribe():
    index = RoutingIndex()
    index.subscribe("c", b"a/b/c/d")
    index.unsubscribe("c", b"a/b/c/d")
    assert index._public.empty()


def test_separator_dot():
    index = RoutingIndex(b".")
    index.subscribe("c", b"a.*.c.")
    assert index.match(b"a.b.c.d.e") == ("c",)
    assert index.match(b"a/b/c/d") == ()
    assert brute(b"a.*.c.", b"a.b.c.", b".")


segment = st.sampled_from([b"", b"a", b"b", b"ab", b"!", b"cred", b"1"])
key_st = st.lists(segment, max_size=5).map(b"/".join) | st.binary(max_size=8)
pattern_seg = st.sampled_from([b"", b"a", b"b", b"*", b"a*", b"*b", b"a*b", b"**", b"!", b"1"])
pattern_st = (
    st.tuples(st.lists(pattern_seg, max_size=5).map(b"/".join), st.booleans())
    .map(lambda t: t[0] + (b"/" if t[1] else b""))
    | st.binary(max_size=8)
)


@given(pattern_st, key_st)
def test_matches_agrees_with_brute(pattern, key):
    assert matches(pattern, key) is brute(pattern, key)


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from("xyz"), pattern_st), max_size=12),
       st.lists(key_st, max_size=8), st.data())
def test_index_agrees_with_brute(subs, keys, data):
    index = RoutingIndex()
    model = defaultdict(list)
    for client, pattern in subs:
        index.subscribe(client, pattern)
        model[client].append(pattern)
    # remove some, exactly as the model does
    for client, pattern in data.draw(st.lists(st.sampled_from(subs), max_size=4)) if subs else []:
        if pattern in model[client]:
            model[client].remove(pattern)
            assert index.unsubscribe(client, pattern)
    for key in keys + [k for _, k in subs]:
        want = {c for c, pats in model.items() if any(brute(p, key) for p in pats)}
        got = index.match(key)
        assert len(got) == len(set(got))
        assert set(got) == want, (key, dict(model))


# -- the cache: bounded in bytes, charged to owners, invalidated where a change matters --

from sbus.routing import ENTRY_COST, FRAMED_COST, SECOND_COST, RouteCache  # noqa: E402


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(["sub", "unsub", "match", "drop"]),
                          st.sampled_from("xyz"), pattern_st, key_st), max_size=40))
def test_cached_answers_equal_uncached_ones(ops):
    """With a tiny cache (evicting all the time) and without: the same answers, always;
    the framed copy of the cache (the broker's heads) is the cache, always."""
    cached = RoutingIndex(cache=RouteCache(b"/", limit=3 * (ENTRY_COST + FRAMED_COST + 32),
                                           framing=(b"<", b"/")))
    plain = RoutingIndex()
    for op, client, pattern, key in ops:
        if op == "sub":
            cached.subscribe(client, pattern)
            plain.subscribe(client, pattern)
        elif op == "unsub":
            assert cached.unsubscribe(client, pattern) == plain.unsubscribe(client, pattern)
        elif op == "drop":
            cached.remove_client(client)
            plain.remove_client(client)
        for k in (key, pattern):
            assert set(cached.match(k, owner=client)) == set(plain.lookup(k))
        entries = cached.cache.entries
        assert cached.cache.framed == {b"<" + k + b"/": v for k, v in entries.items()
                                       if b"/" not in k}


def test_cache_is_bounded_in_bytes_and_per_owner():
    index = RoutingIndex(cache=RouteCache(b"/", limit=200_000, per_owner=80_000))
    for i in range(10_000):
        index.match(b"attacker/%d/" % i + b"x" * 500, owner=1000)
    assert index.cache.owner_bytes(1000) <= 80_000
    for i in range(100):
        index.match(b"honest/%d" % i, owner=1001)
    assert index.cache.owner_bytes(1001) > 0
    assert all(b"honest/%d" % i in index.cache.entries for i in range(100))
    assert index.cache.nbytes <= 200_000


def test_unrelated_subscriptions_keep_the_cache():
    index = RoutingIndex()
    index.subscribe("s", b"sensors/*/temp")
    keys = [b"sensors/%d/temp" % i for i in range(100)]
    for k in keys:
        assert index.match(k) == ("s",)
    for i in range(1000):  # churn elsewhere: other first segments, literal patterns
        index.subscribe("churn", b"jobs/%d/" % i)
        index.subscribe("churn", b"sensors/%d/humidity" % i)
        index.unsubscribe("churn", b"jobs/%d/" % i)
    assert all(k in index.cache.entries for k in keys)
    index.subscribe("t", b"sensors/")  # a change that can matter drops that group
    assert not any(k in index.cache.entries for k in keys)
    assert index.match(keys[0]) in (("s", "t"), ("t", "s"))


def test_churn_of_patterns_that_begin_with_a_wildcard_keeps_unrelated_entries():
    """``*/x`` names no first segment: it drops only the keys whose second segment is x
    (it used to clear every public entry, so one user's churn of ``*/N`` halved another
    user's publishing); a change that can matter is still seen at once."""
    index = RoutingIndex()
    index.subscribe("s", b"tp/")
    keys = [b"tp/k%d" % i for i in range(100)]
    for k in keys:
        assert index.match(k) == ("s",)
    for i in range(1000):
        index.subscribe("churn", b"*/%d" % i)
        index.unsubscribe("churn", b"*/%d" % i)
    assert all(k in index.cache.entries for k in keys)
    index.subscribe("t", b"*/k7")  # can matter: tp/k7 is dropped and matched anew
    assert b"tp/k7" not in index.cache.entries and b"tp/k8" in index.cache.entries
    assert set(index.match(b"tp/k7")) == {"s", "t"} and index.match(b"tp/k8") == ("s",)
    assert index.match(b"tp/k8/z") == ("s",)
    index.subscribe("u", b"*/k8/")  # the keys below tp/k8 have k8 second too
    assert b"tp/k8/z" not in index.cache.entries
    assert set(index.match(b"tp/k8/z")) == {"s", "u"}
    index.subscribe("v", b"*")  # no literal second segment: every public entry goes
    assert not index.cache.entries


def test_secret_changes_drop_only_that_process_s_keys():
    index = RoutingIndex()
    mine, other = b"!/cred/1/2/3/inbox", b"!/cred/1/2/4/inbox"
    index.match(mine)
    index.match(other)
    index.match(b"public")
    index.subscribe("p", b"!/cred/1/2/3/")
    assert other in index.cache.entries and b"public" in index.cache.entries
    assert index.match(mine) == ("p",)


def test_many_prefix_siblings_cost_one_probe_per_length():
    index = RoutingIndex()
    for i in range(10_000):
        index.subscribe("attacker", b"a%d*" % i)
    node = index._public
    assert list(node.lengths) == [2, 3, 4, 5]
    assert index.lookup(b"a42x") == ("attacker",)
    assert index.lookup(b"b1") == ()
    for i in range(10):  # the last patterns of one length: it is probed no more
        assert index.unsubscribe("attacker", b"a%d*" % i)
    assert list(node.lengths) == [3, 4, 5] and node.lengths[5] == 9000
    assert index.lookup(b"a42x") == ("attacker",) and index.lookup(b"a1") == ()


def test_keys_are_split_no_deeper_than_the_deepest_pattern():
    index = RoutingIndex()
    index.subscribe("c", b"a/")
    index.subscribe("d", b"a/b")
    assert index._depth == 2
    key = b"a/" + b"x/" * 100_000
    assert index.lookup(key) == ("c",)
    assert set(index.lookup(b"a/b")) == {"c", "d"}


def _traced(build) -> int:
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep = build()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del keep
    return used


@pytest.mark.parametrize("patterns", [
    [b"/".join(b"s%d_%d" % (i, j) for j in range(256)) for i in range(100)],  # deep
    [b"k%d" % i for i in range(3000)],                                       # short
    [b"a%d*" % i for i in range(3000)],                                      # siblings
    [b"x/%d/" % i for i in range(3000)],                                     # tails
    [b"p/" + b"*/" * 200 + b"q%d" % i for i in range(100)],                  # wild
    [b"w*/" + b"/".join(b"s%d_%d" % (i, j) for j in range(200)) + b"/"       # long leaves
     for i in range(100)],
], ids=["deep", "short", "prefix-siblings", "tails", "wildcards", "leaves"])
def test_what_a_subscription_is_charged_covers_its_memory(patterns):
    """The subscription budget bounds broker memory only if `pattern_cost` is no less than
    what the index really allocates, for the shapes an attacker would pick."""
    from sbus.routing import pattern_cost

    def build():
        index = RoutingIndex()
        for i, p in enumerate(patterns):
            index.subscribe(i, p)
        return index

    assert _traced(build) <= sum(pattern_cost(p) for p in patterns)


def test_what_a_cache_entry_is_charged_covers_its_memory():
    cache = RouteCache(b"/", limit=1 << 30)

    def build():
        for i in range(5000):
            cache.put(b"key/%d/" % i + b"x" * (i % 300), ("a", "b"), i % 7)
        return cache

    assert _traced(build) <= cache.nbytes


def test_a_departing_client_can_leave_a_part_at_a_time():
    index = RoutingIndex()
    for i in range(1000):
        index.subscribe("big", b"p/%d" % i)
    index.subscribe("big", b"p/0")
    index.subscribe("other", b"p/5")
    assert index.remove_some("big", 400) == (401, True)  # p/0 counted twice
    assert index.remove_some("big", 400) == (400, True)
    assert index.remove_some("big", 400) == (200, False)
    assert index.remove_some("big", 400) == (0, False)
    assert index.match(b"p/5") == ("other",) and index.match(b"p/6") == ()
    assert len(index) == 1


def test_a_lone_shape_is_one_leaf_split_where_shapes_part_and_folded_back():
    """Below the first segment no other pattern shares, a pattern's literal rest is one
    leaf; a second shape splits it only as far as they share, and leaving folds it."""
    from sbus.routing import _Leaf, _Node

    index = RoutingIndex()
    index.subscribe("a", b"s/x*/y/z/")
    star = index._public.literal[b"s"]
    assert type(star) is _Node and star.prefix[b"x"].rest == b"y/z/"
    index.subscribe("b", b"s/x*/y/w")
    index.subscribe("c", b"s/x*/y/w")
    y = star.prefix[b"x"].literal[b"y"]
    assert type(y) is _Node and y.literal[b"z"] == "a"  # a bare tail leaf
    assert y.literal[b"w"].rest is None and y.literal[b"w"].subs == {"b": 1, "c": 1}
    assert index.lookup(b"s/xx/y/z/q") == ("a",) and index.lookup(b"s/x/y/z") == ()
    assert set(index.lookup(b"s/x1/y/w")) == {"b", "c"} and index.lookup(b"s/x/y/w/") == ()
    index.unsubscribe("b", b"s/x*/y/w")
    index.remove_client("c")
    leaf = star.prefix[b"x"]
    assert type(leaf) is _Leaf and (leaf.rest, leaf.subs) == (b"y/z/", "a")
    assert index.lookup(b"s/x/y/z/") == ("a",)
    index.unsubscribe("a", b"s/x*/y/z/")
    assert index._public.empty()


def test_a_long_shared_stretch_is_split_and_folded_back_whole():
    """A second shape sharing 200 segments with a leaf gets nodes down to where they part
    (the leaf's bytes split once); when it leaves, the stretch is one leaf again."""
    from sbus.routing import _Leaf

    index = RoutingIndex()
    deep = b"/".join(b"s%d" % i for i in range(200))
    index.subscribe("a", b"x*/" + deep + b"/a")
    index.subscribe("b", b"x*/" + deep + b"/b/")
    assert index.lookup(b"x1/" + deep + b"/a") == ("a",)
    assert index.lookup(b"x1/" + deep + b"/b/c") == ("b",)
    assert index.lookup(b"x1/" + deep + b"/b") == ()
    index.unsubscribe("b", b"x*/" + deep + b"/b/")
    leaf = index._public.prefix[b"x"]
    assert type(leaf) is _Leaf and (leaf.rest, leaf.subs) == (deep + b"/a", "a")
    assert index.lookup(b"x/" + deep + b"/a") == ("a",)


@pytest.mark.parametrize("pattern, key, expected", [
    (b"p*/a/b", b"p/a/b", True), (b"p*/a/b", b"p/a/bc", False),
    (b"p*/a/b", b"p/a/b/", False), (b"p*/a/b", b"p/a", False), (b"p*/a/b", b"p", False),
    (b"p*/a/", b"p/a/", True), (b"p*/a/", b"p/a", False), (b"p*/a/", b"p/ab/", False),
    (b"p*//", b"p//x", True), (b"p*//", b"p/", False), (b"p*/", b"p/", True),
    (b"p*", b"p", True), (b"p*", b"p/", False),
    (b"p*/a/b/", b"p/a/b/c/d/e", True), (b"p*/a/b", b"p/a/b/c/d", False),
    (b"p*/a/b/", b"p/a/bb/c", False), (b"p*/a/b", b"p/a/", False),
])
def test_leaf_edges(pattern, key, expected):
    assert matches(pattern, key) is expected
    index = RoutingIndex()
    index.subscribe("c", pattern)
    index.subscribe("d", b"p*/zz/")  # so that "c" sits in a leaf below a shared node
    assert ("c" in index.lookup(key)) is expected


def test_keys_only_the_empty_pattern_matches_share_one_tuple_charged_once():
    """A thousand subscribers of the empty pattern: every key no other pattern matches
    gets the same tuple (no set of a thousand built per message), cached without a
    charge per subscriber, and made anew when the empty pattern's holders change."""
    cache = RouteCache(b"/", 1 << 20)
    idx = RoutingIndex(b"/", cache)
    for i in range(1000):
        idx.subscribe(i, b"")
    idx.subscribe("other", b"b/x")
    first = idx.match(b"a/1")
    assert sorted(first) == list(range(1000))
    assert idx.match(b"a/2") is first and idx.match(b"c") is first
    assert cache.nbytes < 3 * (ENTRY_COST + SECOND_COST + 64)  # not 3 x 8,000 bytes
    assert set(idx.match(b"b/x")) == {*range(1000), "other"}  # a tuple of its own
    idx.unsubscribe(999, b"")
    again = idx.match(b"a/1")
    assert again is not first and sorted(again) == list(range(999))
    assert idx.match(b"!/cred/1/2/3") == ()  # secret keys: never the empty pattern's
