"""Tools for fault tests: a socket-holding supervisor, other-user processes, /proc readings.

`HeldSocket` plays the part systemd plays under socket activation: it owns the
listening socket and starts brokers on it with ``LISTEN_FDS=1``/``LISTEN_PID``,
and reads their ``READY=1`` from a ``NOTIFY_SOCKET`` of its own.  Because the
socket outlives each broker, a client that connects while no broker runs waits
in the backlog instead of being refused, and the next broker serves it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from conftest import stop_process

SBUS = [sys.executable, "-m", "sbus.cli"]
NOBODY = 65534


class HeldSocket:
    """A listening SEQPACKET socket held across broker restarts (what systemd does)."""

    def __init__(self, directory: Path, *serve_args: str, nofile: int | None = None,
                 notify: bool = True) -> None:
        self.dir = directory
        os.chmod(directory, 0o755)
        self.address = str(directory / "bus.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.address)
        os.chmod(self.address, 0o666)
        self.listener.listen(socket.SOMAXCONN)
        self.notify_path = str(directory / "notify")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.serve_args = serve_args
        self.use_notify = notify
        self.nofile = nofile
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.logs: list[Path] = []

    def start(self, timeout: float = 15.0) -> subprocess.Popen:
        """Start a broker on the held socket and wait for its READY=1."""
        fd = self.listener.fileno()
        move = "" if fd == 3 else f"exec 3<&{fd} {fd}<&-; "
        script = move + 'LISTEN_FDS=1 LISTEN_PID=$$ exec "$@"'
        log = self.dir / f"broker-{self.starts}.log"
        self.logs.append(log)
        env = dict(os.environ)
        if self.use_notify:
            env["NOTIFY_SOCKET"] = self.notify_path
        env.pop("SBUS_ADDRESS", None)
        nofile = self.nofile

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", script, "bash", *SBUS, "-v", "serve", *self.serve_args],
                pass_fds=(fd,), env=env, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=limit,
            )
        self.starts += 1
        self._wait_ready(timeout)
        return self.proc

    def _wait_ready(self, timeout: float) -> None:
        if not self.use_notify:  # no READY=1 to wait for: wait for a whoami answer
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            probe.connect(self.address)
            answered = served(probe, timeout)
            probe.close()
            if not answered:
                raise RuntimeError(f"broker not serving: {self.log_text()}")
            return
        self.notify.settimeout(0.2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.notify.recv(4096)
            except TimeoutError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"broker exited with {self.proc.returncode}: "
                                       f"{self.logs[-1].read_text()}") from None
                continue
            if b"READY=1" in msg.split(b"\n"):
                return
        raise TimeoutError(f"broker sent no READY=1 within {timeout} s")

    def status(self, until: Callable[[str], bool], timeout: float = 10.0) -> str:
        """Read the broker's STATUS= reports until one satisfies *until*; return it."""
        self.notify.settimeout(0.5)
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                msg = self.notify.recv(4096).decode(errors="replace")
            except TimeoutError:
                continue
            for line in msg.splitlines():
                if line.startswith("STATUS="):
                    last = line[len("STATUS="):]
                    if until(last):
                        return last
        raise TimeoutError(f"no matching STATUS= within {timeout} s; last: {last!r}")

    def kill(self) -> None:
        """kill -9 the running broker."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        stop_process(self.proc)
        self.listener.close()
        self.notify.close()

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs if p.exists())


class FullBacklog:
    """A listening SEQPACKET socket that does not accept, its backlog full: what a client
    meets at a broker that is stopped or whose loop is busy (a blocking connect waits,
    a non-blocking one says EAGAIN).  `make_room` accepts the oldest waiting connection."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(address)
        self.listener.listen(0)
        self.held: list[socket.socket] = []  # the fillers, then what `make_room` took
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
            try:
                s.connect(address)
            except BlockingIOError:  # full now
                s.close()
                break
            self.held.append(s)

    def make_room(self) -> socket.socket:
        conn, _ = self.listener.accept()
        self.held.append(conn)
        return conn

    def close(self) -> None:
        """Close it all and remove the socket file (once: then the path may be a broker's)."""
        if self.listener.fileno() < 0:
            return
        for s in self.held:
            s.close()
        self.listener.close()
        os.unlink(self.address)


