"""The pure parts of the FUSE mount: path mapping, known-name tree, framing, signals."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbus.fuse import mapping
from sbus.fuse.framing import Outbox, dropped_frame, frame
from sbus.fuse.mapping import Kind, KnownTree, Refused, lookup, pattern_of
from sbus.fuse.signals import interrupted, pending_from_status, unblocked_pending
from sbus.routing import matches

OWN = (b"100", b"1000", b"4242")


def p(text: str) -> tuple[bytes, ...]:
    return tuple(s.encode() for s in text.split("/")) if text else ()


def decide(tree: KnownTree, parent: str, name: str, caller_ok: bool = True) -> Kind:
    return lookup(tree, p(parent), name.encode(), OWN, caller_ok)


def refused(tree: KnownTree, parent: str, name: str, caller_ok: bool = True) -> int:
    with pytest.raises(Refused) as info:
        decide(tree, parent, name, caller_ok)
    return info.value.errno


# -- paths to patterns -----------------------------------------------------------

@pytest.mark.parametrize("path, pattern", [
    ("a/b/c", b"a/b/c"),
    ("a/*/c", b"a/*/c"),
    ("a/*/**", b"a/*/"),
    ("**", b""),
    ("a/b/!", b"a/b"),
    ("a/*/!", b"a/*"),
    ("!/cred/1/2/3/x", b"!/cred/1/2/3/x"),
    ("!/cred/1/2/3/**", b"!/cred/1/2/3/"),
])
def test_pattern_of(path: str, pattern: bytes) -> None:
    assert pattern_of(p(path)) == pattern


def test_only_plain_keys_are_writable() -> None:
    assert not mapping.is_pattern(b"a/b/c")
    assert mapping.is_pattern(b"a/*/c")
    assert mapping.is_pattern(b"a/")
    assert mapping.is_pattern(b"")


def test_key_segments_rejects_unnameable_keys() -> None:
    assert mapping.key_segments(b"a/b") == (b"a", b"b")
    assert mapping.key_segments(b"!/cred/1/2/3/x") == p("!/cred/1/2/3/x")
    for key in (b"a//b", b"/a", b"a/", b"a/../b", b"a/*/b", b"a/!/b", b"a/**", b"!/cred/x/2/3/y",
                b"!/cred/1/2/3"):
        assert mapping.key_segments(key) is None, key


# -- lookups ---------------------------------------------------------------------

def test_unknown_names_are_absent_so_echo_creates() -> None:
    tree = KnownTree()
    assert refused(tree, "", "nothing") == errno.ENOENT
    assert refused(tree, "a", "b") == errno.ENOENT


def test_mkdir_and_learned_keys() -> None:
    tree = KnownTree()
    tree.mkdir(p("made/here"))
    tree.learn(p("live/x/y"))
    assert decide(tree, "", "made") is Kind.DIR
    assert decide(tree, "made", "here") is Kind.DIR
    assert decide(tree, "live/x", "y") is Kind.FILE
    assert decide(tree, "live", "x") is Kind.DIR
    assert tree.entries(()) == [(b"live", Kind.DIR), (b"made", Kind.DIR), (b"**", Kind.FILE)]


def test_reserved_names() -> None:
    tree = KnownTree()
    assert decide(tree, "a", "*") is Kind.DIR
    assert decide(tree, "a", "x*") is Kind.DIR
    assert decide(tree, "a/*", "**") is Kind.FILE
    assert decide(tree, "", "**") is Kind.FILE
    assert decide(tree, "a", "!") is Kind.FILE
    assert decide(tree, "", "!") is Kind.DIR  # the secret key space


def test_names_below_wildcards_are_files_unless_known_as_prefix() -> None:
    tree = KnownTree()
    assert decide(tree, "a/*", "c") is Kind.FILE
    tree.learn(p("a/x/c/d"))
    assert decide(tree, "a/*", "c") is Kind.DIR  # 'a/*/c' is a prefix of a live key
    assert decide(tree, "a/x*", "c") is Kind.DIR
    assert decide(tree, "a/y*", "c") is Kind.FILE
    assert tree.entries(p("a/*")) == [(b"**", Kind.FILE)]  # wildcard directories: only how to read


def test_a_fresh_name_below_wildcards_is_decided_without_walking_the_keys() -> None:
    """10,000 remembered keys all match ``t/*/*/*``: a name none of them has below is a
    file at once, and known prefixes are still found at once (the work is counted)."""
    tree = KnownTree(max_bytes=64 << 20)
    for i in range(10000):
        tree.learn(p(f"t/A{i}/B{i}/C"))
    assert len(tree) == 10000
    before = tree.visited
    for n in range(100):
        assert decide(tree, "t/*/*/*", f"x{n}") is Kind.FILE
        assert decide(tree, "t/*/*", "C") is Kind.FILE  # a key, no prefix
    assert tree.visited == before
    assert decide(tree, "t/*", "B7") is Kind.DIR
    assert decide(tree, "t/A*", "B7") is Kind.DIR
    assert decide(tree, "*/*", "B7") is Kind.DIR
    assert decide(tree, "t/B*", "B7") is Kind.FILE
    assert decide(tree, "*", "B7") is Kind.FILE
    assert decide(tree, "t/*/*", "B7") is Kind.FILE
    assert tree.visited - before < 50


def test_the_work_of_one_lookup_below_wildcards_is_bounded() -> None:
    """Keys laid out so that neither way is short (5,000 directories named 'n' below
    'a', 5,000 names below 'u'): one lookup of 'u/*/n' looks at no more than twice
    LOOKUP_WORK nodes and answers a directory, whose '!' still reads 'u/*/n'."""
    tree = KnownTree(max_bytes=64 << 20)
    for i in range(5000):
        tree.learn(p(f"a/X{i}/n/z"))
        tree.learn(p(f"u/Y{i}/q"))
    before = tree.visited
    assert decide(tree, "u/*", "n") is Kind.DIR
    assert 0 < tree.visited - before <= 2 * mapping.LOOKUP_WORK
    assert decide(tree, "u/*/n", "!") is Kind.FILE
    before = tree.visited
    assert decide(tree, "a/*", "n") is Kind.DIR  # found by either way: exact
    assert decide(tree, "a/*", "q") is Kind.FILE  # no directory 'q' anywhere
    assert tree.visited - before < 10


WILD_SEGS = ["a", "b", "ab", "*", "a*", "*b"]


def _fits(pattern: tuple[bytes, ...], path: tuple[bytes, ...]) -> bool:
    for want, seg in zip(pattern, path, strict=True):
        head, star, tail = want.partition(b"*")
        if not star and want != seg:
            return False
        if star and (tail.strip(b"*") or not seg.startswith(head)):
            return False
    return True


@given(st.lists(st.tuples(st.sampled_from(["learn", "forget", "mkdir", "rmdir"]),
                          st.lists(st.sampled_from(["a", "b", "ab"]), min_size=1, max_size=3)),
                max_size=40))
def test_directories_below_wildcards_are_what_the_remembered_names_make(ops) -> None:
    """Through learning, forgetting (also the oldest, at capacity), mkdir and rmdir, a
    path with wildcards is a directory exactly when a remembered key goes on below a
    match of it or a made directory is (or is below) one."""
    import itertools

    tree = KnownTree(capacity=4)
    made: set[tuple[bytes, ...]] = set()
    for op, segs in ops:
        path = tuple(s.encode() for s in segs)
        if op == "learn":
            tree.learn(path)
        elif op == "forget":
            tree.forget(path)
        elif op == "mkdir":
            tree.mkdir(path)
            made.add(path)
        elif tree.rmdir(path):
            made.discard(path)
    keys = list(tree._keys)
    for depth in (1, 2, 3):
        for segs in itertools.product(WILD_SEGS, repeat=depth):
            pattern = tuple(s.encode() for s in segs)
            want = (any(len(k) > depth and _fits(pattern, k[:depth]) for k in keys)
                    or any(len(d) >= depth and _fits(pattern, d[:depth]) for d in made))
            assert tree.is_dir(pattern) is want, (pattern, keys, made)


def test_wildcard_paths_end_where_a_subscription_pattern_must() -> None:
    """A pattern has at most 256 segments, so a wildcard path of more names is
    ENAMETOOLONG (which bounds how deep ``cd '*'`` goes); '!' in the deepest wildcard
    directory still reads its pattern, and deeper keys keep their plain paths."""
    tree = KnownTree()
    stars = "/".join(["*"] * 255)
    assert decide(tree, stars, "*") is Kind.DIR  # 256 names
    assert decide(tree, stars, "x") is Kind.FILE
    assert decide(tree, stars, "**") is Kind.FILE  # pattern of 256 segments
    assert decide(tree, stars + "/*", "!") is Kind.FILE
    for name in ("*", "x", "**"):
        assert refused(tree, stars + "/*", name) == errno.ENAMETOOLONG
    assert refused(tree, "a/" + stars, "x") == errno.ENAMETOOLONG
    deep = [f"k{i}" for i in range(300)]
    tree.learn(p("/".join(deep)))
    assert decide(tree, "/".join(deep[:280]), "k280") is Kind.DIR
    assert decide(tree, "/".join(deep[:299]), "k299") is Kind.FILE


def test_key_that_is_also_a_prefix_is_reached_through_self_name() -> None:
    tree = KnownTree()
    tree.learn(p("p/q"))
    assert decide(tree, "p", "q") is Kind.FILE
    tree.learn(p("p/q/r"))
    assert decide(tree, "p", "q") is Kind.DIR
    assert tree.entries(p("p/q")) == [(b"!", Kind.FILE), (b"r", Kind.FILE), (b"**", Kind.FILE)]
    assert pattern_of(p("p/q/!")) == b"p/q"


def test_lru_memory_is_bounded() -> None:
    tree = KnownTree(capacity=3)
    for k in ("k/1", "k/2", "k/3"):
        tree.learn(p(k))
    tree.learn(p("k/1"))  # refresh: k/2 is now the oldest
    tree.learn(p("k/4"))
    assert len(tree) == 3
    assert [n for n, _ in tree.entries(p("k"))] == [b"1", b"3", b"4", b"**"]
    for k in ("x/1", "x/2", "x/3"):
        tree.learn(p(k))
    assert refused(tree, "", "k") == errno.ENOENT  # pruned entirely


def test_forget_and_rmdir() -> None:
    tree = KnownTree()
    tree.learn(p("a/b"))
    tree.mkdir(p("a/d"))
    assert tree.forget(p("a/b")) and not tree.forget(p("a/b"))
    assert tree.rmdir(p("a/d")) and not tree.rmdir(p("a/d"))
    assert tree.entries(()) == [(b"**", Kind.FILE)]


def test_secret_paths_only_for_own_credentials() -> None:
    tree = KnownTree()
    assert decide(tree, "!", "cred") is Kind.DIR
    assert refused(tree, "!", "other") == errno.ENOENT
    assert decide(tree, "!/cred", "100") is Kind.DIR
    assert decide(tree, "!/cred/100/1000", "4242") is Kind.DIR
    assert refused(tree, "!/cred/100/1000", "4243") == errno.EACCES
    assert refused(tree, "!/cred/100/1000", "4242", caller_ok=False) == errno.EACCES
    assert refused(tree, "!/cred/100/1000/7", "x") == errno.EACCES
    assert decide(tree, "!/cred/100/1000/4242", "**") is Kind.FILE
    assert refused(tree, "!/cred/100/1000/4242", "!") == errno.ENOENT
    assert refused(tree, "!/cred/100/1000/4242", "x") == errno.ENOENT
    tree.learn(p("!/cred/100/1000/4242/x"))
    assert decide(tree, "!/cred/100/1000/4242", "x") is Kind.FILE


def test_creatable() -> None:
    mapping.creatable(p("a"), b"b")
    for parent, name, code in [("a", "*", errno.EEXIST), ("a", "!", errno.EEXIST),
                               ("a", "**", errno.EEXIST), ("a/*", "b", errno.EACCES),
                               ("!/cred", "5", errno.EACCES)]:
        with pytest.raises(Refused) as info:
            mapping.creatable(p(parent), name.encode())
        assert info.value.errno == code


segment = st.sampled_from([b"a", b"b", b"c"])
wild = st.sampled_from([b"a", b"b", b"*"])


@given(key=st.lists(segment, min_size=1, max_size=4),
       pat=st.lists(wild, min_size=1, max_size=4), trailing=st.booleans())
def test_file_paths_subscribe_to_what_the_protocol_matches(key, pat, trailing) -> None:
    """A path's pattern, fed to the protocol matcher, agrees with reading the pattern
    directly: the mapping adds or loses nothing."""
    path = tuple(pat) + ((b"**",) if trailing else ())
    pattern = b"/".join(pat) + (b"/" if trailing else b"")
    assert pattern_of(path) == pattern
    assert matches(pattern_of(path), b"/".join(key)) == matches(pattern, b"/".join(key))


# -- framing ---------------------------------------------------------------------

def test_lines_framing_adds_a_newline_only_when_missing() -> None:
    assert frame("lines", b"k", b"hi\n", 0) == b"hi\n"
    assert frame("lines", b"k", b"hi", 0) == b"hi\n"
    assert frame("lines", b"k", b"", 0) == b"\n"
    assert frame("raw", b"k", b"hi", 0) == b"hi"


def test_jsonl_framing() -> None:
    rec = json.loads(frame("jsonl", b"a/b", b"hi", 12.5))
    assert rec == {"key": "a/b", "payload": "hi", "time": 12.5}
    rec = json.loads(frame("jsonl", b"a/b", b"\xff\x00", 1))
    assert rec["payload_base64"] == "/wA=" and "payload" not in rec
    line = frame("jsonl", "h/c1\x9bx\u202eY".encode(), "é\x1b]0;x\x07".encode(), 1)
    assert line.isascii() and b"\x1b" not in line  # nothing a terminal acts on
    assert json.loads(line) == {"key": "h/c1\x9bx\u202eY", "payload": "é\x1b]0;x\x07",
                                "time": 1}
    with pytest.raises(ValueError):
        frame("xml", b"k", b"", 0)


def test_outbox_fills_reads_across_messages_and_continues_long_ones() -> None:
    box = Outbox()
    for m in (b"aaaa\n", b"bb\n", b"cccccccc\n"):
        box.push(m)
    assert box.take(7) == b"aaaa\nbb"
    assert box.take(4) == b"\nccc"
    assert box.nbytes == 6
    assert box.take(100) == b"ccccc\n"
    assert not box and box.nbytes == 0 and box.take(10) == b""


def test_outbox_raw_keeps_message_boundaries() -> None:
    box = Outbox(one_per_read=True)
    box.push(b"first")
    box.push(b"")  # nothing to show: skipped
    box.push(b"second")
    assert box.take(100) == b"first"
    assert box.take(3) == b"sec"
    assert box.take(100) == b"ond"
    assert not box


@given(st.lists(st.binary(min_size=1, max_size=50), max_size=20),
       st.lists(st.integers(1, 64), min_size=1, max_size=10))
def test_outbox_loses_and_reorders_nothing(messages, sizes) -> None:
    box = Outbox()
    for m in messages:
        box.push(m)
    out = []
    i = 0
    while box:
        out.append(box.take(sizes[i % len(sizes)]))
        i += 1
    assert b"".join(out) == b"".join(messages)
    assert box.nbytes == 0


def test_a_gap_stops_the_read_that_reaches_it_and_is_told_once() -> None:
    """Messages the broker dropped for a reader: the reads before the place deliver what
    came before it (never across it), the read there learns of the gap (ENOBUFS in the
    mount), and the next one goes on after it; gaps in a row are told as one."""
    for box in (Outbox(), Outbox(one_per_read=True)):
        box.push(b"a\n")
        box.push_gap(3)
        box.push_gap(2)
        box.push(b"b\n")
        assert box.take(100) == b"a\n"
        assert box and box.take(100) == b"" and box.nbytes == 2
        assert box.gap() == 5 and box.gap() is False
        assert box.take(100) == b"b\n" and not box
    box = Outbox()
    box.push_gap(None)  # a reconnect: how many were missed is not known
    box.push_gap(2)
    assert box.gap() is None and box.gap() is False
    box = Outbox()
    box.push(b"long message\n")
    box.push_gap(1)
    assert box.take(4) == b"long" and box.take(100) == b" message\n" and box.gap() == 1
    assert dropped_frame(7, 1.5) == b'{"dropped": 7, "time": 1.5}\n'
    assert dropped_frame(None, 2) == b'{"dropped": null, "time": 2}\n'


# -- signals ---------------------------------------------------------------------

STATUS = """Name:\tcat
SigQ:\t0/31348
SigPnd:\t0000000000000000
ShdPnd:\t{shd}
SigBlk:\t{blk}
SigIgn:\t0000000000000000
"""


def test_pending_from_status() -> None:
    sigint = 1 << (signal.SIGINT - 1)
    assert pending_from_status(STATUS.format(shd=f"{sigint:016x}", blk="0" * 16)) == sigint
    assert pending_from_status(STATUS.format(shd=f"{sigint:016x}", blk=f"{sigint:016x}")) == 0
    assert pending_from_status(STATUS.format(shd="0" * 16, blk="0" * 16)) == 0
    tstp = 1 << (signal.SIGTSTP - 1)
    assert pending_from_status(STATUS.format(shd=f"{tstp:016x}", blk="0" * 16)) == 0
    caught = STATUS.format(shd=f"{tstp:016x}", blk="0" * 16) + f"SigCgt:\t{tstp:016x}\n"
    assert pending_from_status(caught) == tstp  # a handler runs: the call should end


def test_real_process_pending_signal() -> None:
    """A child that blocks SIGUSR1 and has one pending shows it; unblocked it would not
    be pending, and a vanished process counts as interrupted."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: block SIGUSR1, handle SIGUSR2, say so, wait to be killed
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        signal.signal(signal.SIGUSR2, lambda *a: None)
        os.write(w, b"x")
        while True:
            signal.pause()
    try:
        os.read(r, 1)
        assert unblocked_pending(pid) == 0 and not interrupted(pid)
        os.kill(pid, signal.SIGUSR1)
        assert unblocked_pending(pid) == 0  # pending but blocked: the call is not ended
        os.kill(pid, signal.SIGSTOP)  # a stopped process keeps a caught signal pending
        deadline = time.monotonic() + 5
        while not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("T"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(pid, signal.SIGUSR2)
        assert unblocked_pending(pid) == 1 << (signal.SIGUSR2 - 1)
        assert interrupted(pid)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    assert not interrupted(pid)  # gone: nobody to ask, so keep waiting
    assert not interrupted(0)


def test_thread_group_of_a_thread() -> None:
    import threading

    from sbus.fuse.signals import thread_group

    tids = []
    t = threading.Thread(target=lambda: tids.append(threading.get_native_id()))
    t.start()
    t.join()
    assert thread_group(os.getpid()) == os.getpid()
    assert not interrupted(tids[0], os.getpid())  # thread gone, process asked instead


def test_remembered_keys_are_bounded_in_bytes_and_cost_what_they_are_charged():
    """A publisher of many long, deep keys cannot make the mount hold more than
    max_bytes: the charge covers what tracemalloc sees the tree allocate."""
    import gc
    import tracemalloc

    tree = KnownTree(capacity=100_000, max_bytes=2 << 20)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(3000):
            tree.learn(tuple(b"s%d_%d" % (i, j) for j in range(i % 60 + 1)))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tree.held <= 2 << 20 and len(tree) < 3000
    assert used <= tree.held


# -- implicit directories: is the caller creating a file below a name? --------------

from sbus.fuse import intent  # noqa: E402
from sbus.fuse.intent import Call, absolute, continues_below, parse_syscall  # noqa: E402

MNT = (b"/tmp/m",)


@pytest.mark.parametrize("line, call", [
    # open("…", O_WRONLY|O_CREAT|O_TRUNC, 0666)
    ("2 0x7ffd10 0x241 0x1b6 0x0 0x0 0x0 0x7ffd00 0x7f0000", Call(0x7ffd10, None, 0x241)),
    # openat(AT_FDCWD, …): glibc's -100, with or without sign extension
    ("257 0xffffff9c 0x5581 0x241 0x1b6 0x0 0x0 0x7ffd 0x7f", Call(0x5581, None, 0x241)),
    ("257 0xffffffffffffff9c 0x5581 0x41 0x1b6 0x0 0x0 0x7ffd 0x7f", Call(0x5581, None, 0x41)),
    # openat(3, …): relative to descriptor 3
    ("257 0x3 0x5581 0x241 0x1b6 0x0 0x0 0x7ffd 0x7f", Call(0x5581, 3, 0x241)),
    # creat(path, mode): O_CREAT|O_WRONLY|O_TRUNC implied
    ("85 0x5581 0x1b6 0x0 0x0 0x0 0x0 0x7ffd 0x7f",
     Call(0x5581, None, os.O_CREAT | os.O_WRONLY | os.O_TRUNC)),
    # openat2(AT_FDCWD, path, &how, 24): flags are read from how
    ("437 0xffffff9c 0x5581 0x7ffd20 0x18 0x0 0x0 0x7ffd 0x7f", Call(0x5581, None, None, 0x7ffd20)),
    ("0 0x3 0x5581 0x1000 0x0 0x0 0x0 0x7ffd 0x7f", None),  # read(2)
    ("4 0x5581 0x7ffd20 0x0 0x0 0x0 0x0 0x7ffd 0x7f", None),  # stat(2)
    ("-1 0x7ffd 0x7f", None),  # not in a system call
    ("running", None),
    ("", None),
    ("257 0xzz 0x5581", None),
])
def test_parse_syscall_line(line, call):
    assert parse_syscall(line, "x86_64") == call


def test_parse_syscall_knows_only_its_machines_numbers():
    assert parse_syscall("56 0xffffff9c 0x55 0x241 0x1b6 0x0 0x0 0x7f 0x7f", "aarch64") == \
        Call(0x55, None, 0x241)
    assert parse_syscall("2 0x55 0x241 0x1b6 0x0 0x0 0x0 0x7f 0x7f", "aarch64") is None
    assert parse_syscall("257 0xffffff9c 0x55 0x241 0x1b6 0x0 0x0 0x7f 0x7f", "mips") is None


@pytest.mark.parametrize("path, base, root, full", [
    (b"a/b/c", b"/tmp/m", b"/", b"/tmp/m/a/b/c"),  # relative: below the cwd or dirfd
    (b"./a//b/c", b"/tmp/m/", b"/", b"/tmp/m/./a//b/c"),
    (b"/tmp/m/a/c", b"/ignored", b"/", b"/tmp/m/a/c"),  # absolute: below the root
    (b"/m/a/c", b"/ignored", b"/srv/jail", b"/srv/jail/m/a/c"),  # a chrooted caller
])
def test_absolute_paths(path, base, root, full):
    assert absolute(path, base, root) == full


@pytest.mark.parametrize("path, parent, name, below", [
    (b"/tmp/m/a/b/c", "", "a", True),
    (b"/tmp/m/a/b/c", "a", "b", True),
    (b"/tmp/m/a/b/c", "a/b", "c", False),  # the last name: the file being created
    (b"/tmp/m/./a//b/c", "a", "b", True),
    (b"/tmp/m/a/b/c", "x", "b", False),  # another path
    (b"/tmp/m/a/b/c", "", "b", False),
    (b"/tmp/other/a/b/c", "", "a", False),  # not on this mount
    (b"/tmp/mm/a/b/c", "", "a", False),
    (b"/tmp/m/x/../a/b/c", "", "a", False),  # '..' could climb out of a symlink
    (b"/tmp/m/a/b/../c", "", "a", False),
    (b"/tmp/m", "", "tmp", False),
])
def test_continues_below(path, parent, name, below):
    assert continues_below(path, MNT, p(parent), name.encode()) is below


def test_continues_below_the_mount_point_as_given_or_resolved():
    both = (b"/var/run/m", b"/run/m")
    assert continues_below(b"/run/m/a/b", both, (), b"a")
    assert continues_below(b"/var/run/m/a/b", both, (), b"a")
    assert not continues_below(b"/run/m/a/b", (), (), b"a")  # mount point unknown


def _blocked_in_open(tmp_path, code: str) -> subprocess.Popen:
    """A real process blocked inside an open call: opening a FIFO for writing waits
    for a reader, so its /proc entries show the call as a FUSE lookup would."""
    os.mkfifo(tmp_path / "d" / "fifo")
    proc = subprocess.Popen([sys.executable, "-c", "import os, ctypes, sys\n"
                             "sys.stdout.write('go\\n'); sys.stdout.flush()\n" + code],
                            cwd=tmp_path, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"go\n"
    deadline = time.monotonic() + 10
    seen = ""
    while True:  # the same open call, sleeping, twice in a row
        with open(f"/proc/{proc.pid}/syscall") as f:
            now = f.read()
        with open(f"/proc/{proc.pid}/stat") as f:
            sleeping = f.read().rsplit(")", 1)[1].split()[0] == "S"
        if sleeping and now == seen and now.split()[0] in ("2", "257", "437", "56"):
            return proc
        seen = now if sleeping else ""
        assert time.monotonic() < deadline, f"the child never blocked in open: {now}"
        time.sleep(0.05)


def _release(tmp_path, proc: subprocess.Popen) -> None:
    fd = os.open(tmp_path / "d" / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert proc.wait(10) == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("code, created", [
    ("os.open('d/fifo', os.O_WRONLY | os.O_CREAT)", "d/fifo"),  # relative to the cwd
    ("d = os.open('d', os.O_RDONLY)\nos.open('fifo', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
     "d/fifo"),  # openat with a descriptor: below /proc/PID/fd/N
    ("os.open(os.path.abspath('d/fifo'), os.O_WRONLY | os.O_CREAT)", "d/fifo"),
    ("os.open('d/fifo', os.O_WRONLY)", None),  # no O_CREAT: not creating anything
    # openat2(AT_FDCWD, "d/fifo", {flags: O_WRONLY|O_CREAT}, 24)
    ("libc = ctypes.CDLL(None, use_errno=True)\n"
     "how = (ctypes.c_uint64 * 3)(os.O_WRONLY | os.O_CREAT, 0o600, 0)\n"
     "assert libc.syscall(437, -100, b'd/fifo', ctypes.byref(how), 24) >= 0", "d/fifo"),
])
def test_creating_reads_the_blocked_call_from_proc(tmp_path, code, created):
    (tmp_path / "d").mkdir()
    proc = _blocked_in_open(tmp_path, code)
    try:
        got = intent.creating(proc.pid)
    finally:
        _release(tmp_path, proc)
    want = None if created is None else os.fsencode(os.path.realpath(tmp_path / created))
    assert got == want


def test_creating_is_none_for_unknown_or_idle_threads():
    assert intent.creating(0) is None  # the kernel itself
    assert intent.creating(os.getpid()) is None  # running, reading its own syscall
    assert intent.creating(2**22 + 12345) is None  # no such thread


def test_the_path_is_read_without_touching_a_byte_past_it(monkeypatch):
    """The intent check reads the caller's path a page at a time up to its NUL: the
    page after it may never arrive (a file mapped from a dead NFS server) and would
    pin the reading thread.  Read from this process's own memory."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    area = mmap.mmap(-1, 3 * page)
    path = b"/mnt/a/b/c"
    at = 2 * page - len(path) - 1  # ends, NUL included, on the last byte of page 1
    area[at:at + len(path) + 1] = path + b"\0"
    base = ctypes.addressof(ctypes.c_char.from_buffer(area))
    reads = []
    real = os.pread

    def pread(fd, size, offset):
        reads.append((offset, size))
        return real(fd, size, offset)

    monkeypatch.setattr(os, "pread", pread)
    try:
        assert intent._read_string(os.getpid(), base + at) == path
        assert all(off + size <= base + 2 * page for off, size in reads), reads
        # a path crossing a page boundary is read on into the next page, no further
        reads.clear()
        at = page - 4
        area[at:at + len(path) + 1] = path + b"\0"
        assert intent._read_string(os.getpid(), base + at) == path
        assert len(reads) == 2 and reads[-1][0] + reads[-1][1] <= base + 2 * page
    finally:
        monkeypatch.undo()
        del base
        area.close()


def test_a_key_too_large_to_remember_pushes_out_nothing() -> None:
    """A key costing more than a sixteenth of what the tree may hold is not learned:
    it once pushed out every other key and then stayed alone over the bound."""
    from sbus.fuse.mapping import LARGEST_KEY_PART, key_cost, raw_key_cost

    tree = KnownTree(max_bytes=1 << 20)
    assert tree.learn(p("a/b"))
    huge = tuple(b"x" for _ in range((1 << 20) // LARGEST_KEY_PART // 450))
    assert not tree.fits(key_cost(huge)) and not tree.learn(huge)
    assert tree.is_key(p("a/b")) and tree.held == key_cost(p("a/b"))
    key = b"/".join(huge)
    assert raw_key_cost(key) >= key_cost(huge)


def test_refusals_are_logged_rationed_per_user_and_kind(caplog) -> None:
    """A user retrying a refused request cannot flood the log (1,400 lines a second in
    the audit of 2026-11-28), and running into another share still names it."""
    from sbus.fuse.bus import MountBus

    bus = MountBus("/nowhere", "lines", mapping.KnownTree(10, 1 << 20, 1 << 20), 1024, 1.0)
    with caplog.at_level("INFO", logger="sbus.fuse"):
        for _ in range(1000):
            bus.refused("uid %d waits in too many requests; answering EAGAIN", 7)
        bus.refused("uid %d holds %d open readers (its share); answering EMFILE", 7, 32)
        bus.refused("uid %d waits in too many requests; answering EAGAIN", 8)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 12, lines
    assert lines[10] == "uid 7 holds 32 open readers (its share); answering EMFILE"
    assert lines[11] == "uid 8 waits in too many requests; answering EAGAIN"
