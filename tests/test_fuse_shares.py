"""What one local user can make an ``--allow-other`` mount hold (issue 28): each user
has a bounded share (`sbus.fuse.shares.UserShare`), refused with a clear errno beyond
it, while another user's ``cat`` and ``echo > key`` go on at once.  The attacker is a
real process of uid 65534 (nobody); the mount runs as root, whom the broker exempts
from its own per-user limits."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import (
    BrokerProcess,
    named_after_a_cut_send,
    read_until_quiet,
)
from test_fuse import (
    Mount,
    broker_in,
    cat,
    end,
    mounted,
    publish,
    read_lines,
    read_on,
    space_dir,
    subscriber,
    touch,
)
from test_fuse_files import AS_NOBODY, UserMount

from sbus.client import Client
from sbus.fuse.operations import RECLAIM_BATCH, inode_cost
from sbus.fuse.shares import UserShare


def counted_as_nobody(script: str) -> tuple[int, int, subprocess.CompletedProcess]:
    """Run *script* as nobody; it prints how far it got and the errno that stopped it."""
    r = subprocess.run([*AS_NOBODY, "python3", "-c", script], capture_output=True,
                       text=True, timeout=60)
    count, err = map(int, r.stdout.split())
    return count, err, r

@pytest.fixture(scope="module")
def space():
    yield from space_dir("sbus-fuse-shares-")


@pytest.fixture(scope="module")
def bus(space):
    yield from broker_in(space)


@pytest.fixture
def mount(bus, space):
    made: list[Mount] = []

    def make(name: str, *args: str) -> Mount:
        m = Mount(bus.address, os.path.join(space, name), "--allow-other", *args).start()
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()


# Opens files for reading (one per argument) until one fails; prints how many it
# holds and the errno, then keeps them open (without reading) until stdin closes.
HOLDER = """
import os, sys
fds, err = [], 0
for p in sys.argv[1:]:
    try:
        fds.append(os.open(p, os.O_RDONLY))
    except OSError as e:
        err = e.errno
        break
print(len(fds), err, flush=True)
sys.stdin.read()
"""


def hold(paths: list[str]) -> tuple[subprocess.Popen, int, int]:
    """nobody opens *paths* for reading: (its process, how many it holds, errno)."""
    p = subprocess.Popen([*AS_NOBODY, "python3", "-c", HOLDER, *paths],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line, "the holder ended"
    held, err = map(int, line.split())
    return p, held, err


def others_go_on(m: Mount, key: str) -> None:
    """root's `cat` of a fresh key subscribes, and `echo > key` reaches it, at once."""
    start = time.monotonic()
    reader = cat(m / key)
    try:
        subprocess.run(["sh", "-c", f"echo through > {m / key}"], check=True, timeout=10)
        assert read_lines(reader, 1, timeout=5) == [b"through\n"]
    finally:
        end(reader)
    assert time.monotonic() - start < 5


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_one_user_holds_at_most_its_share_of_readers(mount):
    """nobody opens readers until EMFILE ("Too many open files") at its share of 8;
    root still subscribes and publishes at once; closing gives the share back."""
    m = mount("readers", "--user-readers", "8")
    os.makedirs(m / "r", exist_ok=True)
    paths = [m / f"r/k{i}" for i in range(20)]
    for p in paths:
        open(p, "wb").close()  # known keys: the attack needs no intent reading
    holder, held, err = hold(paths)
    try:
        assert (held, err) == (8, errno.EMFILE)
        others_go_on(m, "r/free")
    finally:
        end(holder)
    deadline = time.monotonic() + 10  # its files closed: the share is free again
    while True:
        again, held, err = hold(paths[:8])
        end(again)
        if held == 8 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert (held, err) == (8, 0)


