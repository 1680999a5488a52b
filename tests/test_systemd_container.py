"""The system units in a booted Debian container, installed and started as users do.

sbus is installed inside into a virtualenv of the container's own Python, with
``pip install --no-index`` from wheels built on the host (``pip wheel`` of this tree
and its dependencies, bind-mounted read-only): no network needed, nothing borrowed
from the host's virtualenv.  The compiled dependencies come from Debian
(python3-systemd, python3-msgpack, python3-numpy in the rootfs, seen through
``--system-site-packages``), so the host's Python version does not matter: the
host only has to provide pure-Python wheels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import publish_to_recorder, recorded_pairs
from restart_load import Audience
from systemd_container import REPO, ROOTFS, Container, ensure_rootfs

from sbus.client import Client, ConnectError
from sbus.journal.store import list_segments
from sbus.protocol import Publish

VENV = "/opt/sbus"
SBUS = f"{VENV}/bin/sbus"
USER = "alice"


@pytest.fixture(scope="module")
def container() -> Iterator[Container]:
    timings = {"rootfs": ensure_rootfs()}
    base = Path(tempfile.mkdtemp(prefix="sbus-ct-", dir="/tmp"))
    wheels = base / "wheels"
    t = time.monotonic()
    # Build from a copy: an in-tree build would reuse (and package) stale files in build/.
    src = base / "src"
    shutil.copytree(REPO / "sbus", src / "sbus",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheels),
                    str(src)], check=True, capture_output=True, timeout=600)
    timings["wheels"] = time.monotonic() - t
    t = time.monotonic()
    c = Container(ROOTFS, f"sbus-test-{os.getpid()}", {str(wheels): "/mnt/sbus-wheels"},
                  base / "console.log").start()
    timings["boot"] = time.monotonic() - t
    try:
        t = time.monotonic()
        c.run("python3", "-m", "venv", "--system-site-packages", VENV)
        c.run(f"{VENV}/bin/pip", "install", "--quiet", "--no-index",
              "--find-links", "/mnt/sbus-wheels", "sbus")
        timings["install"] = time.monotonic() - t
        c.run("useradd", "--create-home", USER)
        print("container setup (s):", {k: round(v, 1) for k, v in timings.items()})
        yield c
    finally:
        leftover = c.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert not leftover, f"processes left behind by the container: {leftover}"


@pytest.fixture(scope="module")
def bus(container: Container) -> str:
    """`sbus install-units` and `systemctl start sbus.socket`, typed in the container."""
    out = container.run(SBUS, "install-units").stdout
    assert out.splitlines()[:7] == [
        "wrote /etc/systemd/system/sbus.socket",
        "wrote /etc/systemd/system/sbus.service",
        "wrote /etc/systemd/system/sbus-mount.service",
        "wrote /etc/systemd/system/sbus-record.service",
        "wrote /etc/systemd/system/sbus-bridge@.service",
        "wrote /etc/systemd/system/sbus-gateway.service",
        "ran systemctl daemon-reload",
    ]
    container.run("systemctl", "start", "sbus.socket")
    return container.host_path("/run/sbus.socket")


def _show(c: Container, unit: str, *props: str) -> dict[str, str]:
    out = c.run("systemctl", "show", unit, "-p", ",".join(props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_installed_units_verify_clean(container: Container, bus: str) -> None:
    units = [f"/etc/systemd/system/{n}" for n in ("sbus.socket", "sbus.service",
                                                   "sbus-mount.service", "sbus-record.service")]
    done = container.run("systemd-analyze", "verify", *units, check=False)
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "")
    service = container.run("cat", units[1]).stdout
    assert f"ExecStart={SBUS} serve\n" in service
    assert "DynamicUser=yes\n" in service and "ProtectHome=yes\n" in service


def test_service_sandbox_exposure_is_low(container: Container, bus: str) -> None:
    """systemd's own rating of the broker's sandbox (0 = fully locked down, 10 = none)."""
    out = container.run("systemd-analyze", "security", "--no-pager", "sbus.service").stdout
    line = next(x for x in out.splitlines() if "Overall exposure level for sbus.service" in x)
    exposure = float(line.split(":")[1].split()[0])
    assert exposure <= 2.0, line  # 1.0 when written; a service without sandboxing: ~9.6


def test_socket_listens_for_everyone_and_service_waits(container: Container, bus: str) -> None:
    assert _show(container, "sbus.socket", "ActiveState", "SubState") == \
        {"ActiveState": "active", "SubState": "listening"}
    mode = container.run("stat", "-c", "%A %U", "/run/sbus.socket").stdout.split()
    assert mode == ["srw-rw-rw-", "root"]
    if _show(container, "sbus.service", "ActiveState")["ActiveState"] == "inactive":
        with Client(bus, timeout=10) as c:
            c.whoami()
    state = _show(container, "sbus.service", "ActiveState", "SubState", "MainPID",
                  "StatusText")
    assert (state["ActiveState"], state["SubState"]) == ("active", "running")
    # DynamicUser=yes: the broker does not run as root.
    status = container.run("cat", f"/proc/{state['MainPID']}/status").stdout  # container pid
    uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
    assert int(uid) != 0
    assert "clients" in state["StatusText"]


def test_container_and_host_clients_exchange_messages(container: Container, bus: str) -> None:
    with Client(bus, timeout=10) as host:  # through the container's socket path
        host.subscribe(b"chat/*")
        host.whoami()
        # container -> host, with the CLI as typed in the container (root, then alice)
        container.run(SBUS, "pub", "chat/root", "hello from the container")
        container.run(SBUS, "pub", "chat/alice", "hello from alice", user=USER)
        assert host.receive(timeout=10) == Publish(b"chat/root", b"hello from the container")
        assert host.receive(timeout=10) == Publish(b"chat/alice", b"hello from alice")

        # host -> container: `sbus sub` inside, the host publishes until it has arrived
        sub = container.popen(SBUS, "sub", "--count", "1", "news/")
        try:
            deadline = time.monotonic() + 15
            while sub.poll() is None:
                assert time.monotonic() < deadline, "container subscriber got nothing"
                host.publish(b"news/host", b"hello from the host")
                time.sleep(0.1)
            out, err = sub.communicate(timeout=5)
        finally:
            container.end(sub)
        assert (sub.returncode, out) == (0, "news/host hello from the host\n"), err


def test_unprivileged_user_publishes_and_subscribes(container: Container, bus: str) -> None:
    uid = container.run("id", "-u", USER).stdout.strip()
    gid = container.run("id", "-g", USER).stdout.strip()
    script = (
        "from sbus.client import Client\n"
        "sub, pub = Client(timeout=10), Client(timeout=10)\n"
        "sub.subscribe(b'alice/*')\n"
        "who = sub.whoami().decode()\n"
        "pub.publish(b'alice/x', b'own message')\n"
        "print(who, sub.receive(timeout=10).payload.decode())\n"
    )
    done = container.run(f"{VENV}/bin/python", "-c", script, user=USER)
    who, payload = done.stdout.split(" ", 1)
    # The broker sees alice's real, kernel-verified uid and gid (no UID remapping).
    assert who.startswith(f"!/cred/{gid}/{uid}/") and uid != "0"
    assert payload == "own message\n"


def test_record_service_journals_as_a_dynamic_user(container: Container, bus: str) -> None:
    """sbus-record.service in the system manager: an unprivileged dynamic user writing
    /var/lib/sbus/journal (StateDirectory=), sealed on stop, with Debian's numpy."""
    container.run("systemctl", "start", "sbus-record.service")
    journal = Path(container.host_path("/var/lib/private/sbus/journal"))
    sent = [(b"log/%d" % (i % 4), b"\0entry %d\xfe" % i) for i in range(200)]
    try:
        publish_to_recorder(bus, journal, sent)
        pid = _show(container, "sbus-record.service", "MainPID")["MainPID"]
        owner = container.run("stat", "-c", "%U", f"/proc/{pid}").stdout.strip()
        assert owner not in ("root", "0")  # DynamicUser=yes
    finally:
        container.run("systemctl", "stop", "sbus-record.service")
    assert _show(container, "sbus-record.service", "Result") == {"Result": "success"}
    assert [s.sealed for s in list_segments(journal)] == [True]
    assert recorded_pairs(journal) == sent


