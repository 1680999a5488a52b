"""The pyfuse3 filesystem: broker connections behind the mapping of `sbus.fuse.mapping`.

Connections:

* one *monitor* subscribed to everything (and the mount's own secrets) with the
  ``discard`` flood policy: it only teaches the `KnownTree` which names are live;
* one shared *publisher* for all writes: each ``write(2)`` is one ``MSG``;
* one connection per open readable file, subscribed before ``open()`` returns (a
  whoami round trip proves the broker has processed the ``SUB``).  A pump task moves
  its packets into the handle's `Outbox`; it stops reading while the outbox is full,
  so a slow reader pushes back on the broker, whose flood policy then applies.

Every wait that a caller's syscall depends on also watches the caller's pending
signals (`sbus.fuse.signals`), because pyfuse3 does not deliver FUSE interrupts.

When the broker goes away, every connection reconnects and re-subscribes for up to
``reconnect_timeout`` seconds (socket activation keeps the socket while the broker
restarts); readers then simply go on.  After that, readers get EIO and a log line.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import select
import socket
import stat
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pyfuse3
import trio
from pyfuse3 import FUSEError
from trio.lowlevel import ParkingLot, wait_readable, wait_writable

from .. import protocol
from ..defaults import MAX_MESSAGE
from ..display import brief
from ..keys import Credentials, KeyRefused, KeyRules
from ..protocol import PUBLISHER_NOWAIT, WHOAMI
from . import mapping
from .framing import Outbox, frame
from .mapping import Kind, Path, Refused
from .signals import interrupted, thread_group

log = logging.getLogger("sbus.fuse")

T = TypeVar("T")
Ctx = pyfuse3.RequestContext
Attrs = pyfuse3.EntryAttributes

#: How often a waiting operation looks at its caller's pending signals (seconds).
SIGNAL_POLL = 0.05
#: A reader's pump stops reading from the broker above this many waiting bytes...
OUTBOX_HIGH = 4 * 1024 * 1024
#: ...and starts again below this.
OUTBOX_LOW = 1024 * 1024
#: Packets a pump drains before letting other tasks run.
PUMP_BATCH = 512
#: The broker has to answer a subscription's whoami round trip within this time.
SUBSCRIBE_TIMEOUT = 5.0
SEND_BUFFER = 512 * 1024
#: Seconds the kernel may cache a name's lookup (and attributes).
ENTRY_TIMEOUT = 1.0
#: Receive buffer beyond the largest packet: a little room for the newline the
#: ``lines`` format appends in place, so a message is copied once.
RECV_SPARE = 64
#: Packets the monitor drains before pausing; during floods it learns from a sample
#: (the broker discards the rest for it) instead of competing with readers for CPU.
MONITOR_BATCH = 64
MONITOR_PAUSE = 0.05
#: A pump that found only a few packets waits this long before looking again, so a
#: steady stream is handled in batches (fewer wakeups, fewer FUSE round trips) at the
#: price of at most this much latency; the first packet after a quiet spell goes
#: through at once.
PUMP_COALESCE = 0.002
PUMP_SMALL = 32
DROPPED = b"CMSG " + protocol.DROPPED + b"\0"
WHOAMI_REPLY = b"CMSG " + WHOAMI + b"\0"


class BrokerGone(Exception):
    pass


def _connect(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def _send(sock: socket.socket, packet: bytes) -> None:
    while True:
        try:
            sock.send(packet)
            return
        except BlockingIOError:
            await wait_writable(sock)


async def guarded(pid: int, fn: Callable[[], Awaitable[T]], tgid: int | None = None) -> T:
    """Run *fn*, answering EINTR if the calling process gets a signal meanwhile.

    *fn*'s `FUSEError` is re-raised as it is (not inside an exception group), since
    pyfuse3 turns only a bare `FUSEError` into an answer for the kernel."""
    hit = False
    error: FUSEError | None = None
    result: T | None = None
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            nonlocal hit
            while True:
                await trio.sleep(SIGNAL_POLL)
                if interrupted(pid, tgid):
                    hit = True
                    nursery.cancel_scope.cancel()
                    return

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


class Reader:
    """One open readable file: its subscription, waiting bytes and waiting callers."""

    def __init__(self, pattern: bytes, fmt: str) -> None:
        self.pattern = pattern
        self.out = Outbox(one_per_read=fmt == "raw")
        self.sock: socket.socket | None = None
        self.lot = ParkingLot()  # read() calls waiting for data
        self.space: trio.Event | None = None  # set when the pump may read again
        self.poll_handle: pyfuse3.PollHandle | None = None
        self.failed = False
        self.scope = trio.CancelScope()

    def wake(self) -> None:
        self.lot.unpark_all()
        ph, self.poll_handle = self.poll_handle, None
        if ph is not None:
            try:
                ph.notify()
            except OSError as exc:
                log.debug("poll notify failed: %s", exc)

    def close(self) -> None:
        self.scope.cancel()
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Handle:
    __slots__ = ("ino", "path", "pattern", "pid", "tgid", "reader", "writable")

    def __init__(self, ino: int, path: Path, pattern: bytes, pid: int,
                 reader: Reader | None, writable: bool) -> None:
        self.ino = ino
        self.path = path
        self.pattern = pattern
        self.pid = pid  # the opener: read() and write() are not told who calls them
        self.tgid = thread_group(pid)
        self.reader = reader
        self.writable = writable


class BusFS(pyfuse3.Operations):
    """The filesystem.  Call `start` inside a nursery before `pyfuse3.main`."""

    def __init__(self, address: str, *, fmt: str = "lines", remember: int = 10000,
                 remember_bytes: int = 16 << 20, max_message: int = MAX_MESSAGE,
                 reconnect_timeout: float = 30.0) -> None:
        super().__init__()
        self.address = address
        self.fmt = fmt
        self.tree = mapping.KnownTree(remember, remember_bytes)
        self.max_message = max_message
        self.reconnect_timeout = reconnect_timeout
        self.rules = KeyRules(mapping.SEP)
        self.uid, self.gid = os.getuid(), os.getgid()
        self.own: Path | None = None  # (GID, UID, PID) the broker sees for this process
        self.cred: Credentials | None = None
        self.started = time.time_ns()
        self.closing = False
        self.nursery: trio.Nursery | None = None
        # inodes: (path, kind) <-> number, with the kernel's lookup counts
        self._ino_of: dict[tuple[Path, Kind], int] = {((), Kind.DIR): pyfuse3.ROOT_INODE}
        self._node_of: dict[int, tuple[Path, Kind]] = {pyfuse3.ROOT_INODE: ((), Kind.DIR)}
        self._lookups: Counter[int] = Counter()
        self._next_ino = pyfuse3.ROOT_INODE + 1
        self._handles: dict[int, Handle] = {}
        self._opened: Counter[int] = Counter()
        self._next_fh = 1
        self._dirs: dict[int, tuple[Path, list[tuple[bytes, Kind]]]] = {}
        self._publisher: socket.socket | None = None
        self._publish_lock = trio.Lock()
        self._buf = bytearray(max(max_message, MAX_MESSAGE) + RECV_SPARE)
        self._recv_size = len(self._buf) - RECV_SPARE
        self._view = memoryview(self._buf)
        self._readers: set[Reader] = set()

    # -- lifecycle ---------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Learn our credentials and start the monitor; raises OSError if no broker."""
        self.nursery = nursery
        sock = _connect(self.address)
        cred = await self._subscribe(sock, [], None)
        try:
            self.cred = Credentials.parse(cred)
            self.own = tuple(cred.split(mapping.SEP)[2:5])
        except ValueError:
            log.warning("the broker's whoami answer %s is not a credentials path; "
                        "secret keys are not reachable through this mount", brief(cred))
        nursery.start_soon(self._monitor, sock)

    def shutdown(self) -> None:
        """Unmounting: blocked reads end (EOF) instead of holding up the main loop."""
        self.closing = True
        for r in list(self._readers):
            r.wake()

    async def _subscribe(self, sock: socket.socket, patterns: list[bytes],
                         reader: Reader | None) -> bytes:
        """Subscribe and wait until the broker has processed it; returns whoami.
        Messages arriving meanwhile go to *reader*."""
        for p in patterns:
            await _send(sock, b"SUB " + p)
        await _send(sock, b"CMSG " + WHOAMI)
        with trio.fail_after(SUBSCRIBE_TIMEOUT):
            while True:
                try:
                    n = sock.recv_into(self._buf, self._recv_size)
                except BlockingIOError:
                    await wait_readable(sock)
                    continue
                if n == 0:
                    raise BrokerGone("the broker closed the connection")
                packet = self._view[:n].tobytes()
                if packet.startswith(WHOAMI_REPLY):
                    return packet[len(WHOAMI_REPLY):]
                if reader is not None:
                    self._deliver(reader, packet)

    async def _reconnect(self, patterns: list[bytes],
                         reader: Reader | None) -> socket.socket | None:
        """A fresh, subscribed connection, retried until `reconnect_timeout`; None after."""
        deadline = trio.current_time() + self.reconnect_timeout
        while True:
            try:
                sock = _connect(self.address)
            except OSError:
                pass
            else:
                try:
                    await self._subscribe(sock, patterns, reader)
                    return sock
                except (OSError, BrokerGone, trio.TooSlowError):
                    sock.close()
            if trio.current_time() >= deadline or self.closing:
                return None
            await trio.sleep(0.1)

    async def _monitor(self, sock: socket.socket) -> None:
        """Learn live keys: everything public, and our own secrets."""
        patterns = [b""]
        if self.own is not None:
            patterns.append(b"!/cred/" + b"/".join(self.own) + b"/")
        for p in patterns:
            await _send(sock, b"SUB " + p)
        await _send(sock, b"CMSG blocking/soft/discard")
        learn = self.tree.learn
        seen: dict[bytes, Path | None] = {}
        batch = 0
        while True:
            try:
                n = sock.recv_into(self._buf, self._recv_size)
            except BlockingIOError:
                batch = 0
                await wait_readable(sock)
                continue
            except OSError:
                n = 0
            if n == 0:
                sock.close()
                log.warning("lost the broker at %s; reconnecting", self.address)
                while True:
                    new = await self._reconnect(patterns, None)
                    if new is not None:
                        break
                    log.error("no broker at %s for %.0f s; still trying", self.address,
                              self.reconnect_timeout)
                sock = new
                await _send(sock, b"CMSG blocking/soft/discard")
                log.warning("reconnected to the broker at %s", self.address)
                continue
            # the buffer is shared: use the packet before the next await
            nul = self._buf.find(b"\0", 4, n) if self._buf.startswith(b"MSG ") else -1
            if nul >= 0:
                key = self._view[4:nul].tobytes()
                if key in seen:
                    path = seen[key]
                else:
                    if len(seen) >= 4096:
                        seen.clear()
                    path = seen[key] = mapping.key_segments(key)
                if path is not None:
                    learn(path)
            batch += 1
            if batch >= MONITOR_BATCH:
                batch = 0
                await trio.sleep(MONITOR_PAUSE)

    # -- inodes --------------------------------------------------------------------

    def _inode(self, path: Path, kind: Kind) -> int:
        ino = self._ino_of.get((path, kind))
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
            self._ino_of[path, kind] = ino
            self._node_of[ino] = (path, kind)
        return ino

    def _node(self, ino: int) -> tuple[Path, Kind]:
        try:
            return self._node_of[ino]
        except KeyError:
            raise FUSEError(errno.ENOENT) from None

    def _attrs(self, ino: int) -> Attrs:
        path, kind = self._node_of[ino]
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        secret = path[:1] == (mapping.SECRET,)
        # Names can change type with traffic (a key becomes a prefix), so the kernel
        # may trust an answer for one second only; secret names are checked per
        # caller, so never cached.
        a.entry_timeout = 0 if secret else ENTRY_TIMEOUT
        a.attr_timeout = 0 if secret else ENTRY_TIMEOUT
        if kind is Kind.DIR:
            a.st_mode = stat.S_IFDIR | (0o700 if secret else 0o777)
            a.st_nlink = 2
        else:
            pattern = mapping.pattern_of(path)
            perm = 0o444 if mapping.is_pattern(pattern) else 0o666
            a.st_mode = stat.S_IFREG | (perm & 0o700 if secret else perm)
            a.st_nlink = 1
        a.st_uid, a.st_gid = self.uid, self.gid
        a.st_size = 0
        a.st_blksize = 128 * 1024
        a.st_blocks = 0
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.started
        return a

    def _caller_may_read_own(self, ctx: Ctx) -> bool:
        return ctx.uid in (self.uid, 0)

    def _decide(self, parent: Path, name: bytes, ctx: Ctx) -> Kind:
        try:
            return mapping.lookup(self.tree, parent, name, self.own,
                                  self._caller_may_read_own(ctx))
        except Refused as exc:
            raise FUSEError(exc.errno) from None

    @answering
    async def lookup(self, parent_inode: int, name: bytes, ctx: Ctx) -> Attrs:
        parent, kind = self._node(parent_inode)
        if kind is not Kind.DIR:
            raise FUSEError(errno.ENOTDIR)
        if name == b".":
            ino = parent_inode
        elif name == b"..":
            ino = self._inode(parent[:-1], Kind.DIR)
        else:
            ino = self._inode(parent + (name,), self._decide(parent, name, ctx))
        self._lookups[ino] += 1
        return self._attrs(ino)

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
        entries = self.tree.entries(path)
        if not self._caller_may_read_own(ctx):  # the secrets listed are the mount's own
            entries = [(n, k) for n, k in entries if path or n != mapping.SECRET]
            if path[:1] == (mapping.SECRET,):
                entries = []
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = (path, entries)
        return fh

    @answering
    async def readdir(self, fh: int, start_id: int, token) -> None:
        path, entries = self._dirs.get(fh, ((), []))
        for i in range(start_id, len(entries)):
            name, kind = entries[i]
            ino = self._inode(path + (name,), kind)
            if not pyfuse3.readdir_reply(token, name, self._attrs(ino), i + 1):
                return
            self._lookups[ino] += 1

    @answering
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @answering
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Ctx) -> Attrs:
        parent, kind = self._node(parent_inode)
        if kind is not Kind.DIR:
            raise FUSEError(errno.ENOTDIR)
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
        self.tree.mkdir(path)
        ino = self._inode(path, Kind.DIR)
        self._lookups[ino] += 1
        return self._attrs(ino)

    @answering
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Ctx) -> None:
        parent, _ = self._node(parent_inode)
        if not self.tree.rmdir(parent + (name,)):
            raise FUSEError(errno.ENOENT)

    @answering
    async def unlink(self, parent_inode: int, name: bytes, ctx: Ctx) -> None:
        """Forget a remembered key (it comes back if it is published again)."""
        parent, _ = self._node(parent_inode)
        path = parent + (name,)
        if name == mapping.SELF and parent:
            path = parent
        if not self.tree.forget(path):
            raise FUSEError(errno.ENOENT)

    # -- files ---------------------------------------------------------------------

    @answering
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Ctx) -> tuple[pyfuse3.FileInfo, Attrs]:
        parent, kind = self._node(parent_inode)
        if kind is not Kind.DIR:
            raise FUSEError(errno.ENOTDIR)
        try:
            mapping.creatable(parent, name)
            if parent[:1] == (mapping.SECRET,):
                mapping.lookup(self.tree, parent, b"x", self.own,
                               self._caller_may_read_own(ctx))
        except Refused as exc:
            raise FUSEError(exc.errno) from None
        path = parent + (name,)
        self._check_key(mapping.pattern_of(path))
        self.tree.learn(path)
        ino = self._inode(path, Kind.FILE)
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
        reader = None
        if readable:
            if self.closing:
                raise FUSEError(errno.ENOTCONN)
            if self.cred is not None:
                try:
                    self.rules.check_pattern(pattern, self.cred)
                except KeyRefused:
                    raise FUSEError(errno.EACCES) from None
            reader = Reader(pattern, self.fmt)
            await guarded(ctx.pid, lambda: self._start_reader(reader))
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = Handle(ino, path, pattern, ctx.pid, reader, writable)
        self._opened[ino] += 1
        # seekable (offsets are ignored) because head(1) and others seek back over what
        # they read but did not use, and fail loudly on a non-seekable regular file
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, nonseekable=False)

    async def _start_reader(self, r: Reader) -> None:
        try:
            sock = _connect(self.address)
        except OSError as exc:
            log.error("cannot subscribe to %r: no broker at %s: %s", r.pattern, self.address,
                      exc.strerror)
            raise FUSEError(errno.EIO) from None
        try:
            await self._subscribe(sock, [r.pattern], r)
        except (OSError, BrokerGone, trio.TooSlowError) as exc:
            sock.close()
            log.error("cannot subscribe to %r at %s: %s", r.pattern, self.address, exc)
            raise FUSEError(errno.EIO) from None
        except BaseException:  # cancelled: the caller was interrupted
            sock.close()
            raise
        r.sock = sock
        self._readers.add(r)
        assert self.nursery is not None
        self.nursery.start_soon(self._pump, r)

    def _deliver(self, r: Reader, packet: bytes | memoryview) -> None:
        if packet[:4] == b"MSG ":
            raw = bytes(packet)
            nul = raw.find(b"\0", 4)
            if nul >= 0:
                r.out.push(frame(self.fmt, raw[4:nul], raw[nul + 1:], time.time()))
        elif bytes(packet[:len(DROPPED)]) == DROPPED:
            n = bytes(packet[len(DROPPED):])
            log.warning("the broker dropped %s messages for a reader of %s (it was too slow)",
                        brief(n), brief(r.pattern))

    async def _pump(self, r: Reader) -> None:
        with r.scope:
            view, buf, size = self._view, self._buf, self._recv_size
            lines = self.fmt == "lines"
            push = r.out.push
            while True:
                if r.out.nbytes >= OUTBOX_HIGH:
                    r.space = trio.Event()
                    await r.space.wait()
                    continue
                sock = r.sock
                if sock is None:
                    return
                got = 0
                eof = False
                for _ in range(PUMP_BATCH):
                    try:
                        n = sock.recv_into(buf, size)
                    except BlockingIOError:
                        break
                    except OSError:
                        n = 0
                    if n == 0:
                        eof = True
                        break
                    got += 1
                    if lines and buf.startswith(b"MSG "):  # the hot path: one copy
                        nul = buf.find(b"\0", 4, n)
                        if nul >= 0:
                            if buf[n - 1] != 10 or n == nul + 1:
                                buf[n] = 10
                                n += 1
                            push(view[nul + 1:n].tobytes())
                            continue
                    self._deliver(r, view[:n])
                    if r.out.nbytes >= OUTBOX_HIGH:
                        break
                if got:
                    r.wake()
                if eof:
                    await self._reader_lost(r)
                    if r.failed:
                        return
                elif got >= PUMP_SMALL:
                    await trio.lowlevel.checkpoint()
                elif got:
                    await trio.sleep(PUMP_COALESCE)
                else:
                    await wait_readable(sock)

    async def _reader_lost(self, r: Reader) -> None:
        if r.sock is not None:
            r.sock.close()
            r.sock = None
        if self.closing:
            r.failed = True
            r.wake()
            return
        log.warning("reader of %s lost the broker at %s; re-subscribing", brief(r.pattern),
                    self.address)
        sock = await self._reconnect([r.pattern], r)
        if sock is None:
            log.error("no broker at %s for %.0f s: readers of %r get EIO", self.address,
                      self.reconnect_timeout, r.pattern)
            r.failed = True
        else:
            r.sock = sock
            log.warning("reader of %s re-subscribed", brief(r.pattern))
        r.wake()

    @answering
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles.get(fh)
        if h is None or h.reader is None:
            raise FUSEError(errno.EBADF)
        r = h.reader
        while True:
            if r.out:
                data = r.out.take(size)
                if r.space is not None and r.out.nbytes < OUTBOX_LOW:
                    r.space.set()
                    r.space = None
                return data
            if r.failed:
                if self.closing:
                    return b""
                raise FUSEError(errno.EIO)
            if self.closing:
                return b""
            if interrupted(h.pid, h.tgid):
                raise FUSEError(errno.EINTR)
            with trio.move_on_after(SIGNAL_POLL):
                await r.lot.park()

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
        packet = b"MSG " + h.pattern + b"\0" + bytes(buf)
        if len(packet) > self.max_message:
            raise FUSEError(errno.EMSGSIZE)
        if not self._publish_now(packet):
            await guarded(h.pid, lambda: self._publish(packet), h.tgid)
        return len(buf)

    def _publish_now(self, packet: bytes) -> bool:
        """The common case without a task or a lock: the connection is up and the
        kernel takes the packet at once.  False means: take the slow path."""
        sock = self._publisher
        if sock is None or self._publish_lock.locked():
            return False
        try:
            sock.send(packet)
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                raise FUSEError(errno.EMSGSIZE) from None
            return False
        return True

    async def _publish(self, packet: bytes) -> None:
        async with self._publish_lock:
            for _ in range(2):
                sock = self._publisher
                if sock is None:
                    sock = await self._reconnect([], None)
                    if sock is None:
                        log.error("cannot publish: no broker at %s", self.address)
                        raise FUSEError(errno.EIO)
                    # one connection publishes for every writer: a slow subscriber of
                    # one key must not stall writers of others (docs/protocol.md)
                    await _send(sock, b"CMSG " + PUBLISHER_NOWAIT)
                    self._publisher = sock
                try:
                    await _send(sock, packet)
                    return
                except OSError as exc:
                    if exc.errno == errno.EMSGSIZE:
                        raise FUSEError(errno.EMSGSIZE) from None
                    log.warning("publishing failed (%s); reconnecting", exc.strerror)
                    sock.close()
                    self._publisher = None
            raise FUSEError(errno.EIO)

    async def flush(self, fh: int) -> None:
        # Nothing is buffered, so there is nothing to flush.  ENOSYS tells the kernel
        # (which then treats close() as successful) to stop sending FLUSH at all:
        # two of five requests per 'echo >' (bash closes the file twice).
        raise FUSEError(errno.ENOSYS)

    @answering
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        if h.reader is not None:
            h.reader.close()
            self._readers.discard(h.reader)
        self._opened[h.ino] -= 1
        if self._opened[h.ino] <= 0:
            del self._opened[h.ino]
            self._drop_inode(h.ino)

