"""The systemd file-descriptor store, proven under both kinds of manager this project
tests with (systemd 252): a connected socket and a memfd stored with ``FDSTORE=1``
survive ``systemctl restart`` and come back in ``LISTEN_FDS``/``LISTEN_FDNAMES``, the
peer never noticing; ``stop`` then ``start`` empties the store (the peer sees EOF).
A broker that hands its clients over across restarts (issue 14) rests on exactly this.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from systemd_container import REPO, ROOTFS, Container, ensure_rootfs
from systemd_usermgr import UserManager

SERVICE = """[Service]
Type=notify
ExecStart=/usr/bin/python3 {script} {listener}
FileDescriptorStoreMax=16
"""


def prove(listener: socket.socket, systemctl: Callable[..., object],
          show: Callable[[], dict]) -> None:
    systemctl("start", "fds.service")
    listener.settimeout(30)
    conn, _ = listener.accept()
    conn.settimeout(30)
    assert conn.recv(200) == b"generation 1 got -"
    for generation in (2, 3):
        systemctl("restart", "fds.service")
        assert conn.recv(200) == b"generation %d got client,state" % generation
    assert show() == {"NFileDescriptorStore": "2", "ActiveState": "active"}
    systemctl("stop", "fds.service")
    assert conn.recv(200) == b""  # stopped (not restarted): the store is emptied
    systemctl("start", "fds.service")
    again, _ = listener.accept()  # a fresh generation 1 on a new connection
    again.settimeout(30)
    assert again.recv(200) == b"generation 1 got -"
    systemctl("stop", "fds.service")


def listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    s.listen(4)
    return s


def test_fd_store_under_a_user_manager() -> None:
    base = Path(tempfile.mkdtemp(prefix="sbus-fds-", dir="/tmp"))
    listener = listen(str(base / "l.sock"))
    manager = UserManager(base).start()
    try:
        manager.unit_dir.mkdir(parents=True, exist_ok=True)
        (manager.unit_dir / "fds.service").write_text(SERVICE.format(
            script=REPO / "tests" / "fdstore_service.py", listener=base / "l.sock"))
        manager.systemctl("daemon-reload")
        prove(listener, manager.systemctl,
              lambda: manager.show("fds.service", "NFileDescriptorStore", "ActiveState"))
    finally:
        leftover = manager.stop()
        listener.close()
        shutil.rmtree(base, ignore_errors=True)
    assert not leftover


def test_fd_store_under_a_booted_system_manager(tmp_path: Path) -> None:
    ensure_rootfs()
    c = Container(ROOTFS, f"sbus-fds-{os.getpid()}",
                  {str(REPO / "tests"): "/mnt/tests"}, tmp_path / "container.log").start()
    try:
        unit = SERVICE.format(script="/mnt/tests/fdstore_service.py", listener="/run/l.sock")
        Path(c.host_path("/etc/systemd/system/fds.service")).write_text(unit)
        listener = listen(c.host_path("/run/l.sock"))
        c.run("systemctl", "daemon-reload")

        def show() -> dict:
            out = c.run("systemctl", "show", "fds.service", "-p",
                        "NFileDescriptorStore,ActiveState").stdout
            return dict(line.split("=", 1) for line in out.splitlines())

        prove(listener, lambda *a: c.run("systemctl", *a), show)
        listener.close()
    finally:
        leftover = c.stop()
    assert not leftover


pytestmark = pytest.mark.timeout(300)
