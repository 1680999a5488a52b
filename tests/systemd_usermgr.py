"""A real ``systemd --user`` manager for tests, on a machine whose PID 1 is not systemd.

systemd refuses to run as a user manager unless ``/run/systemd/system`` exists
(its test for "booted with systemd").  The manager therefore runs in a private
mount namespace with a tmpfs on ``/run/systemd`` -- the host's ``/run`` is not
touched -- in a cgroup of its own (see `systemd_cgroup`).  It is reached from
outside like any user manager: ``systemctl --user`` with ``XDG_RUNTIME_DIR``
pointing at its runtime directory (the private socket ``systemd/private``).
The manager's own messages are kept in ``manager.log``; its services' standard
output and error go to /dev/null (``inherit`` means the manager's standard input)
unless a unit says otherwise (``StandardError=append:FILE``).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from conftest import stop_process
from systemd_cgroup import PrivateCgroup

SYSTEMD = "/lib/systemd/systemd"

_START = ("mkdir -p /run/systemd && mount -t tmpfs -o mode=0755 sbus-test /run/systemd "
          "&& mkdir /run/systemd/system && exec \"$@\"")


class UserManager:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.runtime = base / "run"  # XDG_RUNTIME_DIR: %t in unit files
        self.config = base / "config"  # XDG_CONFIG_HOME: units in config/systemd/user
        self.state = base / "state"  # XDG_STATE_HOME: %S in unit files
        self.log = base / "manager.log"
        self.runtime.mkdir(mode=0o700)
        self.config.mkdir()
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "XDG_RUNTIME_DIR": str(self.runtime),
            "XDG_CONFIG_HOME": str(self.config),
            "XDG_STATE_HOME": str(self.state),
            # a worktree's sbus, where the venv's editable install points elsewhere
            **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ
               else {}),
        }
        self.cgroup: PrivateCgroup | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def unit_dir(self) -> Path:
        return self.config / "systemd" / "user"

    def start(self, timeout: float = 30) -> UserManager:
        self.cgroup = PrivateCgroup("sbus-test-user-manager")
        argv = [SYSTEMD, "--user", "--log-target=console",
                "--default-standard-output=inherit", "--default-standard-error=inherit"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private",
                 "/bin/sh", "-c", _START, "sh", *self.cgroup.wrap(argv)],
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                cwd=self.base,
            )
        deadline = time.monotonic() + timeout
        while True:
            # not is-system-running: it answers "offline" where /run/systemd/system is missing
            state = self.systemctl("show", "-p", "SystemState", "--value",
                                   check=False).stdout.strip()
            if state in ("running", "degraded"):
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"systemd --user did not come up (state {state!r}, "
                                   f"exit {self.proc.poll()}):\n{self.log.read_text()}")
            time.sleep(0.05)

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(["systemctl", "--user", "--no-pager", *args], env=self.env,
                              capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"systemctl --user {' '.join(args)} failed "
                                 f"({done.returncode}): {done.stderr}{done.stdout}")
        return done

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a command with this manager's environment (as a user's shell would)."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=60, check=check)

    def stray_pids(self) -> set[int]:
        """Processes in the manager's cgroup tree other than the manager itself."""
        assert self.cgroup is not None and self.proc is not None
        return self.cgroup.pids() - {self.proc.pid}

    def stop(self) -> set[int]:
        """Exit the manager cleanly; return any process that had to be killed afterwards."""
        if self.proc is not None and self.proc.poll() is None:
            self.systemctl("exit", check=False)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                stop_process(self.proc)
        return self.cgroup.remove() if self.cgroup is not None else set()
