"""The mount as the design card promises it (issue 27), on real mounts: subscribing on a
fresh bus, one file written = one message, ``tail -f``, per-open formats, and fair
shares of the request pool between users (issue 28)."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import time

import pytest
from conftest import SBUS, BrokerProcess
from faultkit import cpu_seconds, until
from test_fuse import (
    ENV,
    Mount,
    broker_in,
    cat,
    default_sigint,
    end,
    mounted,
    read_lines,
    space_dir,
    subscriber,
    wait_in_fuse,
    wait_open,
    waiting_in_fuse,
)

NOBODY = 65534
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
LIMIT = 256 * 1024  # the broker's (and the mount's) default packet limit


@pytest.fixture(scope="module")
def space():
    yield from space_dir("sbus-fuse-files-")


@pytest.fixture(scope="module")
def bus(space):
    yield from broker_in(space)


@pytest.fixture(scope="module")
def mnt(bus, space):
    m = Mount(bus.address, os.path.join(space, "mnt"), "--allow-other").start()
    yield m
    m.stop()


class UserMount(Mount):
    """``sbus mount`` run by an unprivileged user (fusermount3 mounts it)."""

    def start(self) -> Mount:
        os.makedirs(self.path, exist_ok=True)
        os.chown(self.path, NOBODY, NOBODY)
        with open(self.logfile, "w") as log:
            self.proc = subprocess.Popen(
                [*AS_NOBODY, *SBUS, "-v", "mount", "--address", self.address, self.path,
                 *self.args], stdout=log, stderr=log, env=ENV)
        deadline = time.monotonic() + 15
        while not mounted(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mount failed: {self.log()}")
            time.sleep(0.02)
        return self


def _subscribe_first_then_echo(m: Mount, tag: str, as_user: list[str]) -> None:
    """`cat 'M/T/*/c'` and `cat 'M/T/*/**'` started before anything exists under T
    receive `echo hi > M/T/b/c` written afterwards; so does `cat M/T/x/y` (a plain
    key nobody has published), and the keyed view tells where each came from."""
    readers = [subprocess.Popen([*as_user, "cat", m / p], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
               for p in (f"{tag}/*/c", f"{tag}/*/**", f"{tag}/b/c", f".keyed/{tag}/**")]
    try:
        for r, p in zip(readers, (f"{tag}/*/c", f"{tag}/*/**", f"{tag}/b/c",
                                  f".keyed/{tag}/**"), strict=True):
            wait_open(r, m / p)
        subprocess.run([*as_user, "sh", "-c", f"echo hi > {m / tag}/b/c"], check=True,
                       timeout=10)
        for r in readers[:3]:
            assert read_lines(r, 1) == [b"hi\n"]
        assert read_lines(readers[3], 1) == [f"{tag}/b/c hi\n".encode()]
    finally:
        for r in readers:
            end(r)


def test_reading_through_unknown_names_subscribes_as_root_with_allow_other(mnt):
    _subscribe_first_then_echo(mnt, "fresh", [])
    _subscribe_first_then_echo(mnt, "other", AS_NOBODY)  # another user, allow_other


def test_reading_through_unknown_names_subscribes_on_a_user_mount(bus, space):
    m = UserMount(bus.address, os.path.join(space, "usermnt")).start()
    try:
        _subscribe_first_then_echo(m, "mine", AS_NOBODY)
    finally:
        m.stop()


def test_unknown_names_still_fail_for_everything_but_open(mnt):
    for argv in (["ls", mnt / "nothing/here"], ["stat", mnt / "nothing"],
                 ["mkdir", mnt / "nothing/here"]):
        r = subprocess.run(argv, capture_output=True, timeout=10)
        assert r.returncode != 0 and b"No such file or directory" in r.stderr, argv


def test_every_directory_shows_how_to_subscribe(mnt):
    os.makedirs(mnt / "shown/dir", exist_ok=True)
    assert "**" in os.listdir(mnt / "shown/dir")
    assert "**" in os.listdir(mnt / "shown/*")
    assert {".keyed", ".jsonl", "**"} <= set(os.listdir(mnt.path))
    # the design card's `cat a/*/`: a directory cannot be read; the listing says what can
    r = subprocess.run(["cat", mnt / "shown/*/"], capture_output=True, timeout=10)
    assert b"Is a directory" in r.stderr


# -- one file written = one message ---------------------------------------------------

def test_cp_and_redirection_of_a_file_is_one_message(mnt, bus, space):
    data = os.urandom(150_000)
    src = os.path.join(space, "f150k")
    with open(src, "wb") as f:
        f.write(data)
    sub = subscriber(bus.address, b"files/")
    subprocess.run(["cp", src, mnt / "files/cfg"], check=True, timeout=10)
    subprocess.run(["sh", "-c", f"cat {src} > {mnt / 'files/cat'}"], check=True, timeout=10)
    subprocess.run(["sh", "-c", f"{{ echo one; echo two; }} > {mnt / 'files/group'}"],
                   check=True, timeout=10)
    sub.settimeout(10)
    assert sub.recv(1 << 20) == b"MSG files/cfg\0" + data
    assert sub.recv(1 << 20) == b"MSG files/cat\0" + data
    assert sub.recv(1 << 20) == b"MSG files/group\0one\ntwo\n"


def test_an_oversized_file_fails_and_publishes_nothing(mnt, bus, space):
    src = os.path.join(space, "f300k")
    with open(src, "wb") as f:
        f.write(b"z" * 300_000)
    sub = subscriber(bus.address, b"files/big")
    r = subprocess.run(["cp", src, mnt / "files/big"], capture_output=True, timeout=10)
    assert r.returncode != 0 and b"Message too long" in r.stderr
    r = subprocess.run(["sh", "-c", f"cat {src} > {mnt / 'files/big'}"],
                       capture_output=True, timeout=10)
    assert r.returncode != 0 and b"Message too long" in r.stderr
    r = subprocess.run(["sh", "-c", f"head -c 300000 /dev/zero > {mnt / 'files/big'}"],
                       capture_output=True, timeout=10)
    assert r.returncode != 0 and b"Message too long" in r.stderr
    fits = b"y" * (LIMIT - len(b"MSG files/big\0"))
    with open(mnt / "files/big", "wb") as f:
        f.write(fits)
    sub.settimeout(10)
    assert sub.recv(1 << 20) == b"MSG files/big\0" + fits  # the only one that went out


def test_what_unfinished_files_hold_is_bounded_per_user(mnt, bus):
    """Files are published at close, so the mount holds what was written before: at
    most 32 MiB per user, then ENOBUFS; closing publishes what fits, and the share is
    free again."""
    import errno

    sub = subscriber(bus.address, b"held/")
    sub.settimeout(10)
    chunk = b"h" * 200_000
    fds: list[int] = []
    try:
        with pytest.raises(OSError) as info:
            for i in range(200):  # 40 MB if nothing stopped it
                fd = os.open(mnt / f"held/k{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                fds.append(fd)
                os.write(fd, chunk)
        assert info.value.errno == errno.ENOBUFS
        assert 150 <= len(fds) <= 170  # 32 MiB / 200 kB = 167
        whole = 0
        for i, fd in enumerate(fds[:-1]):  # each close publishes what its file holds
            os.close(fd)
            fds[i] = -1
            whole += sub.recv(1 << 20).endswith(b"\0" + chunk)
        assert whole == len(fds) - 1  # (the last file's write was refused: it holds 0)
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
    fd = os.open(mnt / "held/again", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.write(fd, chunk)  # the share is free again
    os.close(fd)


def test_line_streams_publish_each_line_as_written(mnt, bus):
    """`>>` (O_APPEND) publishes every write at once: a loop of `echo >>` and a
    `tail -f log >> key` stream arrive line by line while the writer goes on."""
    sub = subscriber(bus.address, b"logs/x")
    sub.settimeout(10)
    subprocess.run(["sh", "-c", f"for i in 1 2 3; do echo line$i >> {mnt / 'logs/x'}; done"],
                   check=True, timeout=10)
    assert [sub.recv(1000) for _ in range(3)] == [b"MSG logs/x\0line%d\n" % i
                                                  for i in (1, 2, 3)]
    log = mnt.path + ".stream.log"
    open(log, "w").close()
    # from its first byte, not `-n0`: tail finds "the end" after opening the file, so a
    # line written in between was skipped (a timeout in a detached suite run)
    streamer = subprocess.Popen(["sh", "-c", f"exec tail -c +1 -f {log} >> {mnt / 'logs/x'}"])
    try:
        wait_open(streamer, log)
        for i in range(3):
            with open(log, "a") as f:
                f.write(f"stream{i}\n")
            # arrives while the writer still runs: one message per line written
            assert sub.recv(1000) == b"MSG logs/x\0stream%d\n" % i
    finally:
        end(streamer)


def test_a_write_waiting_for_a_gone_broker_ends_at_ctrl_c(space):
    """A write goes straight into the publisher's socket only while nothing waits; with
    the broker gone it waits (up to --reconnect-timeout), and Ctrl-C ends that wait at
    once (EINTR), though the writer's process is looked up only then.  Once the broker
    is back, writes go through again, the interrupted one not among them."""
    b = BrokerProcess(os.path.join(space, "wgone.sock")).start()
    m = Mount(b.address, os.path.join(space, "wgone")).start()
    try:
        sub = subscriber(b.address, b"w/k")
        subprocess.run(["sh", "-c", f"mkdir -p {m / 'w'}; echo before >> {m / 'w/k'}"],
                       check=True, timeout=10)
        assert sub.recv(1000) == b"MSG w/k\0before\n"
        b.stop()
        writer = subprocess.Popen(["sh", "-c", f"echo lost >> {m / 'w/k'}"],
                                  stderr=subprocess.PIPE, preexec_fn=default_sigint)
        wait_in_fuse(writer.pid)  # inside write(), waiting for the broker
        t = time.monotonic()
        writer.send_signal(signal.SIGINT)
        writer.wait(5)
        assert time.monotonic() - t < 0.5 and writer.returncode == -signal.SIGINT
        b.start()
        sub = subscriber(b.address, b"w/k")
        subprocess.run(["sh", "-c", f"echo after >> {m / 'w/k'}"], check=True, timeout=20)
        sub.settimeout(10)
        assert sub.recv(1000) == b"MSG w/k\0after\n"
    finally:
        m.stop()
        b.stop()


def _wakeups(pid: int) -> int:
    """Times the threads of process *pid* gave up the CPU waiting (voluntary switches)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            status = open(f"/proc/{pid}/task/{task}/status").read()
            total += int(re.search(r"voluntary_ctxt_switches:\s*(\d+)", status).group(1))
    return total


