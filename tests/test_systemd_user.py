"""The user units under a real systemd user manager (see `systemd_usermgr`).

One manager serves the whole module; every test starts with sbus.socket and
sbus.service stopped and leaves them so.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import publish_to_recorder, recorded_pairs, sync
from faultkit import until
from restart_load import Audience
from systemd_usermgr import UserManager

from sbus.client import Client, ConnectError, SbusError
from sbus.journal.store import list_segments
from sbus.protocol import Publish

SBUS_EXE = Path(sys.executable).parent / "sbus"


@pytest.fixture(scope="module")
def manager() -> Iterator[UserManager]:
    base = Path(tempfile.mkdtemp(prefix="sbus-um-", dir="/tmp"))
    m = UserManager(base).start()
    try:
        yield m
    finally:
        leftover = m.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert not leftover, f"processes left in the user manager's cgroup: {leftover}"


@pytest.fixture(scope="module")
def installed(manager: UserManager) -> str:
    """The project's user units, installed the way a user would."""
    return manager.run(str(SBUS_EXE), "install-units", "--user").stdout


@pytest.fixture
def bus(manager: UserManager, installed: str) -> Iterator[str]:
    """sbus.socket started; yields the socket path. Stopped (and checked) afterwards."""
    manager.systemctl("start", "sbus.socket")
    try:
        yield str(manager.runtime / "sbus.socket")
    finally:
        manager.systemctl("stop", "sbus.socket", "sbus.service")
        manager.systemctl("reset-failed", check=False)


def test_install_units_writes_into_the_managers_unit_dir(manager: UserManager,
                                                         installed: str) -> None:
    unit_dir = manager.unit_dir
    assert installed.splitlines()[:3] == [f"wrote {unit_dir / n}" for n in
                                          ("sbus.socket", "sbus.service", "sbus-mount.service")]
    assert "ran systemctl --user daemon-reload" in installed
    service = (unit_dir / "sbus.service").read_text()
    assert f"ExecStart={SBUS_EXE} serve --exit-idle-time 10min\n" in service
    loaded = manager.show("sbus.socket", "LoadState", "FragmentPath", "Listen")
    assert loaded["LoadState"] == "loaded"
    assert loaded["FragmentPath"] == str(unit_dir / "sbus.socket")
    assert loaded["Listen"] == f"{manager.runtime}/sbus.socket (SequentialPacket)"
    # Installing again changes nothing.
    again = manager.run(str(SBUS_EXE), "install-units", "--user").stdout
    assert again.splitlines()[:3] == [f"unchanged {unit_dir / n}" for n in
                                      ("sbus.socket", "sbus.service", "sbus-mount.service")]


def test_service_starts_on_first_connection_with_status(manager: UserManager, bus: str) -> None:
    sock = manager.show("sbus.socket", "ActiveState", "SubState")
    assert (sock["ActiveState"], sock["SubState"]) == ("active", "listening")
    assert Path(bus).exists() and oct(os.stat(bus).st_mode & 0o777) == "0o600"
    before = manager.show("sbus.service", "ActiveState", "MainPID")
    assert before == {"ActiveState": "inactive", "MainPID": "0"}

    with Client(bus, timeout=10) as sub, Client(bus, timeout=10) as pub:
        sub.subscribe(b"t/*")
        sub.whoami()
        pub.publish(b"t/1", b"hello")
        assert sub.receive(timeout=5) == Publish(b"t/1", b"hello")
        state = manager.show("sbus.service", "ActiveState", "SubState", "MainPID",
                             "StatusText", "NotifyAccess", "Type")
        assert (state["ActiveState"], state["SubState"]) == ("active", "running")
        assert (state["Type"], state["NotifyAccess"]) == ("notify", "main")
        assert int(state["MainPID"]) > 0
        assert state["StatusText"].startswith("listening, ") or "clients" in state["StatusText"]
        # The periodic STATUS= (every 2 s) reports the live numbers.
        deadline = time.monotonic() + 10
        while True:
            status = manager.systemctl("status", "sbus.service", check=False).stdout
            if 'Status: "2 clients, 1 subscriptions, 1 published, 1 delivered, 0 dropped' \
                    in status:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert "Active: active (running)" in status


