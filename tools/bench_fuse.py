#!/usr/bin/env python3
"""Benchmark ``sbus mount``: how fast ``cat`` of a mounted key keeps up, and writers' rates.

Starts its own broker and mount in a temporary directory (needs /dev/fuse), then:

1. read: a raw-socket publisher (its own process) sends 64-byte payloads on one key
   at a paced rate (or unpaced: ``flood``) for a few seconds while ``cat MNT/key``
   runs; every line is checked for sequence (loss, order) under the default flood
   policy;
2. write: 64-byte messages through the mount, each counted by a raw subscriber, each
   against its like-for-like raw-socket baseline (its own process, one ``send`` per
   message): ``echo $i > MNT/key`` in a bash loop (a builtin: one open/close per
   message) against a raw client connecting per message; ``echo $i >&3`` with
   ``3>> MNT/key`` (one open, a write per message) and a tight ``os.write`` loop on
   an ``O_APPEND`` descriptor against a raw client keeping its connection; 4 of
   those bash writers at once against 4 raw clients at once; ``cp`` of a
   150,000-byte file (one message per file).  Every writer times itself (no
   interpreter start-up counted);
3. requests: the FUSE requests each writer's message costs and the mount's Python
   time per message (a mount whose operations are counted, in a child process);
4. floor: the same writers against a no-op pyfuse3 filesystem (every handler returns
   at once; the same ``pyfuse3.main`` as the mount): the most any pyfuse3 mount can
   do, one FUSE request round trip at a time; also without FLUSH requests (the
   handler answers ENOSYS once), what skipping them on close would give;
5. intent: the cost of a lookup of an unknown name (the mount reads the caller's
   open call from /proc), per ``stat`` and per ``open`` for reading, against a known
   name.

``--compare TREE`` runs parts 2 and 3 with the mount (and broker) of another tree as
well (e.g. ``git worktree add --detach /tmp/before main``), alternating the trees for
``--rounds`` rounds, and prints each figure's median per tree.

Usage: .venv/bin/python tools/bench_fuse.py [--seconds 3] [--rates 20000,40000,flood]
       [--writes 5000] [--only read,write,requests,floor,intent] [--compare TREE
       --rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)  # children run in the tree under test: no relative path
ROOT = os.path.dirname(os.path.dirname(HERE))
SBUS = [sys.executable, "-m", "sbus.cli"]
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
KEY = b"bench/key"
SIZE = 64


def wait_for(cond, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.02)


def connectable(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def publisher(address: str, rate: float, seconds: float) -> None:
    """Child process: send sequence-numbered 64-byte payloads; rate 0 means flat out."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    head = b"MSG " + KEY + b"\0"
    start = time.monotonic()
    end = start + seconds
    i = 0
    batch = 50
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if rate and i >= (now - start) * rate:
            time.sleep(batch / rate / 2)
            continue
        for _ in range(batch):
            s.send(head + (b"%08d" % i).ljust(SIZE, b"."))
            i += 1
    s.send(b"MSG " + KEY + b"\0END")
    s.close()
    print(i)


class CatReader:
    """``cat MNT/key``: the thing measured."""

    name = "cat MNT/key"

    def __init__(self, address: str, mnt: str) -> None:
        path = os.path.join(mnt, KEY.decode())
        self.proc = subprocess.Popen(["cat", path], stdout=subprocess.PIPE)
        pid = self.proc.pid
        wait_for(lambda: any(os.readlink(f"/proc/{pid}/fd/{fd}") == path
                             for fd in os.listdir(f"/proc/{pid}/fd")))
        self.fd = self.proc.stdout.fileno()

    def chunks(self, timeout: float):
        while select.select([self.fd], [], [], timeout)[0]:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


