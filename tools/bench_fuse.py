#!/usr/bin/env python3
"""Benchmark ``sbus mount``: how fast ``cat`` of a mounted key keeps up, and ``echo >`` rate.

Starts its own broker and mount in a temporary directory (needs /dev/fuse), then:

1. read: a raw-socket publisher (its own process) sends 64-byte payloads on one key
   at a paced rate (or unpaced: ``flood``) for a few seconds while ``cat MNT/key``
   runs; every line is checked for sequence (loss, order) under the default flood
   policy;
2. write: 64-byte messages through the mount against a raw-socket publisher (its own
   process, one ``send`` per message), each counted by a raw subscriber:
   ``echo $i > MNT/key`` in a bash loop (a builtin: one open/close per message),
   ``echo $i >&3`` with ``3>> MNT/key`` (one open, a write per message), and ``cp`` of
   a 150,000-byte file (one message per file);
3. intent: the cost of a lookup of an unknown name (the mount reads the caller's
   open call from /proc), per ``stat`` and per ``open`` for reading, against a known
   name.

Usage: .venv/bin/python tools/bench_fuse.py [--seconds 3] [--rates 20000,40000,flood]
       [--writes 5000] [--only read,write,intent]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    pub = subprocess.Popen([sys.executable, __file__, "--publisher", address, str(rate),
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


def raw_writer(address: str, count: int, size: int, reconnect: bool) -> None:
    """Child process: a baseline writer, one ``send`` per message on a raw socket
    (with *reconnect*, a connection per message, as ``echo >`` opens a file per
    message); prints its own elapsed seconds, so interpreter start-up is not counted."""
    head = b"MSG " + KEY + b"\0"
    t0 = time.monotonic()
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
    print(time.monotonic() - t0)


WRITERS = {
    "raw socket": "one",
    "raw, connect per msg": "each",
    "echo > MNT/key": 'for ((i=0; i<{n}; i++)); do echo "$i{pad}" > {path}; done',
    "echo >&3 (3>>key)": 'exec 3>>{path}; for ((i=0; i<{n}; i++)); do echo "$i{pad}" >&3; done',
}


def bench_write(address: str, mnt: str, name: str, count: int) -> dict:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    s.send(b"SUB " + KEY)
    s.send(b"CMSG !/cred/whoami")
    s.recv(1000)
    path = os.path.join(mnt, KEY.decode())
    t0 = time.monotonic()
    if WRITERS[name] in ("one", "each"):
        out = subprocess.run([sys.executable, __file__, "--raw-writer", address, str(count),
                              WRITERS[name]], check=True, env=ENV, capture_output=True)
        elapsed = float(out.stdout)
    else:
        script = WRITERS[name].format(n=count, path=path, pad="." * (SIZE - 6))
        subprocess.run(["bash", "-c", script], check=True)
        elapsed = time.monotonic() - t0
    s.settimeout(5)
    got = 0
    try:
        while got < count:
            s.recv(1000)
            got += 1
    except TimeoutError:
        pass
    s.close()
    return {"count": count, "received": got, "rate": count / elapsed}


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


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--publisher":
        publisher(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-writer":
        raw_writer(sys.argv[2], int(sys.argv[3]), SIZE, sys.argv[4] == "each")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rates", default="20000,40000,flood")
    ap.add_argument("--writes", type=int, default=5000)
    ap.add_argument("--only", default="read,write,intent")
    args = ap.parse_args()
    only = set(args.only.split(","))
    tmp = tempfile.mkdtemp(prefix="sbus-bench-fuse-", dir="/tmp")
    address = os.path.join(tmp, "bus.sock")
    mnt = os.path.join(tmp, "mnt")
    os.mkdir(mnt)
    broker = subprocess.Popen([*SBUS, "serve", "--address", address], env=ENV,
                              stderr=subprocess.DEVNULL)
    mount = None
    try:
        wait_for(lambda: connectable(address))
        mount = subprocess.Popen([*SBUS, "mount", "--address", address, mnt], env=ENV)
        wait_for(lambda: mounted(mnt))
        os.makedirs(os.path.join(mnt, os.path.dirname(KEY.decode())), exist_ok=True)
        open(os.path.join(mnt, KEY.decode()), "wb").close()
        print(f"cat of a mounted key, {SIZE}-byte payloads, {args.seconds:g} s each, "
              f"default flood policy; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs")
        print(f"{'reader':>12} {'offered':>12} {'sent':>9} {'received':>9} {'lost':>7} "
              f"{'gaps':>5} {'received msg/s':>15} {'mount CPU µs/msg':>17}")
        for r in filter(None, args.rates.split(",") if "read" in only else []):
            rate = 0.0 if r == "flood" else float(r)
            for kind in (SocketReader, CatReader):
                res = bench_read(kind(address, mnt), address, rate, args.seconds, mount.pid)
                print(f"{kind.name:>12} {res['offered']:>12} {res['sent']:>9} "
                      f"{res['received']:>9} {res['lost']:>7} {res['gaps']:>5} "
                      f"{res['rate']:>15,.0f} {res['cpu_us']:>17.1f}")
        if "write" in only:
            print(f"\nwriters, {SIZE}-byte messages")
            base = None
            for name in WRITERS:
                res = bench_write(address, mnt, name, args.writes)
                base = base or res["rate"]
                unit = "msg/s" if name.startswith("raw") else "publishes/s"
                print(f"{name:>20}: {res['count']} writes, {res['received']} received, "
                      f"{res['rate']:>9,.0f} {unit}  ({res['rate'] / base:.2f}x raw)")
            res = bench_cp(address, mnt, tmp, 10)  # the subscriber reads only afterwards
            print(f"{'cp 150,000 B file':>20}: {res['count']} files, {res['whole']} whole "
                  f"messages received, {res['rate']:>9,.0f} files/s")
        if "intent" in only:
            res = bench_intent(mnt, 2000)
            print("\nlookups (µs per call): " + ", ".join(f"{k} {v:.0f}"
                                                       for k, v in res.items()))
    finally:
        if mount is not None:
            mount.terminate()
            mount.wait(10)
        if mounted(mnt):
            subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
        broker.terminate()
        broker.wait(10)
        subprocess.run(["rm", "-rf", tmp], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
