"""The Debian package, as a user meets it: ``tools/build-deb.sh`` builds it (lintian
clean of errors), ``apt install ./sbus_*.deb`` installs it in a booted Debian container
with no network (every dependency is Debian's own, already in the rootfs), and then
the design card, typed in the container: ``systemctl start sbus.socket``,
``echo hi > /mnt/sbus/a/b/c`` seen by a subscriber, ``cat`` of a pattern receiving,
``sbus-top`` showing the traffic.  Removing the package stops everything.

FUSE inside systemd-nspawn needs only the device: ``--bind=/dev/fuse`` (nspawn runs
the container as real root with CAP_SYS_ADMIN, and with ``--register=no --keep-unit``
no device cgroup policy is installed that would need a ``DeviceAllow=``).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import raw, recorded_pairs, sync
from systemd_container import REPO, ROOTFS, Container, ensure_rootfs

from sbus.journal.store import list_segments

USER = "alice"


def _version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


#: What tools/build-deb.sh printed, for the tests of what it checked itself.
BUILD: dict[str, str] = {}


@pytest.fixture(scope="module")
def deb() -> Iterator[Path]:
    out = Path(tempfile.mkdtemp(prefix="sbus-deb-", dir="/tmp"))
    scratch = out / "tmp"  # lintian leaves a file in TMPDIR (mldbm-elf-*): removed with out
    scratch.mkdir()
    try:
        done = subprocess.run([str(REPO / "tools" / "build-deb.sh"), str(out)],
                              capture_output=True, text=True, timeout=900,
                              stdin=subprocess.DEVNULL,
                              env={**os.environ, "TMPDIR": str(scratch)})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        BUILD["output"] = done.stdout + done.stderr
        debs = list(out.glob("*.deb"))
        assert len(debs) == 1, debs
        yield debs[0]
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def container(deb: Path) -> Iterator[Container]:
    ensure_rootfs()
    log = deb.parent / "console.log"
    c = Container(ROOTFS, f"sbus-deb-{os.getpid()}", {str(deb.parent): "/mnt/dist"}, log,
                  options=("--bind=/dev/fuse",)).start()
    try:
        c.run("useradd", "--create-home", USER)
        yield c
    finally:
        leftover = c.stop()
    assert not leftover, f"processes left behind by the container: {leftover}"


@pytest.fixture(scope="module")
def installed(container: Container) -> subprocess.CompletedProcess:
    """`apt install ./sbus_*.deb`, as typed (the container has no network)."""
    return container.run("sh", "-c", "cd /mnt/dist && apt install -y ./sbus_*.deb",
                         timeout=300)


def _unit(c: Container, verb: str, unit: str) -> str:
    return c.run("systemctl", verb, unit, check=False).stdout.strip()


def _wait_subscribed(c: Container, pattern: str, timeout: float = 15) -> None:
    """Until the broker lists *pattern* among its clients' subscriptions."""
    deadline = time.monotonic() + timeout
    while pattern not in c.run("sbus", "status").stdout:
        assert time.monotonic() < deadline, f"nobody subscribed to {pattern!r}"
        time.sleep(0.05)


def _main_pid(c: Container, unit: str) -> str:
    return c.run("systemctl", "show", "-p", "MainPID", "--value", unit).stdout.strip()


def _line(proc: subprocess.Popen, timeout: float = 10) -> str:
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise TimeoutError(f"no output from {' '.join(proc.args[-3:])}")
    return proc.stdout.readline()


def test_the_package_is_named_for_version_and_arch(deb: Path) -> None:
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert deb.name == f"sbus_{_version()}_{arch}.deb"
    fields = subprocess.run(["dpkg-deb", "-f", str(deb), "Version", "Depends"],
                            capture_output=True, text=True, check=True).stdout
    assert f"Version: {_version()}\n" in fields
    assert "python3-msgpack" in fields and "fuse3" in fields
    assert "python3-anyio" not in fields  # bookworm's is too old: carried instead
    files = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True,
                           check=True).stdout
    for path in ("./usr/bin/sbus", "./usr/bin/sbus-top", "./lib/systemd/system/sbus.socket",
                 "./lib/systemd/system/sbus.service", "./usr/lib/sbus/sbus/cli.py",
                 "./usr/lib/sbus/anyio/__init__.py", "./usr/lib/sbus/paho/__init__.py",
                 "./lib/systemd/system/sbus-bridge@.service", "./usr/share/man/man1/sbus.1.gz",
                 "./lib/systemd/system/sbus-gateway.service",
                 "./usr/share/man/man1/sbus-top.1.gz",
                 "./usr/share/bash-completion/completions/sbus",
                 "./usr/share/zsh/vendor-completions/_sbus"):
        assert f" {path}\n" in files, path


def test_lintian_finds_no_errors(deb: Path) -> None:
    """tools/build-deb.sh runs `lintian --fail-on error` on the package it built and fails
    on any error, so a package that exists passed it; its output says so."""
    out = BUILD["output"]
    assert "build-deb: lintian" in out and f"built {deb}" in out, out[-3000:]
    assert not [line for line in out.splitlines() if line.startswith("E:")]