def test_messages_for_readers_that_do_not_read_are_bounded_per_user(mount, bus):
    """nobody's 8 readers of one key never read while 12 MB are published on it: the
    mount holds about its 2 MiB share for them (not 4 MiB per reader), and root's
    reader of another key gets its message at once."""
    m = mount("queue", "--user-readers", "8", "--user-queue", "2m")
    os.makedirs(m / "q", exist_ok=True)
    open(m / "q/k", "wb").close()
    holder, held, err = hold([m / "q/k"] * 8)
    try:
        assert (held, err) == (8, 0)
        pid = m.proc.pid
        before = rss(pid)
        payload = os.urandom(100_000)
        with Client(bus.address) as c:
            for _ in range(120):
                c.publish(b"q/k", payload)
            c.sync()  # the broker has routed them all
        peak = before
        deadline = time.monotonic() + 1.5  # the mount's pumps take what they may
        while time.monotonic() < deadline:
            peak = max(peak, rss(pid))
            time.sleep(0.05)
        grown = peak - before
        # 2 MiB share + one packet per reader, plus the interpreter's slack; without
        # the share each reader kept 4 MiB: 32 MiB
        assert grown < 14 << 20, grown
        others_go_on(m, "q/free")
    finally:
        end(holder)


def test_directories_one_user_makes_are_bounded(mount):
    """nobody's mkdir loop ends with EDQUOT at its 1 MiB share; root's mkdir still
    works; nobody's rmdir gives its share back."""
    m = mount("dirs")
    os.makedirs(m / "d", exist_ok=True)
    os.chmod(m / "d", 0o777)
    script = f"""
import os, errno
n = 0
try:
    for n in range(5000):
        os.mkdir({str(m / 'd')!r} + '/n%d' % n)
    print(5000, 0)
except OSError as e:
    print(n, e.errno)
"""
    made, err, r = counted_as_nobody(script)
    assert err == errno.EDQUOT and 500 < made < 2500, (made, err)
    os.mkdir(m / "d/roots")
    assert os.path.isdir(m / "d/roots")
    r = subprocess.run([*AS_NOBODY, "sh", "-c", f"rmdir {m / 'd'}/n1 {m / 'd'}/n2 && "
                        f"mkdir {m / 'd'}/again"], capture_output=True, timeout=10)
    assert r.returncode == 0, r.stderr


def test_keys_one_user_creates_push_out_only_its_own(mount):
    """With room for 2500 keys, nobody's 3000 `: > key` forget its own oldest (at its
    2 MiB share) and not root's known key."""
    m = mount("created", "--remember", "2500")
    os.makedirs(m / "c", exist_ok=True)
    open(m / "c/roots", "wb").close()
    script = f"""
import os
for n in range(3000):
    os.close(os.open({str(m / 'c')!r} + '/s%d' % n, os.O_WRONLY | os.O_CREAT))
"""
    subprocess.run([*AS_NOBODY, "python3", "-c", script], check=True, timeout=60)
    names = os.listdir(m / "c")
    assert "roots" in names
    assert "s2999" in names and "s0" not in names  # nobody's newest kept, oldest gone


def test_a_broker_refusal_reaches_the_opener_and_leaves_no_subscription(space):
    """A mount of nobody's on a broker that lets uid 65534 hold 4 subscriptions (the
    mount's monitor holds 2): the third reader's open fails with EDQUOT (the broker's
    refusal), and once a reader closes, an open succeeds again (no phantom)."""
    b = BrokerProcess(os.path.join(space, "tight.sock"),
                      "--max-subscriptions-per-user", "4").start()
    m = UserMount(b.address, os.path.join(space, "tight"))
    try:
        m.start()
        first = subprocess.run([*AS_NOBODY, "sh", "-c", f": > {m / 'k'}"], timeout=10)
        assert first.returncode == 0
        holder, held, err = hold([m / "k"] * 3)
        try:
            assert (held, err) == (2, errno.EDQUOT), m.log()[-3000:]
        finally:
            end(holder)
        deadline = time.monotonic() + 10
        while True:
            again, held, err = hold([m / "k"] * 2)
            end(again)
            if held == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (held, err) == (2, 0)
    finally:
        m.stop()
        b.stop()


