#!/usr/bin/env python3
"""Broker benchmark: sbus against the C reference broker (and mosquitto) in one run.

The load comes from the C load generator in ../shared/bench (lg), which is faster
than any Python broker, so the broker is the bottleneck: it is pinned to core 0,
the load generator to core 1.  Each scenario publishes 64-byte payloads that carry
their send time, so the subscriber side measures one-way latency too.

    S1  1 publisher -> 1 subscriber, one key
    S2  1 publisher -> 10 subscribers of one key      (deliveries/s)
    S3  1 publisher -> 100 subscribers on 100 keys    (messages spread over the keys)
    S4  4 publishers -> 1 subscriber
    S5  1 publisher -> 1,000 subscribers of one key  (deliveries/s; --count / 100 messages)

Usage: tools/bench.py [--count N] [--runs R] [--brokers cbroker,sbus,mosquitto]
                      [--before TREE]
Prints throughput with ratios, latency at 1,000 msg/s, and broker memory with
1,000 idle clients.  Results belong in docs/performance.md with this command.
``--before TREE`` adds the broker of another checkout (e.g. a ``git worktree`` of the
commit before a change) as broker ``before``, taking turns with the others, and prints
sbus/before: an optimisation or a hardening measured before and after in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SBUS_BENCH_SRC", ROOT.parent / "shared" / "bench"))
BIN = Path(os.environ.get("SBUS_BENCH_BIN", "/var/cache/sbus-bench"))

SCENARIOS = {
    # name: (subscriber connections, keys, publishers, deliveries per message)
    "S1": (1, 1, 1, 1),
    "S2": (10, 1, 1, 10),
    "S3": (100, 100, 1, 1),
    "S4": (1, 1, 4, 1),
    "S5": (1000, 1, 1, 1000),
}
#: Scenarios that publish fewer messages than ``--count`` (a fan-out to 1,000 would
#: otherwise take minutes): name -> divisor.
FEWER = {"S5": 100}
CORE_BROKER, CORE_LOAD = "0", "1"
#: Messages of the light-load latency run (S1 at 1,000 msg/s: 5 s).
LIGHT_COUNT = 5000


def build() -> tuple[Path, Path]:
    """Compile the reference broker and load generator once (cached by source mtime)."""
    BIN.mkdir(parents=True, exist_ok=True)
    out = []
    for name in ("cbroker", "lg"):
        src, exe = SHARED / f"{name}.c", BIN / name
        if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
            subprocess.run(["gcc", "-O2", "-o", str(exe), str(src)], check=True)
        out.append(exe)
    return out[0], out[1]


def taskset(core: str, cmd: list[str]) -> list[str]:
    return ["taskset", "-c", core, *cmd] if shutil.which("taskset") and os.cpu_count() > 1 else cmd


def wait_socket(path: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    kind = socket.SOCK_SEQPACKET if not path.endswith(".mqtt") else socket.SOCK_STREAM
    while time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX, kind)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.05)
        finally:
            s.close()
    raise TimeoutError(f"no broker on {path}")


class Broker:
    #: the checkout the ``before`` broker runs from (``--before``)
    before_tree: Path | None = None
    #: extra arguments of the C broker (``-m`` with ``--batched``)
    cbroker_args: list[str] = []

    def __init__(self, kind: str, tmp: Path, cbroker: Path, sbus_args: list[str]) -> None:
        self.kind = kind
        self.path = str(tmp / ("b.mqtt" if kind == "mosquitto" else "b.sock"))
        self.proto = "mqtt" if kind == "mosquitto" else "sbus"
        if kind == "cbroker":
            cmd = [str(cbroker), self.path, *self.cbroker_args]
        elif kind in ("sbus", "before"):
            cmd = [sys.executable, "-m", "sbus.cli", "serve", "--address", self.path, *sbus_args]
        else:
            conf = tmp / "mosquitto.conf"
            # as root mosquitto would switch to its own user, which cannot create the
            # socket in our private directory
            conf.write_text(f"listener 0 {self.path}\nallow_anonymous true\n"
                            "max_queued_messages 0\nmax_inflight_messages 0\n"
                            + ("user root\n" if os.getuid() == 0 else ""))
            cmd = ["mosquitto", "-c", str(conf)]
        tree = self.before_tree if kind == "before" else ROOT
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(taskset(CORE_BROKER, cmd), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, cwd=tree, env=env)
        wait_socket(self.path)

    def cpu_seconds(self) -> float:
        """User + system CPU time the broker process has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if os.path.exists(self.path):
            os.unlink(self.path)


#: The broker's system calls counted by ``--syscalls`` (perf's tracepoints).
SYSCALLS = ("recvmmsg", "recvmsg", "read", "sendmmsg", "sendto", "write", "epoll_wait",
            "epoll_ctl")


