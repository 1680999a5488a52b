"""`sbus serve` under real socket activation (``systemd-socket-activate``).

systemd-socket-activate binds the socket, waits for the first connection and only
then execs the broker with the socket in LISTEN_FDS -- what sbus.socket does,
without needing a running systemd.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import raw, sync

from sbus.client import Client
from sbus.protocol import Publish

SBUS_EXE = Path(sys.executable).parent / "sbus"
ACTIVATE = shutil.which("systemd-socket-activate")


def _exe(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/exe")


def activate(path: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """systemd-socket-activate listening on *path*, set to exec `sbus serve`."""
    extra = [f"-E{k}={v}" for k, v in (env or {}).items()]
    proc = subprocess.Popen([ACTIVATE, *flags, "-l", str(path), *extra, str(SBUS_EXE), "serve"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    ready = path.exists if "--datagram" in flags else lambda: _listening(path)
    while not ready():  # bound is not enough: a connect before listen() is refused
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "systemd-socket-activate did not listen"
        time.sleep(0.01)
    return proc


def _listening(path: Path) -> bool:
    """Whether a socket listens on *path*, asked of /proc/net/unix (its flags column has
    __SO_ACCEPTCON), not by connecting: a connection would start the broker."""
    with open("/proc/net/unix") as f:
        next(f)  # the header
        return any(int(fields[3], 16) & 0x10000 and fields[-1] == str(path)
                   for fields in (line.split() for line in f) if len(fields) == 8)


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    if proc.poll() is None:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def test_first_connection_starts_broker_and_pubsub_works(short_tmp: Path) -> None:
    path = short_tmp / "bus.sock"
    proc = activate(path, "--seqpacket")
    try:
        time.sleep(0.2)
        # Nobody has connected: no broker yet, only the activator holding the socket.
        assert _exe(proc.pid) == os.path.realpath(ACTIVATE)

        # The first connection is made before any broker runs, and is still served.
        with Client(str(path), timeout=10) as sub:
            sub.subscribe(b"sensors/*/temp")
            assert sub.whoami() == f"!/cred/{os.getgid()}/{os.getuid()}/{os.getpid()}".encode()
            # ... by the broker the activator exec'd in its place
            assert _exe(proc.pid) == os.path.realpath(sys.executable)
            with Client(str(path), timeout=10) as pub:
                pub.publish(b"sensors/kitchen/temp", b"21.5")
                pub.publish(b"sensors/kitchen/humidity", b"40")
                pub.publish(b"sensors/hall/temp", b"19.0")
            got = [sub.receive(timeout=5), sub.receive(timeout=5)]
            assert got == [Publish(b"sensors/kitchen/temp", b"21.5"),
                           Publish(b"sensors/hall/temp", b"19.0")]
            # Raw protocol too: a second subscriber sees what the first publishes.
            s = raw(str(path))
            s.send(b"SUB a/")
            sync(s)
            sub.publish(b"a/b", b"x")
            assert s.recv(1024) == b"MSG a/b\0x"
            s.close()
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    assert "listening on the socket from systemd" in err
    assert path.exists()  # the socket belongs to the activator, never unlinked by the broker


def test_notify_ready_status_watchdog_and_stopping(short_tmp: Path) -> None:
    """READY=1, STATUS= and WATCHDOG=1 reach $NOTIFY_SOCKET; STOPPING=1 on SIGTERM."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(short_tmp / "notify"))
    notify.settimeout(10)
    path = short_tmp / "bus.sock"
    proc = activate(path, "--seqpacket",
                    env={"NOTIFY_SOCKET": str(short_tmp / "notify"), "WATCHDOG_USEC": "600000"})
    try:
        with Client(str(path), timeout=10) as c:
            first = notify.recv(4096).decode().split("\n")
            assert first[0] == "READY=1"
            assert first[1].startswith("STATUS=listening, ")
            c.subscribe(b"x")
            c.publish(b"x", b"1")
            c.receive(timeout=5)
            # WATCHDOG_USEC=0.6 s: a ping at least every 0.3 s, each with a fresh STATUS=.
            start = time.monotonic()
            pings = []
            while len(pings) < 4:
                msg = notify.recv(4096).decode().split("\n")
                if "WATCHDOG=1" in msg:
                    pings.append(msg)
            assert time.monotonic() - start < 3  # 1.2 s expected; slack for loaded CI
            assert pings[-1][0].startswith("STATUS=1 clients, 1 subscriptions, 1 published")
        proc.send_signal(signal.SIGTERM)
        while "STOPPING=1" not in notify.recv(4096).decode().split("\n"):
            pass
        proc.wait(timeout=10)
    finally:
        rc, err = stop(proc)
        notify.close()
    assert rc == 0, err


@pytest.mark.parametrize("kind", ["stream", "datagram"])
def test_wrong_socket_type_is_a_clear_error(short_tmp: Path, kind: str) -> None:
    path = short_tmp / "bus.sock"
    proc = activate(path, *(["--datagram"] if kind == "datagram" else []))
    try:
        s = socket.socket(socket.AF_UNIX,
                          socket.SOCK_DGRAM if kind == "datagram" else socket.SOCK_STREAM)
        if kind == "datagram":
            s.sendto(b"SUB x", str(path))
        else:
            s.connect(str(path))
        proc.wait(timeout=20)
        s.close()
    finally:
        rc, err = stop(proc)
    assert rc == 1
    last = err.strip().splitlines()[-1]
    assert last == ("sbus serve: the socket systemd passed (fd 3) is not a listening unix "
                    "SOCK_SEQPACKET socket: use ListenSequentialPacket= in sbus.socket")
    assert "Traceback" not in err