def as_user(uid: int, target: Callable, *args) -> tuple[multiprocessing.Process, object]:
    """Run ``target(pipe, *args)`` in a forked child that has become *uid*.

    Returns the process and the parent's end of a duplex pipe for talking to it.
    """
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_become, args=(uid, target, child, args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def _become(uid: int, target: Callable, pipe, args: tuple) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    target(pipe, *args)


def rss_kib(pid: int) -> int:
    """Resident set size of *pid* from /proc (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process *pid* so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def broker_pid(proc: subprocess.Popen) -> int:
    """The broker's pid (bash exec()s into it, so it is the Popen's pid)."""
    return proc.pid


def served(sock: socket.socket, timeout: float = 3.0, sep: bytes = b"/") -> bool | None:
    """Whoami round trip: True if answered, False on EOF/reset (refused), None on timeout."""
    whoami = b"CMSG !" + sep + b"cred" + sep + b"whoami"
    old = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        sock.send(whoami)
        while True:
            p = sock.recv(1 << 20)
            if not p:
                return False
            if p.startswith(whoami + b"\0"):
                return True
    except (BrokenPipeError, ConnectionResetError):
        return False
    except TimeoutError:
        return None
    finally:
        sock.settimeout(old)


def broker_clients(address: str, timeout: float = 10.0) -> list[dict]:
    """The clients the broker's status lists now (``CMSG broker/status``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout)
        s.connect(address)
        s.send(b"CMSG broker/status")
        while not (p := s.recv(1 << 17)).startswith(b"CMSG broker/status\0"):
            if not p:
                raise ConnectionError("the broker closed the connection")
        return json.loads(p.split(b"\0", 1)[1])["clients"]


def wait_subscribed(address: str, pattern: bytes | str, timeout: float = 10.0) -> None:
    """Until the broker's status lists a client holding *pattern*: the way to know that
    another process's subscription is in force (instead of sleeping and hoping)."""
    text = pattern.decode() if isinstance(pattern, bytes) else pattern
    until(lambda: any(text in c["patterns"] for c in broker_clients(address)),
          f"a client subscribed to {text!r}", timeout, every=0.02)


def until(condition: Callable[[], object], what: str, timeout: float = 10.0,
          every: float = 0.01) -> object:
    """Poll *condition* until it returns something true (returned), failing after *timeout*
    seconds with *what*: the wait on a condition that replaces a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(every)
    return result


class PipeLines:
    """The whole lines a child's pipe has given so far (without their newline), read
    straight from its descriptor: a buffered ``readline`` may take two lines at once,
    and ``select`` on the descriptor then never reports the one left in Python's buffer
    (a test waited in vain for a drop report it had already read)."""

    def __init__(self, pipe) -> None:
        self.fd = pipe.fileno()
        self.lines: list[bytes] = []
        self.ended = False
        self._part = b""

    def take(self, timeout: float = 0) -> bool:
        """Read what the pipe holds, waiting up to *timeout* for the first bytes; whether
        anything came (the end included)."""
        came = False
        while not self.ended and select.select([self.fd], [], [], timeout)[0]:
            chunk = os.read(self.fd, 1 << 16)
            self.ended = not chunk
            *whole, self._part = (self._part + chunk).split(b"\n")
            self.lines += whole
            came, timeout = True, 0
        return came

    def next(self, n: int, timeout: float = 10) -> list[bytes]:
        """The next *n* lines, taken out."""
        deadline = time.monotonic() + timeout
        while len(self.lines) < n:
            if self.ended:
                raise EOFError(f"the pipe ended after {self.lines[-3:]}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(self.lines)} of {n} lines: {self.lines[-3:]}")
            self.take(left)
        got, self.lines[:n] = self.lines[:n], []
        return got

    def until(self, last: bytes, timeout: float = 30) -> list[bytes]:
        """The lines up to one equal to *last* (included), taken out."""
        deadline = time.monotonic() + timeout
        while last not in self.lines:
            assert not self.ended, f"the pipe ended after {self.lines[-5:]}"
            assert time.monotonic() < deadline, self.lines[-5:]
            self.take(0.5)
        return self.next(self.lines.index(last) + 1)