class SocketReader:
    """A raw socket subscriber, the baseline: what the broker delivers without the mount."""

    name = "raw socket"

    def __init__(self, address: str, mnt: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(address)
        self.sock.send(b"SUB " + KEY)
        self.sock.send(b"CMSG !/cred/whoami")
        self.sock.recv(1000)
        self.skip = len(b"MSG " + KEY + b"\0")

    def chunks(self, timeout: float):
        s, skip = self.sock, self.skip
        while select.select([s], [], [], timeout)[0]:
            out = []
            try:
                for _ in range(1000):
                    packet = s.recv(65536, socket.MSG_DONTWAIT)
                    if packet.startswith(b"MSG "):  # not a drop report: those show as lost
                        out.append(packet[skip:] + b"\n")
            except BlockingIOError:
                pass
            yield b"".join(out)

    def close(self) -> None:
        self.sock.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_read(reader, address: str, rate: float, seconds: float, mount_pid: int) -> dict:
    cpu0 = cpu_seconds(mount_pid)
    pub = subprocess.Popen([sys.executable, HERE, "--publisher", address, str(rate),
                            str(seconds)], stdout=subprocess.PIPE, env=ENV)
    buf = b""
    got = 0
    expect = 0
    gaps = 0
    t_first = t_last = None
    done = False
    for chunk in reader.chunks(seconds + 10):
        t_last = time.monotonic()
        if t_first is None:
            t_first = t_last
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line == b"END":
                done = True
                break
            n = int(line[:8])
            if n != expect:
                gaps += 1
            expect = n + 1
            got += 1
        if done:
            break
    sent = int(pub.communicate()[0])
    cpu = cpu_seconds(mount_pid) - cpu0
    reader.close()
    elapsed = (t_last - t_first) if t_first is not None else 0
    return {"offered": "flat out" if not rate else f"{rate:,.0f}/s", "sent": sent,
            "received": got, "lost": sent - got, "gaps": gaps,
            "rate": got / elapsed if elapsed else 0.0,
            "cpu_us": cpu / got * 1e6 if got else 0.0}


def tree_env(tree: str) -> dict[str, str]:
    """The environment that runs *tree*'s sbus (its own directory first on the path)."""
    return {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}


def raw_writer(address: str, count: int, size: int, reconnect: bool) -> None:
    """Child process: a baseline writer, one ``send`` per message on a raw socket
    (with *reconnect*, a connection per message, as ``echo >`` opens a file per
    message); prints when it started and ended, so interpreter start-up is not
    counted."""
    head = b"MSG " + KEY + b"\0"
    sys.stdin.readline()  # all writers at once: started, then told to go
    t0 = time.time()
    s = None
    for i in range(count):
        if s is None or reconnect:
            if s is not None:
                s.close()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(address)
        s.send(head + (b"%d" % i).ljust(size - 1, b".") + b"\n")
    if s is not None:
        s.close()
    print(t0, time.time())


def os_writer(path: str, count: int, size: int) -> None:
    """Child process: the fastest client a mount can have, ``os.write`` of each
    message on one ``O_APPEND`` descriptor (each write is one message)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    sys.stdin.readline()
    t0 = time.time()
    for i in range(count):
        os.write(fd, (b"%d" % i).ljust(size - 1, b".") + b"\n")
    t1 = time.time()
    os.close(fd)
    print(t0, t1)


#: writer -> (how, its like-for-like raw baseline, processes at once)
WRITERS = {
    "raw, one connection": ("one", None, 1),
    "raw, connect per msg": ("each", None, 1),
    "echo > MNT/key": ('for ((i=0; i<{n}; i++)); do echo "$i{pad}" > {path}; done',
                       "raw, connect per msg", 1),
    "echo >&3 (3>>key)": ('exec 3>>{path}; for ((i=0; i<{n}; i++)); do echo "$i{pad}" >&3; '
                          'done', "raw, one connection", 1),
    "os.write, O_APPEND fd": ("os", "raw, one connection", 1),
    "4 raw, one conn. each": ("one", None, 4),
    "4 x echo >&3 (3>>key)": ('exec 3>>{path}; for ((i=0; i<{n}; i++)); do echo "$i{pad}" '
                              '>&3; done', "4 raw, one conn. each", 4),
}


def run_writers(how: str, address: str, path: str, count: int, procs: int,
                env: dict[str, str]) -> float:
    """Start *procs* writers of *count* messages each at once; messages per second
    from the first one's start to the last one's end (each writer times itself)."""
    if how in ("one", "each"):
        cmds = [[sys.executable, HERE, "--raw-writer", address, str(count), how]]
    elif how == "os":
        cmds = [[sys.executable, HERE, "--os-writer", path, str(count)]]
    else:
        script = ("read -r go; s=$EPOCHREALTIME; "
                  + how.format(n=count, path=path, pad="." * (SIZE - 6))
                  + '; echo "$s $EPOCHREALTIME"')
        cmds = [["bash", "-c", script]]
    running = [subprocess.Popen(cmds[0], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env=env, text=True) for _ in range(procs)]
    time.sleep(0.3 + 0.1 * procs)  # each has started (a Python one has imported) and waits
    spans = []
    for p in running:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.close()
    for p in running:
        assert p.stdout is not None
        out = p.stdout.read()
        if p.wait():
            raise RuntimeError(f"writer {cmds[0][:3]} failed ({p.returncode})")
        spans.append([float(x) for x in out.split()])
    start, end = min(s for s, _ in spans), max(e for _, e in spans)
    return count * procs / (end - start)


def subscribe(address: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    s.send(b"SUB " + KEY)
    s.send(b"CMSG !/cred/whoami")
    s.recv(1000)
    return s


def bench_write(address: str, mnt: str, name: str, count: int, env: dict[str, str],
                mount_pid: int) -> dict:
    how, _, procs = WRITERS[name]
    s = subscribe(address)
    cpu0 = cpu_seconds(mount_pid)
    rate = run_writers(how, address, os.path.join(mnt, KEY.decode()), count // procs, procs,
                       env)
    cpu = cpu_seconds(mount_pid) - cpu0
    s.settimeout(5)
    got = 0
    try:
        while got < count // procs * procs:
            s.recv(1000)
            got += 1
    except TimeoutError:
        pass
    s.close()
    return {"count": count // procs * procs, "received": got, "rate": rate,
            "cpu_us": cpu / (count // procs * procs) * 1e6}


def bench_cp(address: str, mnt: str, tmp: str, count: int) -> dict:
    src = os.path.join(tmp, "f150k")
    with open(src, "wb") as f:
        f.write(os.urandom(150_000))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    s.send(b"SUB " + KEY)
    s.send(b"CMSG !/cred/whoami")
    s.recv(1000)
    path = os.path.join(mnt, KEY.decode())
    t0 = time.monotonic()
    subprocess.run(["bash", "-c", f"for ((i=0; i<{count}; i++)); do cp {src} {path}; done"],
                   check=True)
    elapsed = time.monotonic() - t0
    s.settimeout(5)
    whole = 0
    try:
        for _ in range(count):
            packet = s.recv(1 << 20)
            if len(packet) == len(b"MSG " + KEY + b"\0") + 150_000:
                whole += 1
    except TimeoutError:
        pass
    s.close()
    return {"count": count, "whole": whole, "rate": count / elapsed}


def bench_intent(mnt: str, count: int) -> dict:
    """µs per stat/open of an unknown name (asks /proc) and of a known one."""
    known = os.path.join(mnt, KEY.decode())
    out = {}
    for label, path in (("known", known), ("unknown", os.path.join(mnt, "no/such"))):
        t0 = time.perf_counter()
        for _ in range(count):
            try:
                os.stat(path)
            except FileNotFoundError:
                pass
        out[f"stat {label}"] = (time.perf_counter() - t0) / count * 1e6
    # open for reading subscribes (a broker round trip) either way: the difference
    # is what reading the intent costs
    for label, path in (("known", known), ("unknown", os.path.join(mnt, "fresh/k"))):
        t0 = time.perf_counter()
        for _ in range(count // 10):
            os.close(os.open(path, os.O_RDONLY))
        out[f"open {label}"] = (time.perf_counter() - t0) / (count // 10) * 1e6
    return out


class NoOpFS:
    """A pyfuse3 filesystem that does nothing: ``bench/key`` takes every write at
    once.  Its rate is what one FUSE request round trip costs in pyfuse3 (made
    lazily: pyfuse3 is imported in the child only)."""

    @staticmethod
    def run(mnt: str, flush: bool) -> None:
        import errno
        import stat

        import pyfuse3
        import trio

        class FS(pyfuse3.Operations):
            def _attrs(self, ino: int) -> pyfuse3.EntryAttributes:
                a = pyfuse3.EntryAttributes()
                a.st_ino = ino
                a.entry_timeout = a.attr_timeout = 1.0
                a.st_mode = (stat.S_IFREG | 0o666) if ino == 3 else (stat.S_IFDIR | 0o777)
                a.st_nlink = 1
                a.st_uid, a.st_gid = os.getuid(), os.getgid()
                return a

            async def lookup(self, parent, name, ctx):
                if (parent, name) in ((pyfuse3.ROOT_INODE, b"bench"), (2, b"key")):
                    return self._attrs(parent + 1)
                raise pyfuse3.FUSEError(errno.ENOENT)

            async def getattr(self, ino, ctx):
                return self._attrs(ino)

            async def setattr(self, ino, attr, fields, fh, ctx):
                return self._attrs(ino)

            async def open(self, ino, flags, ctx):
                return pyfuse3.FileInfo(fh=1, direct_io=True, keep_cache=False)

            async def write(self, fh, off, buf):
                return len(buf)

            async def flush(self, fh):
                if not flush:
                    raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel stops sending it

            async def release(self, fh):
                return None

        pyfuse3.init(FS(), mnt, set(pyfuse3.default_options) | {"fsname=noop"})
        try:
            trio.run(pyfuse3.main, 2, 1000)  # as `sbus mount` runs it
        finally:
            pyfuse3.close(unmount=True)


def counted_mount(counts: str, argv: list[str]) -> int:
    """Child process: ``sbus mount`` (of the tree on PYTHONPATH) whose every operation
    is counted and timed; SIGUSR1 writes ``{op: [calls, seconds]}`` to *counts*."""
    import functools
    import json
    import signal

    from sbus.cli import main as cli
    from sbus.fuse.operations import BusFS

    calls: dict[str, list] = {}

    def counted(name: str, op):
        @functools.wraps(op)
        async def wrapper(self, *args):
            t = time.perf_counter()
            try:
                return await op(self, *args)
            finally:
                c = calls.setdefault(name, [0, 0.0])
                c[0] += 1
                c[1] += time.perf_counter() - t
        return wrapper

    for name in ("lookup", "forget", "getattr", "setattr", "open", "create", "read",
                 "write", "flush", "release", "poll", "opendir", "readdir", "releasedir"):
        setattr(BusFS, name, counted(name, getattr(BusFS, name)))

    def dump(signum, frame) -> None:
        with open(counts + ".tmp", "w") as f:
            json.dump(calls, f)
        os.rename(counts + ".tmp", counts)

    signal.signal(signal.SIGUSR1, dump)
    return cli(["mount", *argv])


class Setup:
    """A broker and a mount (``sbus``, ``counted``, or the no-op filesystem ``noop``,
    ``noflush``) in a temporary directory, from *tree*'s code."""

    def __init__(self, tree: str, kind: str = "sbus") -> None:
        self.kind = kind
        self.tree = os.path.abspath(tree)
        self.env = tree_env(self.tree)
        self.tmp = tempfile.mkdtemp(prefix="sbus-bench-fuse-", dir="/tmp")
        self.address = os.path.join(self.tmp, "bus.sock")
        self.mnt = os.path.join(self.tmp, "mnt")
        self.counts = os.path.join(self.tmp, "counts.json")
        os.mkdir(self.mnt)
        self.broker = self.mount = None

    def __enter__(self) -> Setup:
        # `python -m` puts the working directory first on the path: run in the tree,
        # and make sure its code is what runs
        where = subprocess.run([sys.executable, "-c", "import sbus; print(sbus.__file__)"],
                               cwd=self.tree, env=self.env, capture_output=True, text=True,
                               check=True).stdout.strip()
        if not where.startswith(self.tree + os.sep):
            raise RuntimeError(f"the code of {self.tree} does not run there: {where}")
        try:
            margs = ["--address", self.address, self.mnt]
            if self.kind in ("noop", "noflush"):
                cmd = [sys.executable, HERE, "--noop-mount", self.mnt, self.kind]
            else:
                self.broker = subprocess.Popen([*SBUS, "serve", "--address", self.address],
                                               cwd=self.tree, env=self.env,
                                               stderr=subprocess.DEVNULL)
                wait_for(lambda: connectable(self.address))
                cmd = ([*SBUS, "mount", *margs] if self.kind == "sbus" else
                       [sys.executable, HERE, "--counted-mount", self.counts, *margs])
            self.mount = subprocess.Popen(cmd, cwd=self.tree, env=self.env)
            wait_for(lambda: mounted(self.mnt))
            if self.kind in ("sbus", "counted"):
                os.makedirs(os.path.join(self.mnt, os.path.dirname(KEY.decode())),
                            exist_ok=True)
                open(os.path.join(self.mnt, KEY.decode()), "wb").close()
        except BaseException:
            self.__exit__()
            raise
        return self

    def calls(self) -> dict[str, list]:
        """The counted mount's ``{op: [calls, seconds]}`` so far."""
        import json

        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.counts)
        assert self.mount is not None
        self.mount.send_signal(signal.SIGUSR1)
        wait_for(lambda: os.path.exists(self.counts))
        with open(self.counts) as f:
            return json.load(f)

    def __exit__(self, *exc: object) -> None:
        if self.mount is not None:
            self.mount.terminate()
            self.mount.wait(10)
        if mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)
        if self.broker is not None:
            self.broker.terminate()
            self.broker.wait(10)
        subprocess.run(["rm", "-rf", self.tmp], check=False)