def test_writes_a_killed_broker_took_with_it_are_counted_in_the_log(space):
    """A write returns once the broker's socket has the message; 40 writes go into a
    stopped broker's socket and the broker is killed -9: the mount's log says up to how
    many writes the lost connection took with it (before: only that it was lost), at
    once, not at the next write, and the idle mount then sleeps (before: the line waited
    for a write, and the mount woke 4 times a second); the writes after arrive."""
    b = BrokerProcess(os.path.join(space, "wkill.sock")).start()
    m = Mount(b.address, os.path.join(space, "wkill"), "--reconnect-timeout", "20").start()
    try:
        sub = subscriber(b.address, b"w/k")
        sub.settimeout(10)
        subprocess.run(["sh", "-c", f"mkdir -p {m / 'w'}; echo before >> {m / 'w/k'}"],
                       check=True, timeout=10)
        assert sub.recv(1000) == b"MSG w/k\0before\n"
        time.sleep(0.6)  # confirmed by the broker meanwhile (every 0.25 s while writes go)
        b.proc.send_signal(signal.SIGSTOP)
        subprocess.run(["sh", "-c", f"for i in $(seq 40); do echo lost$i >> {m / 'w/k'}; "
                                    "done"], check=True, timeout=10)
        b.proc.kill()
        b.proc.wait()
        b.start()
        said = re.compile(r"publisher: .*\(up to (\d+) message\(s\) sent since the broker "
                          r"last confirmed may be lost with the connection\)")
        log = until(lambda: said.search(m.log()) and m.log(), "the loss said, no write made")
        assert 40 <= int(said.search(log).group(1)) <= 41, log
        until(lambda: "publisher: reconnected" in m.log(), "the publisher back")
        time.sleep(0.5)
        woke = _wakeups(m.proc.pid)
        time.sleep(2)
        assert _wakeups(m.proc.pid) - woke <= 4  # idle: no question, no poll
        sub = subscriber(b.address, b"w/k")
        sub.settimeout(10)
        subprocess.run(["sh", "-c", f"echo after >> {m / 'w/k'}"], check=True, timeout=20)
        assert sub.recv(1000) == b"MSG w/k\0after\n"
    finally:
        m.stop()
        b.stop()