def test_apt_installs_it_offline_and_enables_the_socket(container: Container,
                                                        installed) -> None:
    assert "Setting up sbus (" in installed.stdout
    assert _unit(container, "is-enabled", "sbus.socket") == "enabled"
    assert _unit(container, "is-active", "sbus.socket") == "active"
    assert _unit(container, "is-enabled", "sbus-mount.service") == "enabled"
    assert _unit(container, "is-active", "sbus-mount.service") == "active"
    for unit in ("sbus-record.service", "sbus-gateway.service"):  # for the admin to enable
        assert _unit(container, "is-enabled", unit) == "disabled"
        assert _unit(container, "is-active", unit) == "inactive"
    assert _unit(container, "is-enabled", "sbus.service") == "static"  # by the socket
    assert container.run("sbus", "--version").stdout == f"sbus {_version()}\n"
    # the broker runs as a dynamic user, from the carried packages in /usr/lib/sbus
    verify = container.run("systemd-analyze", "verify", "/lib/systemd/system/sbus.service",
                           "/lib/systemd/system/sbus.socket", check=False)
    assert (verify.returncode, verify.stderr) == (0, "")


def test_the_design_card(container: Container, installed) -> None:
    c = container
    c.run("systemctl", "start", "sbus.socket")
    # (`timeout`: each reader ends by itself even if this test cannot end it)
    sub = c.popen("timeout", "120", "sbus", "sub", "a/b/c", user=USER)
    cat = publisher = None
    try:
        _wait_subscribed(c, "a/b/c")
        # A fresh bus: no directory is known yet, creating the file implies them.
        c.run("sh", "-c", "echo hi > /mnt/sbus/a/b/c")
        assert _line(sub).startswith("a/b/c hi")

        cat = c.popen("timeout", "120", "cat", "/mnt/sbus/a/*/c")
        _wait_subscribed(c, "a/*/c")
        publisher = c.popen("sh", "-ec", "for i in $(seq 60); do echo m$i > /mnt/sbus/a/b/c;"
                                         " sleep 0.05; done")
        top = c.run("sbus-top", "--once", "--seconds", "2", timeout=60)
        assert publisher.wait(timeout=30) == 0, publisher.communicate()
        assert _line(cat) == "m1\n"
        assert "a/b/c" in top.stdout, top.stdout + top.stderr
    finally:
        # The publisher ends by itself, within seconds: waited for even when a step
        # failed, so that its a/b/c traffic never reaches the next test's recorder.
        if publisher is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # not to hide the failure
                publisher.wait(timeout=30)
        for proc in (sub, cat):
            if proc is not None:
                c.end(proc)


def test_the_recorder_runs_from_the_package(container: Container, installed) -> None:
    """sbus-record.service, installed disabled, runs when the admin starts it (Debian's
    numpy) and seals its segment on stop."""
    c = container
    c.run("systemctl", "start", "sbus-record.service")
    try:
        deadline = time.monotonic() + 15
        pid = _main_pid(c, "sbus-record.service")
        # a row of sbus status: id pid uid subs ...; the recorder's, once it subscribed
        while not any(row.split()[1:2] == [pid] and row.split()[3] != "0"
                      for row in c.run("sbus", "status").stdout.splitlines()):
            assert time.monotonic() < deadline, "the recorder did not subscribe"
            time.sleep(0.1)
        c.run("sbus", "pub", "log/x", "to the journal")
    finally:
        c.run("systemctl", "stop", "sbus-record.service")
    assert c.run("systemctl", "show", "-p", "Result", "--value",
                 "sbus-record.service").stdout.strip() == "success"
    journal = Path(c.host_path("/var/lib/private/sbus/journal"))
    assert [s.sealed for s in list_segments(journal)] == [True]
    assert recorded_pairs(journal) == [(b"log/x", b"to the journal")]


def test_an_upgrade_restarts_the_broker_and_keeps_its_clients(container: Container,
                                                             installed) -> None:
    """Reinstalling is an upgrade to the maintainer scripts: the broker is reloaded (new
    code, make-before-break: the successor becomes the main process through MAINPID=,
    the service never leaves "active") and hands its clients over; the socket is neither
    stopped nor restarted."""
    c = container
    s = raw(c.host_path("/run/sbus.socket"), timeout=10)
    try:
        s.send(b"SUB up/")
        sync(s)
        before = _main_pid(c, "sbus.service")
        broker_since = c.run("systemctl", "show", "-p", "ActiveEnterTimestampMonotonic",
                             "sbus.service").stdout
        listening_since = c.run("systemctl", "show", "-p", "ActiveEnterTimestampMonotonic",
                                "sbus.socket").stdout
        c.run("sh", "-c", "cd /mnt/dist && apt install -y --reinstall ./sbus_*.deb",
              timeout=300)
        deadline = time.monotonic() + 30
        while _main_pid(c, "sbus.service") in ("0", before):
            assert time.monotonic() < deadline, "the broker was not reloaded"
            time.sleep(0.1)
        # a restart would have left "active" and entered it again
        assert c.run("systemctl", "show", "-p", "ActiveEnterTimestampMonotonic",
                     "sbus.service").stdout == broker_since
        assert c.run("systemctl", "show", "-p", "ActiveEnterTimestampMonotonic",
                     "sbus.socket").stdout == listening_since
        c.run("sbus", "pub", "up/x", "after the upgrade")
        assert s.recv(1000) == b"MSG up/x\0after the upgrade"
    finally:
        s.close()


def test_removing_the_package_stops_everything(container: Container, installed) -> None:
    container.run("apt", "remove", "-y", "sbus", timeout=120)
    for unit in ("sbus.socket", "sbus.service", "sbus-mount.service"):
        assert _unit(container, "is-active", unit) == "inactive", unit
    assert "/mnt/sbus" not in container.run("cat", "/proc/mounts").stdout
    assert container.run("test", "-e", "/run/sbus.socket", check=False).returncode == 1