def print_write(name: str, res: dict, rates: dict[str, float]) -> None:
    rates[name] = res["rate"]
    base = WRITERS[name][1]
    unit = "msg/s" if base is None else "publishes/s"
    vs = (f"  ({res['rate'] / rates[base]:.3f}x {base}; mount CPU "
          f"{res['cpu_us']:.1f} µs/msg)" if base in rates else "")
    print(f"{name:>22}: {res['count']} writes, {res['received']} received, "
          f"{res['rate']:>9,.0f} {unit}{vs}", flush=True)


def part_write(trees: list[tuple[str, str]], args: argparse.Namespace) -> None:
    runs: dict[str, dict[str, list[dict]]] = {label: {} for label, _ in trees}
    for r in range(args.rounds):
        for label, tree in trees if r % 2 == 0 else trees[::-1]:
            print(f"\nwriters, {SIZE}-byte messages, mount of {label} ({tree}), round "
                  f"{r + 1}; load average {os.getloadavg()[0]:.1f}", flush=True)
            rates: dict[str, float] = {}
            with Setup(tree) as m:
                for name in WRITERS:
                    res = bench_write(m.address, m.mnt, name, args.writes, m.env, m.mount.pid)
                    print_write(name, res, rates)
                    runs[label].setdefault(name, []).append(res)
                if r == 0 and label == trees[0][0]:
                    res = bench_cp(m.address, m.mnt, m.tmp, 10)
                    print(f"{'cp 150,000 B file':>22}: {res['count']} files, {res['whole']} "
                          f"whole messages received, {res['rate']:>9,.0f} files/s")
    if args.rounds == 1 and len(trees) == 1:
        return
    labels = [label for label, _ in trees]
    med = statistics.median
    print(f"\nmedians of {args.rounds} round(s): msg/s (x its baseline, the median of "
          "each round's own ratio); mount CPU µs/msg")
    head = "| writer | " + " | ".join(labels) + " |"
    if len(labels) > 1:
        head += f" {labels[0]} / {labels[1]} (median of round ratios) |"
    print(head)
    print("|---|" + "---|" * (len(labels) + (len(labels) > 1)))
    for name, (_, base, _) in WRITERS.items():
        cells, mids = [], []
        for label in labels:
            mine = runs[label][name]
            mid = med(x["rate"] for x in mine)
            mids.append(mid)
            cell = f"{mid:,.0f}"
            if base:
                ratios = [x["rate"] / b["rate"]
                          for x, b in zip(mine, runs[label][base], strict=True)]
                cell += f" ({med(ratios):.3f}x); {med(x['cpu_us'] for x in mine):.0f} µs"
            cells.append(cell)
        row = f"| {name} | " + " | ".join(cells) + " |"
        if len(labels) > 1:
            paired = med(x["rate"] / y["rate"] for x, y in
                         zip(runs[labels[0]][name], runs[labels[1]][name], strict=True))
            row += f" {mids[0] / mids[1]:.2f} ({paired:.2f}) |"
        print(row)