def test_listings_one_user_holds_open_are_bounded(mount, bus):
    """Each open directory keeps its listing: nobody's opendir loop on a directory of
    1500 keys ends with EMFILE at its share (2^18 entries, ~175 opens), and root still
    lists it."""
    m = mount("listed")
    deadline = time.monotonic() + 15
    with Client(bus.address) as c:
        # the monitor learns from a sample during floods: publish until it knows all
        # (it drops what does not fit its socket buffer): a hundred at a time
        while not os.path.isdir(m / "l") or len(os.listdir(m / "l")) < 1501:
            assert time.monotonic() < deadline
            known = set(os.listdir(m / "l")) if os.path.isdir(m / "l") else set()
            missing = [i for i in range(1500) if f"k{i}" not in known]
            for at in range(0, len(missing), 100):
                for i in missing[at:at + 100]:
                    c.publish(f"l/k{i}", b"")
                c.sync()
                time.sleep(0.06)
            time.sleep(0.1)
    script = f"""
import os
fds = []
try:
    for n in range(400):
        fds.append(os.open({str(m / 'l')!r}, os.O_RDONLY | os.O_DIRECTORY))
    print(400, 0)
except OSError as e:
    print(len(fds), e.errno)
"""
    held, err, r = counted_as_nobody(script)
    assert err == errno.EMFILE and 150 < held < 200, (held, err)
    assert len(os.listdir(m / "l")) == 1501  # and '**'


def test_names_one_users_lookups_make_are_bounded(mount):
    """Every name the kernel looks up is an inode in the mount until the kernel forgets
    it, and a wildcard name always exists: nobody's stat loop over fresh wildcard
    names ends with EDQUOT at its share, and root still looks names up; the mount
    then has the kernel forget nobody's older names, so it can go on."""
    m = mount("inodes", "--user-inodes", "3000")
    script = f"""
import os
n = 0
try:
    for n in range(5000):
        os.stat({m.path!r} + '/w*%d' % n)
    print(5000, 0)
except OSError as e:
    print(n, e.errno)
"""
    made, err, r = counted_as_nobody(script)
    # (the root directory's inode is nobody's; its own '..' lookups may take a few)
    assert err == errno.EDQUOT and 2990 <= made <= 3000, (made, err, r.stderr)
    assert os.path.isdir(m / "r*fresh")
    # the mount asked the kernel to forget nobody's older names: new ones work again
    script = f"""
import os, time
deadline = time.monotonic() + 5
while True:
    try:
        os.stat({m.path!r} + '/again*')
        break
    except OSError:
        assert time.monotonic() < deadline
        time.sleep(0.05)
for n in range(500):
    os.stat({m.path!r} + '/v*%d' % n)
"""
    subprocess.run([*AS_NOBODY, "python3", "-c", script], check=True, timeout=30)
    # half of its names at most, and at most a batch at once: the loop's work is bounded
    asked = [int(n) for n in re.findall(r"asked the kernel to forget (\d+) of uid 65534",
                                        m.log())]
    assert asked and max(asked) == RECLAIM_BATCH, asked


def test_a_walk_down_wildcard_directories_ends_at_a_patterns_depth_and_its_bytes(mount):
    """nobody goes down ``cd '*'`` as far as it can: ENAMETOOLONG below the 256
    names a pattern may have (no depth limit before: 6,000 deep held 411 MB).  Just
    above, it looks up fresh names until EDQUOT, since each deep name is charged for its path
    (about 2.9 KB at this depth): the mount grew by about its 32 MiB share, not by
    the 65,536-name count share times the depth."""
    m = mount("deep")
    before = rss(m.proc.pid)
    script = f"""
import os
os.chdir({m.path!r})
depth = 0
try:
    while depth < 1000:
        os.chdir('*')
        depth += 1
except OSError as e:
    deep_err = e.errno
else:
    deep_err = 0
os.chdir('..')  # names below 255 wildcards are patterns of 256 segments
n = 0
try:
    for n in range(40000):
        os.stat('x%d' % n)
except OSError as e:
    print(depth, deep_err, n, e.errno)
else:
    print(depth, deep_err, n, 0)
"""
    r = subprocess.run([*AS_NOBODY, "python3", "-c", script], capture_output=True,
                       text=True, timeout=120)
    depth, deep_err, made, err = map(int, r.stdout.split())
    assert (depth, deep_err) == (256, errno.ENAMETOOLONG), r.stderr
    share = UserShare.inode_bytes
    cost = inode_cost((b"*",) * 255 + (b"x10000",))
    assert err == errno.EDQUOT and 0.9 * share / cost < made < share / cost, (made, err)
    grown = rss(m.proc.pid) - before
    assert grown < 1.5 * share, grown
    assert os.path.isdir(m / "r*fresh")  # root still looks names up


