"""The pyfuse3 filesystem: the mapping of `sbus.fuse.mapping` answered to the kernel.

The broker connections behind it live in `sbus.fuse.bus`; this module holds only what
FUSE asks (inodes, directories, open/read/write/poll) and how each answer is decided.

Every wait that a caller's syscall depends on also watches the caller's pending
signals (`sbus.fuse.signals`), because pyfuse3 does not deliver FUSE interrupts.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import select
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError

from .. import protocol
from ..defaults import MAX_MESSAGE
from ..display import brief
from ..keys import KeyRefused, KeyRules
from . import intent, mapping, signals
from .bus import MountBus, Reader
from .callers import SIGNAL_POLL, Caller, Callers
from .mapping import Kind, Path, Refused, key_cost, split_view
from .shares import Shares, UserShare
from .signals import thread_group

log = logging.getLogger("sbus.fuse")

T = TypeVar("T")
Ctx = pyfuse3.RequestContext
Attrs = pyfuse3.EntryAttributes

#: Seconds the kernel may cache a name's lookup (and attributes).
ENTRY_TIMEOUT = 1.0
#: Bytes an inode holds here besides its path (its entries in the inode tables and
#: lookup counts, its place among its user's; measured: tests/test_fuse_shares.py),
#: and per name in its path (a pointer in its own path tuple: names are shared with
#: the parent's).
INODE_COST = 600
INODE_SEGMENT_COST = 9
#: Names a user at its share has the kernel forget per reclaim (at most one a second):
#: a bound on the loop's work there (half of a 65,536-inode share at once took 68 ms).
RECLAIM_BATCH = 1024


def inode_cost(path: Path) -> int:
    """What an inode of *path* is charged: deep paths cost what they hold, so depth
    cannot multiply what a user's share of inodes holds."""
    return INODE_COST + INODE_SEGMENT_COST * len(path) + (len(path[-1]) if path else 0)


#: How long a question about a caller may take (`BusFS._ask_caller`): a lookup miss
#: asking whether its caller creates below it, an open whether its caller follows.
INTENT_TIMEOUT = 0.5


async def guarded(caller: Caller, fn: Callable[[], Awaitable[T]]) -> T:
    """Run *fn*, answering EINTR if *caller* gets a signal meanwhile (`Callers`).

    *fn*'s `FUSEError` is re-raised as it is (not inside an exception group), since
    pyfuse3 turns only a bare `FUSEError` into an answer for the kernel."""
    hit = False
    error: FUSEError | None = None
    result: T | None = None
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            nonlocal hit
            await caller.wait_hit()
            hit = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            result = await fn()
        except FUSEError as exc:
            error = exc
        finally:
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    if hit:
        raise FUSEError(errno.EINTR)
    return result  # type: ignore[return-value]