def test_stop_in_container_leaves_no_broker(container: Container, bus: str) -> None:
    with Client(bus, timeout=10) as c:
        c.whoami()
    pid = _show(container, "sbus.service", "MainPID")["MainPID"]
    assert pid != "0"
    container.run("systemctl", "stop", "sbus.socket", "sbus.service")
    assert _show(container, "sbus.service", "ActiveState", "Result") == \
        {"ActiveState": "inactive", "Result": "success"}
    assert container.run("test", "-e", f"/proc/{pid}", check=False).returncode == 1
    assert container.cgroup is not None
    for p in container.cgroup.pids():
        try:
            assert b"serve" not in Path(f"/proc/{p}/cmdline").read_bytes()
        except FileNotFoundError:
            pass
    with pytest.raises(ConnectError):
        Client(bus)
    container.run("systemctl", "start", "sbus.socket")  # as the other tests found it


def _broker_log(c: Container) -> list[str]:
    return c.run("journalctl", "-u", "sbus.service", "-o", "cat", "--no-pager").stdout \
        .splitlines()


def test_restart_in_container_hands_every_client_over(container: Container, bus: str) -> None:
    """`systemctl restart sbus.service` in the booted system, under load: the host's
    reliable (block), ordinary and secret readers keep their connections and get
    everything, in order; `stop` then `start` is an ordinary restart (end-of-file)."""
    audience = Audience(bus)
    try:
        first = _show(container, "sbus.service", "MainPID")["MainPID"]
        mark = len(_broker_log(container))
        report = audience.across(lambda: container.run("systemctl", "restart", "sbus.service"))
        print("systemctl restart under load in the container:", report)
        assert _show(container, "sbus.service", "MainPID")["MainPID"] not in ("0", first)
        log = "\n".join(_broker_log(container)[mark:])
        assert "handing over 4 clients" in log and "took over 4 clients" in log, log
        assert _show(container, "sbus.service", "NFileDescriptorStore") == \
            {"NFileDescriptorStore": "0"}
        container.run("systemctl", "stop", "sbus.service")
        audience.all_see_eof()
        mark = len(_broker_log(container))
        container.run("systemctl", "start", "sbus.service")
        with Client(bus, timeout=10) as c:
            c.whoami()
        assert not any("took over" in x for x in _broker_log(container)[mark:])
    finally:
        audience.close()
