"""``sbus mount`` on real FUSE mounts, against real brokers, with raw-socket peers."""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SBUS, BrokerProcess, raw, stop_process, sync
from faultkit import PipeLines, until

from sbus.routing import matches

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


class Mount:
    """A real ``sbus mount`` in a child process; always unmounted by `stop`."""

    def __init__(self, address: str, path: str, *args: str) -> None:
        self.address, self.path, self.args = address, path, args
        self.logfile = path + ".log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Mount:
        os.makedirs(self.path, exist_ok=True)
        with open(self.logfile, "w") as log:
            self.proc = subprocess.Popen(
                [*SBUS, "-v", "mount", "--address", self.address, self.path, *self.args],
                stdout=log, stderr=log, env=ENV)
        deadline = time.monotonic() + 15
        while not mounted(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mount failed: {self.log()}")
            time.sleep(0.02)
        os.stat(self.path)  # answered once the main loop runs
        return self

    def log(self) -> str:
        with open(self.logfile) as f:
            return f.read()

    def stop(self) -> None:
        try:
            stop_process(self.proc)
        finally:
            if mounted(self.path):
                subprocess.run(["fusermount3", "-u", "-z", self.path], check=False)

    def __truediv__(self, rel: str) -> str:
        return os.path.join(self.path, rel)


def space_dir(prefix: str) -> Iterator[str]:
    """A fixture's directory under /tmp that other users can reach, removed after."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(d, 0o755)
    yield d
    subprocess.run(["rm", "-rf", d], check=False)


def broker_in(space: str) -> Iterator[BrokerProcess]:
    """A fixture's broker on ``SPACE/bus.sock``, stopped after."""
    b = BrokerProcess(os.path.join(space, "bus.sock")).start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def space():
    yield from space_dir("sbus-fuse-")


@pytest.fixture(scope="module")
def bus(space):
    yield from broker_in(space)


@pytest.fixture(scope="module")
def mnt(bus, space):
    m = Mount(bus.address, os.path.join(space, "mnt")).start()
    yield m
    m.stop()


def subscriber(address: str, *patterns: bytes) -> socket.socket:
    s = raw(address)
    for p in patterns:
        s.send(b"SUB " + p)
    sync(s)
    return s


def publish(address: str, *messages: tuple[bytes, bytes]) -> None:
    s = raw(address)
    for key, payload in messages:
        s.send(b"MSG " + key + b"\0" + payload)
    sync(s)
    s.close()


def wait_open(proc: subprocess.Popen, path: str, timeout: float = 10) -> None:
    """Wait until *proc* holds *path* open: its subscription then exists."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fds = f"/proc/{proc.pid}/fd"
        try:
            if any(os.readlink(os.path.join(fds, fd)) == path for fd in os.listdir(fds)):
                return
        except FileNotFoundError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"reader exited: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.01)
    raise TimeoutError(f"{path} not opened")


def default_sigint() -> None:
    """In a child: SIGINT as at a terminal.  A suite started in the background (``cmd &``
    in a script) inherits SIGINT ignored, and so would every ``cat`` it starts."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cat(path: str, *args: str, job: bool = False) -> subprocess.Popen:
    """``cat`` of *path*; with *job*, in a process group of its own, as a shell runs a job.

    A job must be its own group for SIGTSTP to stop it when the suite runs detached
    (``setsid``, as CI and cron do): the suite's group is then orphaned (no parent in
    another group of its session) and the kernel discards stop signals sent to it."""
    proc = subprocess.Popen([*args, "cat", path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, process_group=0 if job else None,
                            preexec_fn=default_sigint)
    wait_open(proc, path)
    return proc


# `cat` that reads on past a read that says messages were missed there (ENOBUFS, as
# the mount says a drop or a reconnect), noting each such place on stderr.
READ_ON = """
import errno, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
while True:
    try:
        data = os.read(fd, 65536)
    except OSError as e:
        if e.errno != errno.ENOBUFS:
            raise
        sys.stderr.write("ENOBUFS\\n")
        sys.stderr.flush()
        continue
    if not data:
        break
    os.write(1, data)
"""


def read_on(path: str, *args: str) -> subprocess.Popen:
    """A reader of *path* that goes on past the places where messages were missed;
    *args* run it (as `cat`'s: e.g. as another user)."""
    python = "python3" if args else sys.executable
    proc = subprocess.Popen([*args, python, "-c", READ_ON, path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    wait_open(proc, path)
    return proc


def _stdout(proc: subprocess.Popen) -> PipeLines:
    lines = getattr(proc, "lines", None)
    if lines is None:
        lines = proc.lines = PipeLines(proc.stdout)
    return lines


def read_lines(proc: subprocess.Popen, n: int, timeout: float = 10) -> list[bytes]:
    """The next *n* lines *proc* prints (what came after them is kept for the next call)."""
    try:
        return [line + b"\n" for line in _stdout(proc).next(n, timeout)]
    except EOFError as exc:
        raise EOFError(f"{exc}; its stderr: {proc.stderr.read()!r}") from None


def readable(proc: subprocess.Popen, timeout: float) -> bool:
    lines = _stdout(proc)
    return bool(lines.lines) or lines.take(timeout)


def touch(m: Mount, rel: str) -> str:
    """Make *rel* a file of the mount (creating it publishes nothing)."""
    os.makedirs(os.path.dirname(m / rel), exist_ok=True)
    open(m / rel, "wb").close()
    return m / rel


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


# -- writing ---------------------------------------------------------------------

def test_echo_publishes_one_message(mnt, bus):
    sub = subscriber(bus.address, b"a/b/c")
    os.makedirs(mnt / "a/b", exist_ok=True)
    subprocess.run(["sh", "-c", f"echo hi > {mnt / 'a/b/c'}"], check=True)
    assert sub.recv(1 << 20) == b"MSG a/b/c\0hi\n"
    assert os.path.isfile(mnt / "a/b/c")


def test_a_blocking_subscriber_does_not_stall_other_writers(mnt, bus):
    """The mount publishes every writer's messages on one connection: a subscriber on
    `block` that never reads (root's, so it may pause anyone) must not stall the mount.
    The mount says `blocking/publisher/nowait`; the stuck subscriber loses messages and
    is told so, and another writer's message goes through at once."""
    stuck = subscriber(bus.address)
    stuck.send(b"CMSG blocking/soft/block")
    stuck.send(b"SUB stall/")
    sync(stuck)
    other = subscriber(bus.address, b"freeflow/y")
    os.makedirs(mnt / "stall", exist_ok=True)
    os.makedirs(mnt / "freeflow", exist_ok=True)
    flood = "import sys\nwith open(sys.argv[1], 'ab', buffering=0) as f:\n" \
            "    for i in range(6000): f.write(b'%d ' % i + b'x' * 1000)\n"
    subprocess.run([sys.executable, "-c", flood, str(mnt / "stall/x")], check=True, timeout=30)
    subprocess.run(["sh", "-c", f"echo hi > {mnt / 'freeflow/y'}"], check=True, timeout=10)
    other.settimeout(10)
    assert other.recv(1 << 20) == b"MSG freeflow/y\0hi\n"
    stuck.settimeout(10)
    got, dropped = 0, 0
    while got + dropped < 6000:
        p = stuck.recv(1 << 20)
        if p.startswith(b"CMSG blocking/dropped\0"):
            dropped += int(p.split(b"\0")[1])
        else:
            got += 1
    assert dropped > 0


def test_append_publishes_each_write_and_truncate_the_whole_file(mnt, bus):
    sub = subscriber(bus.address, b"w/k")
    os.makedirs(mnt / "w", exist_ok=True)
    subprocess.run(["sh", "-c", f"echo one >> {mnt / 'w/k'}; printf two > {mnt / 'w/k'}"],
                   check=True)
    fd = os.open(mnt / "w/k", os.O_WRONLY | os.O_APPEND)
    try:
        assert os.write(fd, b"three") == 5
        assert os.write(fd, b"four") == 4
    finally:
        os.close(fd)
    with open(mnt / "w/k", "r+b", buffering=0) as f:  # O_RDWR: one message at close
        f.truncate(0)
        f.write(b"five")
        f.write(b"six")
    got = [sub.recv(1 << 20) for _ in range(5)]
    assert got == [b"MSG w/k\0" + m for m in (b"one\n", b"two", b"three", b"four", b"fivesix")]


def test_write_larger_than_the_broker_accepts_fails(mnt, bus):
    sub = subscriber(bus.address, b"big")
    limit = 256 * 1024 - len(b"MSG big\0")
    fd = os.open(mnt / "big", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with pytest.raises(OSError) as info:
            os.write(fd, b"x" * (limit + 1))
        assert info.value.errno == errno.EMSGSIZE
        with pytest.raises(OSError):
            os.write(fd, b"x" * (2 << 20))
        assert os.write(fd, b"y" * limit) == limit
    finally:
        os.close(fd)
    assert sub.recv(1 << 20) == b"MSG big\0" + b"y" * limit  # the only one that went out


def test_patterns_and_reserved_names_are_not_writable(mnt):
    for path in ("a/*/c", "a/*/**", "**"):
        with pytest.raises(PermissionError):
            open(mnt / path, "wb")
    with pytest.raises(FileExistsError):
        os.mkdir(mnt / "a/*")


# -- reading ---------------------------------------------------------------------

def test_cat_prints_messages_in_order(mnt, bus):
    proc = cat(touch(mnt, "r/k"))
    try:
        publish(bus.address, *[(b"r/k", b"m%d" % i) for i in range(200)])
        assert read_lines(proc, 200) == [b"m%d\n" % i for i in range(200)]
    finally:
        end(proc)


KEYS = [b"a/x/c", b"a/y/c", b"a/x/d", b"a/x/c/e", b"b/x/c", b"a/c", b"a/x"]


@pytest.mark.parametrize("path, pattern", [("a/*/c", b"a/*/c"), ("a/*/**", b"a/*/"),
                                           ("a/*/!", b"a/*")])
def test_wildcard_paths_follow_the_protocol(mnt, bus, path, pattern):
    proc = cat(mnt / path)
    try:
        marker = pattern.replace(b"*", b"end") + (b"z" if pattern.endswith(b"/") else b"")
        publish(bus.address, *[(k, k) for k in KEYS], (marker, marker))
        expected = [k + b"\n" for k in KEYS if matches(pattern, k)]
        assert 0 < len(expected) < len(KEYS)  # the pattern tells keys apart
        assert read_lines(proc, len(expected) + 1) == expected + [marker + b"\n"]
    finally:
        end(proc)


def test_mkdir_learned_directories_and_unknown_names(mnt, bus):
    os.makedirs(mnt / "made/deep", exist_ok=True)
    assert os.path.isdir(mnt / "made/deep")
    assert "made" in os.listdir(mnt.path)
    with pytest.raises(FileNotFoundError):
        os.stat(mnt / "unknown")
    publish(bus.address, (b"live/x/y", b"1"), (b"p/q", b"2"), (b"p/q/r", b"3"))
    deadline = time.monotonic() + 5
    while not os.path.isdir(mnt / "p/q"):
        assert time.monotonic() < deadline, "traffic never showed up as directories"
        time.sleep(0.02)
    assert os.listdir(mnt / "live/x") == ["y", "**"] and os.path.isfile(mnt / "live/x/y")
    assert sorted(os.listdir(mnt / "p/q")) == ["!", "**", "r"]  # p/q is a key and a prefix
    assert os.listdir(mnt / "live/*") == ["**"]  # wildcards list only how to read
    # patterns are read-only: removing what `ls` shows is EACCES, not "no such file";
    # every name below a wildcard is a pattern, so it exists (mkdir: EEXIST)
    for remove, path in ((os.remove, "**"), (os.remove, "live/x/**"),
                         (os.remove, "live/*/y"), (os.rmdir, "live/*")):
        with pytest.raises(PermissionError):
            remove(mnt / path)
    with pytest.raises(FileExistsError):
        os.mkdir(mnt / "live/*/new")
    assert os.path.isfile(mnt / "live/x/y")
    proc = cat(mnt / "p/q/!")
    try:
        publish(bus.address, (b"p/q/r", b"not this"), (b"p/q", b"this"))
        assert read_lines(proc, 1) == [b"this\n"]
    finally:
        end(proc)


def test_creating_a_file_makes_its_directories_on_a_fresh_bus(space):
    """The design card: ``echo hi > MNT/a/b/c`` publishes with no mkdir on a fresh bus
    (the mount reads the creating call from /proc); a failed create leaves nothing."""
    b = BrokerProcess(os.path.join(space, "fresh.sock")).start()
    m = Mount(b.address, os.path.join(space, "fresh"))
    try:
        m.start()
        keys = [b"a/b/c", b"sh/b/c", b"rel/x/y", b"py/thon/w", b"at/fd/z/z"]
        sub = subscriber(b.address, *keys)
        subprocess.run(["bash", "-c", f"echo hi > {m / 'a/b/c'}"], check=True)
        subprocess.run(["sh", "-c", f"echo hi > {m / 'sh/b/c'}"], check=True)
        subprocess.run(["sh", "-c", "echo hi > rel/x/y"], check=True, cwd=m.path)
        with open(m / "py/thon/w", "w") as f:
            f.write("hi\n")
        root = os.open(m.path, os.O_RDONLY | os.O_DIRECTORY)
        try:  # openat with a descriptor of the mount's root
            fd = os.open("at/fd/z/z", os.O_WRONLY | os.O_CREAT, dir_fd=root)
            os.write(fd, b"hi\n")
            os.close(fd)
        finally:
            os.close(root)
        for key in keys:
            assert sub.recv(1000) == b"MSG " + key + b"\0hi\n"
        assert os.path.isdir(m / "a/b") and os.path.isfile(m / "a/b/c")  # learned

        r = subprocess.run(["ls", m / "nonexistent"], capture_output=True)
        assert r.returncode != 0 and b"No such file or directory" in r.stderr
        # a create that fails leaves no directory behind: the implicit ones are
        # neither remembered nor cached by the kernel
        with pytest.raises(PermissionError):  # '**' is a pattern: not writable
            open(m / "gone/sub/**", "w")
        with pytest.raises(FileNotFoundError):
            os.stat(m / "gone")
        # the secret tree keeps its rules
        with pytest.raises(FileNotFoundError):
            open(m / "!/other/x/y", "w")
        with pytest.raises(PermissionError):
            open(m / "!/cred/1/2/3/x/y", "w")
        assert not select.select([sub], [], [], 0.2)[0]  # the refused ones published nothing
    finally:
        m.stop()
        b.stop()


def test_long_message_continues_in_the_next_read(mnt, bus):
    payload = bytes(range(256)) * 40  # 10240 bytes
    fd = os.open(touch(mnt, "big"), os.O_RDONLY)
    try:
        publish(bus.address, (b"big", payload), (b"big", b"short"))
        got = b""
        while len(got) < len(payload) + 7:
            chunk = os.read(fd, 4096)
            assert 0 < len(chunk) <= 4096
            got += chunk
        assert got == payload + b"\nshort\n"
    finally:
        os.close(fd)


def test_slow_reader_is_held_back_by_the_broker_flood_policy(mnt, bus):
    """A reader that does not read: the mount buffers 4 MiB, then stops reading, the
    broker queues its 4 MiB and then discards (the default policy) and says so; what
    the reader gets is in order, without duplicates, starting at the first message, and
    the read that reaches the place of the loss fails once with ENOBUFS (the reader was
    not told before: only the mount's log said it), the next going on after it."""
    fd = os.open(touch(mnt, "slow"), os.O_RDONLY)
    try:
        n = 20_000  # 14 MB: more than the mount (4 MiB) and the broker (4 MiB) keep
        s = raw(bus.address)
        for i in range(n):
            s.send(b"MSG slow\0%06d" % i + b"." * 693)
        sync(s)
        got, told = [b""], []
        # (its end is 3 s without news: sync says the broker has it all, not the mount)
        while select.select([fd], [], [], 3.0)[0]:
            try:
                got[-1] += os.read(fd, 1 << 17)
            except OSError as exc:
                assert exc.errno == errno.ENOBUFS
                told.append(len(got))
                got.append(b"")
        parts = [[int(x[:6]) for x in part.split()] for part in got]
        numbers = [m for part in parts for m in part]
        assert numbers[0] == 0
        assert all(a < b for a, b in zip(numbers, numbers[1:], strict=False))
        assert 4 * 1024 * 1024 // 700 < len(numbers) < n  # buffered a lot, dropped some
        assert told, "the loss was not told to the reader"
        # each place it was told is a place of loss, and every loss was told there
        gaps = [i for i, (a, b) in enumerate(zip(numbers, numbers[1:], strict=False))
                if b != a + 1]
        gaps += [len(numbers) - 1] if numbers[-1] != n - 1 else []  # (the last ones lost)
        assert [sum(map(len, parts[:k])) - 1 for k in told] == gaps
        deadline = time.monotonic() + 5
        while "dropped" not in mnt.log():
            assert time.monotonic() < deadline, "the broker's drop report was not logged"
            time.sleep(0.05)
    finally:
        os.close(fd)


def test_a_slow_jsonl_reader_finds_a_line_where_messages_were_dropped(mnt, bus):
    """The ``jsonl`` view has room to say it in the stream: ``{"dropped": N, …}`` stands
    where the broker dropped N messages for the reader, and N is exactly what is
    missing."""
    import json

    touch(mnt, "slowj")
    fd = os.open(mnt / ".jsonl/slowj", os.O_RDONLY)
    try:
        n = 20_000
        s = raw(bus.address)
        for i in range(n):
            s.send(b"MSG slowj\0%06d" % i + b"." * 693)
        sync(s)
        got = b""
        numbers: list[int] = []
        dropped = 0
        while len(numbers) + dropped < n and select.select([fd], [], [], 10)[0]:
            got += os.read(fd, 1 << 17)
            whole, _, got = got.rpartition(b"\n")
            records = [json.loads(line) for line in whole.splitlines()]
            numbers += [int(r["payload"][:6]) for r in records if "payload" in r]
            dropped += sum(r["dropped"] for r in records if "dropped" in r)
        assert dropped > 0 and len(numbers) + dropped == n
        assert numbers == sorted(set(numbers))
    finally:
        os.close(fd)


def test_poll_and_select(mnt, bus):
    fd = os.open(touch(mnt, "big"), os.O_RDONLY)
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        assert p.poll(200) == []
        publish(bus.address, (b"big", b"ready"))
        assert p.poll(5000) == [(fd, select.POLLIN)]
        assert select.select([fd], [], [], 5)[0] == [fd]
        assert os.read(fd, 100) == b"ready\n"
        assert p.poll(100) == []
    finally:
        os.close(fd)


def test_timeout_cat_ends_promptly(mnt):
    t = time.monotonic()
    proc = subprocess.run(["timeout", "2", "cat", touch(mnt, "x")], capture_output=True)
    assert proc.returncode == 124
    assert time.monotonic() - t < 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_ends_a_blocked_cat_within_half_a_second(mnt, sig):
    proc = cat(touch(mnt, "x"))
    wait_in_fuse(proc.pid)
    t = time.monotonic()
    proc.send_signal(sig)
    proc.wait(5)
    assert time.monotonic() - t < 0.5
    assert proc.returncode == -sig


def test_a_process_that_exits_while_another_thread_reads_is_not_held(mnt, bus):
    """The main thread opens a file and exits the process (``os._exit``) while another
    thread is blocked reading it: the process ends at once.  Before, the mount asked
    only the opener, a zombie whose pending signals are gone, and the reading thread
    sat in ``request_wait_answer`` (not even SIGKILL ended it) until a message came on
    the key (the re-audit of 2026-11-27: 11 minutes)."""
    script = ("import os, threading, time\n"
              "f = open(os.environ['FILE'], 'rb', buffering=0)\n"
              "threading.Thread(target=f.read, args=(100,), daemon=True).start()\n"
              "time.sleep(0.5)\n"
              "os._exit(0)\n")
    proc = subprocess.Popen([sys.executable, "-c", script],
                            env={**os.environ, "FILE": touch(mnt, "exits")})
    try:
        proc.wait(5)
    finally:
        if proc.poll() is None:  # held: a message on its key lets it go
            publish(bus.address, (b"exits", b"free"))
            proc.wait(10)
    assert proc.returncode == 0


def waiting_in_fuse(pid: int) -> int:
    """How many of *pid*'s threads wait for a FUSE answer (``request_wait_answer``)."""
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                count += f.read() == "request_wait_answer"
        except FileNotFoundError:
            pass  # the thread ended
    return count


def wait_in_fuse(pid: int, timeout: float = 10) -> None:
    """Until *pid* waits for a FUSE answer: inside the call the test means to interrupt,
    without a fixed sleep."""
    until(lambda: waiting_in_fuse(pid), f"{pid} waiting on the mount", timeout, every=0.005)


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_ctrl_z_stops_at_the_next_message_and_fg_reads_on(mnt, bus):
    """SIGTSTP must not turn into EINTR (cat would fail after fg): the reader stops
    once its next message is delivered, and reads on after SIGCONT."""
    proc = cat(touch(mnt, "tstp"), job=True)
    try:
        wait_in_fuse(proc.pid)  # in its read(), not still on its way there (CI, loaded)
        proc.send_signal(signal.SIGTSTP)
        time.sleep(0.3)
        assert proc_state(proc.pid) != "T"  # still waiting inside read()
        publish(bus.address, (b"tstp", b"one"))
        deadline = time.monotonic() + 5
        while proc_state(proc.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGCONT)
        publish(bus.address, (b"tstp", b"two"))
        assert read_lines(proc, 2) == [b"one\n", b"two\n"]
        assert proc.poll() is None
    finally:
        end(proc)
    assert proc.stderr.read() == b""


def test_head_ends_after_three_lines(mnt, bus):
    proc = subprocess.Popen(["head", "-n", "3", touch(mnt, "big")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_open(proc, mnt / "big")
        publish(bus.address, *[(b"big", b"h%d" % i) for i in range(2)])
        time.sleep(0.1)
        assert proc.poll() is None  # two lines: still waiting for the third
        publish(bus.address, *[(b"big", b"h%d" % i) for i in range(2, 5)])
        out, err = proc.communicate(timeout=2)
        assert (out, err, proc.returncode) == (b"h0\nh1\nh2\n", b"", 0)
    finally:
        end(proc)


def test_ten_readers_each_get_every_message(mnt, bus):
    procs = [cat(touch(mnt, "big")) for _ in range(10)]
    try:
        publish(bus.address, *[(b"big", b"n%d" % i) for i in range(300)])
        for proc in procs:
            assert read_lines(proc, 300) == [b"n%d\n" % i for i in range(300)]
    finally:
        for proc in procs:
            end(proc)


def test_secret_keys(mnt, bus):
    mount_pid = mnt.proc.pid
    other = raw(bus.address)
    other.send(b"CMSG !/cred/whoami")
    other_cred = other.recv(1000).split(b"\0")[1].decode()
    with pytest.raises(PermissionError):  # another process's secrets
        open(mnt / f"{other_cred}/x", "rb")
    with pytest.raises(PermissionError):
        os.listdir(mnt / other_cred)
    own = f"!/cred/{os.getgid()}/{os.getuid()}/{mount_pid}"
    os.makedirs(mnt / own, exist_ok=True)
    proc = cat(mnt / f"{own}/**")
    try:
        publish(bus.address, (f"{other_cred}/x".encode(), b"not mine"),
                (f"{own}/x".encode(), b"mine"))
        assert read_lines(proc, 1) == [b"mine\n"]
    finally:
        end(proc)


def test_nobody_cannot_borrow_the_mounts_secrets(bus, space):
    """With allow_other, another user may use public keys but not the mount's secrets."""
    os.chmod(space, 0o755)
    m = Mount(bus.address, os.path.join(space, "shared"), "--allow-other").start()
    try:
        own = f"!/cred/{os.getgid()}/{os.getuid()}/{m.proc.pid}"
        os.makedirs(m / own, exist_ok=True)
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        r = subprocess.run([*as_nobody, "cat", m / f"{own}/**"], capture_output=True,
                           timeout=10)
        assert r.returncode != 0 and b"Permission denied" in r.stderr
        sub = subscriber(bus.address, b"pub/by/nobody")
        sub2 = subscriber(bus.address, b"pub/new/nobody")
        os.makedirs(m / "pub/by", exist_ok=True)
        subprocess.run([*as_nobody, "sh", "-c", f"echo hello > {m / 'pub/by/nobody'}"],
                       check=True, timeout=10)
        assert sub.recv(1000) == b"MSG pub/by/nobody\0hello\n"
        # a root mount may read another user's creating call: no mkdir needed either
        subprocess.run([*as_nobody, "sh", "-c", f"echo hello > {m / 'pub/new/nobody'}"],
                       check=True, timeout=10)
        assert sub2.recv(1000) == b"MSG pub/new/nobody\0hello\n"
    finally:
        m.stop()


# -- formats -----------------------------------------------------------------------

def test_raw_and_jsonl_formats(bus, space):
    mr = Mount(bus.address, os.path.join(space, "raw"), "--format", "raw").start()
    mj = Mount(bus.address, os.path.join(space, "jsonl"), "--format", "jsonl").start()
    try:
        os.mkdir(mr / "f")
        os.mkdir(mj / "f")
        fr = os.open(mr / "f/**", os.O_RDONLY)
        fj = os.open(mj / "f/**", os.O_RDONLY)
        t = time.time()
        publish(bus.address, (b"f/1", b"no newline"), (b"f/2", b""), (b"f/3", b"\xff"))
        assert os.read(fr, 1000) == b"no newline"  # one message per read
        assert os.read(fr, 1000) == b"\xff"  # the empty one is skipped
        lines = b""
        while lines.count(b"\n") < 3:
            lines += os.read(fj, 1000)
        recs = [json.loads(x) for x in lines.splitlines()]
        assert [r["key"] for r in recs] == ["f/1", "f/2", "f/3"]
        assert recs[0]["payload"] == "no newline" and recs[1]["payload"] == ""
        assert recs[2]["payload_base64"] == "/w=="
        assert all(t - 1 < r["time"] < time.time() + 1 for r in recs)
        os.close(fr)
        os.close(fj)
    finally:
        mr.stop()
        mj.stop()


# -- lifecycle ---------------------------------------------------------------------

def test_broker_restart_under_a_reader(space):
    b = BrokerProcess(os.path.join(space, "restart.sock")).start()
    m = Mount(b.address, os.path.join(space, "restart"), "--reconnect-timeout", "20").start()
    proc = None
    try:
        proc = read_on(touch(m, "s/k"))
        with open(m / "s/k", "wb") as f:  # the mount's publisher connects
            f.write(b"before")
        assert read_lines(proc, 1) == [b"before\n"]
        b.stop()
        b.start()
        # the reader is back once a probe reaches it
        deadline = time.monotonic() + 10
        while True:
            publish(b.address, (b"s/k", b"probe"))
            if readable(proc, 0.1):
                break
            assert time.monotonic() < deadline, m.log()
        publish(b.address, *[(b"s/k", b"after%d" % i) for i in range(100)])
        got = [x for x in read_lines(proc, 101) if x != b"probe\n"]
        assert got == [b"after%d\n" % i for i in range(len(got))]
        assert len(got) >= 100 - 1  # at most one probe line can follow the first one
        assert proc.poll() is None  # still reading
        assert "reconnected" in m.log()
        with open(m / "s/k", "wb") as f:  # the publisher reconnects too
            f.write(b"written after the restart")
        assert read_lines(proc, 1) == [b"written after the restart\n"]
    finally:
        if proc is not None:
            end(proc)
            # told once, where it reconnected: what was published meanwhile it missed
            assert proc.stderr.read() == b"ENOBUFS\n"
        m.stop()
        b.stop()


def test_the_mount_serves_on_while_its_reconnects_face_a_full_backlog(space):
    """The broker goes and its address is held by a listener that never accepts (what a
    stopped or overloaded broker looks like): the mount's connections try again without
    blocking its loop, so a reader's waiting messages and stat are still served; once a
    broker is back, reader and publisher carry on."""
    from faultkit import FullBacklog

    b = BrokerProcess(os.path.join(space, "backlog.sock")).start()
    m = Mount(b.address, os.path.join(space, "backlog"), "--reconnect-timeout", "20").start()
    proc = full = None
    fd = -1
    try:
        proc = read_on(touch(m, "s/k"))
        fd = os.open(m / "s/k", os.O_RDONLY)  # subscribed once open returns
        publish(b.address, (b"s/k", b"one"), (b"s/k", b"two"))
        assert read_lines(proc, 2) == [b"one\n", b"two\n"]  # the mount has them for fd too
        os.unlink(b.address)  # the broker's connections live on ...
        full = FullBacklog(b.address)  # ... its address is a full backlog
        b.stop()
        deadline = time.monotonic() + 10
        while "; reconnecting" not in m.log():
            assert time.monotonic() < deadline, m.log()
            time.sleep(0.02)
        served: list[object] = []
        job = threading.Thread(target=lambda: served.extend(
            [os.read(fd, 100), os.stat(m / "s/k").st_size >= 0, sorted(os.listdir(m / "s"))]),
            daemon=True)
        job.start()
        job.join(3)
        assert served == [b"one\ntwo\n", True, ["**", "k"]], "the mount stood still"
        full.close()
        b.start()
        deadline = time.monotonic() + 10
        while not readable(proc, 0.1):  # a write waits for the publisher's reconnect
            with open(m / "s/k", "wb") as f:
                f.write(b"probe")
            assert time.monotonic() < deadline, m.log()
        with open(m / "s/k", "wb") as f:
            f.write(b"back")
        seen: list[bytes] = []
        while b"back\n" not in seen:
            seen += read_lines(proc, 1)
        assert set(seen) == {b"probe\n", b"back\n"}
        assert "reconnected" in m.log()
    finally:
        if full is not None:
            full.close()  # unsticks a mount that blocked on it, so the rest can end
        if fd >= 0:
            os.close(fd)
        if proc is not None:
            end(proc)
        m.stop()
        b.stop()


def test_broker_gone_for_good_gives_readers_an_error(space):
    b = BrokerProcess(os.path.join(space, "gone.sock")).start()
    m = Mount(b.address, os.path.join(space, "gone"), "--reconnect-timeout", "1").start()
    try:
        proc = cat(m / "**")
        b.stop()
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 1 and b"Input/output error" in err
        assert "get EIO" in m.log()
        with pytest.raises(OSError) as info:  # new readers and writers: EIO, too
            open(m / "**", "rb")
        assert info.value.errno == errno.EIO
        os.mkdir(m / "w")
        t = time.monotonic()
        with pytest.raises(OSError) as info, open(m / "w/k", "wb", buffering=0) as f:
            f.write(b"nobody to take it")
        assert info.value.errno == errno.EIO and time.monotonic() - t < 5
        assert m.proc.poll() is None and mounted(m.path)  # the mount itself lives on
    finally:
        m.stop()


def test_ctrl_c_while_open_waits_for_a_silent_broker(space):
    """open() waits for the broker to confirm the subscription; a signal ends that wait
    too.  The broker is replaced by a listening socket that never accepts."""
    b = BrokerProcess(os.path.join(space, "silent.sock")).start()
    m = Mount(b.address, os.path.join(space, "silent")).start()
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        b.stop()
        if os.path.exists(b.address):
            os.unlink(b.address)
        silent.bind(b.address)
        silent.listen(64)
        proc = subprocess.Popen(["cat", m / "**"], stderr=subprocess.PIPE,
                                preexec_fn=default_sigint)
        wait_in_fuse(proc.pid)  # inside open()
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(5)
        assert time.monotonic() - t < 0.5 and proc.returncode == -signal.SIGINT
    finally:
        silent.close()
        m.stop()


def test_sigterm_and_fusermount_unmount_cleanly(bus, space):
    for how in ("SIGTERM", "fusermount"):
        m = Mount(bus.address, os.path.join(space, "life"))
        m.start()
        try:
            proc = cat(m / "**")
            if how == "SIGTERM":
                m.proc.terminate()
                assert m.proc.wait(10) == 0
                proc.wait(5)
                # end of file, and its close() answered before the unmount (it failed
                # with ECONNABORTED: cat exited 1, the audit of 2026-11-28)
                assert proc.returncode == 0, proc.stderr.read()
            else:
                end(proc)
                subprocess.run(["fusermount3", "-u", m.path], check=True)
                assert m.proc.wait(10) == 0
            assert not mounted(m.path)
            assert "unmounted" in m.log()
        finally:
            m.stop()


def test_tells_systemd_when_ready_and_stopping(bus, space):
    """For a Type=notify unit: READY=1 once mounted and serving, STOPPING=1 on SIGTERM."""
    sock_path = os.path.join(space, "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(sock_path)
    notify.settimeout(15)
    path = os.path.join(space, "notified")
    os.makedirs(path, exist_ok=True)
    proc = subprocess.Popen([*SBUS, "mount", "--address", bus.address, path],
                            env={**ENV, "NOTIFY_SOCKET": sock_path}, stderr=subprocess.PIPE)
    try:
        ready = notify.recv(4096).decode()
        assert "READY=1" in ready and mounted(path)
        os.listdir(path)  # serving
        proc.terminate()
        assert "STOPPING=1" in notify.recv(4096).decode()
        assert proc.wait(10) == 0
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mounted(path):
            subprocess.run(["fusermount3", "-u", "-z", path], check=False)


def test_a_notify_socket_naming_nothing_is_said_and_the_mount_serves(bus, space):
    """READY=1 and STOPPING=1 that cannot be sent (no manager at NOTIFY_SOCKET) are one
    warning, and the mount serves and ends as it would (`sdnotify.Reporter`)."""
    path = os.path.join(space, "unnotified")
    os.makedirs(path, exist_ok=True)
    proc = subprocess.Popen([*SBUS, "mount", "--address", bus.address, path],
                            env={**ENV, "NOTIFY_SOCKET": os.path.join(space, "nothing")},
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while not mounted(path):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        with open(os.path.join(path, "n"), "w") as f:  # serving: a write publishes
            f.write("x")
        proc.terminate()
        assert proc.wait(10) == 0
        err = proc.stderr.read().decode()
        assert err.count("cannot notify the service manager") == 1, err
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if mounted(path):
            subprocess.run(["fusermount3", "-u", "-z", path], check=False)


def test_daemon_mode(bus, space):
    path = os.path.join(space, "daemon")
    os.makedirs(path, exist_ok=True)
    r = subprocess.run([*SBUS, "mount", "--daemon", "--address", bus.address, path],
                       capture_output=True, timeout=20,
                       env={**ENV, "XDG_STATE_HOME": space})  # no journald: its log file
    try:
        assert r.returncode == 0, r.stderr
        assert mounted(path)
        sub = subscriber(bus.address, b"d")
        subprocess.run(["sh", "-c", f"echo via-daemon > {path}/d"], check=True, timeout=10)
        assert sub.recv(1000) == b"MSG d\0via-daemon\n"
    finally:
        subprocess.run(["fusermount3", "-u", "-z", path], check=False)
    deadline = time.monotonic() + 10
    while mounted(path):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_clear_errors(bus, space):
    r = subprocess.run([*SBUS, "mount", "--address", os.path.join(space, "none.sock"),
                        space], capture_output=True, text=True, timeout=20, env=ENV)
    assert r.returncode == 1 and "cannot connect" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*SBUS, "mount", "--address", bus.address, "/nonexistent/dir"],
                       capture_output=True, text=True, timeout=20, env=ENV)
    assert r.returncode == 1 and "not a directory" in r.stderr
    r = subprocess.run([*SBUS, "mount", "--address", bus.address, "--max-tasks", "0", space],
                       capture_output=True, text=True, timeout=20, env=ENV)
    assert r.returncode == 1 and "--max-tasks" in r.stderr
    assert not mounted(space)
