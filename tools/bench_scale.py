#!/usr/bin/env python3
"""Cost against work: what the broker spends (RSS, CPU) as clients, patterns, keys and
subscription churn grow, printed as tables and drawn as PNG plots.

The broker is a black box: ``sbus serve`` started as a process (tools/bench.py's
`Broker`, pinned to core 0), measured through /proc (VmRSS; utime + stime).  So this
tool measures whichever broker the checkout has.

    clients   idle connections, 1k -> 100k (as many as RLIMIT_NOFILE allows: this
              process and the broker both get the hard limit; the table says where it
              stopped): RSS, RSS per client, CPU per accepted client, idle CPU
    patterns  distinct held patterns that match nothing, 1k -> 1M, from one client:
              RSS per pattern, CPU per SUB, and S1 throughput (lg) with them held
              against a twin broker that holds none (taking turns); the broker's CPU
              per delivery is the steadier measure on a loaded machine
    keys      distinct keys published once each (nobody subscribed), 1k -> 1M: RSS
              (the route cache is bounded) and CPU per publish
    churn     S3 (lg: 1 publisher, 100 subscribers on 100 keys) while another client
              does SUB+UNSUB pairs at a paced rate over 10,000 held patterns: S3
              throughput and its ratio to no churn (rates alternate within each round;
              ``short``: messages lg's subscriber did not get before it gave up after
              1.5 s without any, which on a loaded machine is a stall, not a loss: the
              broker runs with ``--hard block``)

Usage: tools/bench_scale.py [--parts clients,patterns,keys,churn] [--max-clients N]
                            [--max-patterns N] [--max-keys N] [--rounds R]
                            [--plots DIR]
Results and the PNGs belong in docs/performance.md with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench import CORE_LOAD, Broker, build, run_scenario

#: per-user limits out of the way: this measures the broker, not its quotas
UNLIMITED = ["--hard", "block", "--max-connections-per-user", "1000000",
             "--max-subscriptions-per-user", "10000000",
             "--max-subscription-bytes-per-user", "64g",
             "--max-queued-bytes-per-user", "64g"]
CLIENT_STEPS = [1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000]
PATTERN_STEPS = [1_000, 10_000, 100_000, 1_000_000]
KEY_STEPS = [1_000, 10_000, 100_000, 1_000_000]
CHURN_RATES = [0, 100, 1_000, 5_000]  # SUB+UNSUB pairs/s
CHURN_HELD = 10_000
S_COUNT = 200_000  # messages of one S1 / S3 run


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (higher if privileged); the broker we
    start inherits it.  Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (1 << 20, 300_000, 200_000):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            continue
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def broker_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    return int(line.split()[3])


def cpu_seconds(broker: Broker) -> float:
    """CPU time of all the broker's threads, in nanoseconds resolution (schedstat), where
    /proc/PID/stat counts clock ticks (10 ms)."""
    total = 0
    for task in Path(f"/proc/{broker.proc.pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    return s


def sync(s: socket.socket) -> int:
    """Wait until the broker has handled everything *s* sent; returns how many of its
    packets it refused meanwhile."""
    s.send(b"CMSG !/cred/whoami")
    refused = 0
    while True:
        p = s.recv(1 << 16)
        if not p:
            raise ConnectionError("the broker closed the connection")
        if p.startswith(b"CMSG !/cred/whoami\0"):
            return refused
        if p.startswith(b"REFUSED"):
            refused += 1


def grow(broker: Broker, steps: list[int], packet: bytes) -> Iterator[dict]:
    """From one new connection, send ``packet % i`` for i = 0, 1, ... up to each of
    *steps* in turn; yields for each step the broker's CPU µs per packet of that step,
    how many it refused, its RSS (KB) and the RSS growth since the start (KB)."""
    sock = connect(broker.path)
    sync(sock)
    base = settle(broker)
    n = 0
    for step in steps:
        cpu0, first = cpu_seconds(broker), n
        while n < step:
            sock.send(packet % n)
            n += 1
        refused = sync(sock)
        us = (cpu_seconds(broker) - cpu0) * 1e6 / (step - first)
        rss = settle(broker)
        yield {"step": step, "us": us, "refused": refused, "rss": rss, "growth": rss - base}
    sock.close()


def settle(broker: Broker) -> int:
    time.sleep(0.5)
    return broker.rss_kb()


def part_clients(tmp: Path, cbroker: Path, max_clients: int) -> list[dict]:
    broker = Broker("sbus", tmp, cbroker, UNLIMITED)
    rows = []
    try:
        room = min(max_clients, broker_nofile(broker.proc.pid) - 64,
                   resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64)
        base = settle(broker)
        socks: list[socket.socket] = []
        steps = [s for s in CLIENT_STEPS if s <= room]
        if room < min(max_clients, CLIENT_STEPS[-1]) and room not in steps:
            steps.append(room)  # as many as the descriptor limit allows
        for step in steps:
            cpu0, t0 = cpu_seconds(broker), time.monotonic()
            while len(socks) < step:
                socks.append(connect(broker.path))
            sync(socks[-1])  # accepted in order: all before it are in too
            took = time.monotonic() - t0
            accept_cpu = cpu_seconds(broker) - cpu0
            rss = settle(broker)
            cpu1 = cpu_seconds(broker)
            time.sleep(2)
            idle = (cpu_seconds(broker) - cpu1) / 2
            alive = sum(1 for s in socks[:: max(1, step // 100)] if _alive(s))
            rows.append({"clients": step, "rss_mb": rss / 1024,
                         "kb_per_client": (rss - base) / step,
                         "accept_us": accept_cpu * 1e6 / step,
                         "connect_s": took, "idle_cpu_pct": idle * 100,
                         "sampled_alive_pct": 100 * alive / len(socks[:: max(1, step // 100)])})
            print(f"  clients {step}: {json.dumps(_round(rows[-1]))}", file=sys.stderr)
        for s in socks:
            s.close()
    finally:
        broker.stop()
    if rows and rows[-1]["clients"] < max_clients:
        print(f"  clients: stopped at {rows[-1]['clients']}, the descriptor limit",
              file=sys.stderr)
    return rows


def _alive(s: socket.socket) -> bool:
    """Still connected (no end-of-file waiting)."""
    try:
        return s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def part_patterns(tmp: Path, cbroker: Path, lg: Path, max_patterns: int,
                  rounds: int) -> list[dict]:
    """Patterns held by one broker; S1 on it against S1 on a twin broker holding none,
    the two taking turns (*rounds* each, each going first in every other round) so that
    the machine's noise cancels."""
    (tmp / "held").mkdir()
    (tmp / "none").mkdir()
    broker = Broker("sbus", tmp / "held", cbroker, UNLIMITED)
    twin = Broker("sbus", tmp / "none", cbroker, UNLIMITED)
    rows = []
    try:
        steps = [s for s in PATTERN_STEPS if s <= max_patterns]
        for g in grow(broker, steps, b"SUB p/%d/x"):
            held, none = [], []
            for r in range(rounds):  # each goes first in every other round: no order bias
                pair = [(held, broker), (none, twin)]
                for results, which in pair if r % 2 == 0 else pair[::-1]:
                    results.append(run_scenario(lg, which, "S1", S_COUNT))
            s1, s1_none = (statistics.median(r["rate"] for r in x) for x in (held, none))
            cpu, cpu_none = (statistics.median(r["cpu_us_per_delivery"] for r in x)
                             for x in (held, none))
            rows.append({"patterns": g["step"], "rss_mb": g["rss"] / 1024,
                         "bytes_per_pattern": g["growth"] * 1024 / g["step"],
                         "sub_us": g["us"], "refused": g["refused"],
                         "s1_kps": s1 / 1e3, "s1_none_kps": s1_none / 1e3,
                         "s1_ratio": s1 / s1_none, "s1_cpu_us": cpu,
                         "s1_none_cpu_us": cpu_none, "cpu_ratio": cpu / cpu_none})
            print(f"  patterns: {json.dumps(_round(rows[-1]))}", file=sys.stderr)
    finally:
        broker.stop()
        twin.stop()
    return rows


