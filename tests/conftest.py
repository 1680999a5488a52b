"""Shared fixtures: a real broker process on a temporary socket, and raw sockets to it."""

from __future__ import annotations

import fcntl
import inspect
import os
import re
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


def read_until_quiet(s: socket.socket, key: bytes, quiet: float = 2.0) -> tuple[list[bytes], int]:
    """What a raw subscriber that has not been reading holds: the payloads of the
    messages on *key*, in order, and the drops the broker reported, read until nothing
    comes for *quiet* seconds."""
    got, dropped = [], 0
    head = b"MSG " + key + b"\0"
    s.settimeout(quiet)
    try:
        while True:
            p = s.recv(1 << 16)
            if p.startswith(head):
                got.append(p[len(head):])
            elif p.startswith(b"CMSG blocking/dropped\0"):
                dropped += int(p.split(b"\0")[1])
    except TimeoutError:
        return got, dropped


def carrier_publishes_for(address: str) -> int | None:
    """Whom the broker counts the messages of its one ``nowait`` connection (a mount's
    or a gateway's publisher) for, by its status (`publishing_for`)."""
    import json

    s = raw(address)
    s.send(b"CMSG broker/status")
    while not (p := s.recv(1 << 20)).startswith(b"CMSG broker/status\0"):
        pass
    s.close()
    clients = json.loads(p.split(b"\0", 1)[1])["clients"]
    return next(c["publishing_for"] for c in clients if c["nowait"])


def named_after_a_cut_send(proc: subprocess.Popen, address: str, open_carrier, publish,
                           first: int, second: int) -> int | None:
    """Whom the broker *proc* counts a carrier's messages for (`carrier_publishes_for`)
    after this: a message of user *first*; the broker stopped (SIGSTOP), *first*'s large
    messages until one is cut short (its socket full: cancelled after 50 ms), then one
    of *second*'s cut short the same way, as a writer's signal or a remote client's
    hang-up cuts it; the broker back, one more of *second*'s.  *open_carrier*(nursery)
    starts the carrier; *publish*(carrier, payload, user) sends through it."""
    import signal

    import trio

    async def main() -> int | None:
        async with trio.open_nursery() as nursery:
            carrier = await open_carrier(nursery)
            await publish(carrier, b"first", first)
            proc.send_signal(signal.SIGSTOP)
            try:
                for _ in range(100):
                    with trio.move_on_after(0.05) as late:
                        await publish(carrier, b"x" * 100_000, first)
                    if late.cancelled_caught:
                        break
                with trio.move_on_after(0.05):
                    await publish(carrier, b"mine", second)
            finally:
                proc.send_signal(signal.SIGCONT)
            await publish(carrier, b"mine again", second)
            named = await trio.to_thread.run_sync(carrier_publishes_for, address)
            nursery.cancel_scope.cancel()
        return named

    return trio.run(main)


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


# --- The fast lane: `pytest -m "not slow"` runs the pure tests (no process of any kind) ---
# A test is marked slow when it, a fixture it uses, or a function or class of tests/ that
# either names (transitively) mentions a way of starting a process. In the fast lane a test
# that starts a process anyway fails, so a wrong guess is loud, never silent.
_TESTS_DIR = Path(__file__).resolve().parent
_STARTS_PROCESS = re.compile(
    r"\b(subprocess|Popen|os\.fork|os\.system|posix_spawn|multiprocessing|BrokerProcess"
    r"|SBUS|pyspark|SparkSession|faultkit)\b")
_verdicts: dict[object, bool] = {}


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _starts_process(obj: object) -> bool:
    """Whether *obj*, defined under tests/, or what it names there, starts a process."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    try:
        in_tests = Path(inspect.getfile(obj)).resolve().is_relative_to(_TESTS_DIR)
    except TypeError:  # built-in
        return False
    if not in_tests:
        return False
    if obj in _verdicts:
        return _verdicts[obj]
    _verdicts[obj] = False  # a recursion through itself adds nothing
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        source = ""
    verdict = bool(_STARTS_PROCESS.search(source))
    if not verdict:
        code = getattr(obj, "__code__", None)
        names = _code_names(code) if code is not None else set(re.findall(r"\w+", source))
        module = sys.modules.get(getattr(obj, "__module__", ""), None)
        scope = vars(module) if module is not None else {}
        verdict = any(_starts_process(scope[n]) for n in names
                      if n in scope and (inspect.isfunction(scope[n]) or inspect.isclass(
                          scope[n]) or inspect.ismodule(scope[n])))
    _verdicts[obj] = verdict
    return verdict


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow"):
            continue
        fixtures = getattr(item, "_fixtureinfo", None)
        funcs = [getattr(item, "function", None)] + [
            d.func
            for name, defs in (fixtures.name2fixturedefs.items() if fixtures else ())
            if name != "_fast_lane_guard" for d in defs]
        if any(f is not None and _starts_process(f) for f in funcs):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _fast_lane_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the fast lane, starting a process fails the test: it belongs in the slow lane."""
    if "not slow" not in (request.config.option.markexpr or ""):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it slow")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(os, "fork", refuse)


# --- Tests that bound latency by the wall clock run alone, also under `-n 4` -------------
# tools/test.sh runs four pytest workers (pytest-xdist).  A test marked `alone` (an honest
# client's p99 under an attack) must not share the machine with another test's processes:
# its worker waits until the other workers' current tests are over, and they start
# nothing new meanwhile.  Two locks make that a readers-writer lock that favours the
# writer: every test passes the turnstile; others then hold the room shared, `alone` ones
# hold the turnstile while they wait for the room, and then the room exclusively.
# The lock files live in a directory the main pytest process makes before it starts its
# workers (they inherit its environment) and removes when the run ends.
_LOCKS = "SBUS_TEST_LOCKS"
_locks_key = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ and _LOCKS not in os.environ:
        config.stash[_locks_key] = os.environ[_LOCKS] = tempfile.mkdtemp(prefix="sbus-tests-")


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_locks_key, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[_LOCKS]


def _lock_file(name: str) -> int:
    return os.open(os.path.join(os.environ[_LOCKS], name),
                   os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: nothing runs beside it
        yield
        return
    turnstile, room = _lock_file("turnstile"), _lock_file("room")
    alone = item.get_closest_marker("alone") is not None
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
    finally:
        os.close(room)  # (closing releases the locks)
        os.close(turnstile)
