"""Paths of the mount to routing keys and patterns, and the tree of names it knows.  Pure.

The kernel asks about one path component at a time and the answer fixes its type for
good, so every name must be decided to be a directory, a file, or absent without
knowing what comes after it.  The rules (documented for users in docs/fuse.md):

* ``*`` (any name containing ``*``) is always a directory: a wildcard segment.
* ``**`` is always a file: the pattern of its directory followed by ``/`` (at the
  root: the empty pattern, everything).  A path ending in ``/`` cannot be read on any
  filesystem, so this is the spelling of a trailing ``/``.
* ``!`` inside a non-root directory is always a file: the key (or pattern) the
  directory itself names.  ``!`` is reserved by the protocol as a whole segment, so no
  real key can collide with it.  At the root, ``!`` is the directory of secret keys.
* Other names are directories when the tree knows them as prefixes (``mkdir`` or live
  traffic), files when the tree knows them as keys, and absent (ENOENT) otherwise, so
  ``echo … > name`` creates and publishes.  Below a wildcard directory, unknown names
  are files: a pattern never needs creating.  (An unknown name on the way to a file
  being created is answered as a directory by `sbus.fuse.operations`, which asks
  the caller's open call in ``/proc``: `sbus.fuse.intent`.)
* A wildcard path (one name containing ``*``) has at most `MAX_SEGMENTS` names, as
  a subscription pattern has at most that many segments: a deeper name is
  ENAMETOOLONG (but ``!``, the deepest directory's own pattern), so ``cd '*'`` cannot
  go on for ever.  Plain paths (keys) have no such limit.
* ``.keyed`` and ``.jsonl`` at the root are *views*: the whole tree again, read in
  that format whatever the mount's ``--format`` (`split_view`).  A key whose first
  segment is one of them is reachable below a view (``.keyed/.keyed/x``).
* ``!/cred/GID/UID/PID/…`` is reachable only for the mount's own credentials and only
  by callers allowed to see them (EACCES otherwise): the broker checks the mount's
  credentials, not the caller's, so the mount must not lend its own to others.
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from collections.abc import Iterator
from enum import Enum

from ..errors import Refused  # a name that cannot be used; .errno answers the kernel
from ..keys import MAX_SEGMENTS
from ..routing import PREFIX, compile_pattern

__all__ = ["VIEWS", "split_view", "SEP", "SELF", "TRAILING", "Kind", "Refused", "KnownTree",
           "pattern_of", "is_pattern", "key_cost", "lookup", "creatable", "secret_owner",
           "key_segments", "LOOKUP_WORK"]

SEP = b"/"
SELF = b"!"
TRAILING = b"**"
SECRET = b"!"
CRED = b"cred"

Path = tuple[bytes, ...]

#: Root directories that show the tree again, read in another format.
VIEWS = {b".keyed": "keyed", b".jsonl": "jsonl"}


def split_view(path: Path) -> tuple[str | None, Path]:
    """The format a path's view asks for (None: the mount's) and the path inside it."""
    if path and path[0] in VIEWS:
        return VIEWS[path[0]], path[1:]
    return None, path


class Kind(Enum):
    DIR = "dir"
    FILE = "file"


def is_wild(segment: bytes) -> bool:
    return b"*" in segment


def pattern_of(path: Path) -> bytes:
    """The key or pattern a *file* path stands for."""
    if not path:
        raise ValueError("the root is a directory")
    *parent, last = path
    if last == TRAILING:
        return SEP.join(parent) + SEP if parent else b""
    if last == SELF and parent:
        return SEP.join(parent)
    return SEP.join(path)


def is_pattern(pattern: bytes) -> bool:
    """Patterns can be read (subscribed to) but not written (published to)."""
    return not pattern or b"*" in pattern or pattern.endswith(SEP)


def key_segments(key: bytes) -> Path | None:
    """The path of a key seen on the bus, or None if no path can name it (empty
    segments, ``.``/``..``, wildcards, or the reserved names)."""
    segs = tuple(key.split(SEP))
    secret = segs[:1] == (SECRET,)
    for i, s in enumerate(segs):
        if not s or s in (b".", b"..", TRAILING) or b"*" in s:
            return None
        if s == SELF and not (secret and i == 0):
            return None
    if secret and (len(segs) < 6 or segs[1] != CRED or not all(s.isdigit() for s in segs[2:5])):
        return None
    return segs


def secret_owner(path: Path) -> Path | None:
    """``(GID, UID, PID)`` of a path below ``!/cred/G/U/P``; None for public paths."""
    if path[:1] != (SECRET,) or len(path) < 5:
        return None
    return path[2:5]


class _Node:
    __slots__ = ("children", "key", "explicit", "parent", "name", "indexed")

    def __init__(self, parent: _Node | None = None, name: bytes = b"") -> None:
        self.children: dict[bytes, _Node] = {}
        self.key = False  # a remembered key ends here
        self.explicit = False  # made by mkdir
        self.parent = parent  # None: the root
        self.name = name  # its key in the parent's children
        self.indexed = False  # in `KnownTree._dirs`

    def is_dir(self) -> bool:
        return self.explicit or bool(self.children)

    def empty(self) -> bool:
        return not (self.key or self.explicit or self.children)


#: Bytes a remembered key is charged besides its segments' bytes: its entry and, as if
#: none were shared, a node per segment (measured: tests/test_fuse_mapping.py).
KEY_COST = 200
SEGMENT_COST = 450

#: Nodes one question about a path below wildcard directories may look at, in each of
#: its two ways (`KnownTree.is_dir`): about a millisecond each, however many keys are
#: remembered.  Beyond, the name is taken to be a directory.
LOOKUP_WORK = 2000


#: A key is remembered only if it costs at most this part of what the tree may hold:
#: one that costs more would push out every other (a key of 80,000 segments cost 36 MB
#: of a 16 MiB tree, which it then held alone).
LARGEST_KEY_PART = 16


def key_cost(path: Path) -> int:
    return KEY_COST + sum(SEGMENT_COST + 2 * len(seg) for seg in path)


def raw_key_cost(key: bytes) -> int:
    """At least `key_cost` of *key*'s path (its separators counted as bytes too), without
    splitting it: cheap for any key."""
    return KEY_COST + (key.count(SEP) + 1) * SEGMENT_COST + 2 * len(key)


class KnownTree:
    """The names the mount knows: directories made with ``mkdir`` (kept until
    ``rmdir``) and the most recently seen keys (at most *capacity*, and at most
    *max_bytes* by `key_cost`; least recently seen forgotten first).  A name is a
    directory if anything known lies below it.

    A key learned for a user (created through the mount, not seen on the bus) is
    charged to that user until the bus shows it: at most *user_bytes* per user, its
    own oldest forgotten first, so one user's ``touch`` loop cannot push everyone
    else's keys out.

    Directories are also indexed by their last name (`_dirs`), so a question about a
    name below wildcard directories starts from the few directories of that name (none
    for a fresh name) instead of every remembered key the wildcards match."""

    def __init__(self, capacity: int = 10000, max_bytes: int = 16 << 20,
                 user_bytes: int | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.user_bytes = user_bytes
        self.held = 0
        self._owner: dict[Path, int] = {}  # charged keys -> whose
        self._created: dict[int, OrderedDict[Path, None]] = {}  # per user, oldest first
        self.created_bytes: dict[int, int] = {}
        self._root = _Node()
        self._keys: OrderedDict[Path, None] = OrderedDict()
        # directory nodes by name: one node, or (for a name shared) a dict used as a set
        self._dirs: dict[bytes, _Node | dict[_Node, None]] = {}
        #: nodes looked at by the questions so far (what tests count)
        self.visited = 0

    def __len__(self) -> int:
        return len(self._keys)

    # -- changes ---------------------------------------------------------------

    def fits(self, cost: int) -> bool:
        """May a key of *cost* be remembered (`LARGEST_KEY_PART`)?"""
        return cost <= self.max_bytes // LARGEST_KEY_PART

    def learn(self, path: Path, uid: int | None = None) -> bool:
        """Remember a key (as a path), refreshing it if known; *uid*: a user created
        it (charged to that user), None: it was seen on the bus.  False if it costs too
        much to be remembered (`fits`)."""
        keys = self._keys
        if path in keys:
            keys.move_to_end(path)
            if uid is None:
                self._uncharge(path)
            return True
        if not self.fits(key_cost(path)):
            return False
        keys[path] = None
        self.held += key_cost(path)
        node = self._root
        for seg in path:
            node = self._child(node, seg)
        node.key = True
        if uid is not None and self.user_bytes is not None:
            self._charge(path, uid)
        while len(keys) > 1 and (len(keys) > self.capacity or self.held > self.max_bytes):
            old, _ = keys.popitem(last=False)
            self.held -= key_cost(old)
            self._uncharge(old)
            self._clear(old, "key")
        return True

    def _charge(self, path: Path, uid: int) -> None:
        mine = self._created.setdefault(uid, OrderedDict())
        mine[path] = None
        self._owner[path] = uid
        self.created_bytes[uid] = self.created_bytes.get(uid, 0) + key_cost(path)
        while len(mine) > 1 and self.created_bytes[uid] > (self.user_bytes or 0):
            self.forget(next(iter(mine)))

    def _uncharge(self, path: Path) -> None:
        uid = self._owner.pop(path, None)
        if uid is None:
            return
        mine = self._created[uid]
        del mine[path]
        self.created_bytes[uid] -= key_cost(path)
        if not mine:
            del self._created[uid], self.created_bytes[uid]

    def forget(self, path: Path) -> bool:
        """Drop a remembered key; False if it was not remembered."""
        if path not in self._keys:
            return False
        del self._keys[path]
        self.held -= key_cost(path)
        self._uncharge(path)
        self._clear(path, "key")
        return True

    def mkdir(self, path: Path) -> None:
        node = self._root
        for seg in path:
            node = self._child(node, seg)
        node.explicit = True
        self._index(node)

    def rmdir(self, path: Path) -> bool:
        """Drop a ``mkdir`` mark; False if there was none."""
        node = self._find(path)
        if node is None or not node.explicit:
            return False
        self._clear(path, "explicit")
        return True

    def _clear(self, path: Path, flag: str) -> None:
        trail = [self._root]
        for seg in path:
            nxt = trail[-1].children.get(seg)
            if nxt is None:
                return
            trail.append(nxt)
        setattr(trail[-1], flag, False)
        self._index(trail[-1])
        for depth in range(len(path), 0, -1):
            if not trail[depth].empty():
                break
            del trail[depth - 1].children[path[depth - 1]]
            self._index(trail[depth - 1])

    def _child(self, node: _Node, seg: bytes) -> _Node:
        child = node.children.get(seg)
        if child is None:
            child = node.children[seg] = _Node(node, seg)
            self._index(node)
        return child

    def _index(self, node: _Node) -> None:
        """Keep *node* in `_dirs` exactly while it is a directory (the root never)."""
        want = node.is_dir() and node.parent is not None
        if want == node.indexed:
            return
        node.indexed = want
        held = self._dirs.get(node.name)
        if want:
            if held is None:
                self._dirs[node.name] = node
            elif isinstance(held, _Node):
                self._dirs[node.name] = {held: None, node: None}
            else:
                held[node] = None
        elif held is node:
            del self._dirs[node.name]
        elif isinstance(held, dict):
            del held[node]
            if len(held) == 1:
                self._dirs[node.name] = next(iter(held))

    # -- questions ---------------------------------------------------------------

    def _find(self, path: Path) -> _Node | None:
        node = self._root
        for seg in path:
            node = node.children.get(seg)
            if node is None:
                return None
        return node

    def is_dir(self, path: Path) -> bool:
        """Whether a known directory matches *path*, whose segments may be wildcards.

        Below wildcards the work is bounded (`LOOKUP_WORK`): first the directories
        of the path's last name are followed up to the root, then, if there were too
        many, the tree is walked down along the path.  If both give up, the answer is
        True: a directory still reads as the pattern it names (its ``!``), while a
        file could not be entered."""
        if not any(is_wild(s) for s in path):
            node = self._find(path)
            return node is not None and node.is_dir()
        tests = _segment_tests(path)
        if tests is None:
            return False  # 'a*b' can never match a key segment
        if not is_wild(path[-1]):
            found = self._up_from_dirs(path[-1], tests)
            if found is not None:
                return found
        found = self._down(tests)
        return True if found is None else found

    def _up_from_dirs(self, name: bytes, tests: list[tuple[bytes, bool]]) -> bool | None:
        """Whether a directory named *name* has ancestors matching *tests*; None if
        that takes more than `LOOKUP_WORK` nodes."""
        held = self._dirs.get(name)
        if held is None:
            return False
        budget = LOOKUP_WORK
        root = self._root
        for node in (held,) if isinstance(held, _Node) else held:
            i = len(tests) - 1
            while True:
                budget -= 1
                if budget < 0:
                    self.visited += LOOKUP_WORK
                    return None
                node = node.parent  # type: ignore[assignment]
                if i == 0:
                    if node is root:
                        self.visited += LOOKUP_WORK - budget
                        return True
                    break
                i -= 1
                if node is root:
                    break
                want, prefix = tests[i]
                if not (node.name.startswith(want) if prefix else node.name == want):
                    break
        self.visited += LOOKUP_WORK - budget
        return False

    def _down(self, tests: list[tuple[bytes, bool]]) -> bool | None:
        """Whether a directory matches *tests*, walking down from the root; None if
        that takes more than `LOOKUP_WORK` nodes."""
        budget = LOOKUP_WORK
        last = len(tests) - 1
        stack = [self._matching_children(self._root, tests[0])]
        try:
            while stack:
                child = next(stack[-1], False)
                if child is False:
                    stack.pop()
                    continue
                budget -= 1
                if budget < 0:
                    return None
                if child is None:
                    continue  # a name not matching: counted, not followed
                if len(stack) > last:
                    if child.is_dir():
                        return True
                    continue
                stack.append(self._matching_children(child, tests[len(stack)]))
            return False
        finally:
            self.visited += LOOKUP_WORK - max(budget, 0)

    @staticmethod
    def _matching_children(node: _Node, test: tuple[bytes, bool]) -> Iterator[_Node | None]:
        """*node*'s children that match, and None for each that does not."""
        want, prefix = test
        if not prefix:
            child = node.children.get(want)
            if child is not None:
                yield child
            return
        for name, child in node.children.items():
            yield child if name.startswith(want) else None

    def is_key(self, path: Path) -> bool:
        """Whether *path* (without wildcards: below them every name is a file anyway)
        is a remembered key."""
        node = self._find(path)
        return node is not None and node.key

    def entries(self, path: Path) -> list[tuple[bytes, Kind]]:
        """What ``ls`` shows in a directory: the known names sorted (a key that is also
        a prefix appears as a directory holding ``!``), then ``**``, the file that
        subscribes to everything below, so ``ls`` shows how to read a directory.
        Wildcard directories hold only ``**`` (so shell globs pass through)."""
        hint = [] if path[:1] == (SECRET,) and len(path) < 5 else [(TRAILING, Kind.FILE)]
        if any(is_wild(s) for s in path):
            return hint
        node = self._find(path)
        if node is None:
            return hint
        out = [(name, Kind.DIR if child.is_dir() else Kind.FILE)
               for name, child in node.children.items()]
        if path and node.key and node.is_dir() and path != (SECRET,):
            out.append((SELF, Kind.FILE))
        out.sort()
        return out + hint