def test_inodes_cost_what_they_are_charged():
    """What the mount holds for an inode (tracemalloc: its tables, and its path as a
    lookup builds it from the parent's) stays within `inode_cost`, shallow or deep."""
    import gc
    import tracemalloc

    from sbus.fuse.mapping import Kind
    from sbus.fuse.operations import BusFS

    for depth in (1, 50, 1000):
        fs = BusFS("/nonexistent", share=UserShare(inodes=1 << 30, inode_bytes=1 << 40))
        parent: tuple[bytes, ...] = ()
        for _ in range(depth - 1):
            parent += (b"*",)
            fs._lookups[fs._inode(parent, Kind.DIR, 1)] += 1
        charged = fs._inode_bytes[1]
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(5000):
                fs._lookups[fs._inode(parent + (b"x%d" % n,), Kind.FILE, 1)] += 1
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert used <= fs._inode_bytes[1] - charged, (depth, used)


def test_lookups_below_wildcards_cost_little_however_many_keys_are_remembered(mount, bus):
    """6,000 remembered keys ``t/A/B/C``: nobody's 1,000 lookups of fresh names
    ``t/*/*/*/xN`` are answered from the index of directory names (each walked
    every matching key twice: 6,000 keys cost about 10 s for the 1,000)."""
    m = mount("wide")
    for start in range(0, 6000, 60):  # as fast as the mount's monitor learns
        publish(bus.address, *((b"t/A%d/B%d/C" % (i, i), b"")
                               for i in range(start, start + 60)))
        time.sleep(0.05)
    deadline = time.monotonic() + 20
    while len(os.listdir(m / "t")) < 5500:
        assert time.monotonic() < deadline, len(os.listdir(m / "t"))
        time.sleep(0.1)
    script = f"""
import os, time
t = time.monotonic()
for n in range(1000):
    os.stat({m.path!r} + '/t/*/*/*/x%d' % n)
print(1000, int(1000 * (time.monotonic() - t)))
"""
    count, ms, r = counted_as_nobody(script)
    assert count == 1000 and ms < 3000, (ms, r.stderr)


def test_files_one_user_holds_open_are_bounded(mount):
    """nobody opens one key for writing 5000 times: EMFILE at its share of 4096, and
    root's `echo > key` still goes through."""
    m = mount("files")
    open(m / "w", "wb").close()
    script = f"""
import os, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (6000, 6000))
fds = []
try:
    for n in range(5000):
        fds.append(os.open({str(m / 'w')!r}, os.O_WRONLY))
    print(5000, 0)
except OSError as e:
    print(len(fds), e.errno)
"""
    held, err, r = counted_as_nobody(script)
    assert (held, err) == (4096, errno.EMFILE), (held, err, r.stderr)
    others_go_on(m, "w2")


def test_a_subscription_refused_after_a_reconnect_fails_the_reads(space):
    """Two readers on a mount of nobody's; the broker comes back allowing uid 65534 one
    subscription, so at least one reader's re-subscription is refused: its reads fail
    with EIO instead of waiting on a file subscribed to nothing (after the place of the
    reconnect, told to both as a drop is, ENOBUFS: they read on past it)."""
    b = BrokerProcess(os.path.join(space, "again.sock"),
                      "--max-subscriptions-per-user", "4").start()
    m = UserMount(b.address, os.path.join(space, "again"), "--reconnect-timeout", "30")
    readers: list[subprocess.Popen] = []
    try:
        m.start()
        subprocess.run([*AS_NOBODY, "sh", "-c", f": > {m / 'k'}"], check=True, timeout=10)
        readers = [read_on(m / "k", *AS_NOBODY) for _ in range(2)]
        b.stop()
        b.args = ("--max-subscriptions-per-user", "1")
        b.start()
        deadline = time.monotonic() + 10
        while all(r.poll() is None for r in readers):
            assert time.monotonic() < deadline, m.log()[-2000:]
            time.sleep(0.05)
        failed = next(r for r in readers if r.poll() is not None)
        assert failed.returncode != 0
        assert b"Input/output error" in failed.stderr.read()
    finally:
        for r in readers:
            end(r)
        m.stop()
        b.stop()