def part_keys(tmp: Path, cbroker: Path, max_keys: int) -> list[dict]:
    broker = Broker("sbus", tmp, cbroker, UNLIMITED)
    rows = []
    try:
        steps = [s for s in KEY_STEPS if s <= max_keys]
        for g in grow(broker, steps, b"MSG key/%d\0x"):
            rows.append({"keys": g["step"], "rss_mb": g["rss"] / 1024,
                         "growth_mb": g["growth"] / 1024, "publish_us": g["us"],
                         "refused": g["refused"]})
            print(f"  keys: {json.dumps(_round(rows[-1]))}", file=sys.stderr)
    finally:
        broker.stop()
    return rows


class Churner(threading.Thread):
    """SUB then UNSUB of a fresh pattern, *rate* pairs per second, until stopped."""

    def __init__(self, path: str, rate: int) -> None:
        super().__init__(daemon=True)
        self.sock = connect(path)
        self.rate = rate
        self.pairs = 0
        self.stop = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.stop.is_set():
            pattern = b"churn/%d/*" % (self.pairs % 1000)
            self.sock.send(b"SUB " + pattern)
            self.sock.send(b"UNSUB " + pattern)
            self.pairs += 1
            ahead = self.pairs / self.rate - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)
        self.seconds = time.monotonic() - start
        sync(self.sock)
        self.sock.close()