def answering(op: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A bug in one request answers EIO (and is logged) instead of ending pyfuse3's
    main loop, which would leave the mount dead ("Transport endpoint is not
    connected") for every other user."""
    @functools.wraps(op)
    async def answer(self, *args):
        try:
            return await op(self, *args)
        except FUSEError:
            raise
        except Exception:
            log.exception("%s failed; answering EIO", op.__name__)
            if op.__name__ == "forget":
                return None  # must not raise at all
            raise FUSEError(errno.EIO) from None

    return answer


def _not_a_pattern(path: mapping.Path) -> None:
    """Patterns (a wildcard name, ``**``, or anything below a wildcard) always exist and
    are read-only: removing one is EACCES, not a "no such file" for what ``ls`` shows."""
    if path[-1] == mapping.TRAILING or any(mapping.is_wild(s) for s in path):
        raise FUSEError(errno.EACCES)


class Handle:
    """One open file.  A writer opened without ``O_APPEND`` gathers its writes in
    *pending* and publishes them as one message when the file is closed (`flush`);
    an appending one publishes each write.  A *follow* reader (``tail -f``) sees end
    of file when nothing waits, and the file's size grows by what it can read."""

    __slots__ = ("ino", "path", "pattern", "pid", "_tgid", "uid", "reader", "writable",
                 "head", "pending", "too_big", "follow", "served", "recent")

    def __init__(self, ino: int, path: Path, pattern: bytes, ctx: Ctx,
                 reader: Reader | None, writable: bool, append: bool,
                 follow: bool = False) -> None:
        self.ino = ino
        self.path = path
        self.pattern = pattern
        self.pid = ctx.pid  # the opener: read() and write() are not told who calls them
        # a reader waits for messages, so its process is looked up now, while the
        # opening thread surely lives; a writer waits only when the broker pushes
        # back, so it is looked up then (`group`), sparing every `echo >` a /proc read
        self._tgid = thread_group(ctx.pid) if reader is not None else None
        self.uid = ctx.uid
        self.reader = reader
        self.writable = writable
        # the packet's bytes before the payload, made once: a write adds only its data
        self.head = protocol.publish_head(pattern) if writable else b""
        self.pending: bytearray | None = bytearray() if writable and not append else None
        self.too_big = False
        self.follow = follow
        self.served = 0  # the file offset just past the last bytes read
        self.recent = b""  # those bytes, for a reader that seeks back over them

    def group(self) -> int:
        """The opener's process (thread group), for `interrupted`."""
        if self._tgid is None:
            self._tgid = thread_group(self.pid)
        return self._tgid


class BusFS(pyfuse3.Operations):
    """The filesystem.  Call `start` inside a nursery before `pyfuse3.main`."""

    def __init__(self, address: str, *, fmt: str = "lines", remember: int = 10000,
                 remember_bytes: int = 16 << 20, max_message: int = MAX_MESSAGE,
                 reconnect_timeout: float = 30.0, mountpoint: str | None = None,
                 max_tasks: int = 1000, allow_other: bool = False,
                 share: UserShare | None = None) -> None:
        """*share*: what each user may make the mount hold (`UserShare`; one share for
        everyone, also without *allow_other*, where the owner is the only user)."""
        super().__init__()
        self.share = share or UserShare()
        self._made: dict[Path, int] = {}  # directories made with mkdir -> whose
        self._made_bytes: Counter[int] = Counter()
        # the mount point as given and resolved (found before mounting: afterwards
        # resolving it would ask this very filesystem); None: no implicit directories
        self.mountpoints = tuple(dict.fromkeys(
            os.fsencode(f(mountpoint)) for f in (os.path.abspath, os.path.realpath)
        )) if mountpoint else ()
        self._intent_threads: dict[int, trio.CapacityLimiter] = {}
        self.shares = Shares(max_tasks, fair=allow_other)
        self.callers = Callers()  # those whose operations wait, asked about signals
        self._buffered: Counter[int] = Counter()  # bytes held for writers, per user
        self._followers: dict[int, set[Handle]] = {}
        self._sizes: dict[int, int] = {}  # what follow readers were shown, per inode
        self.address = address
        self.fmt = fmt
        self.tree = mapping.KnownTree(remember, remember_bytes, self.share.created)
        self.max_message = max_message
        self.reconnect_timeout = reconnect_timeout
        self.rules = KeyRules(mapping.SEP)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.bus = MountBus(address, fmt, self.tree, max_message, reconnect_timeout,
                            self.share)
        self.started = time.time_ns()
        # inodes: (path, kind) <-> number, with the kernel's lookup counts
        self._ino_of: dict[tuple[Path, Kind], int] = {((), Kind.DIR): pyfuse3.ROOT_INODE}
        self._node_of: dict[int, tuple[Path, Kind]] = {pyfuse3.ROOT_INODE: ((), Kind.DIR)}
        self._lookups: Counter[int] = Counter()
        self._next_ino = pyfuse3.ROOT_INODE + 1
        self._ino_uid: dict[int, int] = {}  # whose lookup made an inode
        # each user's inodes, oldest first (a dict as an ordered set): what `_reclaim`
        # looks at, without walking everyone's
        self._inos_of: dict[int, dict[int, None]] = {}
        self._inodes: Counter[int] = Counter()  # inodes per user
        self._inode_bytes: Counter[int] = Counter()  # and their bytes (`inode_cost`)
        self._reclaimed: dict[int, float] = {}  # when each user's names were last reclaimed
        self._handles: dict[int, Handle] = {}
        self._files: Counter[int] = Counter()  # open handles per user
        self._opened: Counter[int] = Counter()
        self._next_fh = 1
        # open directories: their path, listing and whose share holds it
        self._dirs: dict[int, tuple[Path, list[tuple[bytes, Kind]], int]] = {}
        self._listed: Counter[int] = Counter()

    @property
    def own(self) -> Path | None:
        """(GID, UID, PID) the broker sees for this process, once known."""
        return self.bus.own

    @property
    def closing(self) -> bool:
        return self.bus.closing

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Learn our credentials and start the monitor; raises `ConnectError` if no broker."""
        await self.bus.start(nursery)
        nursery.start_soon(self.callers.run)

    def shutdown(self) -> None:
        """Unmounting: blocked reads end (EOF) instead of holding up the main loop."""
        self.bus.shutdown()

    async def drain(self, grace: float) -> int:
        """Unmounting, after `shutdown`: wait up to *grace* seconds for the files still
        open to be closed, so that their ``close()`` is answered instead of failed by the
        unmount (ECONNABORTED: a ``cat`` that had read to end of file exited 1, the
        audit of 2026-11-28); how many stayed open."""
        with trio.move_on_after(grace):
            while self._handles:
                await trio.sleep(0.02)
        return len(self._handles)

    # -- inodes --------------------------------------------------------------------

    def _inode(self, path: Path, kind: Kind, uid: int | None = None) -> int:
        """The inode of a name, made if new (charged to *uid*, EDQUOT beyond its share)."""
        ino = self._ino_of.get((path, kind))
        if ino is None:
            if uid is not None:
                self._check_inode_share(uid, path)
                self._inodes[uid] += 1
                self._inode_bytes[uid] += inode_cost(path)
            ino = self._next_ino
            self._next_ino += 1
            self._ino_of[path, kind] = ino
            self._node_of[ino] = (path, kind)
            if uid is not None:
                self._ino_uid[ino] = uid
                self._inos_of.setdefault(uid, {})[ino] = None
        return ino

    def _check_inode_share(self, uid: int, path: Path) -> None:
        """EDQUOT if a new inode of *path* would take *uid* beyond its share."""
        if (self._inodes[uid] >= self.share.inodes
                or self._inode_bytes[uid] + inode_cost(path) > self.share.inode_bytes):
            self.bus.refused("uid %d holds %d inodes of %d bytes (its share); "
                             "answering EDQUOT", uid, self._inodes[uid],
                             self._inode_bytes[uid])
            self._reclaim(uid)
            raise FUSEError(errno.EDQUOT)

    def _reclaim(self, uid: int) -> None:
        """Ask the kernel to forget the older half of *uid*'s names (at most once a
        second): it keeps looked-up names until memory runs short, so a user who
        merely browsed a lot would otherwise stay at its share for good."""
        now = time.monotonic()
        if now - self._reclaimed.get(uid, -1.0) < 1.0:
            return
        self._reclaimed[uid] = now
        if len(self._reclaimed) > 4096:
            self._reclaimed.clear()
        inos = self._inos_of.get(uid, {})
        todo = min(self._inodes[uid] // 2, RECLAIM_BATCH)
        asked = 0
        for ino in list(itertools.islice(inos, 2 * RECLAIM_BATCH)):  # oldest first
            if asked >= todo:
                break
            if self._opened[ino] > 0:
                continue
            path = self._node_of[ino][0]
            parent = self._ino_of.get((path[:-1], Kind.DIR))
            if parent is not None:
                pyfuse3.invalidate_entry_async(parent, path[-1], ignore_enoent=True)
                asked += 1
                del inos[ino]  # the next call goes on with the next ones, while the
                inos[ino] = None  # kernel forgets these (`forget`: `_drop_inode`)
        log.info("asked the kernel to forget %d of uid %d's names", asked, uid)

    def _node(self, ino: int) -> tuple[Path, Kind]:
        try:
            return self._node_of[ino]
        except KeyError:
            raise FUSEError(errno.ENOENT) from None

    def _attrs(self, ino: int) -> Attrs:
        path, kind = self._node_of[ino]
        path = split_view(path)[1]
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        secret = path[:1] == (mapping.SECRET,)
        # Names can change type with traffic (a key becomes a prefix), so the kernel
        # may trust an answer for one second only; secret names are checked per
        # caller, so never cached.
        a.entry_timeout = 0 if secret else ENTRY_TIMEOUT
        # cached too (else every open(2) costs a GETATTR round trip: the kernel checks
        # permissions on fresh attributes), except a followed file's, whose size is
        # how far its follow readers (tail -f) may read (`_open` drops what the
        # kernel cached before its first follower came)
        a.attr_timeout = 0 if secret or ino in self._followers else ENTRY_TIMEOUT
        a.st_size = 0
        if kind is Kind.DIR:
            a.st_mode = stat.S_IFDIR | (0o700 if secret else 0o777)
            a.st_nlink = 2
        else:
            pattern = mapping.pattern_of(path)
            perm = 0o444 if mapping.is_pattern(pattern) else 0o666
            a.st_mode = stat.S_IFREG | (perm & 0o700 if secret else perm)
            a.st_nlink = 1
        a.st_uid, a.st_gid = self.uid, self.gid
        if ino in self._followers:
            a.st_size = self._follow_size(ino)
        a.st_blksize = 128 * 1024
        a.st_blocks = 0
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.started
        return a

    def _caller_may_read_own(self, ctx: Ctx) -> bool:
        return ctx.uid in (self.uid, 0)

    async def _decide(self, full_parent: Path, name: bytes, ctx: Ctx) -> tuple[Kind, bool]:
        """The name's kind, and whether it is only implied: unknown, but the caller's
        open call goes through it (`sbus.fuse.intent`)."""
        if not full_parent and name in mapping.VIEWS:
            return Kind.DIR, False
        parent = split_view(full_parent)[1]
        try:
            return mapping.lookup(self.tree, parent, name, self.own,
                                  self._caller_may_read_own(ctx)), False
        except Refused as exc:
            if exc.errno == errno.ENOENT:
                kind = await self._implied(full_parent, parent, name, ctx)
                if kind is not None:
                    return kind, True
            raise FUSEError(exc.errno) from None

    async def _ask_caller(self, uid: int, question: Callable[[], T]) -> T | None:
        """*question*'s answer about a caller of user *uid*, asked of ``/proc`` in one
        of that user's intent threads; None after INTENT_TIMEOUT.

        Reading a caller's memory (its open call's path, its command line) takes its
        memory-map lock, which the caller can hold for good: a sibling thread reading
        a page that never arrives holds it for reading while another asks to map
        memory.  So never on the event loop, and a stuck question pins only a thread
        of its own user's share."""
        limiter = self._intent_threads.get(uid)
        if limiter is None:
            limiter = self._intent_threads[uid] = trio.CapacityLimiter(
                self.share.intent_threads)
        answer = None
        # waiting for one of the user's threads holds a task: in a slot of its share
        async with self._slot(uid):
            with trio.move_on_after(INTENT_TIMEOUT):
                answer = await trio.to_thread.run_sync(question, abandon_on_cancel=True,
                                                       limiter=limiter)
        if limiter.borrowed_tokens == 0 and not limiter.statistics().tasks_waiting:
            self._intent_threads.pop(uid, None)
        return answer

    async def _implied(self, full_parent: Path, parent: Path, name: bytes,
                       ctx: Ctx) -> Kind | None:
        """An unknown name the caller is opening a path through: a directory when the
        path goes on below it (creating, or subscribing through names nobody
        published yet), the file itself when it is the last name of an open for
        reading (a subscription).  None: the name stays unknown (ENOENT), so a
        create goes on to `create`."""
        if not self.mountpoints:
            return None
        try:
            mapping.creatable(parent, name)  # what mkdir may not make, this may not either
        except Refused:
            return None
        call = await self._ask_caller(ctx.uid, functools.partial(intent.opening, ctx.pid))
        if call is None:
            return None
        below = intent.names_below(call.path, self.mountpoints, full_parent, name)
        if below is None:
            return None
        if below > 0:
            return Kind.DIR
        if call.flags & (os.O_CREAT | os.O_DIRECTORY):
            return None
        return Kind.FILE

    @answering
    async def lookup(self, parent_inode: int, name: bytes, ctx: Ctx) -> Attrs:
        parent, kind = self._node(parent_inode)
        if kind is not Kind.DIR:
            raise FUSEError(errno.ENOTDIR)
        implicit = False
        if name == b".":
            ino = parent_inode
        elif name == b"..":
            ino = self._inode(parent[:-1], Kind.DIR)
        else:
            path = parent + (name,)
            if (path, Kind.DIR) not in self._ino_of and (path, Kind.FILE) not in self._ino_of:
                # a user at its share is refused before any work is done for it
                self._check_inode_share(ctx.uid, path)
            kind, implicit = await self._decide(parent, name, ctx)
            ino = self._inode(path, kind, ctx.uid)
        self._lookups[ino] += 1
        attrs = self._attrs(ino)
        if implicit:
            # held by nobody: not cached by the kernel nor remembered here, so it lasts
            # for this one call; the created key (learned, and charged, in `create`)
            # is what shows the directory afterwards
            attrs.entry_timeout = attrs.attr_timeout = 0
        return attrs

    @answering
    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self._lookups[ino] -= n
            if self._lookups[ino] <= 0:
                del self._lookups[ino]
                self._drop_inode(ino)

    def _drop_inode(self, ino: int) -> None:
        if ino == pyfuse3.ROOT_INODE or self._lookups[ino] > 0 or self._opened[ino] > 0:
            return
        node = self._node_of.pop(ino, None)
        if node is not None:
            del self._ino_of[node]
        uid = self._ino_uid.pop(ino, None)
        if uid is not None:
            inos = self._inos_of[uid]
            del inos[ino]
            if not inos:
                del self._inos_of[uid]
            self._inodes[uid] -= 1
            self._inode_bytes[uid] -= inode_cost(node[0]) if node is not None else 0
            if self._inodes[uid] <= 0:
                del self._inodes[uid], self._inode_bytes[uid]

    @answering
    async def getattr(self, inode: int, ctx: Ctx) -> Attrs:
        self._node(inode)
        return self._attrs(inode)

    @answering
    async def setattr(self, inode: int, attr: Attrs, fields, fh: int | None,
                      ctx: Ctx) -> Attrs:
        # truncation (O_TRUNC, '>') and times are accepted and change nothing: a key
        # holds no data, it only passes messages on
        self._node(inode)
        return self._attrs(inode)

    @answering
    async def statfs(self, ctx: Ctx) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_namemax = 255
        return s

    # -- directories ---------------------------------------------------------------

    @answering
    async def opendir(self, inode: int, ctx: Ctx) -> int:
        path, kind = self._node(inode)
        if kind is not Kind.DIR:
            raise FUSEError(errno.ENOTDIR)
        inner = split_view(path)[1]
        entries = self.tree.entries(inner)
        if not path:
            entries = [(n, Kind.DIR) for n in mapping.VIEWS] + entries
        if not self._caller_may_read_own(ctx):  # the secrets listed are the mount's own
            entries = [(n, k) for n, k in entries if inner or n != mapping.SECRET]
            if inner[:1] == (mapping.SECRET,):
                entries = []
        if self._listed[ctx.uid] + len(entries) > self.share.listed:
            self.bus.refused("uid %d holds %d entries in open directories (its share); "
                             "answering EMFILE", ctx.uid, self._listed[ctx.uid])
            raise FUSEError(errno.EMFILE)
        self._listed[ctx.uid] += len(entries)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = (path, entries, ctx.uid)
        return fh

    @answering
    async def readdir(self, fh: int, start_id: int, token) -> None:
        path, entries, uid = self._dirs.get(fh, ((), [], 0))
        for i in range(start_id, len(entries)):
            name, kind = entries[i]
            try:
                ino = self._inode(path + (name,), kind, uid)
            except FUSEError:
                if i == start_id:
                    raise
                return  # the next call fails: the listing does not end silently
            if not pyfuse3.readdir_reply(token, name, self._attrs(ino), i + 1):
                return
            self._lookups[ino] += 1

    @answering
    async def releasedir(self, fh: int) -> None:
        held = self._dirs.pop(fh, None)
        if held is not None:
            uid = held[2]
            self._listed[uid] -= len(held[1])
            if self._listed[uid] <= 0:
                del self._listed[uid]

    @answering
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Ctx) -> Attrs:
        full, kind = self._node(parent_inode)
        if kind is not Kind.DIR:
            raise FUSEError(errno.ENOTDIR)
        if not full and name in mapping.VIEWS:
            raise FUSEError(errno.EEXIST)
        parent = split_view(full)[1]
        try:
            mapping.creatable(parent, name)
            mapping.lookup(self.tree, parent, name, self.own,
                                      self._caller_may_read_own(ctx))
        except Refused as exc:
            if exc.errno != errno.ENOENT:
                raise FUSEError(exc.errno) from None
        else:
            raise FUSEError(errno.EEXIST)
        path = parent + (name,)
        cost = key_cost(path)
        if self._made_bytes[ctx.uid] + cost > self.share.dirs:
            self.bus.refused("uid %d made directories worth %d bytes (its share); "
                             "answering EDQUOT", ctx.uid, self._made_bytes[ctx.uid])
            raise FUSEError(errno.EDQUOT)
        ino = self._inode(full + (name,), Kind.DIR, ctx.uid)
        self.tree.mkdir(path)
        if path not in self._made:
            self._made[path] = ctx.uid
            self._made_bytes[ctx.uid] += cost
        self._lookups[ino] += 1
        return self._attrs(ino)

    @answering
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Ctx) -> None:
        parent = split_view(self._node(parent_inode)[0])[1]
        path = parent + (name,)
        _not_a_pattern(path)
        if not self.tree.rmdir(path):
            raise FUSEError(errno.ENOENT)
        uid = self._made.pop(path, None)
        if uid is not None:  # the maker's share, whoever removes it
            self._made_bytes[uid] -= key_cost(path)
            if self._made_bytes[uid] <= 0:
                del self._made_bytes[uid]

    @answering
    async def unlink(self, parent_inode: int, name: bytes, ctx: Ctx) -> None:
        """Forget a remembered key (it comes back if it is published again)."""
        parent = split_view(self._node(parent_inode)[0])[1]
        path = parent + (name,)
        _not_a_pattern(path)
        if name == mapping.SELF and parent:
            path = parent
        if not self.tree.forget(path):
            raise FUSEError(errno.ENOENT)

    # -- files ---------------------------------------------------------------------

    @answering
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Ctx) -> tuple[pyfuse3.FileInfo, Attrs]:
        full, kind = self._node(parent_inode)
        if kind is not Kind.DIR:
            raise FUSEError(errno.ENOTDIR)
        if not full and name in mapping.VIEWS:
            raise FUSEError(errno.EEXIST)
        parent = split_view(full)[1]
        try:
            mapping.creatable(parent, name)
            if parent[:1] == (mapping.SECRET,):
                mapping.lookup(self.tree, parent, b"x", self.own,
                               self._caller_may_read_own(ctx))
        except Refused as exc:
            raise FUSEError(exc.errno) from None
        path = parent + (name,)
        self._check_key(mapping.pattern_of(path))
        if not self.tree.fits(mapping.key_cost(path)):
            raise FUSEError(errno.ENAMETOOLONG)  # more than the mount may remember of it
        ino = self._inode(full + (name,), Kind.FILE, ctx.uid)
        self.tree.learn(path, ctx.uid)
        info = await self._open(ino, flags, ctx)
        self._lookups[ino] += 1
        return info, self._attrs(ino)

    @answering
    async def open(self, inode: int, flags: int, ctx: Ctx) -> pyfuse3.FileInfo:
        return await self._open(inode, flags, ctx)

    def _check_key(self, key: bytes) -> None:
        try:
            self.rules.check_key(key)
        except KeyRefused as exc:
            log.info("refusing to publish on %s: %s", brief(key), exc)
            raise FUSEError(errno.EINVAL) from None

    async def _open(self, ino: int, flags: int, ctx: Ctx) -> pyfuse3.FileInfo:
        path, kind = self._node(ino)
        view, path = split_view(path)
        if kind is not Kind.FILE:
            raise FUSEError(errno.EISDIR)
        owner = mapping.secret_owner(path)
        if owner is not None and (owner != self.own or not self._caller_may_read_own(ctx)):
            raise FUSEError(errno.EACCES)
        pattern = mapping.pattern_of(path)
        access = flags & os.O_ACCMODE
        writable = access in (os.O_WRONLY, os.O_RDWR)
        readable = access in (os.O_RDONLY, os.O_RDWR)
        if writable:
            if mapping.is_pattern(pattern):
                raise FUSEError(errno.EACCES)
            self._check_key(pattern)
        if self._files[ctx.uid] >= self.share.files:
            self.bus.refused("uid %d holds %d open files (its share); answering EMFILE",
                             ctx.uid, self._files[ctx.uid])
            raise FUSEError(errno.EMFILE)
        reader = None
        follow = False
        if readable:
            if self.closing:
                raise FUSEError(errno.ENOTCONN)
            if self.bus.cred is not None:
                try:
                    self.rules.check_pattern(pattern, self.bus.cred)
                except KeyRefused:
                    raise FUSEError(errno.EACCES) from None
            if not writable:  # asked before subscribing: a refused slot leaves nothing
                follow = bool(await self._ask_caller(
                    ctx.uid, functools.partial(signals.follows, ctx.pid)))
            reader = self.bus.reader_for(pattern, view or self.fmt, ctx.uid)  # or EMFILE
            try:
                async with self._slot(ctx.uid):
                    with self.callers.waiting(ctx.pid) as caller:
                        await guarded(caller, lambda: self.bus.start_reader(reader))
            except BaseException:  # refused, failed or interrupted: no subscription left
                self.bus.close_reader(reader)
                raise
        fh = self._next_fh
        self._next_fh += 1
        h = self._handles[fh] = Handle(ino, path, pattern, ctx, reader, writable,
                                       bool(flags & os.O_APPEND), follow)
        self._files[h.uid] += 1
        if follow:
            self._followers.setdefault(ino, set()).add(h)
            try:  # its size must not come from a cache: from now on it is never cached
                pyfuse3.invalidate_inode(ino, attr_only=True)
            except OSError as exc:
                log.debug("cannot drop the cached attributes of inode %d: %s", ino, exc)
        self._opened[ino] += 1
        # seekable (offsets are ignored) because head(1) and others seek back over what
        # they read but did not use, and fail loudly on a non-seekable regular file
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, nonseekable=False)

    @answering
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles.get(fh)
        if h is None or h.reader is None:
            raise FUSEError(errno.EBADF)
        r = h.reader
        if off < h.served and off >= h.served - len(h.recent):
            # a seek back over bytes read but not used (bash's `read` builtin does
            # this after each line): read them again
            start = off - (h.served - len(h.recent))
            return h.recent[start:start + size]
        if not r.out and not r.failed and not self.closing and not h.follow:
            async with self._slot(h.uid):
                with self.callers.waiting(h.pid, h.group()) as caller:
                    while not (r.out or r.failed or self.closing):
                        if caller.hit:
                            raise FUSEError(errno.EINTR)
                        await caller.park(r.lot)
        if r.out:
            lost = r.out.gap()
            if lost is not False:  # messages dropped (or missed) here: said, once
                if r.failed and not self.closing:
                    raise FUSEError(errno.EIO)  # (no more to come: that says more)
                log.info("a reader of %s is told of %s messages %s (ENOBUFS)",
                         brief(r.pattern), "some" if lost is None else lost,
                         "missed in a reconnect" if lost is None else "dropped for it")
                raise FUSEError(errno.ENOBUFS)
            data = r.out.take(size)
            self.bus.took(r)
            h.served = off + len(data)
            h.recent = data
            return data
        if r.failed and not self.closing:
            raise FUSEError(errno.EIO)
        return b""  # unmounting, or a follow reader (tail -f) has read all there is

    def _slot(self, uid: int):
        """A slot of the waiting requests' pool for *uid* (`sbus.fuse.shares`), or
        EAGAIN at once."""
        if not self.shares.take(uid):
            self.bus.refused("uid %d waits in too many requests; answering EAGAIN", uid)
            raise FUSEError(errno.EAGAIN)
        return _Slot(self.shares, uid)

    def _follow_size(self, ino: int) -> int:
        """What follow readers of *ino* may read by now: a size that only grows."""
        size = max((h.served + h.reader.out.nbytes for h in self._followers.get(ino, ())
                    if h.reader is not None), default=0)
        size = max(size, self._sizes.get(ino, 0))
        self._sizes[ino] = size
        return size

    @answering
    async def poll(self, inode: int, fh: int, poll_handle: pyfuse3.PollHandle | None,
                   ctx: Ctx) -> int:
        h = self._handles.get(fh)
        if h is None:
            raise FUSEError(errno.EBADF)
        mask = select.POLLOUT | select.POLLWRNORM if h.writable else 0
        r = h.reader
        if r is not None:
            if r.out or r.failed or self.closing:
                mask |= select.POLLIN | select.POLLRDNORM
            elif poll_handle is not None:
                r.poll_handle = poll_handle
        return mask

    @answering
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles.get(fh)
        if h is None or not h.writable:
            raise FUSEError(errno.EBADF)
        if h.pending is None:  # appending: each write is a message
            await self._publish(h, buf)
            return len(buf)
        if h.too_big or len(h.head) + len(h.pending) + len(buf) > self.max_message:
            self._drop_pending(h, too_big=True)
            raise FUSEError(errno.EMSGSIZE)
        if self._buffered[h.uid] + len(buf) > self.share.pending:
            self.bus.refused("uid %d holds %d bytes in unfinished files; answering "
                             "ENOBUFS", h.uid, self._buffered[h.uid])
            raise FUSEError(errno.ENOBUFS)
        h.pending += buf
        self._buffered[h.uid] += len(buf)
        return len(buf)

    async def _publish(self, h: Handle, payload: bytes) -> None:
        if len(h.head) + len(payload) > self.max_message:
            raise FUSEError(errno.EMSGSIZE)
        packet = h.head + payload
        if self.bus.publish_nowait(packet, h.uid):  # the common case: no timer, no await
            return
        with trio.move_on_after(SIGNAL_POLL) as quick:
            await self.bus.publish(packet, h.uid)
        if quick.cancelled_caught:  # the broker pushes back or is away: wait, but
            # answer EINTR to a signal, in a slot of the waiting requests' pool
            async with self._slot(h.uid):
                with self.callers.waiting(h.pid, h.group()) as caller:
                    await guarded(caller, lambda: self.bus.publish(packet, h.uid))

    def _drop_pending(self, h: Handle, too_big: bool = False) -> bytes:
        data = bytes(h.pending or b"")
        if h.pending is not None:
            self._buffered[h.uid] -= len(h.pending)
            if self._buffered[h.uid] <= 0:
                del self._buffered[h.uid]
            h.pending = bytearray()
        h.too_big = h.too_big or too_big
        return data

    @answering
    async def flush(self, fh: int) -> None:
        """``close()``: a file written without ``O_APPEND`` is one message now."""
        h = self._handles.get(fh)
        if h is None or h.pending is None:
            return
        if h.too_big:
            h.too_big = False  # write() said so; nothing of this file is published
            return
        if h.pending:
            await self._publish(h, self._drop_pending(h))

    @answering
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        self._files[h.uid] -= 1
        if self._files[h.uid] <= 0:
            del self._files[h.uid]
        if h.pending:
            log.info("a writer of %s ended without closing; %d bytes not published",
                     brief(h.pattern), len(h.pending))
            self._drop_pending(h)
        if h.reader is not None:
            self.bus.close_reader(h.reader)
        followers = self._followers.get(h.ino)
        if followers is not None:
            followers.discard(h)
            if not followers:
                del self._followers[h.ino]
                self._sizes.pop(h.ino, None)
        self._opened[h.ino] -= 1
        if self._opened[h.ino] <= 0:
            del self._opened[h.ino]
            self._drop_inode(h.ino)


class _Slot:
    """Gives a `Shares` slot back however the request ends."""

    __slots__ = ("shares", "uid")

    def __init__(self, shares: Shares, uid: int) -> None:
        self.shares, self.uid = shares, uid

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        self.shares.give(self.uid)
