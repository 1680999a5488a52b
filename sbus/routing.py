"""The routing index: which subscribers does a key reach?  Pure data, no I/O.

Patterns are split at the separator into a segment trie (the shape NATS uses for
its subject list), so a lookup walks one path per matching pattern shape and its
cost does not grow with subscriptions that do not match.  Each segment of a
pattern is one of:

* a literal (``foo``): the key's segment must be equal;
* a prefix wildcard (``foo*``, or ``*`` with an empty prefix): ``*`` consumes every
  byte up to the next separator, so the key's segment must start with ``foo``;
* never-matching (``a*b``): bytes after a ``*`` inside one segment can never match,
  because the ``*`` has already consumed the segment.  Such patterns are kept (so
  UNSUB works) but sit outside the trie.

A pattern that ends with the separator matches that separator and anything after
it; the empty pattern matches every key that is not secret.  Secret keys
(``!/…``) are looked up in a second trie that only holds secret patterns, so no
other pattern can ever match them.

Patterns without a wildcard or a trailing separator sit in one dict, pattern ->
subscribers, outside the trie.  In the trie, a node exists only where patterns part
ways: below the first segment that no other pattern shares, the literal rest of a
pattern is one leaf (its bytes, compared in one go) rather than a node per segment.
A subscription thus costs about a dict entry and a small object, not a node and its
dicts per segment (docs/performance.md, issue 14).

A lookup costs at most one step per pattern segment (patterns have at most
`keys.MAX_SEGMENTS`) and, at a node with ``prefix*`` children, one dict probe per
distinct prefix *length* (at most `keys.MAX_WILDCARD_PREFIX` + 1), never one per
sibling: ten thousand ``a1*``…``a9999*`` siblings cost four probes.  A leaf reached
costs one comparison of at most its own bytes, less than the nodes it stands for.

Lookups are cached per key in a `RouteCache`, bounded in bytes overall and per owner
(the broker's owner is the publisher's UID).  A subscribe or unsubscribe drops only the
entries it can change: the key itself for a literal pattern, the keys under the
pattern's first segment (or, for secret keys, under its credentials) otherwise, every
public key only for a pattern that starts with a wildcard.  Dropping costs at most what
inserting the dropped entries cost, so churn cannot be made expensive.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from .keys import secret_prefix

__all__ = ["RoutingIndex", "RouteCache", "compile_pattern", "matches", "pattern_cost"]

C = TypeVar("C", bound=Hashable)

#: Segment kinds in a compiled pattern.
LITERAL, PREFIX = 0, 1

#: Bytes of broker memory one trie node costs, at most (tests/test_routing.py measures it).
NODE_COST = 400
#: Bytes one subscription costs besides its nodes and pattern (counters, index entries).
SUBSCRIPTION_COST = 400
#: Bytes one cache entry costs besides its key and targets (dict slots, index entries).
ENTRY_COST = 360
#: Bytes a public key's place in the second-segment index costs besides the segment's
#: bytes (at worst a dict and a bytes object of its own: every key a second segment of
#: its own).
SECOND_COST = 240
#: Bytes the framed copy of an entry's key costs besides the key's bytes (`RouteCache`
#: with *framing*: a bytes object and a dict slot).
FRAMED_COST = 120
#: Default byte bound of the route cache.
CACHE_BYTES = 16 * 1024 * 1024


def compile_pattern(
    pattern: bytes, sep: bytes = b"/"
) -> tuple[list[tuple[int, bytes]], bool] | None:
    """Split a non-empty pattern into ``(segments, tail)``; None if it can never match."""
    tail = pattern.endswith(sep)
    body = pattern[:-1] if tail else pattern
    segments = []
    for seg in body.split(sep):
        star = seg.find(b"*")
        if star < 0:
            segments.append((LITERAL, seg))
        elif seg[star:].strip(b"*"):
            return None
        else:
            segments.append((PREFIX, seg[:star]))
    return segments, tail


def matches(pattern: bytes, key: bytes, sep: bytes = b"/") -> bool:
    """Does *pattern* match *key*?  The same rules as `RoutingIndex`, for one pattern."""
    secret = secret_prefix(sep)
    if key.startswith(secret) and not pattern.startswith(secret):
        return False
    if not pattern:
        return True
    compiled = compile_pattern(pattern, sep)
    if compiled is None:
        return False
    segments, tail = compiled
    keysegs = key.split(sep)
    if len(keysegs) < len(segments) + (1 if tail else 0):
        return False
    if not tail and len(keysegs) != len(segments):
        return False
    for (kind, text), seg in zip(segments, keysegs, strict=False):
        if kind == LITERAL and seg != text or kind == PREFIX and not seg.startswith(text):
            return False
    return True


def pattern_cost(pattern: bytes, sep: bytes = b"/") -> int:
    """Bytes of broker memory a subscription to *pattern* may cost, at most: what a user's
    subscription budget is charged (a node per segment, as if none were shared)."""
    return SUBSCRIPTION_COST + 2 * len(pattern) + NODE_COST * (pattern.count(sep) + 1)


class _Node(Generic[C]):
    """One segment of the trie, where patterns part ways.  Every container is made when
    first needed: a node is cheap to build only if it holds nothing it does not use.

    A child (a value of `literal` or `prefix`) is a `_Node`, or, where only one pattern
    shape continues below it, a leaf: a `_Leaf`, or bare subscribers for the commonest
    leaf of all, a pattern that ends right after the child with the separator (``a/b/``).
    """

    __slots__ = ("literal", "prefix", "lengths", "end", "tail")

    def __init__(self) -> None:
        self.literal: dict[bytes, _Child] | None = None
        self.prefix: dict[bytes, _Child] | None = None
        # length -> how many `prefix` keys have it, in ascending order of length: the
        # lookup probes each length once, and a removal updates its count, not a scan
        self.lengths: dict[int, int] | None = None
        # subscribers of the patterns that end here (the key must end too) and of those
        # that end here with a trailing separator: None, the one subscriber (the usual
        # case, and the cheapest), or a dict of subscriber -> count (`_plus`, `_minus`)
        self.end: C | dict[C, int] | None = None
        self.tail: C | dict[C, int] | None = None

    def empty(self) -> bool:
        return not (self.literal or self.prefix) and self.end is None and self.tail is None

    def add(self, kind: int, text: bytes, child: _Child) -> None:
        if kind == LITERAL:
            if self.literal is None:
                self.literal = {}
            self.literal[text] = child
            return
        if self.prefix is None:
            self.prefix, self.lengths = {}, {}
        self.prefix[text] = child
        size = len(text)
        if size in self.lengths:
            self.lengths[size] += 1
        else:  # a new length (at most `keys.MAX_WILDCARD_PREFIX` + 1 of them): re-sort
            self.lengths[size] = 1
            self.lengths = dict(sorted(self.lengths.items()))

    def remove(self, kind: int, text: bytes) -> None:
        if kind == LITERAL:
            del self.literal[text]
            if not self.literal:
                self.literal = None
            return
        del self.prefix[text]
        if not self.prefix:
            self.prefix = self.lengths = None
            return
        size = len(text)
        self.lengths[size] -= 1
        if not self.lengths[size]:
            del self.lengths[size]


class _Leaf(Generic[C]):
    """The rest of one pattern shape below a child, all literal: one small object instead
    of a node per segment.  `rest` is None if the key must end with the child's segment;
    otherwise the key must go on with the separator and then `rest`, exactly, or (if
    `rest` ends with the separator) followed by anything.  A pattern that ends with the
    separator right after the child is not a `_Leaf` but its bare subscribers."""

    __slots__ = ("rest", "subs")

    def __init__(self, rest: bytes | None, subs: C | dict[C, int]) -> None:
        self.rest = rest
        self.subs = subs


#: A value of `_Node.literal` or `_Node.prefix`: a `_Node`, a `_Leaf`, or the bare
#: subscribers (one, or a dict of them) of a pattern ending with a separator right there.
_Child = object


def _leaf(rest: bytes | None, subs):
    """The leaf for the rest of a pattern after a child (see `_Leaf`)."""
    return subs if rest == b"" else _Leaf(rest, subs)


def _split(child, ahead: list[tuple[int, bytes]], sep: bytes) -> _Node:
    """A leaf as a node, and as further nodes for as long as the segments *ahead* (of a
    pattern being added below it) share its rest; then a leaf of what is left.  Its bytes
    are split and joined once, however long the shared stretch."""
    subs, rest = (child.subs, child.rest) if type(child) is _Leaf else (child, b"")
    top = node = _Node()
    if rest is None:
        node.end = subs
        return top
    parts = rest.split(sep)  # the last part is b"" if the pattern ends with the separator
    m = 0
    while m < len(parts) - 1 and m < len(ahead) and ahead[m] == (LITERAL, parts[m]):
        node.literal = {parts[m]: _Node()}
        node = node.literal[parts[m]]
        m += 1
    if m < len(parts) - 1:
        node.literal = {parts[m]: _leaf(sep.join(parts[m + 1:]), subs)}
    elif parts[m]:
        node.literal = {parts[m]: _Leaf(None, subs)}
    else:
        node.tail = subs
    return top


def _compact(node: _Node, sep: bytes):
    """*node* as a leaf if only one pattern shape is left in it, all literal; else None."""
    if node.prefix:
        return None
    if node.literal is None:
        if node.end is None:
            return node.tail
        return _Leaf(None, node.end) if node.tail is None else None
    if node.end is not None or node.tail is not None or len(node.literal) != 1:
        return None
    (text, child), = node.literal.items()
    if type(child) is _Node:
        return None
    if type(child) is not _Leaf:
        return _Leaf(text + sep, child)
    return _Leaf(text if child.rest is None else text + sep + child.rest, child.subs)


class RouteCache(Generic[C]):
    """Key -> subscribers, bounded in bytes overall and for each owner.

    The broker reads `framed` directly on its hot path (one dict lookup per run of a
    key).  An owner over its share loses its own oldest entries first; the cache over
    its bound loses the oldest of everyone.  Entries are grouped by what a pattern can
    name without a wildcard, so that `invalidate` touches only a pattern's group: a
    public key by its first segment and also by its second (``*/x`` names no first
    segment, and clearing everything at each such SUB let one user's churn halve
    another's publishing).

    With *framing* ``(before, after)``, every entry is also in `framed` under
    ``before + key + after``: the broker looks a publish up by its head as received
    (``MSG key\\0``), without cutting the key out of the packet first, and a head of
    the same width taken blindly from a packet whose key is shorter or longer is never
    found: no framed key holds *after* (a key that does is not framed: no publish has it).
    """

    def __init__(self, sep: bytes, limit: int = CACHE_BYTES, per_owner: int | None = None,
                 framing: tuple[bytes, bytes] | None = None):
        self.sep = sep
        self.limit = limit
        self.per_owner = limit if per_owner is None else per_owner
        self.entries: dict[bytes, tuple[C, ...]] = {}
        self.framed: dict[bytes, tuple[C, ...]] = {}
        self._framing = framing
        self.nbytes = 0
        # key -> owner, group, second segment (None: secret or one segment), cost
        self._meta: dict[bytes, tuple[object, bytes, bytes | None, int]] = {}
        self._owned: dict[object, dict[bytes, None]] = {}  # owner -> its keys, oldest first
        self._owner_bytes: Counter[object] = Counter()
        self._groups: dict[bytes, dict[bytes, None]] = {}  # group -> its keys
        self._seconds: dict[bytes, dict[bytes, None]] = {}  # second segment -> public keys
        self._secret = secret_prefix(sep)

    def group(self, key: bytes) -> bytes:
        """A key's group: its first segment; for a secret key its ``!/cred/G/U/P``."""
        if key.startswith(self._secret):
            return self.sep.join(key.split(self.sep, 5)[:5])
        return key.split(self.sep, 1)[0]

    def __len__(self) -> int:
        return len(self.entries)

    def owner_bytes(self, owner: object) -> int:
        return self._owner_bytes.get(owner, 0)

    def put(self, key: bytes, targets: tuple[C, ...], owner: object,
            shared: bool = False) -> None:
        """Keep *targets* for *key*, charged to *owner*; *shared*: a tuple the index holds
        anyway, once for every key (`RoutingIndex._all`), so not charged per entry."""
        if key in self.entries:
            return
        cost = ENTRY_COST + len(key) + (0 if shared else 8 * len(targets))
        second = None
        if key.startswith(self._secret):
            group = self.group(key)
        else:
            parts = key.split(self.sep, 2)
            group = parts[0]  # `group` of a public key, split once for both
            if len(parts) > 1:
                second = parts[1]
                cost += SECOND_COST + len(second)
        framing = self._framing
        if framing is not None:
            cost += FRAMED_COST + len(framing[0]) + len(key) + len(framing[1])
        if cost > self.per_owner or cost > self.limit:
            return
        owned = self._owned.setdefault(owner, {})
        while self._owner_bytes[owner] + cost > self.per_owner and owned:
            self.drop(next(iter(owned)))
        while self.nbytes + cost > self.limit and self.entries:
            self.drop(next(iter(self.entries)))
        owned = self._owned.setdefault(owner, {})
        if second is not None:
            self._seconds.setdefault(second, {})[key] = None
        self.entries[key] = targets
        if framing is not None and framing[1] not in key:
            self.framed[framing[0] + key + framing[1]] = targets
        self._meta[key] = (owner, group, second, cost)
        owned[key] = None
        self._groups.setdefault(group, {})[key] = None
        self._owner_bytes[owner] += cost
        self.nbytes += cost

    def drop(self, key: bytes) -> None:
        meta = self._meta.pop(key, None)
        if meta is None:
            return
        owner, group, second, cost = meta
        del self.entries[key]
        if self._framing is not None:
            self.framed.pop(self._framing[0] + key + self._framing[1], None)
        owned = self._owned[owner]
        del owned[key]
        if not owned:
            del self._owned[owner]
        members = self._groups[group]
        del members[key]
        if not members:
            del self._groups[group]
        if second is not None:
            members = self._seconds[second]
            del members[key]
            if not members:
                del self._seconds[second]
        self._owner_bytes[owner] -= cost
        if not self._owner_bytes[owner]:
            del self._owner_bytes[owner]
        self.nbytes -= cost

    def drop_group(self, group: bytes) -> None:
        for key in list(self._groups.get(group, ())):
            self.drop(key)

    def clear(self, secret: bool | None = None) -> None:
        """Drop every entry (only the public ones, or only the secret ones, if asked)."""
        if secret is None:
            for table in (self.entries, self.framed, self._meta, self._owned,
                          self._owner_bytes, self._groups, self._seconds):
                table.clear()
            self.nbytes = 0
            return
        for group in [g for g in self._groups if g.startswith(self._secret) == secret]:
            self.drop_group(group)

    def invalidate(self, pattern: bytes, compiled) -> None:
        """Drop the entries a subscription change to *pattern* can make wrong."""
        if not pattern:
            self.clear(secret=False)
            return
        if compiled is None:
            return  # never matches anything
        segments, tail = compiled
        if not tail and all(kind == LITERAL for kind, _ in segments):
            self.drop(pattern)  # only the key that equals it
        elif pattern.startswith(self._secret):
            head = segments[:5]
            if len(segments) + tail > 5 and all(kind == LITERAL for kind, _ in head):
                self.drop_group(self.sep.join(text for _, text in head))
            else:  # not a !/cred/G/U/P/ pattern (the broker refuses those): all secrets
                self.clear(secret=True)
        elif segments[0][0] == LITERAL:
            self.drop_group(segments[0][1])
        elif len(segments) > 1 and segments[1][0] == LITERAL:
            # ``*/x...``: only public keys whose second segment is x can match it
            for key in list(self._seconds.get(segments[1][1], ())):
                self.drop(key)
        else:
            self.clear(secret=False)


class RoutingIndex(Generic[C]):
    """Subscriptions of clients (any hashable) to byte patterns; `match` finds the clients.

    Identical patterns from one client are counted, so two subscribes need two
    unsubscribes; `match` still returns each client once.
    """

    def __init__(self, sep: bytes = b"/", cache: RouteCache[C] | None = None) -> None:
        self.sep = sep
        self._secret_prefix = secret_prefix(sep)
        self._public = _Node[C]()
        self._secret = _Node[C]()
        self._everything: Counter[C] = Counter()  # the empty pattern
        #: Its clients as `match` returns them, made once per change: a key no other
        #: pattern matches gets this very tuple (no set of them built per message, and
        #: the gateway finds such messages in a row to be for the same clients at once)
        self._all: tuple[C, ...] | None = None
        self._never: Counter[tuple[C, bytes]] = Counter()
        # patterns without a wildcard or a trailing separator match only the key equal to
        # them: one probe of this dict finds them all.  A value is the one subscriber
        # (most patterns have one) or a dict of subscriber -> count (`_add`, `_take`)
        self._exact: dict[bytes, C | dict[C, int]] = {}
        self._by_client: dict[C, dict[bytes, int]] = {}  # client -> pattern -> count
        self._depth = 1  # most segments of any pattern ever held: keys are split no further
        self.cache: RouteCache[C] = cache if cache is not None else RouteCache(sep)

    # -- changes ---------------------------------------------------------

    def subscribe(self, client: C, pattern: bytes) -> None:
        compiled = compile_pattern(pattern, self.sep) if pattern else None
        self.cache.invalidate(pattern, compiled)
        if compiled is not None:
            self._depth = max(self._depth, len(compiled[0]))
        mine = self._by_client.get(client)
        if mine is None:
            mine = self._by_client[client] = {}
        mine[pattern] = mine.get(pattern, 0) + 1
        if _exact(compiled):
            _add(self._exact, pattern, client)
            return
        if not pattern:
            self._everything[client] += 1
            self._all = None
        elif compiled is None:
            self._never[client, pattern] += 1
        else:
            self._place(pattern, compiled, client)

    def unsubscribe(self, client: C, pattern: bytes) -> bool:
        """Remove one subscription; False (and no change) if the client did not have it."""
        mine = self._by_client.get(client)
        if not mine or not mine.get(pattern):
            return False
        self.cache.invalidate(pattern, compile_pattern(pattern, self.sep) if pattern else None)
        self._remove(client, pattern, 1)
        mine[pattern] -= 1
        if not mine[pattern]:
            del mine[pattern]
            if not mine:
                del self._by_client[client]
        return True

    def remove_some(self, client: C, n: int) -> tuple[int, bool]:
        """Drop up to *n* of *client*'s distinct patterns (a departing client with many
        leaves a part at a time); returns the subscriptions dropped and whether any are
        left."""
        mine = self._by_client.get(client)
        if not mine:
            return 0, False
        removed = 0
        for pattern in list(itertools.islice(mine, n)):
            count = mine.pop(pattern)
            self.cache.invalidate(pattern,
                                  compile_pattern(pattern, self.sep) if pattern else None)
            self._remove(client, pattern, count)
            removed += count
        if not mine:
            del self._by_client[client]
            return removed, False
        return removed, True

    def remove_client(self, client: C) -> int:
        """Drop every subscription of *client*; returns how many there were."""
        mine = self._by_client.pop(client, None)
        if not mine:
            return 0
        for pattern, count in mine.items():
            self.cache.invalidate(pattern,
                                  compile_pattern(pattern, self.sep) if pattern else None)
            self._remove(client, pattern, count)
        return sum(mine.values())

    def _remove(self, client: C, pattern: bytes, count: int) -> None:
        if not pattern:
            _decrement(self._everything, client, count)
            self._all = None
            return
        compiled = compile_pattern(pattern, self.sep)
        if compiled is None:
            _decrement(self._never, (client, pattern), count)
            return
        if _exact(compiled):
            _take(self._exact, pattern, client, count)
            return
        segments, tail = compiled
        node = self._secret if pattern.startswith(self._secret_prefix) else self._public
        path: list[tuple[_Node[C], int, bytes]] = []  # each node passed, and the way on
        for kind, text in segments:
            children = node.literal if kind == LITERAL else node.prefix
            child = children[text]
            path.append((node, kind, text))
            if type(child) is _Node:
                node = child
                continue
            # the leaf that holds this pattern's shape
            if type(child) is _Leaf:
                child.subs = _minus(child.subs, client, count)
                if child.subs is not None:
                    return
            else:
                held = _minus(child, client, count)
                if held is not None:
                    children[text] = held
                    return
            node.remove(kind, text)
            path.pop()
            break
        else:
            if tail:
                node.tail = _minus(node.tail, client, count)
            else:
                node.end = _minus(node.end, client, count)
        # bottom-up: drop empty nodes; then fold the node left with one pattern shape, and
        # the nodes above it that lead only to it, back into one leaf (joined once)
        while path and node.empty():
            parent, kind, text = path.pop()
            parent.remove(kind, text)
            node = parent
        leaf = _compact(node, self.sep) if path else None
        if leaf is None:
            return
        texts = []
        parent, kind, text = path.pop()
        while kind == LITERAL and path and parent.prefix is None and parent.end is None \
                and parent.tail is None and len(parent.literal) == 1:
            texts.append(text)
            parent, kind, text = path.pop()
        if texts:
            texts.reverse()
            subs, rest = (leaf.subs, leaf.rest) if type(leaf) is _Leaf else (leaf, b"")
            leaf = _Leaf(self.sep.join(texts if rest is None else texts + [rest]), subs)
        (parent.literal if kind == LITERAL else parent.prefix)[text] = leaf

    def _place(self, pattern: bytes, compiled, client: C) -> None:
        """Add a subscriber of *pattern* to the trie: as a leaf at the first segment no
        other pattern shares (if the rest is literal), or at the node where it ends."""
        segments, tail = compiled
        sep = self.sep
        width = len(sep)
        raw = (pattern[:-width] if tail else pattern).split(sep)
        stop = -width  # where the segment at hand ends in *pattern*
        last_star = pattern.rfind(b"*")
        node = self._secret if pattern.startswith(self._secret_prefix) else self._public
        for j, ((kind, text), seg) in enumerate(zip(segments, raw, strict=True)):
            stop += width + len(seg)
            children = node.literal if kind == LITERAL else node.prefix
            child = children.get(text) if children else None
            if child is None:
                if last_star < stop:
                    node.add(kind, text, _leaf(
                        None if stop == len(pattern) else pattern[stop + width:], client))
                    return
                child = _Node()
                node.add(kind, text, child)
            elif type(child) is not _Node:
                rest = child.rest if type(child) is _Leaf else b""
                if rest is None and stop == len(pattern) or rest is not None and \
                        len(pattern) - stop - width == len(rest) and pattern.endswith(rest):
                    if type(child) is _Leaf:  # the same shape: one more subscriber
                        child.subs = _plus(child.subs, client)
                    else:
                        children[text] = _plus(child, client)
                    return
                child = children[text] = _split(child, segments[j + 1:], sep)
            node = child
        if tail:
            node.tail = _plus(node.tail, client)
        else:
            node.end = _plus(node.end, client)

    # -- lookups -----------------------------------------------------------

    def match(self, key: bytes, owner: object = None) -> tuple[C, ...]:
        """The clients with at least one pattern matching *key*, each once; the answer is
        cached and charged to *owner*."""
        hit = self.cache.entries.get(key)
        if hit is not None:
            return hit
        result = self.lookup(key)
        self.cache.put(key, result, owner, result is self._all)
        return result

    def lookup(self, key: bytes) -> tuple[C, ...]:
        """`match` without the cache."""
        found: set[C] = set()
        exact = self._exact.get(key)
        if exact is not None:
            _gather(found, exact)
        # no pattern has more than `_depth` segments: the rest of a longer key stays whole
        segs = key.split(self.sep, self._depth)
        if key.startswith(self._secret_prefix):
            self._walk(self._secret, key, segs, found)
            return tuple(found)
        self._walk(self._public, key, segs, found)
        if not found:
            everyone = self._all
            if everyone is None:
                everyone = self._all = tuple(self._everything)
            return everyone
        found.update(self._everything)
        return tuple(found)

    def _walk(self, root: _Node[C], key: bytes, segs: list[bytes], found: set[C]) -> None:
        n = len(segs)
        sep = self.sep
        width = len(sep)
        starts = None  # where each segment starts in *key*, once a leaf needs it
        stack: list[tuple[_Child, int]] = [(root, 0)]
        while stack:
            node, i = stack.pop()
            if type(node) is not _Node:  # a leaf: the rest of one pattern shape
                if type(node) is not _Leaf:
                    if i < n:
                        _gather(found, node)
                    continue
                rest = node.rest
                if rest is None:
                    if i == n:
                        _gather(found, node.subs)
                elif i + 1 == n:
                    # segs[i] is the key's last segment, whole: the leaf's pattern has a
                    # segment there, so the key was split at least that far
                    if segs[i] == rest:
                        _gather(found, node.subs)
                elif i < n:
                    if starts is None:
                        starts = list(itertools.accumulate(map(len, segs), initial=0))
                    at = starts[i] + i * width
                    if key.startswith(rest, at) and (
                            rest.endswith(sep) or len(key) - at == len(rest)):
                        _gather(found, node.subs)
                continue
            if i == n:
                if node.end is not None:
                    _gather(found, node.end)
                continue
            if node.tail is not None:
                _gather(found, node.tail)
            seg = segs[i]
            literal = node.literal
            if literal is not None:
                child = literal.get(seg)
                if child is not None:
                    stack.append((child, i + 1))
            if node.lengths:
                prefix = node.prefix
                size = len(seg)
                for length in node.lengths:
                    if length > size:
                        break
                    child = prefix.get(seg[:length])
                    if child is not None:
                        stack.append((child, i + 1))

    # -- introspection -----------------------------------------------------

    def patterns(self, client: C) -> Counter[bytes]:
        """A copy of the client's patterns with their counts."""
        return Counter(self._by_client.get(client, ()))

    def first_patterns(self, client: C, n: int) -> list[bytes]:
        """Up to *n* of the client's patterns, without copying the rest (introspection)."""
        return list(itertools.islice(self._by_client.get(client, ()), n))

    def clients(self) -> Iterator[C]:
        return iter(self._by_client)

    def __len__(self) -> int:
        """Number of subscriptions (duplicates counted)."""
        return sum(sum(c.values()) for c in self._by_client.values())


def _exact(compiled) -> bool:
    """Whether a compiled pattern matches only the key equal to it."""
    return compiled is not None and not compiled[1] and \
        all(kind == LITERAL for kind, _ in compiled[0])


def _plus(held, client):
    """Subscribers with one more subscription of *client* (see `_Node.end`)."""
    if held is None:
        return client
    if type(held) is dict:
        held[client] = held.get(client, 0) + 1
        return held
    return {held: 2} if held == client else {held: 1, client: 1}


def _minus(held, client, count: int):
    """Subscribers with *count* fewer subscriptions of *client*; None once empty."""
    if type(held) is not dict:
        return None
    left = held[client] - count
    if left > 0:
        held[client] = left
        return held
    del held[client]
    if not held:
        return None
    if len(held) == 1:
        (only, n), = held.items()
        if n == 1:
            return only
    return held


def _gather(found: set, held) -> None:
    """Add the subscribers *held* (one, or a dict of them) to *found*."""
    if type(held) is dict:
        found.update(held)
    else:
        found.add(held)


def _add(table: dict, pattern: bytes, client) -> None:
    table[pattern] = _plus(table.get(pattern), client)


def _take(table: dict, pattern: bytes, client, count: int) -> None:
    held = _minus(table[pattern], client, count)
    if held is None:
        del table[pattern]
    else:
        table[pattern] = held


def _decrement(counter: Counter, item: object, count: int) -> None:
    counter[item] -= count
    if counter[item] <= 0:
        del counter[item]