def test_restart_during_publish_loop_refuses_nobody(manager: UserManager, bus: str) -> None:
    """Restart the broker 3 times under load: connections may be closed, never refused."""
    stop = threading.Event()
    errors: list[str] = []
    counts = {"connects": 0, "served": 0, "reconnects": 0}
    lock = threading.Lock()

    def connect() -> Client:
        try:
            c = Client(bus, timeout=10)
        except ConnectError as exc:  # what a refused (or missing) socket looks like
            errors.append(str(exc))
            raise
        with lock:
            counts["connects"] += 1
        return c

    def publisher() -> None:
        n = 0
        c = connect()
        while not stop.is_set():
            try:
                c.publish(b"load/n", str(n).encode())
                n += 1
                time.sleep(0.001)
            except (OSError, SbusError):
                c.close()
                with lock:
                    counts["reconnects"] += 1
                c = connect()
        c.close()

    def newcomer() -> None:
        """Fresh connections all the time: each must be answered (by old or new broker)."""
        while not stop.is_set():
            c = connect()
            try:
                c.whoami(timeout=10)
                with lock:
                    counts["served"] += 1
            except SbusError:  # accepted by the broker that was stopping: try again
                with lock:
                    counts["reconnects"] += 1
            finally:
                c.close()

    threads = [threading.Thread(target=f, daemon=True) for f in (publisher, newcomer, newcomer)]
    with Client(bus, timeout=10) as first:
        first.whoami()  # starts the service
    pids = [manager.show("sbus.service", "MainPID")["MainPID"]]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            time.sleep(0.5)
            manager.systemctl("restart", "sbus.service")
            pids.append(manager.show("sbus.service", "MainPID")["MainPID"])
        time.sleep(0.5)
        # After the last restart a subscriber sees the publisher's loop again.
        with Client(bus, timeout=10) as sub:
            sub.subscribe(b"load/n")
            sub.whoami()
            assert sub.receive(timeout=10).key == b"load/n"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=20)
    print(counts, pids)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    assert len(set(pids)) == 4 and "0" not in pids, pids  # really four brokers
    assert counts["served"] > 10 and counts["connects"] > counts["served"] // 2, counts


def test_stop_leaves_no_process_and_no_socket(manager: UserManager, bus: str) -> None:
    with Client(bus, timeout=10) as c:
        c.whoami()
    pid = int(manager.show("sbus.service", "MainPID")["MainPID"])
    assert pid in manager.stray_pids()
    manager.systemctl("stop", "sbus.socket", "sbus.service")
    for unit in ("sbus.socket", "sbus.service"):
        assert manager.show(unit, "ActiveState")["ActiveState"] == "inactive"
    # Exited on SIGTERM with status 0: a clean stop, not a kill.
    assert manager.show("sbus.service", "Result", "ExecMainStatus") == \
        {"Result": "success", "ExecMainStatus": "0"}
    assert manager.stray_pids() == set()
    assert not os.path.exists(f"/proc/{pid}")
    assert not Path(bus).exists()  # RemoveOnStop=yes
    with pytest.raises(ConnectError, match="cannot connect to the sbus broker at"):
        Client(bus)


