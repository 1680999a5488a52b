#!/usr/bin/env python3
"""Bridge benchmark: `sbus bridge` against mosquitto's own bridge, in one run.

Each path carries 64-byte messages from the C load generator's publisher (lg, in
../shared/bench) to its subscriber, which measures rate and one-way latency:

    mqtt-direct       lg pub -> mosquitto M2 -> lg sub                 (no bridge: baseline)
    mosquitto-bridge  lg pub -> mosquitto M1 =bridge=> M2 -> lg sub    (mosquitto's bridge)
    sbus-export       lg pub -> sbus serve -> sbus bridge -> M2 -> lg sub
    sbus-import       lg pub -> M2 -> sbus bridge -> sbus serve -> lg sub

Every bridge hop is TCP on 127.0.0.1; lg talks to each broker over a unix socket; MQTT
messages are QoS 0 end to end, except the bridge's own leg with ``--qos 1``.  Per run
each path is set up fresh, then: a burst of --count messages at full speed (delivered
msg/s and the share lost on the way), --steady msg/s for 3 s (the share lost at a rate
the bridge should sustain), and --light messages at 1,000 msg/s (latency).
Paths take turns, --runs times; medians are printed, with the added latency of each
bridge (its p50 minus the baseline's), and the sbus bridge process's CPU time per message
delivered in the burst and in the steady phase (user + system, from /proc).

``--baseline DIR`` adds ``sbus-export@base`` and ``sbus-import@base``: the same paths with
the sbus of another checkout (e.g. /work/main), for a before/after ratio in one run.

Usage: tools/bench_bridge.py [--count N] [--steady RATE] [--light N] [--runs R] [--qos 0|1]
                             [--baseline DIR] [--paths PATH,…]
Results belong in docs/performance.md with the command and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402

if not bench.SHARED.exists():  # a worktree below the checkout's parent (/work/wt/NAME)
    bench.SHARED = bench.ROOT.parent.parent / "shared" / "bench"

PATHS = ["mqtt-direct", "mosquitto-bridge", "sbus-export", "sbus-import"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ok, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout} s")
        time.sleep(0.05)


class Stack:
    """The processes of one path, started in a private directory and stopped together."""

    def __init__(self, path: str, tmp: Path, qos: int, baseline: str | None = None) -> None:
        self.tmp = tmp
        self.code = baseline if path.endswith("@base") else None
        self.procs: list[subprocess.Popen] = []
        self.bridge: subprocess.Popen | None = None  # the sbus bridge, if the path has one
        try:
            self._start(path.removesuffix("@base"), qos)
        except BaseException:
            self.stop()
            raise

    def _start(self, path: str, qos: int) -> None:
        tmp = self.tmp
        port = free_port()
        self.m2 = self._mosquitto("m2", [f"listener {port} 127.0.0.1"])
        self.pub_addr = self.sub_addr = f"unix:{self.m2}"
        self.pub_proto = self.sub_proto = "mqtt"
        if path == "mosquitto-bridge":
            m1 = self._mosquitto("m1", ["connection to-m2", f"address 127.0.0.1:{port}",
                                        "topic # out 0", "cleansession true",
                                        "remote_clientid to-m2"])
            self.pub_addr = f"unix:{m1}"
            log = tmp / "m2.log"
            wait_for("mosquitto's bridge", lambda: "as to-m2 (" in log.read_text())
        elif path in ("sbus-export", "sbus-import"):
            bus = str(tmp / "bus.sock")
            env = {**os.environ, "PYTHONPATH": self.code or str(bench.ROOT)}
            self._spawn("bus", [sys.executable, "-m", "sbus.cli", "serve", "--address", bus],
                        env=env)
            wait_for("sbus serve", lambda: os.path.exists(bus))
            notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            notify.bind(str(tmp / "notify"))
            side = ["--export", ""] if path == "sbus-export" else ["--import", ""]
            code = Path(self.code or bench.ROOT)
            if (code / "sbus" / "bridge" / "spool.py").exists():  # a bridge with a spool
                side += ["--state-dir", str(tmp / "state")]
            self._spawn("bridge", [sys.executable, "-m", "sbus.cli", "bridge", "--address",
                                   bus, "--mqtt", f"mqtt://127.0.0.1:{port}", *side,
                                   "--export-qos", str(qos), "--import-qos", str(qos),
                                   "--session-expiry", "0", "--client-id", f"bench{port}"],
                        env={**env, "NOTIFY_SOCKET": str(tmp / "notify")})
            self.bridge = self.procs[-1]
            notify.settimeout(15)
            while b"mqtt up" not in notify.recv(4096):
                pass
            notify.close()  # unread, it would fill and make the bridge's notify wait
            os.unlink(tmp / "notify")
            if path == "sbus-export":
                self.pub_addr, self.pub_proto = f"unix:{bus}", "sbus"
            else:
                self.sub_addr, self.sub_proto = f"unix:{bus}", "sbus"

    def _spawn(self, name: str, cmd: list[str], env=None) -> None:
        with open(self.tmp / f"{name}.log", "ab") as log:
            # cwd: not a checkout, so that PYTHONPATH decides which sbus runs (-m puts the
            # working directory first on the path)
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=env,
                                               cwd=self.tmp))

    def _mosquitto(self, name: str, extra: list[str]) -> str:
        sock = str(self.tmp / f"{name}.sock")
        conf = self.tmp / f"{name}.conf"
        conf.write_text("\n".join([f"listener 0 {sock}", "allow_anonymous true",
                                   "max_queued_messages 0", "max_inflight_messages 0",
                                   "log_type all", *extra,
                                   *(["user root"] if os.getuid() == 0 else [])]) + "\n")
        self._spawn(name, ["mosquitto", "-c", str(conf)])
        wait_for(name, lambda: os.path.exists(sock))
        return sock

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cpu_seconds(proc: subprocess.Popen | None) -> float:
    """User + system CPU time of *proc* so far (0 without one)."""
    if proc is None:
        return 0.0
    fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(lg: Path, stack: Stack, count: int, rate: int) -> dict:
    budget = max(20.0, count / 5000)
    sub = subprocess.Popen([str(lg), "sub", "-p", stack.sub_proto, "-a", stack.sub_addr,
                            "-n", "1", "-K", "1", "-e", str(count), "-T", str(budget),
                            "-I", "2000"], stdout=subprocess.PIPE, text=True)
    assert sub.stdout.readline().strip() == "READY"
    time.sleep(0.3)
    cpu = cpu_seconds(stack.bridge)
    subprocess.run([str(lg), "pub", "-p", stack.pub_proto, "-a", stack.pub_addr, "-n", "1",
                    "-c", str(count), "-K", "1", "-r", str(rate), "-T", str(budget)],
                   stdout=subprocess.DEVNULL, check=True)
    result = json.loads(sub.stdout.readline())
    sub.wait(10)
    result["cpu_us"] = (cpu_seconds(stack.bridge) - cpu) * 1e6 / max(1, result["recv"])
    return result


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stacks on the way out
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100_000, help="messages of the burst")
    ap.add_argument("--steady", type=int, default=8000, help="msg/s for 3 s (default 8000)")
    ap.add_argument("--light", type=int, default=3000, help="messages at 1,000 msg/s")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--qos", type=int, choices=(0, 1), default=0,
                    help="QoS of the sbus bridge's MQTT leg (default 0, as mosquitto's)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also run the sbus paths with the sbus of checkout DIR (@base)")
    ap.add_argument("--paths", help="comma-separated subset of the paths to run")
    args = ap.parse_args()
    _, lg = bench.build()
    paths = PATHS + (["sbus-export@base", "sbus-import@base"] if args.baseline else [])
    if args.paths:
        paths = [p for p in paths if p in args.paths.split(",")]
    results: dict[str, list[tuple[dict, dict, dict]]] = {p: [] for p in paths}
    for run in range(args.runs):
        for path in paths:
            with tempfile.TemporaryDirectory(prefix="sbus-bb-") as d:
                stack = Stack(path, Path(d), args.qos, args.baseline)
                try:
                    burst = measure(lg, stack, args.count, 0)
                    steady = measure(lg, stack, args.steady * 3, args.steady)
                    light = measure(lg, stack, args.light, 1000)
                finally:
                    stack.stop()
            results[path].append((burst, steady, light))
            print(f"run {run + 1} {path}: {burst['recv']}/{args.count} at "
                  f"{burst['rate']:.0f} msg/s; steady {steady['recv']}/{args.steady * 3}; "
                  f"p50 {light['p50_us']:.0f} us; bridge CPU {burst['cpu_us']:.1f} / "
                  f"{steady['cpu_us']:.1f} us/msg", file=sys.stderr)
    load = os.getloadavg()
    print(f"\n{args.count} messages at full speed, {args.steady} msg/s for 3 s, "
          f"{args.light} at 1,000 msg/s, 64-byte "
          f"payloads, sbus bridge QoS {args.qos}; medians of {args.runs} alternating runs; "
          f"load average {load[0]:.1f} on {os.cpu_count()} cores\n")
    print(f"| path | burst msg/s | burst lost | lost at {args.steady:,} msg/s | p50 µs "
          "| p99 µs | added p50 µs | bridge CPU µs/msg burst | steady |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = (statistics.median(light["p50_us"] for _, _, light in results["mqtt-direct"])
            if results.get("mqtt-direct") else 0.0)
    for path in paths:
        runs = results[path]
        rate = statistics.median(b["rate"] for b, _, _ in runs)
        lost = statistics.median(1 - b["recv"] / args.count for b, _, _ in runs)
        steady_lost = statistics.median(1 - s["recv"] / (args.steady * 3) for _, s, _ in runs)
        p50 = statistics.median(light["p50_us"] for _, _, light in runs)
        p99 = statistics.median(light["p99_us"] for _, _, light in runs)
        added = "—" if path == "mqtt-direct" else f"{p50 - base:.0f}"
        sbus = path.startswith("sbus-")
        cpu_burst = f"{statistics.median(b['cpu_us'] for b, _, _ in runs):.1f}" if sbus else "—"
        cpu_steady = f"{statistics.median(s['cpu_us'] for _, s, _ in runs):.1f}" if sbus else "—"
        print(f"| {path} | {rate:,.0f} | {lost:.1%} | {steady_lost:.1%} | {p50:.0f} | "
              f"{p99:.0f} | {added} | {cpu_burst} | {cpu_steady} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
