"""A booted Debian container (``systemd-nspawn -b``) for testing the system units.

The root filesystem is built once by ``tools/make-test-rootfs.sh`` and cached in
``/var/cache/sbus-test/rootfs-vVERSION``; it is booted with ``--volatile=overlay`` so every
run starts from the same clean tree and never writes into the cache.
``--register=no --keep-unit`` because no systemd (machined) runs on the host.

Commands run inside with ``nsenter`` into the container's init: the same
namespaces and root directory as the container's own processes.  The host
reaches files inside (such as ``/run/sbus.socket``) through
``/proc/<init pid>/root``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from systemd_cgroup import PrivateCgroup

REPO = Path(__file__).resolve().parent.parent


def _rootfs_version() -> str:
    """VERSION of tools/make-test-rootfs.sh: each version is cached in a directory of its
    own, so that checkouts at different versions never rebuild each other's rootfs."""
    for line in (REPO / "tools" / "make-test-rootfs.sh").read_text().splitlines():
        if line.startswith("VERSION="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError("tools/make-test-rootfs.sh has no VERSION=")


ROOTFS = Path(os.environ.get("SBUS_TEST_ROOTFS",
                             f"/var/cache/sbus-test/rootfs-v{_rootfs_version()}"))
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def ensure_rootfs(rootfs: Path = ROOTFS) -> float:
    """Build the cached root filesystem if it is missing or outdated; return seconds spent."""
    start = time.monotonic()
    done = subprocess.run([str(REPO / "tools" / "make-test-rootfs.sh"), str(rootfs)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"building the test rootfs failed:\n{done.stderr}")
    return time.monotonic() - start


class Container:
    def __init__(self, rootfs: Path, name: str, binds_ro: dict[str, str], log: Path,
                 options: tuple[str, ...] = ()) -> None:
        self.rootfs = rootfs
        self.name = name
        self.binds_ro = binds_ro
        self.options = options  # more systemd-nspawn options, e.g. a device to bind
        self.log = log
        self.cgroup: PrivateCgroup | None = None
        self.proc: subprocess.Popen | None = None
        self.leader = 0  # the container's init, as seen from the host

    def start(self, timeout: float = 60) -> Container:
        self.cgroup = PrivateCgroup("sbus-test-container")
        argv = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit",
                "--directory", str(self.rootfs), "--volatile=overlay", "--private-network",
                "--machine", self.name, "--console=read-only", "--boot"]
        argv += [f"--bind-ro={host}:{inside}" for host, inside in self.binds_ro.items()]
        argv += self.options
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cgroup.wrap(argv), stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        try:
            self.leader = self._find_init(deadline)
            while True:
                state = self.run("systemctl", "is-system-running", check=False).stdout.strip()
                if state in ("running", "degraded"):
                    return self
                if time.monotonic() > deadline:
                    raise RuntimeError(f"container did not boot (state {state!r}):\n"
                                       f"{self.log.read_text(errors='replace')[-3000:]}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def _find_init(self, deadline: float) -> int:
        """nspawn's child that is no longer nspawn itself: the container's PID 1."""
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"systemd-nspawn exited with {self.proc.returncode}:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            try:
                kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
                for kid in kids.split():
                    if os.readlink(f"/proc/{kid}/exe") != shutil.which("systemd-nspawn"):
                        return int(kid)
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("the container's init did not appear")

    def command(self, *argv: str, user: str | None = None) -> list[str]:
        """*argv* as it would run inside (as *user*, with a clean login-like environment)."""
        enter = ["nsenter", "--target", str(self.leader), "--mount", "--uts", "--ipc",
                 "--net", "--pid", "--root", "--wd"]
        env = ["env", "-i", f"PATH={CONTAINER_PATH}", "LANG=C.UTF-8"]
        if user is None:
            return [*enter, *env, "HOME=/root", *argv]
        return [*enter, *env, "runuser", "-u", user, "--", *argv]

    def run(self, *argv: str, user: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run(self.command(*argv, user=user), capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"in the container, {' '.join(argv)} failed "
                                 f"({done.returncode}):\n{done.stdout}{done.stderr}")
        return done

    def popen(self, *argv: str, user: str | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.command(*argv, user=user), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def end(proc: subprocess.Popen, timeout: float = 10) -> None:
        """End a `popen`: SIGTERM to what nsenter started inside, then wait for nsenter.
        Killing nsenter alone would orphan its child to the host's init, whose zombie then
        holds the container's halt for systemd-shutdown's 10 s."""
        if proc.poll() is None:
            try:
                kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            except OSError:
                kids = []
            for kid in kids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(kid), signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def host_path(self, inside: str) -> str:
        """The host's way to the container's *inside* path."""
        return f"/proc/{self.leader}/root{inside}"

    def stop(self, timeout: float = 60) -> set[int]:
        """Halt the container cleanly (SIGTERM to nspawn); return processes killed after it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        propagate = Path("/run/systemd/nspawn/propagate") / self.name
        shutil.rmtree(propagate, ignore_errors=True)
        return self.cgroup.remove() if self.cgroup is not None else set()
