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

Lookups are cached per key; any subscribe or unsubscribe clears the cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["RoutingIndex", "compile_pattern", "matches"]

C = TypeVar("C", bound=Hashable)

#: Segment kinds in a compiled pattern.
LITERAL, PREFIX = 0, 1

CACHE_LIMIT = 65536


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
    secret = b"!" + sep
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


class _Node(Generic[C]):
    __slots__ = ("literal", "prefix", "end", "tail")

    def __init__(self) -> None:
        self.literal: dict[bytes, _Node[C]] = {}
        self.prefix: dict[bytes, _Node[C]] = {}
        self.end: Counter[C] = Counter()  # patterns that end here: the key must end too
        self.tail: Counter[C] = Counter()  # patterns ending here with a trailing separator

    def empty(self) -> bool:
        return not (self.literal or self.prefix or self.end or self.tail)


class RoutingIndex(Generic[C]):
    """Subscriptions of clients (any hashable) to byte patterns; `match` finds the clients.

    Identical patterns from one client are counted, so two subscribes need two
    unsubscribes; `match` still returns each client once.
    """

    def __init__(self, sep: bytes = b"/") -> None:
        self.sep = sep
        self._secret_prefix = b"!" + sep
        self._public = _Node[C]()
        self._secret = _Node[C]()
        self._everything: Counter[C] = Counter()  # the empty pattern
        self._never: Counter[tuple[C, bytes]] = Counter()
        self._by_client: dict[C, Counter[bytes]] = {}
        self._cache: dict[bytes, tuple[C, ...]] = {}

    # -- changes ---------------------------------------------------------

    def subscribe(self, client: C, pattern: bytes) -> None:
        self._cache.clear()
        self._by_client.setdefault(client, Counter())[pattern] += 1
        bucket = self._bucket(pattern, create=True)
        if bucket is None:
            self._never[client, pattern] += 1
        else:
            bucket[client] += 1

    def unsubscribe(self, client: C, pattern: bytes) -> bool:
        """Remove one subscription; False (and no change) if the client did not have it."""
        mine = self._by_client.get(client)
        if not mine or not mine[pattern]:
            return False
        self._cache.clear()
        self._remove(client, pattern, 1)
        mine[pattern] -= 1
        if not mine[pattern]:
            del mine[pattern]
            if not mine:
                del self._by_client[client]
        return True

    def remove_client(self, client: C) -> int:
        """Drop every subscription of *client*; returns how many there were."""
        mine = self._by_client.pop(client, None)
        if not mine:
            return 0
        self._cache.clear()
        for pattern, count in mine.items():
            self._remove(client, pattern, count)
        return sum(mine.values())

    def _remove(self, client: C, pattern: bytes, count: int) -> None:
        if not pattern:
            _decrement(self._everything, client, count)
            return
        compiled = compile_pattern(pattern, self.sep)
        if compiled is None:
            _decrement(self._never, (client, pattern), count)
            return
        segments, tail = compiled
        root = self._secret if pattern.startswith(self._secret_prefix) else self._public
        path = [root]
        for kind, text in segments:
            path.append((path[-1].literal if kind == LITERAL else path[-1].prefix)[text])
        _decrement(path[-1].tail if tail else path[-1].end, client, count)
        # prune empty nodes bottom-up so the trie does not keep dead branches
        for depth in range(len(segments), 0, -1):
            node = path[depth]
            if not node.empty():
                break
            kind, text = segments[depth - 1]
            parent = path[depth - 1]
            del (parent.literal if kind == LITERAL else parent.prefix)[text]

    def _bucket(self, pattern: bytes, create: bool) -> Counter[C] | None:
        if not pattern:
            return self._everything
        compiled = compile_pattern(pattern, self.sep)
        if compiled is None:
            return None
        segments, tail = compiled
        node = self._secret if pattern.startswith(self._secret_prefix) else self._public
        for kind, text in segments:
            children = node.literal if kind == LITERAL else node.prefix
            child = children.get(text)
            if child is None:
                child = children[text] = _Node()
            node = child
        return node.tail if tail else node.end

    # -- lookups -----------------------------------------------------------

    def match(self, key: bytes) -> tuple[C, ...]:
        """The clients with at least one pattern matching *key*, each once."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        found: set[C] = set()
        if key.startswith(self._secret_prefix):
            self._walk(self._secret, key.split(self.sep), found)
        else:
            found.update(self._everything)
            self._walk(self._public, key.split(self.sep), found)
        result = tuple(found)
        if len(self._cache) >= CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = result
        return result

    @staticmethod
    def _walk(root: _Node[C], segs: list[bytes], found: set[C]) -> None:
        n = len(segs)
        stack = [(root, 0)]
        while stack:
            node, i = stack.pop()
            if i == n:
                if node.end:
                    found.update(node.end)
                continue
            if node.tail:
                found.update(node.tail)
            seg = segs[i]
            child = node.literal.get(seg)
            if child is not None:
                stack.append((child, i + 1))
            for prefix, child in node.prefix.items():
                if seg.startswith(prefix):
                    stack.append((child, i + 1))

    # -- introspection -----------------------------------------------------

    def patterns(self, client: C) -> Counter[bytes]:
        """A copy of the client's patterns with their counts."""
        return Counter(self._by_client.get(client, ()))

    def clients(self) -> Iterator[C]:
        return iter(self._by_client)

    def __len__(self) -> int:
        """Number of subscriptions (duplicates counted)."""
        return sum(sum(c.values()) for c in self._by_client.values())


def _decrement(counter: Counter, item: object, count: int) -> None:
    counter[item] -= count
    if counter[item] <= 0:
        del counter[item]