def test_watchdog_restarts_a_hung_broker(manager: UserManager, bus: str) -> None:
    """With WatchdogSec= set, a broker that stops responding is killed and restarted."""
    dropin = manager.unit_dir / "sbus.service.d"
    dropin.mkdir(exist_ok=True)
    (dropin / "watchdog.conf").write_text("[Service]\nWatchdogSec=4s\nLimitCORE=0\n")
    manager.systemctl("daemon-reload")
    try:
        with Client(bus, timeout=10) as c:
            c.whoami()
        state = manager.show("sbus.service", "MainPID", "WatchdogUSec", "NRestarts")
        assert state["WatchdogUSec"] == "4s"
        old = int(state["MainPID"])
        time.sleep(3)  # healthy: the broker pings, nothing happens
        assert manager.show("sbus.service", "MainPID", "NRestarts") == \
            {"MainPID": str(old), "NRestarts": state["NRestarts"]}
        os.kill(old, signal.SIGSTOP)  # hung
        deadline = time.monotonic() + 20
        while manager.show("sbus.service", "MainPID")["MainPID"] in (str(old), "0"):
            assert time.monotonic() < deadline, "the watchdog did not restart the broker"
            time.sleep(0.1)
        after = manager.show("sbus.service", "NRestarts", "ActiveState")
        assert int(after["NRestarts"]) == int(state["NRestarts"]) + 1
        with Client(bus, timeout=10) as c:  # and the bus works again
            c.whoami()
        assert not os.path.exists(f"/proc/{old}")
    finally:
        (dropin / "watchdog.conf").unlink()
        dropin.rmdir()
        manager.systemctl("daemon-reload")


def test_mount_service_shows_the_bus_as_files(manager: UserManager, bus: str) -> None:
    """sbus-mount.service mounts the bus (after sbus.socket) at %t/sbus-fs."""
    assert manager.proc is not None
    mount_point = manager.runtime / "sbus-fs"
    # The manager has its own mount namespace: the host sees the mount through /proc.
    inside = Path(f"/proc/{manager.proc.pid}/root{mount_point}")

    def mounted() -> bool:
        mounts = Path(f"/proc/{manager.proc.pid}/mounts").read_text().splitlines()
        return any(m.split()[1] == str(mount_point) for m in mounts)

    manager.systemctl("start", "sbus-mount.service")
    try:
        deadline = time.monotonic() + 20
        while not mounted():
            state = manager.show("sbus-mount.service", "ActiveState")["ActiveState"]
            assert time.monotonic() < deadline and state in ("active", "activating"), state
            time.sleep(0.1)
        with Client(bus, timeout=10) as c:
            c.subscribe(b"fs/*")
            c.whoami()
            (inside / "fs").mkdir(exist_ok=True)
            (inside / "fs" / "note").write_bytes(b"written as a file\n")
            assert c.receive(timeout=10) == Publish(b"fs/note", b"written as a file\n")
        pid = int(manager.show("sbus-mount.service", "MainPID")["MainPID"])
        assert pid > 0
    finally:
        manager.systemctl("stop", "sbus-mount.service")
    assert not mounted()
    assert not os.path.exists(f"/proc/{pid}")
    assert manager.show("sbus-mount.service", "Result")["Result"] == "success"


def test_record_service_journals_the_bus(manager: UserManager, bus: str) -> None:
    """sbus-record.service records every key that is not secret into %S/sbus/journal (the
    manager's state directory); a stop flushes and seals, so the journal is complete."""
    manager.systemctl("start", "sbus-record.service")
    argv = manager.show("sbus-record.service", "ExecStart")["ExecStart"]
    journal = Path(argv.split(" --dir ")[1].split()[0])
    assert journal.parent.parent in (manager.state, manager.config)  # %S: by systemd version
    sent = [(b"rec/%d" % (i % 3), b"\0payload %d\xff" % i) for i in range(300)]
    try:
        publish_to_recorder(bus, journal, sent, [(b"!/cred/0/secret", b"never recorded")])
    finally:
        manager.systemctl("stop", "sbus-record.service")
    assert manager.show("sbus-record.service", "Result")["Result"] == "success"
    assert [s.sealed for s in list_segments(journal)] == [True]
    assert recorded_pairs(journal) == sent