def _segment_tests(path: Path) -> list[tuple[bytes, bool]] | None:
    """Each segment of a non-empty *path* as (bytes, is a prefix), as the broker's
    routing reads a pattern; None if one can match nothing (``a*b``)."""
    compiled = compile_pattern(SEP.join(path), SEP)
    if compiled is None:
        return None
    return [(seg, kind == PREFIX) for kind, seg in compiled[0]]


def lookup(tree: KnownTree, parent: Path, name: bytes, own: Path | None,
           caller_may_read_own: bool) -> Kind:
    """Decide what *name* in directory *parent* is, or raise `Refused`.

    *own* is the mount's ``(GID, UID, PID)`` as decimal bytes (None if unknown);
    *caller_may_read_own* says whether the calling process may use them.
    """
    if not parent:
        if name == SECRET:
            return Kind.DIR
    elif parent[0] == SECRET:
        depth = len(parent)
        if depth == 1:
            if name == CRED:
                return Kind.DIR
            raise Refused("only 'cred' lives in '!'", errno=errno.ENOENT)
        if depth < 5:
            if not name.isdigit():
                raise Refused("credentials are decimal GID/UID/PID", errno=errno.ENOENT)
            if depth == 4:
                _check_owner(parent[2:4] + (name,), own, caller_may_read_own)
            return Kind.DIR
        _check_owner(parent[2:5], own, caller_may_read_own)
        if depth == 5 and name == SELF:
            raise Refused("a secret key needs a name after its credentials", errno=errno.ENOENT)
    wild = is_wild(name) or any(is_wild(s) for s in parent)
    if wild and len(parent) >= MAX_SEGMENTS and name != SELF:
        # a pattern's file at this depth would have more segments than any
        # subscription may: refused before the path is even made
        raise Refused(f"a pattern has at most {MAX_SEGMENTS} segments",
                      errno=errno.ENAMETOOLONG)
    if name in (TRAILING, SELF):
        return Kind.FILE
    if is_wild(name):
        return Kind.DIR
    path = parent + (name,)
    if tree.is_dir(path):
        return Kind.DIR
    if wild or tree.is_key(path):
        return Kind.FILE
    raise Refused("not a known key or directory", errno=errno.ENOENT)


def _check_owner(cred: Path, own: Path | None, caller_may_read_own: bool) -> None:
    if own is None or cred != own:
        raise Refused("another process's secret keys", errno=errno.EACCES)
    if not caller_may_read_own:
        raise Refused("the mount's secret keys belong to its owner", errno=errno.EACCES)


def creatable(parent: Path, name: bytes) -> None:
    """Raise `Refused` unless ``parent/name`` may be created as a key file or directory."""
    if name in (b".", b"..", SELF, TRAILING) or is_wild(name) or (not parent and name == SECRET):
        raise Refused("a reserved name always exists", errno=errno.EEXIST)
    if any(is_wild(s) for s in parent):
        raise Refused("nothing can be created inside a pattern", errno=errno.EACCES)
    if parent[:1] == (SECRET,) and len(parent) < 5:
        raise Refused("secret keys live below !/cred/GID/UID/PID", errno=errno.EACCES)