def perf_stat(pid: int) -> subprocess.Popen:
    """perf counting *pid*'s `SYSCALLS` until it is sent SIGINT (`syscall_counts`)."""
    events = ",".join(f"syscalls:sys_enter_{n}" for n in SYSCALLS)
    perf = subprocess.Popen(["perf", "stat", "-x,", "-e", events, "-p", str(pid)],
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # (attached before the load starts)
    return perf


def syscall_counts(perf: subprocess.Popen) -> dict[str, float]:
    """What `perf_stat` counted: system call -> how many."""
    perf.send_signal(signal.SIGINT)
    counts = {}
    for line in perf.communicate()[1].splitlines():  # count,unit,event,...
        fields = line.split(",")
        if len(fields) > 2 and fields[0].isdigit():
            counts[fields[2].removeprefix("syscalls:sys_enter_")] = float(fields[0])
    return counts


def run_scenario(lg: Path, broker: Broker, name: str, count: int, rate: int = 0,
                 syscalls: bool = False) -> dict:
    nsub, nkeys, npub, fan = SCENARIOS[name]
    addr = f"unix:{broker.path}"
    count = max(1, count // FEWER.get(name, 1))
    expected = count * fan
    budget = max(30.0, expected / 10000)
    sub = subprocess.Popen(
        taskset(CORE_LOAD, [str(lg), "sub", "-p", broker.proto, "-a", addr, "-n", str(nsub),
                            "-K", str(nkeys), "-e", str(expected), "-T", str(budget),
                            "-I", "1500"]),
        stdout=subprocess.PIPE, text=True)
    assert sub.stdout.readline().strip() == "READY"
    time.sleep(0.2)
    perf = perf_stat(broker.proc.pid) if syscalls else None
    cpu0 = broker.cpu_seconds()
    subprocess.run(
        taskset(CORE_LOAD, [str(lg), "pub", "-p", broker.proto, "-a", addr, "-n", str(npub),
                            "-c", str(count), "-K", str(nkeys), "-r", str(rate),
                            "-T", str(budget)]),
        stdout=subprocess.DEVNULL, check=True)
    result = json.loads(sub.stdout.readline())
    sub.wait(10)
    result["cpu_us_per_delivery"] = (broker.cpu_seconds() - cpu0) * 1e6 / max(result["recv"], 1)
    if perf is not None:
        result["syscalls"] = syscall_counts(perf)
    return result


def idle_clients_rss(broker: Broker, n: int = 1000) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 100)), hard))
    clients = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(broker.path)
        s.send(b"SUB idle/%d" % i)
        clients.append(s)
    # a whoami round trip on the last one: everything before it has been processed
    clients[-1].send(b"CMSG !/cred/whoami")
    clients[-1].recv(4096)
    time.sleep(0.5)
    rss = broker.rss_kb()
    for s in clients:
        s.close()
    return rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000, help="messages per scenario run")
    ap.add_argument("--runs", type=int, default=1, help="runs per scenario (median reported)")
    ap.add_argument("--brokers", default="cbroker,sbus,mosquitto")
    ap.add_argument("--scenarios", default="S1,S2,S3,S4")
    ap.add_argument("--json", metavar="FILE", help="also write raw results here")
    ap.add_argument("--before", metavar="TREE", type=Path,
                    help="also run the sbus broker of this checkout, as broker 'before'")
    ap.add_argument("--lossy", action="store_true",
                    help="run sbus with its default flood policy (hard discard: a lagging "
                         "subscriber loses messages) instead of hard block, which like the C "
                         "broker holds publishers back and loses nothing")
    ap.add_argument("--batched", action="store_true",
                    help="run the C broker batched (cbroker -m: recvmmsg/sendmmsg)")
    ap.add_argument("--syscalls", action="store_true",
                    help="also count each broker's system calls per 1,000 deliveries "
                         "(perf stat on its tracepoints; the counting costs them time)")
    args = ap.parse_args()
    if args.syscalls and not shutil.which("perf"):
        ap.error("--syscalls counts with perf, which is not installed (apt-get install "
                 "linux-perf)")
    if args.batched:
        Broker.cbroker_args = ["-m"]
    sbus_args = [] if args.lossy else ["--hard", "block"]
    brokers = [b for b in args.brokers.split(",") if b != "mosquitto" or shutil.which("mosquitto")]
    if args.before:
        Broker.before_tree = args.before.resolve()
        brokers.append("before")
    scenarios = args.scenarios.split(",")
    cbroker, lg = build()
    results: dict[str, dict] = {b: {} for b in brokers}
    with tempfile.TemporaryDirectory(prefix="sbus-bench-", dir="/tmp") as tmpdir:
        tmp = Path(tmpdir)

        def once(kind: str, name: str, count: int, rate: int = 0) -> dict:
            broker = Broker(kind, tmp, cbroker, sbus_args)
            try:
                return run_scenario(lg, broker, name, count, rate,
                                    syscalls=args.syscalls and not rate)
            finally:
                broker.stop()

        # brokers take turns within each round, so a drift of the machine hits them alike
        for name in scenarios:
            runs: dict[str, list[dict]] = {b: [] for b in brokers}
            for _ in range(args.runs):
                for kind in brokers:
                    runs[kind].append(once(kind, name, args.count))
            for kind in brokers:
                best = sorted(runs[kind], key=lambda r: r["rate"])[len(runs[kind]) // 2]
                results[kind][name] = best
                print(f"  {kind:9} {name}: {best['rate'] / 1e3:7.1f}k/s  "
                      f"recv {best['recv']}/{best['expected']}  "
                      f"cpu {best['cpu_us_per_delivery']:.2f} us/delivery", file=sys.stderr)
        light: dict[str, list[dict]] = {b: [] for b in brokers}
        for _ in range(args.runs):
            for kind in brokers:
                light[kind].append(once(kind, "S1", LIGHT_COUNT, rate=1000))
        for kind in brokers:  # the run with the median p99
            results[kind]["light"] = sorted(light[kind], key=lambda r: r["p99_us"])[
                len(light[kind]) // 2]
        for kind in ("sbus", "before"):
            if kind in brokers:
                broker = Broker(kind, tmp, cbroker, sbus_args)
                try:
                    results[kind]["idle_rss_kb"] = idle_clients_rss(broker)
                finally:
                    broker.stop()
    report(results, brokers, scenarios, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def report(results: dict, brokers: list[str], scenarios: list[str], args) -> None:
    print(f"\nsbus broker benchmark: {args.count:,} messages per scenario, "
          f"median of {args.runs}, 64-byte payloads, broker on core {CORE_BROKER}, "
          f"load on core {CORE_LOAD}\n")
    head = "| scenario | " + " | ".join(f"{b} k/s" for b in brokers)
    head += " | sbus/cbroker | sbus/mosquitto |" if "mosquitto" in brokers else " | sbus/cbroker |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in scenarios:
        rates = {b: results[b][name]["rate"] for b in brokers}
        row = f"| {name} | " + " | ".join(f"{rates[b] / 1e3:.0f}" for b in brokers)
        if "sbus" in rates and "cbroker" in rates:
            row += f" | {rates['sbus'] / rates['cbroker']:.2f}"
        if "sbus" in rates and "mosquitto" in rates:
            row += f" | {rates['sbus'] / rates['mosquitto']:.2f}"
        print(row + " |")
    print("\nBroker CPU time per delivered message (µs; robust to a noisy machine)\n")
    print("| scenario | " + " | ".join(brokers) + " | sbus/cbroker |")
    print("|" + "---|" * (len(brokers) + 2))
    for name in scenarios:
        cpu = {b: results[b][name]["cpu_us_per_delivery"] for b in brokers}
        row = f"| {name} | " + " | ".join(f"{cpu[b]:.2f}" for b in brokers)
        if "sbus" in cpu and "cbroker" in cpu:
            row += f" | {cpu['sbus'] / cpu['cbroker']:.2f}"
        print(row + " |")
    if args.syscalls:
        print("\nBroker system calls per 1,000 deliveries (the median run's)\n")
        print("| scenario | broker | " + " | ".join(SYSCALLS) + " |")
        print("|" + "---|" * (len(SYSCALLS) + 2))
        for name in scenarios:
            for b in brokers:
                counts, recv = results[b][name]["syscalls"], max(results[b][name]["recv"], 1)
                print(f"| {name} | {b} | " + " | ".join(
                    f"{counts.get(n, 0) * 1000 / recv:.2f}" for n in SYSCALLS) + " |")
    print(f"\nLatency (one-way, µs): saturated S1 and light load (S1 at 1,000 msg/s, "
          f"{LIGHT_COUNT:,} messages; the run with the median p99 of {args.runs})\n")
    print("| broker | saturated p50 | saturated p99 | 1k/s p50 | 1k/s p99 | 1k/s lost |")
    print("|---|---|---|---|---|---|")
    for b in brokers:
        sat = results[b].get("S1", {})
        light = results[b]["light"]
        print(f"| {b} | {sat.get('p50_us', float('nan')):.0f} | "
              f"{sat.get('p99_us', float('nan')):.0f} | {light['p50_us']:.0f} | "
              f"{light['p99_us']:.0f} | {light['expected'] - light['recv']} |")
    for kind in ("sbus", "before"):
        if kind in results and "idle_rss_kb" in results[kind]:
            print(f"\n{kind} broker RSS with 1,000 idle subscribed clients: "
                  f"{results[kind]['idle_rss_kb'] / 1024:.1f} MB (target <= 60 MB)")
    if "before" in brokers and "sbus" in brokers:
        print("\nsbus after / before the change, in this run (throughput; CPU per delivery):")
        for n in scenarios:
            after, before = results["sbus"][n], results["before"][n]
            print(f"  {n}: {after['rate'] / before['rate']:.3f}; "
                  f"{after['cpu_us_per_delivery'] / before['cpu_us_per_delivery']:.3f}")
    if "sbus" in results:
        lost = {n: results["sbus"][n]["expected"] - results["sbus"][n]["recv"]
                for n in scenarios}
        print(f"sbus messages not delivered per scenario: {lost}")
    if "sbus" in brokers and "cbroker" in brokers:
        ratios = [results["sbus"][n]["rate"] / results["cbroker"][n]["rate"] for n in scenarios]
        print(f"sbus/cbroker: min {min(ratios):.2f}, median {statistics.median(ratios):.2f} "
              "(target >= 0.5 on each)")


if __name__ == "__main__":
    sys.exit(main())
