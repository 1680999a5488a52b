"""The pure parts of the FUSE mount: path mapping, known-name tree, framing, signals."""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sbus.fuse import mapping
from sbus.fuse.framing import Outbox, frame
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
    assert tree.entries(()) == [(b"live", Kind.DIR), (b"made", Kind.DIR)]


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
    assert tree.entries(p("a/*")) == []  # wildcard directories list nothing


def test_key_that_is_also_a_prefix_is_reached_through_self_name() -> None:
    tree = KnownTree()
    tree.learn(p("p/q"))
    assert decide(tree, "p", "q") is Kind.FILE
    tree.learn(p("p/q/r"))
    assert decide(tree, "p", "q") is Kind.DIR
    assert tree.entries(p("p/q")) == [(b"!", Kind.FILE), (b"r", Kind.FILE)]
    assert pattern_of(p("p/q/!")) == b"p/q"


def test_lru_memory_is_bounded() -> None:
    tree = KnownTree(capacity=3)
    for k in ("k/1", "k/2", "k/3"):
        tree.learn(p(k))
    tree.learn(p("k/1"))  # refresh: k/2 is now the oldest
    tree.learn(p("k/4"))
    assert len(tree) == 3
    assert [n for n, _ in tree.entries(p("k"))] == [b"1", b"3", b"4"]
    for k in ("x/1", "x/2", "x/3"):
        tree.learn(p(k))
    assert refused(tree, "", "k") == errno.ENOENT  # pruned entirely


def test_forget_and_rmdir() -> None:
    tree = KnownTree()
    tree.learn(p("a/b"))
    tree.mkdir(p("a/d"))
    assert tree.forget(p("a/b")) and not tree.forget(p("a/b"))
    assert tree.rmdir(p("a/d")) and not tree.rmdir(p("a/d"))
    assert tree.entries(()) == []


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