def test_exit_on_idle_and_started_again_by_the_next_client(manager: UserManager,
                                                           bus: str) -> None:
    """`--exit-idle-time`: the broker ends once nobody has been connected for that long
    (the user unit's default is 10 minutes; a drop-in shortens it here), sbus.socket
    keeps listening, and the next client starts a new broker and is served."""
    unit = (manager.unit_dir / "sbus.service").read_text()
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(" serve --exit-idle-time 10min")
    dropin = manager.unit_dir / "sbus.service.d"
    dropin.mkdir(exist_ok=True)
    (dropin / "idle.conf").write_text(
        "[Service]\nExecStart=\n" + exec_start.replace("10min", "1s") + "\n")
    manager.systemctl("daemon-reload")
    try:
        with Client(bus) as c:
            c.whoami()
            first = manager.show("sbus.service", "MainPID")["MainPID"]
            time.sleep(2)  # a client connected: no exit however long it lasts
            assert manager.show("sbus.service", "ActiveState")["ActiveState"] == "active"
        closed = time.monotonic()
        while manager.show("sbus.service", "ActiveState")["ActiveState"] != "inactive":
            assert time.monotonic() - closed < 15, "the broker did not exit when idle"
            time.sleep(0.1)
        assert time.monotonic() - closed >= 0.9
        ended = manager.show("sbus.service", "Result", "ExecMainStatus", "NRestarts")
        assert ended == {"Result": "success", "ExecMainStatus": "0", "NRestarts": "0"}
        assert manager.show("sbus.socket", "ActiveState")["ActiveState"] == "active"
        with Client(bus) as c:  # the socket starts it again
            c.subscribe(b"again")
            c.publish(b"again", b"served")
            assert c.receive(timeout=10) == Publish(b"again", b"served")
            assert manager.show("sbus.service", "MainPID")["MainPID"] not in ("0", first)
    finally:
        (dropin / "idle.conf").unlink()
        dropin.rmdir()
        manager.systemctl("daemon-reload")


@pytest.fixture
def broker_log(manager: UserManager, bus: str) -> Iterator[Path]:
    """The broker's standard error, appended to a file (the manager's services write to
    /dev/null otherwise)."""
    path = manager.base / "broker.log"
    path.write_text("")
    dropin = manager.unit_dir / "sbus.service.d"
    dropin.mkdir(exist_ok=True)
    (dropin / "log.conf").write_text(f"[Service]\nStandardError=append:{path}\n")
    manager.systemctl("daemon-reload")
    try:
        yield path
    finally:
        (dropin / "log.conf").unlink()
        if not any(dropin.iterdir()):
            dropin.rmdir()
        manager.systemctl("daemon-reload")


def test_restart_hands_every_client_over_under_load(manager: UserManager, bus: str,
                                                    broker_log: Path) -> None:
    """`systemctl restart sbus.service` while a publisher streams: the broker puts every
    client and a snapshot into the fd store, the next one takes them over, and no client
    notices (no end-of-file; reliable, ordinary and secret readers get everything in
    order).  `stop` then `start` is an ordinary restart: the store is emptied, clients
    see end-of-file."""
    audience = Audience(bus)  # its first connection starts the service
    try:
        first = manager.show("sbus.service", "MainPID")["MainPID"]
        mark = broker_log.stat().st_size
        report = audience.across(lambda: manager.systemctl("restart", "sbus.service"))
        print("systemctl restart under load:", report)
        second = manager.show("sbus.service", "MainPID", "NRestarts")
        assert second["MainPID"] not in ("0", first)  # really a new broker
        log = broker_log.read_text()[mark:]
        assert "handing over 4 clients" in log and "took over 4 clients" in log, log
        # the successor took the fds out of the store: the next handover stores afresh
        assert manager.show("sbus.service", "NFileDescriptorStore") == \
            {"NFileDescriptorStore": "0"}
        mark = broker_log.stat().st_size
        manager.systemctl("stop", "sbus.service")
        audience.all_see_eof()
        manager.systemctl("start", "sbus.service")
        with Client(bus, timeout=10) as c:
            c.whoami()
        assert "took over" not in broker_log.read_text()[mark:]
    finally:
        audience.close()