#: writers whose FUSE requests per message are counted
COUNTED = ("echo > MNT/key", "echo >&3 (3>>key)", "os.write, O_APPEND fd")


def part_requests(trees: list[tuple[str, str]], count: int, rounds: int) -> None:
    print(f"\nFUSE requests per message, the mount's Python time in its handlers and its "
          f"CPU time per message ({count} messages; a counted mount, no other traffic)")
    got: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    ops: dict[tuple[str, str], str] = {}
    for r in range(rounds):
        for label, tree in trees if r % 2 == 0 else trees[::-1]:
            with Setup(tree, "counted") as m:
                path = os.path.join(m.mnt, KEY.decode())
                for name in COUNTED:
                    before = m.calls()
                    cpu0 = cpu_seconds(m.mount.pid)
                    rate = run_writers(WRITERS[name][0], m.address, path, count, 1, m.env)
                    cpu = (cpu_seconds(m.mount.pid) - cpu0) / count * 1e6
                    after = m.calls()
                    per = {op: (c - before.get(op, [0, 0.0])[0], t - before.get(op, [0, 0.0])[1])
                           for op, (c, t) in after.items()}
                    per = {op: v for op, v in per.items() if v[0] >= count / 10}
                    n = sum(c for c, _ in per.values()) / count
                    us = sum(t for _, t in per.values()) / count * 1e6
                    got.setdefault((label, name), []).append((n, us, cpu, rate))
                    ops[label, name] = ", ".join(
                        f"{op} {c / count:.2f} ({t / c * 1e6:.1f} µs)"
                        for op, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][0]))
    med = statistics.median
    for (label, name), runs in got.items():
        print(f"{label:>10} {name:>22}: {med(x[0] for x in runs):.2f} requests, "
              f"{med(x[1] for x in runs):5.1f} µs Python, mount CPU "
              f"{med(x[2] for x in runs):5.1f} µs per message, {med(x[3] for x in runs):>7,.0f}"
              f" msg/s (medians of {len(runs)}); {ops[label, name]}", flush=True)


