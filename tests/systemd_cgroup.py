"""A private cgroup for a systemd instance started by a test.

A systemd manager (``systemd --user``, or the container's init under
``systemd-nspawn --keep-unit``) takes over the cgroup it starts in: when that is
the root cgroup -- as on a machine whose PID 1 is not systemd -- it moves *every*
process of the machine into its ``init.scope``.  So each one gets a fresh cgroup of
its own in the hierarchies systemd manages (``name=systemd`` and the unified
one), entered by a tiny shell wrapper just before it execs, and removed at the end.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def _mounts() -> tuple[str | None, str | None]:
    """Mount points of the unified (cgroup2) and the ``name=systemd`` v1 hierarchy."""
    unified = named = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = right.split()[:3]
            mount_point = left.split()[4]
            if fstype == "cgroup2" and unified is None:
                unified = mount_point
            elif fstype == "cgroup" and "name=systemd" in options.split(","):
                named = mount_point
    return unified, named


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: '' (unified) or 'name=systemd' -> path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _num, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers in ("", "name=systemd"):
                out[controllers] = path
    return out


class PrivateCgroup:
    """Fresh child cgroups (one per systemd-relevant hierarchy) for one process tree."""

    def __init__(self, name: str) -> None:
        unified, named = _mounts()
        own = _own_paths()
        self.dirs: list[Path] = []
        for mount, key in ((named, "name=systemd"), (unified, "")):
            if mount is not None and key in own:
                self.dirs.append(Path(mount + own[key].rstrip("/")) / f"{name}-{os.getpid()}")
        if not self.dirs:
            raise RuntimeError("no cgroup hierarchy for systemd (is /sys/fs/cgroup mounted?)")
        for d in self.dirs:
            d.mkdir(exist_ok=True)

    def wrap(self, argv: list[str]) -> list[str]:
        """*argv*, run so that it execs inside this cgroup."""
        script = "".join(f'echo $$ > "{d}/cgroup.procs" && ' for d in self.dirs) + 'exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *argv]

    def pids(self) -> set[int]:
        """Every process still in the cgroup tree (any depth)."""
        found: set[int] = set()
        for d in self.dirs:
            if d.exists():
                for procs in d.rglob("cgroup.procs"):
                    try:
                        found.update(int(p) for p in procs.read_text().split())
                    except OSError:
                        pass
        return found

    def remove(self, timeout: float = 10.0) -> set[int]:
        """Kill what is left inside, remove the directories; return the pids that were left."""
        leftover = self.pids()
        for pid in leftover:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for d in self.dirs:
            while d.exists():
                for sub in sorted((p for p in d.rglob("*") if p.is_dir()),
                                  key=lambda p: len(p.parts), reverse=True):
                    try:
                        sub.rmdir()
                    except OSError:
                        pass
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        return leftover