def test_reload_makes_the_next_broker_before_breaking(manager: UserManager, bus: str,
                                                     broker_log: Path) -> None:
    """`systemctl reload sbus.service` (ExecReload= sends SIGHUP): the next broker starts
    while the old one serves, takes every client over and becomes the service's main
    process (MAINPID=); no client notices, the service never leaves "active", and the
    manager counts no restart."""
    audience = Audience(bus)
    try:
        first = manager.show("sbus.service", "MainPID", "NRestarts")
        mark = broker_log.stat().st_size

        def reload() -> None:
            """`systemctl reload` returns once the signal is sent, while the old broker
            serves on: the load goes on until the successor has taken the clients over
            (its start-up took over a second on a loaded machine)."""
            manager.systemctl("reload", "sbus.service")
            until(lambda: "took over 4 clients" in broker_log.read_text()[mark:],
                  "the successor took the clients over", timeout=30)

        report = audience.across(reload)
        print("systemctl reload under load:", report)
        log = broker_log.read_text()[mark:]
        assert "reload: started the next broker" in log, log
        deadline = time.monotonic() + 10
        while manager.show("sbus.service", "MainPID")["MainPID"] == first["MainPID"]:
            assert time.monotonic() < deadline, "the successor never became the main process"
            time.sleep(0.05)
        now = manager.show("sbus.service", "MainPID", "NRestarts", "ActiveState")
        assert now["MainPID"] != "0" and now["ActiveState"] == "active"
        assert now["NRestarts"] == first["NRestarts"]
        with Client(bus, timeout=10) as c:  # the new main process serves newcomers too
            c.whoami()
        manager.systemctl("stop", "sbus.service")  # and stops as the service's own
        audience.all_see_eof()
    finally:
        audience.close()


def test_restart_refuses_a_snapshot_of_another_version(manager: UserManager, bus: str,
                                                       broker_log: Path) -> None:
    """A broker of another snapshot format stored its clients; its successor refuses the
    snapshot with one log line, lets those clients go (end-of-file: they reconnect, as
    after an ordinary restart), empties the store and serves."""
    dropin = manager.unit_dir / "sbus.service.d"
    dropin.mkdir(exist_ok=True)
    older = ("import sys; from sbus import handover, cli; "
             "handover.FORMAT = 'sbus-handover/0'; sys.exit(cli.main(['serve']))")
    (dropin / "older.conf").write_text(f'[Service]\nExecStart=\nExecStart={sys.executable} '
                                       f'-c "{older}"\n')
    manager.systemctl("daemon-reload")
    try:
        audience = Audience(bus)  # served by the "older" broker
    finally:
        (dropin / "older.conf").unlink()
        manager.systemctl("daemon-reload")
    try:
        mark = broker_log.stat().st_size
        manager.systemctl("restart", "sbus.service")
        audience.all_see_eof()
        with Client(bus, timeout=10) as c:
            c.whoami()
        log = broker_log.read_text()[mark:]
        lines = [x for x in log.splitlines() if "not taking over" in x]
        assert len(lines) == 1, log
        assert "'sbus-handover/0'" in lines[0] and "its 4 clients reconnect" in lines[0]
        assert "Traceback" not in log
        assert manager.show("sbus.service", "NFileDescriptorStore") == \
            {"NFileDescriptorStore": "0"}
    finally:
        audience.close()


def test_restart_hands_over_eleven_thousand_clients(manager: UserManager, bus: str,
                                                   broker_log: Path) -> None:
    """More clients than one fd-store entry each could pass (their names would exceed
    the kernel's 128 KiB for LISTEN_FDNAMES beyond about 10,000): all cross inside one
    carrier socket and are served by the next broker."""
    n = 11_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < n + 500:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {n + 500}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    clients: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            clients.append(s)
            s.connect(bus)
        sync(clients[-1])
        started = time.monotonic()
        manager.systemctl("restart", "sbus.service")
        print(f"systemctl restart with {n} clients: {time.monotonic() - started:.2f} s")
        for s in clients[:: n // 50] + clients[-1:]:
            s.settimeout(30)
            sync(s)  # the same connection, answered by the next broker
        log = broker_log.read_text()
        assert f"handing over {n} clients" in log and f"took over {n} clients" in log, log
    finally:
        for s in clients:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
