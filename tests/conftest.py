"""Shared fixtures: a real broker process on a temporary socket, and raw sockets to it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbus.client import wait_for_broker
from sbus.journal.store import JournalError, records

SBUS = [sys.executable, "-m", "sbus.cli"]


def stop_process(proc: subprocess.Popen | None, timeout: float = 10) -> None:
    """SIGTERM, wait up to *timeout* seconds, then SIGKILL: every harness's shutdown."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for_socket(path: str, proc: subprocess.Popen | None = None, timeout: float = 10) -> None:
    """Wait until a broker accepts connections on *path* (failing early if *proc* exits)."""
    wait_for_broker(path, timeout, alive=None if proc is None else lambda: proc.poll() is None)


class BrokerProcess:
    """A real `sbus serve` in a child process."""

    def __init__(self, address: str, *args: str) -> None:
        self.address = address
        self.args = args
        self.proc: subprocess.Popen | None = None
        # a file, not a pipe: a pipe nobody reads would stall the broker once full
        self.logfile = tempfile.NamedTemporaryFile(prefix="sbus-broker-", suffix=".log")

    def start(self) -> BrokerProcess:
        self.proc = subprocess.Popen(
            [*SBUS, "-v", "serve", "--address", self.address, *self.args],
            stdout=subprocess.DEVNULL, stderr=self.logfile,
        )
        wait_for_socket(self.address, self.proc)
        return self

    def stop(self) -> str:
        """SIGTERM, wait, and return what the broker logged."""
        assert self.proc is not None
        stop_process(self.proc)
        with open(self.logfile.name, errors="replace") as f:
            return f.read()

    def log(self) -> str:
        """Stop the broker and return its log (for assertions on refusals)."""
        return self.stop()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory: unix socket paths are limited to 107 bytes."""
    d = tempfile.mkdtemp(prefix="sbus-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def broker(short_tmp: Path) -> Iterator[BrokerProcess]:
    """A running broker with default settings; ``broker.address`` is its socket path."""
    b = BrokerProcess(str(short_tmp / "bus.sock")).start()
    yield b
    b.stop()


@pytest.fixture
def make_broker(short_tmp: Path):
    """Start brokers with extra ``sbus serve`` arguments; all stopped at teardown."""
    started: list[BrokerProcess] = []

    def make(*args: str, name: str = "bus.sock") -> BrokerProcess:
        b = BrokerProcess(str(short_tmp / name), *args).start()
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


def raw(address: str, timeout: float = 5.0) -> socket.socket:
    """A raw SOCK_SEQPACKET connection: the protocol without our library."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect(address)
    return s


def sync(s: socket.socket) -> None:
    """Wait until the broker has processed everything *s* sent before (whoami round trip)."""
    s.send(b"CMSG !/cred/whoami")
    while True:
        p = s.recv(1 << 20)
        if not p:
            raise ConnectionError("the broker closed the connection")
        if p.startswith(b"CMSG !/cred/whoami\0"):
            return


def recorded_pairs(journal: Path) -> list[tuple[bytes, bytes]]:
    """``(key, payload)`` of every record but the probes of `publish_to_recorder`, in order;
    none while the journal does not exist yet."""
    try:
        return [(r[2], r[3]) for r in records(journal) if r[2] != b"probe"]
    except (JournalError, FileNotFoundError):
        return []


def publish_to_recorder(address: str, journal: Path, sent: list[tuple[bytes, bytes]],
                        unrecorded: list[tuple[bytes, bytes]] = ()) -> None:
    """Once a recorder of everything writes *journal* (it has recorded a ``probe``),
    publish *sent* then *unrecorded*, and wait until *sent* is in."""
    with raw(address, timeout=10) as c:
        deadline = time.monotonic() + 30
        while not journal.is_dir() or not any(True for _ in records(journal)):
            assert time.monotonic() < deadline, f"nothing recorded into {journal}"
            c.send(b"MSG probe\0")
            sync(c)
            time.sleep(0.1)
        for key, payload in [*sent, *unrecorded]:
            c.send(b"MSG " + key + b"\0" + payload)
        sync(c)
    deadline = time.monotonic() + 10
    while len(recorded_pairs(journal)) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def _sbus_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parent.parent)
                       + os.pathsep + os.environ.get("PYTHONPATH", ""))