def part_floor(count: int, rounds: int) -> None:
    print(f"\nthe floor: the same writers against a no-op pyfuse3 filesystem ({count} "
          "messages)")
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in range(rounds):
        for kind in ("noop", "noflush") if r % 2 == 0 else ("noflush", "noop"):
            with Setup(ROOT, kind) as m:
                path = os.path.join(m.mnt, KEY.decode())
                for name in ("echo > MNT/key", "echo >&3 (3>>key)", "os.write, O_APPEND fd",
                             "4 x echo >&3 (3>>key)"):
                    how, _, procs = WRITERS[name]
                    cpu0 = cpu_seconds(m.mount.pid)
                    rate = run_writers(how, m.address, path, count // procs, procs, m.env)
                    cpu = (cpu_seconds(m.mount.pid) - cpu0) / (count // procs * procs) * 1e6
                    got.setdefault((kind, name), []).append((rate, cpu))
    for (kind, name), runs in got.items():
        rate = statistics.median(r for r, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        what = "no-op" if kind == "noop" else "no-op, no FLUSH"
        print(f"{what:>16} {name:>22}: {rate:>9,.0f} writes/s, {1e6 / rate:6.1f} µs each, "
              f"filesystem CPU {cpu:5.1f} µs each (medians of {len(runs)})", flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--publisher":
        publisher(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-writer":
        raw_writer(sys.argv[2], int(sys.argv[3]), SIZE, sys.argv[4] == "each")
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--os-writer":
        os_writer(sys.argv[2], int(sys.argv[3]), SIZE)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--noop-mount":
        NoOpFS.run(sys.argv[2], flush=sys.argv[3] == "noop")
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--counted-mount":
        return counted_mount(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rates", default="20000,40000,flood")
    ap.add_argument("--writes", type=int, default=5000)
    ap.add_argument("--only", default="read,write,requests,floor,intent")
    ap.add_argument("--compare", metavar="TREE",
                    help="also run the write and requests parts with TREE's mount")
    ap.add_argument("--rounds", type=int, default=1,
                    help="of the write, requests and floor parts (alternating)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    trees = [(os.path.basename(ROOT), ROOT)]
    if args.compare:
        trees.append((os.path.basename(os.path.abspath(args.compare)),
                      os.path.abspath(args.compare)))
    print(f"{SIZE}-byte messages; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    if "read" in only:
        with Setup(ROOT) as m:
            print(f"cat of a mounted key, {args.seconds:g} s each, default flood policy")
            print(f"{'reader':>12} {'offered':>12} {'sent':>9} {'received':>9} {'lost':>7} "
                  f"{'gaps':>5} {'received msg/s':>15} {'mount CPU µs/msg':>17}")
            for r in filter(None, args.rates.split(",")):
                rate = 0.0 if r == "flood" else float(r)
                for kind in (SocketReader, CatReader):
                    res = bench_read(kind(m.address, m.mnt), m.address, rate, args.seconds,
                                     m.mount.pid)
                    print(f"{kind.name:>12} {res['offered']:>12} {res['sent']:>9} "
                          f"{res['received']:>9} {res['lost']:>7} {res['gaps']:>5} "
                          f"{res['rate']:>15,.0f} {res['cpu_us']:>17.1f}", flush=True)
    if "write" in only:
        part_write(trees, args)
    if "requests" in only:
        part_requests(trees, args.writes, args.rounds)
    if "floor" in only:
        part_floor(args.writes, args.rounds)
    if "intent" in only:
        with Setup(ROOT) as m:
            res = bench_intent(m.mnt, 2000)
        print("\nlookups (µs per call): " + ", ".join(f"{k} {v:.0f}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