# -- readers -----------------------------------------------------------------------

def test_tail_f_follows_new_messages(mnt, bus):
    os.makedirs(mnt / "tails", exist_ok=True)
    tail = subprocess.Popen(["tail", "-f", mnt / "tails/k"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_open(tail, mnt / "tails/k")
        for i in range(3):
            subprocess.run(["sh", "-c", f"echo m{i} >> {mnt / 'tails/k'}"], check=True)
            assert read_lines(tail, 1, timeout=10) == [b"m%d\n" % i]
    finally:
        end(tail)


def _descendants(pid: int) -> list[int]:
    try:
        kids = [int(k) for k in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except FileNotFoundError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def end_tree(proc: subprocess.Popen) -> None:
    """End *proc* and everything under it.  script(1) runs its command in a session of
    its own: killed alone, it left `less` on a hung-up terminal, spinning at half a
    core (three such slowed a later full run from 9 to 16 minutes)."""
    for pid in _descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end(proc)


def test_less_follow_mode_shows_new_messages(mnt, bus):
    """`less +F` on a terminal (script(1) gives it one): less looks at the file with
    stat(2) first, so the key must be known (`: > key` makes it so, publishing
    nothing); then every message shows as it arrives."""
    os.makedirs(mnt / "lessf", exist_ok=True)
    open(mnt / "lessf/k", "wb").close()
    less = subprocess.Popen(["script", "-qfc", f"less +F {mnt / 'lessf/k'}", "/dev/null"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "TERM": "xterm"})
    try:
        deadline = time.monotonic() + 10
        seen = b""
        for i in range(2):
            # publish until less shows it (its open is in another process: no fd to
            # wait for), at most one message per 0.2 s
            while f"shown-{i}".encode() not in seen:
                assert time.monotonic() < deadline, seen[-200:]
                subprocess.run(["sh", "-c", f"echo shown-{i} >> {mnt / 'lessf/k'}"],
                               check=True)
                t = time.monotonic() + 0.2
                while time.monotonic() < t and select.select([less.stdout], [], [], 0.05)[0]:
                    seen += os.read(less.stdout.fileno(), 4096)
    finally:
        end_tree(less)


def test_grep_line_buffered_and_a_while_read_loop_see_every_line(mnt, bus):
    os.makedirs(mnt / "loops", exist_ok=True)
    grep = subprocess.Popen(["grep", "--line-buffered", "keep", mnt / "loops/k"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_open(grep, mnt / "loops/k")
    loop = subprocess.Popen(["bash", "-c", f"while read -r l; do echo got $l; done < "
                             f"{mnt / 'loops/k'}"], stdout=subprocess.PIPE)
    try:
        wait_open(loop, mnt / "loops/k")
        # several lines in one message: bash's `read` seeks back over what it read
        # past each line, so the mount must give those bytes again
        subprocess.run(["sh", "-c", f"printf 'keep1\\ndrop\\nkeep2\\n' >> {mnt / 'loops/k'}; "
                        f"echo keep3 >> {mnt / 'loops/k'}"], check=True)
        assert read_lines(grep, 3) == [b"keep1\n", b"keep2\n", b"keep3\n"]
        assert read_lines(loop, 4) == [b"got keep1\n", b"got drop\n", b"got keep2\n",
                                       b"got keep3\n"]
    finally:
        end(grep)
        end(loop)


def test_the_jsonl_view_names_keys_whatever_the_mount_format(mnt):
    r = cat(mnt / ".jsonl/view/*/!")  # the pattern view/*
    try:
        subprocess.run(["sh", "-c", f"echo hi > {mnt / 'view/k'}"], check=True)
        line = read_lines(r, 1)[0]
        assert line.startswith(b'{"key": "view/k", "payload": "hi\\n"')
    finally:
        end(r)


# -- fair shares between users (issue 28) -----------------------------------------

BLOCKERS = """
import os, sys, threading
paths = sys.argv[1:]
fds = []
for p in paths:
    try:
        fds.append(os.open(p, os.O_RDONLY))
    except OSError as e:
        print("open", e.errno, flush=True)
def block(fd):
    try:
        os.read(fd, 100)
    except OSError as e:
        os.write(1, b"read %d\\n" % e.errno)  # one write: the threads' lines must not mix
print("opened", len(fds), flush=True)  # before the reads: their errors print in threads
for fd in fds:
    threading.Thread(target=block, args=(fd,), daemon=True).start()
sys.stdin.read()
"""


def echo_through(m: Mount, bus: BrokerProcess) -> float:
    """Seconds root's ``echo > free/k`` through mount *m* takes; the message arrives."""
    sub = subscriber(bus.address, b"free/k")
    start = time.monotonic()
    subprocess.run(["sh", "-c", f"echo through > {m / 'free/k'}"], check=True, timeout=15)
    took = time.monotonic() - start
    sub.settimeout(10)
    assert sub.recv(1000) == b"MSG free/k\0through\n"
    sub.close()
    return took


def test_one_users_blocked_reads_do_not_stop_another_users_writes(bus, space):
    """Another user (nobody) tries more blocked reads than the mount has tasks: it holds
    its share (half of the 18 the answering-at-once reserve leaves), the excess fails at
    once with EAGAIN, and root's `echo > key` still goes through at once."""
    m = Mount(bus.address, os.path.join(space, "shares"), "--allow-other",
              "--max-tasks", "20").start()
    hog = None
    try:
        os.makedirs(m / "hog", exist_ok=True)
        paths = [m / f"hog/k{i}" for i in range(30)]
        for p in paths:  # known keys, so that the test shows the same before the fix
            open(p, "wb").close()
        hog = subprocess.Popen([*AS_NOBODY, "python3", "-c", BLOCKERS, *paths],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        said = b""
        seen: list = [None, 0.0]  # the last (refused, waiting) and since when

        def settled() -> bool:
            """Every read waits in the mount or has failed, and has for 0.5 s: a read the
            mount has not answered yet waits in FUSE too (in CI, 30 waiting and none
            refused was once taken for the end)."""
            nonlocal said
            while select.select([hog.stdout], [], [], 0)[0]:
                chunk = os.read(hog.stdout.fileno(), 4096)
                assert chunk, "the blocking process ended"
                said += chunk
            if not said.startswith(b"opened 30\n"):
                assert not said or b"\n" not in said, said
                return False
            lines = said.splitlines()[1:]
            assert set(lines) <= {b"read 11"}, lines
            state = (len(lines), waiting_in_fuse(hog.pid))
            if sum(state) != len(paths) or state != seen[0]:
                seen[:] = [state, time.monotonic()]
                return False
            return time.monotonic() - seen[1] >= 0.5

        until(settled, "nobody's 30 reads waiting or refused")
        assert (waiting_in_fuse(hog.pid), said.count(b"read 11")) == (9, 21)
        took = echo_through(m, bus)
        assert took < 2, took
    finally:
        if hog is not None:
            end(hog)
        m.stop()


# One thread opens the files, THREADS threads block in pread on them (pread: the kernel's
# per-file lock lets one read(2) of a file into the mount at a time), IDLE more make the
# process's thread list long, and the opener (the leader) exits: asking the process
# about its signals then lists its threads.  Prints "ready" once the threads started.
PREADERS = """
import ctypes, os, sys, threading, time
paths, threads, idle = sys.argv[3:], int(sys.argv[1]), int(sys.argv[2])
fds = [os.open(p, os.O_RDONLY) for p in paths]
for _ in range(idle):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
def block(fd):
    try:
        os.pread(fd, 100, 0)
    except OSError:
        pass
for i in range(threads):
    threading.Thread(target=block, args=(fds[i % len(fds)],), daemon=True).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def test_many_threads_waiting_in_reads_cost_the_mount_little(bus, space):
    """Another user (nobody) has 300 threads wait in reads of files one thread opened,
    and that thread, its process's leader, exits (2,400 threads and a leader gone:
    the audit of 2026-11-28).  Each waiting read asked about its caller's signals 20
    times a second, and asking about a process whose leader is gone lists its threads:
    the mount ran at 100 % CPU and another user's ``open`` took up to 24 s.  Now a
    caller is asked about once per round whatever the number of its reads: the mount
    idles while they wait, root's ``echo > key`` goes through at once, and kill -9
    still ends the waiting process."""
    m = Mount(bus.address, os.path.join(space, "preads"), "--allow-other").start()
    hog = None
    try:
        os.makedirs(m / "idle", exist_ok=True)
        paths = [m / f"idle/k{i}" for i in range(8)]
        for p in paths:
            open(p, "wb").close()
        hog = subprocess.Popen([*AS_NOBODY, "python3", "-c", PREADERS, "300", "1000",
                                *paths], stdout=subprocess.PIPE)
        assert hog.stdout.readline() == b"ready\n"
        until(lambda: waiting_in_fuse(hog.pid) >= 300, "300 reads waiting in the mount")
        before = cpu_seconds(m.proc.pid)
        time.sleep(2)
        spent = cpu_seconds(m.proc.pid) - before
        assert spent < 0.5, f"the mount spent {spent:.2f} s of CPU in 2 s on waiting reads"
        took = echo_through(m, bus)
        assert took < 1, took
        hog.kill()
        hog.wait(10)  # its reads were answered: the threads could die
    finally:
        if hog is not None and hog.poll() is None:
            hog.kill()
        m.stop()


def test_help_tells_pip_users_what_the_man_page_does():
    """pip installs no man pages: `sbus mount --help` carries the page's text, and the
    fallback address it names is the real one even when $SBUS_ADDRESS is set."""
    r = subprocess.run([*SBUS, "mount", "--help"], capture_output=True, text=True, check=True,
                       env={**ENV, "SBUS_ADDRESS": "/tmp/elsewhere.sock"}, timeout=30)
    text = " ".join(r.stdout.split())
    assert "else /run/sbus.socket" in text and "/tmp/elsewhere.sock" not in text
    assert "cat 'MNT/a/*/**' for a/*/" in text and "examples:" in text
