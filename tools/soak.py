#!/usr/bin/env python3
"""Soak the broker: many hostile and slow clients for a bounded time, then check the damage.

    tools/soak.py                  # 10 minutes
    tools/soak.py --duration 12    # CI-sized (tests/test_soak.py)

A real `sbus serve` runs on a temporary socket.  Worker processes (some of them
setuid to other users, so the broker sees several kernel-verified UIDs) drive raw
SOCK_SEQPACKET clients:

* churners subscribe, unsubscribe, publish (public and secret keys, their own and
  others'), try forbidden secret patterns, and disconnect at random;
* slow readers of every flood mode (soft queue/discard/error, hard discard/error,
  order stack/random) read at a trickle behind the churn;
* reliable readers (soft block, hard block) read slowly from a sequenced publisher;
* idlers hold hundreds of subscribed connections and never read.

A warm-up phase (a tenth of the time) runs the same load; when everyone has left,
the broker's VmRSS is the baseline.  At the end, with everyone gone again, the
checks are: RSS back to baseline (within max(8 MiB, 10 %)), every reliable reader
got every message in order, no secret key reached anyone but its owner, readers in
arrival order never saw a publisher's messages out of order, and the broker lived.
Prints a figures table; exit status 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from sbus.protocol import STATUS

HEADER = struct.Struct("!QQ")  # (publisher id, sequence number) at the start of a payload
NOBODY = 65534
WHOAMI = b"CMSG !/cred/whoami"
FLOOD_MODES = {
    "soft-queue": [b"CMSG blocking/soft/queue"],
    "soft-discard": [b"CMSG blocking/soft/discard"],
    "soft-error": [b"CMSG blocking/soft/error"],
    "hard-discard": [b"CMSG blocking/hard/discard"],
    "hard-error": [b"CMSG blocking/hard/error"],
    "order-stack": [b"CMSG order/stack"],
    "order-random": [b"CMSG order/random"],
}
RELIABLE_MODES = {
    "soft-block": [b"CMSG blocking/soft/block"],
    "hard-block": [b"CMSG blocking/soft/queue", b"CMSG blocking/hard/block"],
}


# -- clients -------------------------------------------------------------------------------

class Conn:
    """One raw non-blocking client."""

    serial = 0

    def __init__(self, address: str, setup: list[bytes] = ()) -> None:
        Conn.serial += 1
        self.serial = Conn.serial
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        deadline = time.monotonic() + 30
        while True:
            try:
                s.connect(address)
                break
            except BlockingIOError:  # the listen backlog is full: the broker is behind
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        for p in setup:
            s.send(p)
        s.setblocking(False)
        self.sock = s
        self.open = True

    def send(self, packet: bytes) -> bool:
        """Non-blocking send; False if the kernel buffer is full (or the broker left)."""
        try:
            self.sock.send(packet)
            return True
        except BlockingIOError:
            return False
        except OSError:
            self.open = False
            return False

    def recv_some(self, limit: int) -> list[bytes] | None:
        """Up to *limit* waiting packets; None once the broker closed the connection."""
        out = []
        for _ in range(limit):
            try:
                p = self.sock.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError:
                self.open = False
                return None
            if not p:
                self.open = False
                return None
            out.append(p)
        return out

    def close(self) -> None:
        self.sock.close()
        self.open = False


class Worker:
    """State and checks shared by every role: secret-leak detection and counters."""

    def __init__(self, name: str, address: str, creds: list[tuple[int, int, int]], seed: int):
        self.name = name
        self.address = address
        self.rng = random.Random(seed)
        self.me = (os.getgid(), os.getuid(), os.getpid())
        self.own_secret = b"!/cred/%d/%d/%d/" % self.me
        self.creds = creds
        self.stats: Counter[str] = Counter()
        self.problems: list[str] = []
        self.pub_base = (seed & 0xFFFF) << 32

    def seen(self, packet: bytes) -> None:
        """Check one received packet; count it."""
        if packet.startswith(b"MSG !/"):
            if not packet.startswith(b"MSG " + self.own_secret):
                self.stats["secret_leaks"] += 1
                if len(self.problems) < 5:
                    self.problems.append(f"{self.name} (uid {self.me[1]}) received another's "
                                         f"secret {packet[:60]!r}")
            else:
                self.stats["secrets_received"] += 1
        if packet.startswith(b"MSG "):
            self.stats["received"] += 1

    def payload(self, conn: Conn, seq: int, size: int) -> bytes:
        """A payload that names its publisher connection: order holds per connection only."""
        return HEADER.pack(self.pub_base | conn.serial, seq) + self.rng.randbytes(size)


SEGMENTS = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"]


def churner(pipe, address: str, seed: int, clients: int, rate: float, deadline: float) -> None:
    """Clients that subscribe, unsubscribe, publish (about *rate* msg/s) and vanish at random."""
    creds = pipe.recv()
    w = Worker(f"churner-{seed}", address, creds, seed)
    rng = w.rng
    conns: list[Conn] = []
    seq = 0

    def pattern() -> bytes:
        r = rng.random()
        a, b = rng.choice(SEGMENTS), rng.choice(SEGMENTS)
        if r < 0.6:
            return rng.choice([b"soak/%s/%s" % (a, b), b"soak/%s/*" % a, b"soak/*/%s" % b,
                               b"soak/%s/" % a, b"soak/%s*/%s" % (a[:1], b)])
        if r < 0.8:  # own secrets, explicitly or with empty fields
            return rng.choice([w.own_secret, b"!/cred////", w.own_secret + b"*",
                               b"!/cred////x/"])
        # forbidden or catch-all: none of these may ever yield someone else's secret
        other = rng.choice(creds)
        return rng.choice([b"", b"!/", b"!/cred/*/*/*/", b"!/cred/%d/%d/%d/" % other,
                           b"*/", b"*/cred/", b"!*/", b"soak/"])

    def key() -> bytes:
        if rng.random() < 0.2:
            return b"!/cred/%d/%d/%d/" % rng.choice(creds) + rng.choice([b"x", b"x/y", b"z"])
        return b"soak/%s/%s" % (rng.choice(SEGMENTS), rng.choice(SEGMENTS))

    start = time.monotonic()
    while (now := time.monotonic()) < deadline:
        if len(conns) < clients:
            conns.append(Conn(address))
            w.stats["connects"] += 1
        budget = int(rate * (now - start)) - w.stats["published"]
        for c in rng.sample(conns, min(8, len(conns))):
            r = rng.random()
            if r < 0.15:
                c.send(b"SUB " + pattern())
                w.stats["subscribes"] += 1
            elif r < 0.25:
                c.send(b"UNSUB " + pattern())
            elif r < 0.93:
                for _ in range(min(budget, rng.randint(1, 30))):
                    if c.send(b"MSG " + key() + b"\0" + w.payload(c, seq, rng.randint(0, 200))):
                        seq += 1
                        budget -= 1
                        w.stats["published"] += 1
            elif r < 0.995:
                c.send(rng.choice([b"", b"JUNK", b"MSG nonul", b"CMSG blocking/soft/xyz"]))
            else:
                c.close()
                w.stats["disconnects"] += 1
            if c.open:
                for p in c.recv_some(200) or ():
                    w.seen(p)
        conns = [c for c in conns if c.open]
        time.sleep(0.002)
    for c in conns:
        c.close()
    pipe.send((dict(w.stats), w.problems))


def slow_readers(pipe, address: str, seed: int, deadline: float) -> None:
    creds = pipe.recv()
    w = Worker(f"slow-{seed}", address, creds, seed)
    readers: dict[str, Conn] = {}
    last: dict[str, dict[int, int]] = {m: {} for m in FLOOD_MODES}
    reconnect_at: dict[str, float] = {}

    def connect(mode: str) -> None:
        readers[mode] = Conn(address, FLOOD_MODES[mode] + [b"SUB soak/", b"SUB !/cred////"])

    for mode in FLOOD_MODES:
        connect(mode)
    while time.monotonic() < deadline:
        for mode, c in list(readers.items()):
            if not c.open:
                if time.monotonic() >= reconnect_at.setdefault(mode, time.monotonic() + 0.2):
                    del reconnect_at[mode]
                    connect(mode)
                    last[mode].clear()  # a new connection starts a new stream
                    w.stats[f"reconnects_{mode}"] += 1
                continue
            got = c.recv_some(3)  # a trickle (~300 msg/s): far slower than the churn
            if got is None:
                w.stats[f"disconnected_{mode}"] += 1
                continue
            for p in got:
                w.seen(p)
                if p.startswith(b"MSG soak/") and not mode.startswith("order-"):
                    body = p[p.index(b"\0") + 1:]
                    pub, seq = HEADER.unpack_from(body)
                    if last[mode].get(pub, -1) >= seq:
                        w.stats["reordered"] += 1
                        if len(w.problems) < 5:
                            w.problems.append(f"{mode} reader: publisher {pub:x} seq {seq} "
                                              f"after {last[mode][pub]}")
                    last[mode][pub] = seq
                elif p.startswith(b"CMSG blocking/dropped\0"):
                    w.stats[f"dropped_{mode}"] += int(p.split(b"\0")[1])
        time.sleep(0.01)
    for c in readers.values():
        c.close()
    pipe.send((dict(w.stats), w.problems))


def reliable(pipe, address: str, seed: int, deadline: float) -> None:
    """A sequenced publisher and one slow reader per blocking mode; nothing may be lost."""
    creds = pipe.recv()
    w = Worker(f"reliable-{seed}", address, creds, seed)
    prefix = {m: b"rel/%d/%s/" % (seed, m.encode()) for m in RELIABLE_MODES}
    readers = {m: Conn(address, RELIABLE_MODES[m] + [b"SUB " + prefix[m]])
               for m in RELIABLE_MODES}
    for c in readers.values():
        c.sock.setblocking(True)
        c.sock.send(WHOAMI)
        while not c.sock.recv(1 << 16).startswith(WHOAMI):
            pass
        c.sock.setblocking(False)
    pub = Conn(address)
    sent = {m: 0 for m in RELIABLE_MODES}
    expect = {m: 0 for m in RELIABLE_MODES}
    modes = list(RELIABLE_MODES)

    def read(limit: int) -> None:
        for m, c in readers.items():
            for p in c.recv_some(limit) or ():
                w.seen(p)
                if not p.startswith(b"MSG rel/"):
                    continue
                seq = HEADER.unpack_from(p, p.index(b"\0") + 1)[1]
                if seq != expect[m]:
                    w.stats[f"lost_or_reordered_{m}"] += 1
                    if len(w.problems) < 5:
                        w.problems.append(f"{m} reader expected {expect[m]}, got {seq}")
                expect[m] = seq + 1
            if not c.open:
                w.problems.append(f"{m} reader was disconnected")
                readers[m] = Conn(address)  # keep the loop simple; the run has failed anyway

    while time.monotonic() < deadline:
        for _ in range(200):
            m = modes[sent["soft-block"] + sent["hard-block"] & 1]
            key = b"MSG " + prefix[m] + b"k\0"
            if not pub.send(key + HEADER.pack(0, sent[m]) + w.rng.randbytes(64)):
                w.stats["publisher_held_back"] += 1
                break
            sent[m] += 1
        read(60)  # slower than the publisher can go: the broker must hold it back
        time.sleep(0.002)
    end = time.monotonic() + 60
    while any(expect[m] < sent[m] for m in modes) and time.monotonic() < end:
        read(10_000)
        time.sleep(0.001)
    for m in modes:
        w.stats[f"sent_{m}"] = sent[m]
        w.stats[f"received_{m}"] = expect[m]
        if expect[m] != sent[m]:
            w.problems.append(f"{m} reader got {expect[m]} of {sent[m]} messages")
    for c in [pub, *readers.values()]:
        c.close()
    pipe.send((dict(w.stats), w.problems))


def idler(pipe, address: str, seed: int, count: int, deadline: float) -> None:
    creds = pipe.recv()
    w = Worker(f"idler-{seed}", address, creds, seed)
    # a few also take their (shared, per-process) secrets: each such message fans out to all
    conns = [Conn(address, [b"SUB soak/idle/%d" % n] + [b"SUB !/cred////"] * (n % 50 == 0))
             for n in range(count)]
    w.stats["held"] = len(conns)
    pipe.send("holding")
    while time.monotonic() < deadline:
        time.sleep(0.1)
    for c in conns:
        c.close()
    pipe.send((dict(w.stats), w.problems))


# -- orchestration -------------------------------------------------------------------------

def _become(uid: int, target, pipe, *args) -> None:
    if uid != os.getuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    try:
        target(pipe, *args)
    except Exception as exc:  # noqa: BLE001 - a worker's failure is a finding, reported
        pipe.send(({}, [f"{target.__name__} worker failed: {exc!r}"]))


class Broker:
    """`sbus serve` in a child process, with its STATUS= reports on a notify socket."""

    def __init__(self, directory: Path, queue_limit: str, nice: int = 0) -> None:
        self.address = str(directory / "bus.sock")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(directory / "notify"))
        self.notify.setblocking(False)
        env = dict(os.environ, NOTIFY_SOCKET=str(directory / "notify"))
        env.pop("LISTEN_FDS", None)
        self.log = open(directory / "broker.log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sbus.cli", "serve", "--address", self.address,
             "--mode", "666", "--queue-limit", queue_limit],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.status: dict[str, float] = {}
        self.peak: Counter[str] = Counter()
        deadline = time.monotonic() + 15
        while "clients" not in self.status:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"soak: broker did not start: {self.log_text()}")
            self.poll_status()
            time.sleep(0.05)

    def poll_status(self) -> None:
        """Read pending STATUS= reports: '3 clients, 5 subscriptions, ... , 1234 msg/s'."""
        while True:
            try:
                msg = self.notify.recv(4096).decode(errors="replace")
            except BlockingIOError:
                return
            for line in msg.splitlines():
                if line.startswith("STATUS="):
                    for part in line[7:].split(","):
                        fields = part.split()
                        if len(fields) == 2 and fields[0].replace(".", "").isdigit():
                            self.status[fields[1]] = float(fields[0])
                            self.peak[fields[1]] = max(self.peak[fields[1]], float(fields[0]))

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.notify.close()


def run_phase(broker: Broker, duration: float, args, seed: int) -> tuple[Counter, list[str], dict]:
    """Run every worker for *duration* seconds; return summed stats, problems, samples."""
    ctx = multiprocessing.get_context("fork")
    deadline = time.monotonic() + duration
    plan = []
    users = [0, NOBODY, NOBODY - 1]
    for n in range(args.churners):
        plan.append((users[n % 3], churner, (seed + n, args.clients, args.rate, deadline)))
    plan.append((NOBODY, slow_readers, (seed + 100, deadline)))
    plan.append((0, slow_readers, (seed + 101, deadline)))
    plan.append((NOBODY - 1, reliable, (seed + 200, deadline)))
    plan.append((0, reliable, (seed + 201, deadline)))
    plan.append((NOBODY, idler, (seed + 300, args.idle, deadline)))
    procs, pipes, creds = [], [], []
    for uid, target, extra in plan:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_become, args=(uid, target, child, broker.address, *extra),
                        daemon=True)
        p.start()
        child.close()
        procs.append(p)
        pipes.append((target.__name__, parent))
        creds.append((uid, uid, p.pid))  # setgid(uid) too, so gid == uid (root: 0)
    for _, pipe in pipes:
        pipe.send(creds)
    samples = {"rss_peak_kib": 0, "clients_peak": 0}
    results: list = [None] * len(pipes)
    end = deadline + 60
    while any(r is None for r in results) and time.monotonic() < end:
        broker.poll_status()
        samples["rss_peak_kib"] = max(samples["rss_peak_kib"], broker.rss_kib())
        for i, (_, pipe) in enumerate(pipes):
            if results[i] is None and pipe.poll(0.02):
                msg = pipe.recv()
                if msg != "holding":
                    results[i] = msg
        samples["clients_peak"] = max(samples["clients_peak"], broker.status.get("clients", 0))
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    total: Counter = Counter()
    problems: list[str] = []
    for (name, _), result in zip(pipes, results, strict=True):
        if result is None:
            problems.append(f"a {name} worker did not report (hung or crashed)")
            continue
        stats, probs = result
        total.update(stats)
        problems += probs
    return total, problems, samples


def settle(broker: Broker, problems: list[str], timeout: float = 120.0) -> int:
    """Wait until the broker has no clients but the asker of ``CMSG broker/status``
    (asked every 0.1 s: STATUS= comes only every 2 s), take its counters, and return its
    RSS once that stopped falling (the allocator gives back what departed clients held).

    Under load the broker may still be working through what departed clients left
    in their sockets; that is slow, not wrong, so only a long wait is a problem.
    """
    deadline = time.monotonic() + timeout
    asker = Conn(broker.address)
    asker.sock.setblocking(True)
    totals: dict = {}
    while time.monotonic() < deadline:
        asker.sock.send(b"CMSG " + STATUS)
        while not (p := asker.sock.recv(1 << 17)).startswith(b"CMSG " + STATUS + b"\0"):
            pass
        totals = json.loads(p[len(STATUS) + 6:])["broker"]
        if totals["clients"] == 1:
            break
        time.sleep(0.1)
    else:
        problems.append(f"clients still connected {timeout:.0f} s after they all left: "
                        f"{totals}")
    asker.close()
    broker.status.update({k: totals[k] for k in ("published", "delivered") if k in totals})
    rss, end = broker.rss_kib(), time.monotonic() + 5
    while time.monotonic() < end:
        time.sleep(0.2)
        now = broker.rss_kib()
        if now >= rss - 256:
            return now
        rss = now
    return rss


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds (default 600)")
    ap.add_argument("--churners", type=int, default=6, help="churning worker processes")
    ap.add_argument("--clients", type=int, default=40, help="clients per churner")
    ap.add_argument("--rate", type=float, default=1500, help="msg/s each churner publishes")
    ap.add_argument("--idle", type=int, default=500, help="idle connections held")
    ap.add_argument("--queue-limit", default="256k", help="broker --queue-limit")
    ap.add_argument("--broker-nice", type=int, default=-5,
                    help="nice value for the broker, so a dozen load-generating processes on "
                         "a small machine cannot starve it (default -5)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args(argv)
    if os.getuid() != 0:
        print("soak: run as root (workers setuid to other users)", file=sys.stderr)
        return 2
    directory = Path(tempfile.mkdtemp(prefix="sbus-soak-", dir="/tmp"))
    os.chmod(directory, 0o755)
    broker = Broker(directory, args.queue_limit, args.broker_nice)
    status = 1
    try:
        status = _soak(broker, args)
        return status
    finally:
        broker.stop()
        if status == 0:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"soak: broker log kept in {directory}/broker.log")


def _soak(broker: Broker, args) -> int:
    """A warm-up cycle, then cycles of the same load; memory is read between cycles."""
    fresh = broker.rss_kib()
    cycle = min(60.0, args.duration / 3)
    cycles = max(2, round(args.duration / cycle) - 1)
    _, problems, _ = run_phase(broker, cycle, args, args.seed)
    baseline = settle(broker, problems)
    published_before = broker.status.get("published", 0)
    delivered_before = broker.status.get("delivered", 0)
    stats: Counter = Counter()
    samples = {"rss_peak_kib": 0, "clients_peak": 0}
    rss_after_cycles = []
    t0 = time.monotonic()
    for n in range(cycles):
        more_stats, more, more_samples = run_phase(broker, cycle, args, args.seed + 1000 * (n + 1))
        stats.update(more_stats)
        problems += more
        for k, v in more_samples.items():
            samples[k] = max(samples[k], v)
        rss_after_cycles.append(settle(broker, problems))
    elapsed = time.monotonic() - t0
    # memory returns to the baseline (give the allocator a moment)
    allowed = max(8192, baseline // 10)
    deadline = time.monotonic() + 10
    while (after := broker.rss_kib()) > baseline + allowed and time.monotonic() < deadline:
        time.sleep(0.5)
    if after > baseline + allowed:
        problems.append(f"broker RSS {after} KiB did not return to baseline {baseline} KiB "
                        f"(+{allowed} KiB allowed); after each cycle: {rss_after_cycles}")
    if not broker.alive():
        problems.append("the broker died")
    if "Traceback" in broker.log_text():
        problems.append("the broker logged a traceback")
    published = broker.status.get("published", 0) - published_before
    delivered = broker.status.get("delivered", 0) - delivered_before
    load_time = cycle * cycles
    rel_sent = sum(stats[f"sent_{m}"] for m in RELIABLE_MODES)
    rel_recv = sum(stats[f"received_{m}"] for m in RELIABLE_MODES)
    if stats["secrets_received"] == 0:
        problems.append("no secret message reached its owner: the secrecy check is vacuous")
    if rel_sent == 0:
        problems.append("the reliable publisher sent nothing")
    figures = {
        "load_s": round(load_time, 1),
        "wall_s_with_drains": round(elapsed, 1),
        "cycles_after_warmup": cycles,
        "connections_peak": int(samples["clients_peak"]),
        "idle_connections_held": stats["held"],
        "connects": stats["connects"],
        "disconnects_random": stats["disconnects"],
        "broker_published": int(published),
        "broker_delivered": int(delivered),
        "published_msg_per_s": round(published / load_time),
        "delivered_msg_per_s": round(delivered / load_time),
        "status_rate_peak_msg_per_s": int(broker.peak.get("msg/s", 0)),
        "reliable_sent": rel_sent,
        "reliable_received_in_order": rel_recv,
        "publisher_held_back": stats["publisher_held_back"],
        "soft_error_disconnects": stats["reconnects_soft-error"],
        "hard_error_disconnects": stats["reconnects_hard-error"],
        "drops_reported": sum(v for k, v in stats.items() if k.startswith("dropped_")),
        "reordered": stats["reordered"],
        "secrets_received_by_owners": stats["secrets_received"],
        "secret_leaks": stats["secret_leaks"],
        "rss_fresh_kib": fresh,
        "rss_baseline_kib": baseline,
        "rss_peak_kib": samples["rss_peak_kib"],
        "rss_after_cycles_kib": " ".join(map(str, rss_after_cycles)),
        "rss_after_kib": after,
        "load_average_1min": round(os.getloadavg()[0], 1),
        "problems": len(problems),
    }
    width = max(map(len, figures))
    print(f"{'figure':<{width}}  value")
    for k, v in figures.items():
        print(f"{k:<{width}}  {v}")
    for p in problems:
        print(f"PROBLEM: {p}")
    print("soak: " + ("FAILED" if problems else "OK: nothing lost, no secret leaked, "
                      "memory back to baseline"))
    if args.json:
        print("JSON " + json.dumps({"figures": figures, "problems": problems}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