# -- intent threads nobody can pin (issue 28) --------------------------------------

# A filesystem whose one file, f (1 MiB), opens and maps but whose reads never answer:
# a page of it mapped into memory is a page that never arrives (a dead NFS server).
HANGING_FS = """
import errno, stat, sys
import pyfuse3, trio
class Hang(pyfuse3.Operations):
    async def getattr(self, inode, ctx=None):
        a = pyfuse3.EntryAttributes()
        a.st_ino, a.st_nlink = inode, 1
        top = inode == pyfuse3.ROOT_INODE
        a.st_mode = stat.S_IFDIR | 0o755 if top else stat.S_IFREG | 0o444
        a.st_size = 0 if top else 1 << 20
        a.entry_timeout = a.attr_timeout = 3600
        return a
    async def lookup(self, parent, name, ctx=None):
        if name != b"f":
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(2)
    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode)
    async def read(self, fh, off, size):
        await trio.sleep_forever()
pyfuse3.init(Hang(), sys.argv[1], {"allow_other", "ro", "fsname=sbus-test-hang"})
trio.run(pyfuse3.main)
"""


class Hanging:
    """A file whose pages never arrive (`HANGING_FS`), and nobody's processes using it."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.users: list[subprocess.Popen] = []

    def nobody(self, script: str, *args: str) -> subprocess.Popen:
        """nobody runs *script*; killed once the filesystem is aborted (before, a thread
        waiting for its page may not even die)."""
        p = subprocess.Popen([*AS_NOBODY, "python3", "-c", script, *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.users.append(p)
        return p


@contextlib.contextmanager
def page_that_never_arrives(space: str) -> Iterator[Hanging]:
    """`HANGING_FS` mounted below *space* for everyone.  On the way out, whatever
    happened, the connection is aborted (every read waiting on it fails, freeing
    whatever waited on those), its users killed and the filesystem unmounted."""
    where = tempfile.mkdtemp(prefix="hang-", dir=space)
    os.chmod(where, 0o755)
    proc = subprocess.Popen([sys.executable, "-c", HANGING_FS, where],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    hanging = Hanging(os.path.join(where, "f"))
    abort = None
    try:
        deadline = time.monotonic() + 15
        while not mounted(where):
            assert proc.poll() is None and time.monotonic() < deadline, \
                proc.stderr.read() if proc.poll() is not None else "not mounted"
            time.sleep(0.02)
        abort = f"/sys/fs/fuse/connections/{os.minor(os.stat(where).st_dev)}/abort"
        yield hanging
    finally:
        if abort is not None and os.path.exists(abort):
            with open(abort, "w") as f:
                f.write("1")
        proc.kill()  # closing /dev/fuse aborts the connection too
        proc.wait()
        for p in hanging.users:
            end(p)
        subprocess.run(["fusermount3", "-u", "-z", where], check=False,
                       stderr=subprocess.DEVNULL)


# nobody's opens (O_CREAT|O_WRONLY) of MNT/TAG<i>/dir/key, in batches at once, each
# path placed so that its NUL is the last byte before a page of the hanging file
# (mapped right after it).  The path starts on a word boundary, so that the kernel's
# word-at-a-time copy of it stops at the NUL too.  Each open is a process of its own
# (a process whose memory a reader is stuck in cannot even map a thread's stack).
# Prints "batch N" before each batch and "i errno seconds" for each open, then "done".
PATHS_AT_THE_EDGE = """
import ctypes, mmap, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.open.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
MAP_FIXED = 0x10
mnt, hanging, tag, *batches = sys.argv[1:]
batches = [int(b) for b in batches]
page, n = mmap.PAGESIZE, sum(batches)
fd = os.open(hanging, os.O_RDONLY)
base = libc.mmap(None, 2 * n * page, mmap.PROT_READ | mmap.PROT_WRITE,
                 mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
paths = []
for i in range(n):
    edge = base + (2 * i + 1) * page
    assert libc.mmap(edge, page, mmap.PROT_READ, mmap.MAP_SHARED | MAP_FIXED, fd, 0) == edge
    path = f"{mnt}/{tag}{i}/dir/key"
    path = f"{mnt}/{'/' * (-(len(path) + 1) % 8)}{tag}{i}/dir/key".encode() + b"\\0"
    ctypes.memmove(edge - len(path), path, len(path))
    paths.append(edge - len(path))
first = 0
for size in batches:
    go_r, go_w = os.pipe()
    children = []
    for i in range(first, first + size):
        pid = os.fork()
        if pid == 0:
            os.close(go_w)
            os.read(go_r, 1)
            start = time.monotonic()
            got = libc.open(paths[i], os.O_CREAT | os.O_WRONLY, 0o600)
            err = ctypes.get_errno() if got < 0 else 0
            os.write(1, f"{i} {err} {time.monotonic() - start:.3f}\\n".encode())
            os._exit(0)
        children.append(pid)
    print("batch", size, flush=True)
    os.close(go_w)  # all of them at once
    for pid in children:
        os.waitpid(pid, 0)
    os.close(go_r)
    first += size
print("done", flush=True)
"""


def task_state(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def stuck_threads(pid: int) -> int:
    """Threads of *pid* in uninterruptible sleep (reading some caller's memory)."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            n += task_state(pid, int(tid)) == "D"
        except (FileNotFoundError, ProcessLookupError):
            pass
    return n


def wait_until(what: Callable[[], bool], why: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.01)


def echo_goes_through(m: Mount, key: str, address: str) -> None:
    """root's `echo x > MNT/KEY` through names nobody knows publishes, at once."""
    sub = subscriber(address, key.encode())
    start = time.monotonic()
    r = subprocess.run(["sh", "-c", f"echo x > {m / key}"], capture_output=True,
                       timeout=15)
    took = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    sub.settimeout(5)
    assert sub.recv(1000) == b"MSG " + key.encode() + b"\0x\n"
    sub.close()
    assert took < 2, took


def test_a_path_before_a_page_that_never_arrives_pins_no_intent_thread(mount, bus, space):
    """nobody creates 12 files through unknown names (8 at once, then 4), each path's NUL
    the last byte before a page that never arrives.  The kernel copied only the path
    and so does the mount's intent check: every open succeeds at once, and root's
    `echo > key` through unknown names publishes at once afterwards.  (Reading PATH_MAX
    bytes, as the check once did, pinned each thread reading such a path for good.)"""
    m = mount("pin-path")
    with page_that_never_arrives(space) as hanging:
        attacker = hanging.nobody(PATHS_AT_THE_EDGE, m.path, hanging.file, "new", "8", "4")
        lines = read_lines(attacker, 15, timeout=20)
        assert lines[0] == b"batch 8\n" and lines[9] == b"batch 4\n"
        assert lines[-1] == b"done\n"
        opens = [line.split() for line in lines[1:9] + lines[10:14]]
        assert sorted(int(i) for i, _, _ in opens) == list(range(12))
        assert [int(e) for _, e, _ in opens] == [0] * 12, opens
        assert max(float(t) for _, _, t in opens) < 2, opens
        wait_until(lambda: stuck_threads(m.proc.pid) == 0,
                   "some of the mount's threads stuck in nobody's memory", 2)
        echo_goes_through(m, "other/dir/key", bus.address)


# nobody's process locks its own memory map against readers: one thread reads a page
# that never arrives through /proc/self/mem (the kernel holds the map's lock for
# reading while it waits for the page), another maps memory (which waits for the lock
# for writing; new readers queue behind it).  Every reader of this process's memory is
# then stuck for good: the mount's intent check of each thread that next opens through
# an unknown name, or anything else of the mount that reads the caller's memory.
# stdin says when to take each step (one byte each): hold, want, then each wave of
# openers (their paths are the arguments after the first two, waves split by "--";
# "r:" before a path opens it for reading).  Prints the two threads' ids, then a
# line per open that returned.
LOCKED_MAP = """
import ctypes, mmap, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
hanging, *rest = sys.argv[1:]
waves = [[]]
for arg in rest:
    if arg == "--":
        waves.append([])
    else:
        waves[-1].append((os.O_RDONLY, arg[2:]) if arg.startswith("r:")
                         else (os.O_CREAT | os.O_WRONLY, arg))
fd = os.open(hanging, os.O_RDONLY)
page = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
mem = os.open("/proc/self/mem", os.O_RDONLY)
steps = [threading.Event() for _ in range(2 + len(waves))]
def hold():
    steps[0].wait()
    try:
        os.pread(mem, 1, page)
    except OSError:
        pass  # the filesystem was aborted
def want():
    steps[1].wait()
    libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
              -1, 0)
def opener(step, flags, path):
    step.wait()
    try:
        os.open(path, flags, 0o600)
    except OSError:
        pass
    os.write(1, b".\\n")
    forever.wait()  # a thread that ends frees memory, which waits for the lock
forever = threading.Event()
threads = [threading.Thread(target=hold), threading.Thread(target=want)]
threads += [threading.Thread(target=opener, args=(steps[2 + w], flags, path))
            for w, wave in enumerate(waves) for flags, path in wave]
for t in threads:
    t.start()
print(threads[0].native_id, threads[1].native_id, flush=True)
for step in steps:
    os.read(0, 1)
    step.set()
os.read(0, 1)
"""


def test_callers_that_lock_their_own_memory_pin_only_their_share(mount, bus, space):
    """nobody locks its memory map so that nothing can read its memory (a thread waits
    for a page that never arrives, holding the map's lock), then 6 threads at once open
    through unknown names, and 3 more after them, and one opens a known key for reading.
    Each question about them is stuck for good, but only in the 2 intent threads of
    nobody's share: every open is answered, and root's `echo > key` through unknown
    names publishes at once.  (With one pool of 4 intent threads for everyone, nobody
    took them all and every user's implicit directories failed for good; with the
    reader's command line read on the event loop, to see whether it is `tail -f`, the
    whole mount stopped answering.)"""
    m = mount("pin-lock")
    for i in range(9):
        os.makedirs(m / f"p{i}", exist_ok=True)  # parents of their own: in parallel
    touch(m, "known/key")
    first = [m / f"p{i}/new/dir/key" for i in range(6)] + ["r:" + m / "known/key"]
    then = [m / f"p{i}/new/dir/key" for i in range(6, 9)]
    with page_that_never_arrives(space) as hanging:
        attacker = hanging.nobody(LOCKED_MAP, hanging.file, *first, "--", *then)
        hold, want = map(int, read_lines(attacker, 1)[0].split())
        for tid, doing in ((hold, "reading the page"), (want, "waiting to map memory")):
            attacker.stdin.write(b".")
            attacker.stdin.flush()
            wait_until(lambda tid=tid: task_state(attacker.pid, tid) == "D",
                       f"nobody's thread {doing} never blocked")
        for wave in (first, then):
            attacker.stdin.write(b".")
            attacker.stdin.flush()
            read_lines(attacker, len(wave))  # each answered (ENOENT) in time
        echo_goes_through(m, "other/dir/key", bus.address)
        share = UserShare().intent_threads
        wait_until(lambda: stuck_threads(m.proc.pid) == share,
                   f"not {share} of the mount's threads stuck in nobody's memory", 2)


# Appends *count* messages to the file given, one per write: with a size, of that many
# bytes each, as fast as it can; else numbered lines, one every 2 ms.
WRITER = """
import os, sys, time
path, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
for n in range(count):
    os.write(fd, b"f" * size if size else b"q%05d" % n)
    if not size:
        time.sleep(0.002)
os.close(fd)
"""


def test_a_writer_flooding_a_slow_subscriber_loses_its_own_messages_not_others(mount, bus):
    """Two users of other UIDs write through one root mount to a subscriber that does
    not read: the mount tells the broker whose each message is (``publisher/for``), so
    the broker's share of the full queue is per writer, not one for the whole mount.
    The quiet writer's 300 numbered messages all arrive, in order; the flooder's are
    dropped (counted).  Before, the mount's writers held one share: most of the quiet
    writer's messages were lost with the flood's."""
    m = mount("writers")
    os.makedirs(m / "w", exist_ok=True)
    slow = subscriber(bus.address, b"w/")
    flood = subprocess.Popen([*AS_NOBODY, "python3", "-c", WRITER, str(m / "w/flood"),
                              "3000", "4000"])
    time.sleep(0.5)  # the queue is full by now
    quiet = subprocess.run(["setpriv", "--reuid=65532", "--regid=65532", "--clear-groups",
                            "python3", "-c", WRITER, str(m / "w/quiet"), "300", "0"],
                           timeout=60, capture_output=True, text=True)
    assert quiet.returncode == 0, quiet.stderr
    assert flood.wait(120) == 0
    got, dropped = read_until_quiet(slow, b"w/quiet")
    assert got == [b"q%05d" % n for n in range(300)], f"{len(got)} of 300 arrived"
    assert dropped > 500  # the flood's, reported


def test_a_cancelled_naming_is_made_again_before_the_next_users_message(space):
    """The mount's publisher named a writer (``publisher/for``) and recorded it before
    the packet went; a write cancelled while the socket was full (the broker stalled)
    left the broker counting the previous writer, and the next writes of the new one
    were charged to that other user.  Driven on `MountBus` itself against a real broker
    stopped with SIGSTOP; the broker's status says whose the publisher's messages are."""
    from sbus.fuse.bus import MountBus
    from sbus.fuse.mapping import KnownTree

    bus = broker_in(tempfile.mkdtemp(dir=space))  # a broker of its own: it is stopped
    broker = next(bus)
    victim, attacker = 65532, 65534

    async def open_mount_bus(nursery) -> MountBus:
        mb = MountBus(broker.address, "raw", KnownTree(), 256 << 10, 5.0)
        await mb.start(nursery)
        return mb

    try:
        assert named_after_a_cut_send(
            broker.proc, broker.address, open_mount_bus,
            lambda mb, body, uid: mb.publish(b"MSG t/x\0" + body, uid),
            victim, attacker) == attacker
    finally:
        next(bus, None)


def test_keys_too_large_to_remember_are_not_remembered_nor_held(mount, bus):
    """Any user of the bus publishes keys of 80,000 segments: each cost 36 MB of the
    mount's 16 MiB of remembered keys, so one pushed out every other key and stayed,
    and the monitor's cache of split keys held 3.7 MB for each (40 took the mount from
    43 to 222 MB).  Now such a key is not remembered (nor even split): root's own keys
    stay, and the mount holds what it held."""
    m = mount("bigkeys")
    os.makedirs(m / "mine", exist_ok=True)
    open(m / "mine/k", "wb").close()
    publish(bus.address, (b"mine/k", b"seen on the bus"))
    deadline = time.monotonic() + 5
    while not os.path.exists(m / "mine/k"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = rss(m.proc.pid)
    script = f"""
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect({bus.address!r})
for n in range(40):
    s.send(b"MSG " + b"/".join(b"%d" % (n % 10) for _ in range(80000)) + b"\\0x")
s.send(b"CMSG !/cred/whoami")
s.recv(100)
print(40, 0)
"""
    assert counted_as_nobody(script)[:2] == (40, 0)
    time.sleep(1.5)  # the monitor has seen them all
    grown = rss(m.proc.pid) - before
    assert grown < 30 << 20, grown
    assert os.path.exists(m / "mine/k")  # remembered still (was pushed out)