def part_churn(tmp: Path, cbroker: Path, lg: Path, rounds: int) -> list[dict]:
    broker = Broker("sbus", tmp, cbroker, UNLIMITED)
    runs: dict[int, list[dict]] = {r: [] for r in CHURN_RATES}
    try:
        holder = connect(broker.path)
        for i in range(CHURN_HELD):
            holder.send(b"SUB held/%d/*" % i)
        sync(holder)
        for _ in range(rounds):
            for rate in CHURN_RATES:
                churner = Churner(broker.path, rate) if rate else None
                if churner:
                    churner.start()
                cpu0 = cpu_seconds(broker)
                r = run_scenario(lg, broker, "S3", S_COUNT)
                cpu = cpu_seconds(broker) - cpu0
                achieved = 0.0
                if churner:
                    churner.stop.set()
                    churner.join(30)
                    achieved = churner.pairs / churner.seconds
                runs[rate].append({"rate": r["rate"], "cpu_s": cpu, "achieved": achieved,
                                   "cpu_us": cpu * 1e6 / max(r["recv"], 1),
                                   "recv": r["recv"], "expected": r["expected"]})
        holder.close()
    finally:
        broker.stop()
    none = statistics.median(x["rate"] for x in runs[0])
    cpu_none = statistics.median(x["cpu_us"] for x in runs[0])
    rows = []
    for rate, xs in runs.items():
        s3 = statistics.median(x["rate"] for x in xs)
        cpu = statistics.median(x["cpu_us"] for x in xs)
        rows.append({"pairs_per_s": rate,
                     "achieved_pairs_per_s": statistics.median(x["achieved"] for x in xs),
                     "s3_kps": s3 / 1e3, "ratio": s3 / none, "cpu_us": cpu,
                     "cpu_ratio": cpu / cpu_none,
                     "short": sum(x["expected"] - x["recv"] for x in xs)})
        print(f"  churn {rate}: {json.dumps(_round(rows[-1]))}", file=sys.stderr)
    return rows


def _round(row: dict) -> dict:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def plot(results: dict[str, list[dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    made = []
    # (part, x, [(y, label, axis)], x label, log x)
    specs = {
        "clients": ("clients", [("rss_mb", "RSS (MB)", 0), ("kb_per_client", "KB per client", 1)],
                    "idle clients", True),
        "patterns": ("patterns", [("rss_mb", "RSS (MB)", 0),
                                  ("cpu_ratio", "S1 CPU per delivery / with none", 1)],
                     "held non-matching patterns", True),
        "keys": ("keys", [("rss_mb", "RSS (MB)", 0), ("publish_us", "CPU µs per publish", 1)],
                 "distinct keys published", True),
        "churn": ("pairs_per_s", [("s3_kps", "S3 k msg/s", 0),
                                  ("cpu_us", "broker CPU µs per S3 delivery", 1)],
                  "SUB+UNSUB pairs/s over 10,000 held patterns", False),
    }
    for part, rows in results.items():
        rows = [r for r in rows if "skipped" not in r]
        if not rows:
            continue
        x, ys, xlabel, logx = specs[part]
        fig, ax = plt.subplots(figsize=(6, 3.6))
        axes = [ax, ax.twinx()]
        xs = [r[x] for r in rows]
        for (y, label, side), style in zip(ys, ("o-", "s--"), strict=True):
            values = [r[y] for r in rows]
            axes[side].plot(xs, values, style, label=label, color=f"C{side}")
            axes[side].set_ylabel(label, color=f"C{side}")
            axes[side].set_ylim(0, max(values) * 1.15 or 1)
        if logx:
            ax.set_xscale("log")
        elif 0 in xs:
            ax.set_xscale("symlog", linthresh=100)
            ax.set_xlim(0, max(xs) * 1.5)  # no negative half, room for the last point
        ax.set_xlabel(xlabel)
        ax.set_title(f"sbus broker: cost against {part}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"scale-{part}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="clients,patterns,keys,churn")
    ap.add_argument("--max-clients", type=int, default=100_000)
    ap.add_argument("--max-patterns", type=int, default=1_000_000)
    ap.add_argument("--max-keys", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of the throughput runs (median reported)")
    ap.add_argument("--plots", type=Path, default=None, metavar="DIR",
                    help="write scale-PART.png here (default: no plots)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    unknown = set(parts) - {"clients", "patterns", "keys", "churn"}
    if unknown:
        ap.error(f"--parts: unknown {', '.join(sorted(unknown))}")
    nofile = raise_nofile()
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {int(CORE_LOAD)})
    cbroker, lg = build()
    results: dict[str, list[dict]] = {}
    load = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sbus-scale-", dir="/tmp") as tmpdir:
        tmp = Path(tmpdir)
        if "clients" in parts:
            results["clients"] = part_clients(tmp, cbroker, args.max_clients)
        if "patterns" in parts:
            results["patterns"] = part_patterns(tmp, cbroker, lg, args.max_patterns,
                                                args.rounds)
        if "keys" in parts:
            results["keys"] = part_keys(tmp, cbroker, args.max_keys)
        if "churn" in parts:
            results["churn"] = part_churn(tmp, cbroker, lg, args.rounds)
    print(f"RLIMIT_NOFILE {nofile}; load average before {load[0]:.1f}, after "
          f"{os.getloadavg()[0]:.1f}; {time.monotonic() - started:.0f} s")
    for part, rows in results.items():
        table(part, rows)
    if args.plots:
        for path in plot(results, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
