#!/usr/bin/env python3
"""Bridge benchmark: `sbus bridge` against mosquitto's own bridge, in one run.

Each path carries 64-byte messages from the C load generator's publisher (lg, in
../shared/bench) to its subscriber, which measures rate and one-way latency:

    mqtt-direct       lg pub -> mosquitto M2 -> lg sub                 (no bridge: baseline)
    sbus-direct       lg pub -> sbus serve -> lg sub                   (the local hop alone)
    mosquitto-export  lg pub -> mosquitto M1 =bridge=> M2 -> lg sub    (mosquitto's bridge,
    mosquitto-import  lg pub -> M2 =bridge=> mosquitto M1 -> lg sub     out / in)
    sbus-export       lg pub -> sbus serve -> sbus bridge -> M2 -> lg sub
    sbus-import       lg pub -> M2 -> sbus bridge -> sbus serve -> lg sub
    floor-export      lg pub -> sbus serve -> tools/bridge_floor.py -> M2 -> lg sub
                      (the least a Python hop does per export: the floor under
                      sbus-export's added latency; not among the default paths)
    floor-acked-export  the same, its PUBACKs read by a thread woken for each
                      (as the bridge's import lane is; not among the default paths)
    floor-c-export    the same hop with its per-message loop in C (no Python per
                      message: the extra process's share; not among the default paths)

Every bridge hop is TCP on 127.0.0.1; lg talks to each broker over a unix socket; MQTT
messages are QoS 0 end to end, except each bridge's own leg at ``--qos`` (both bridges
at the same QoS; ``--qos 1,0`` runs every path at both; at QoS 1 the brokers raise what
they send a bridge to QoS 1, ``upgrade_outgoing_qos``: lg publishes at QoS 0).  Per run
each path is set up fresh, then: a burst of --count messages at full speed (delivered
msg/s and the share lost on the way), --steady msg/s for 3 s (the share lost at a rate
the bridge should sustain), and --light messages at 1,000 msg/s (latency).  Paths take
turns, --runs times; medians are printed, with the added latency of each bridge (its p50
minus the baseline's; also p50 and p99 at the steady rate, where the sbus bridge's
``--linger`` waits) and CPU time (user + system, from /proc) per message delivered, in
the burst and in the steady phase, of the bridge process alone (mosquitto's: M1, broker
and bridge in one) and of the bridging host's side (sbus: `sbus serve` + `sbus bridge`;
mosquitto: M1).  Then the goals of issue 26 side by side: sbus against mosquitto's
bridge in each direction, burst throughput ratio, CPU per message ratio, added p50.

``--baseline DIR`` adds ``sbus-export@base`` and ``sbus-import@base``: the same paths with
the sbus of another checkout (e.g. /work/main), for a before/after ratio in one run.

Usage: tools/bench_bridge.py [--count N] [--steady RATE] [--light N] [--runs R]
                             [--qos 0|1|1,0] [--baseline DIR] [--paths PATH,…]
Results belong in docs/performance.md with the command and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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

PATHS = ["mqtt-direct", "sbus-direct", "mosquitto-export", "sbus-export",
         "mosquitto-import", "sbus-import"]
#: run only when named in --paths
EXTRA_PATHS = ["floor-export", "floor-acked-export", "floor-c-export"]


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

    def __init__(self, path: str, tmp: Path, qos: int, baseline: str | None = None,
                 extra: list[str] | None = None) -> None:
        self.tmp = tmp
        self.code = baseline if path.endswith("@base") else None
        self.extra = extra or []  # more options of `sbus bridge`
        self.procs: list[subprocess.Popen] = []
        self.bridge: subprocess.Popen | None = None  # the bridge's process, if any
        self.side: list[subprocess.Popen] = []  # the bridging host's processes
        try:
            self._start(path.removesuffix("@base"), qos)
        except BaseException:
            self.stop()
            raise

    def _start(self, path: str, qos: int) -> None:
        tmp = self.tmp
        port = free_port()
        # lg publishes at QoS 0 and MQTT never raises a message's QoS on its way to a
        # subscriber: at --qos 1 both brokers are told to (upgrade_outgoing_qos), so that
        # every bridge's MQTT leg really is QoS 1 (acknowledged), either way
        upgrade = ["upgrade_outgoing_qos true"] if qos else []
        self.m2 = self._mosquitto("m2", [f"listener {port} 127.0.0.1", *upgrade])
        self.pub_addr = self.sub_addr = f"unix:{self.m2}"
        self.pub_proto = self.sub_proto = "mqtt"
        if path in ("mosquitto-export", "mosquitto-import"):
            way = "out" if path == "mosquitto-export" else "in"
            m1 = self._mosquitto("m1", ["connection to-m2", f"address 127.0.0.1:{port}",
                                        f"topic # {way} {qos}", "cleansession true",
                                        "remote_clientid to-m2", *upgrade])
            self.bridge = self.procs[-1]
            self.side = [self.bridge]
            if way == "out":
                self.pub_addr = f"unix:{m1}"
            else:
                self.sub_addr = f"unix:{m1}"
            log = tmp / "m2.log"
            wait_for("mosquitto's bridge", lambda: "as to-m2 (" in log.read_text())
            if way == "in":  # its subscription in force at M2
                wait_for("its subscription", lambda: "SUBSCRIBE from to-m2" in log.read_text()
                         or "to-m2 #" in log.read_text())
        elif path in ("sbus-export", "sbus-import", "sbus-direct", *EXTRA_PATHS):
            bus = str(tmp / "bus.sock")
            env = {**os.environ, "PYTHONPATH": self.code or str(bench.ROOT)}
            self._spawn("bus", [sys.executable, "-m", "sbus.cli", "serve", "--address", bus],
                        env=env)
            wait_for("sbus serve", lambda: os.path.exists(bus))
            if path == "sbus-direct":
                self.pub_addr = self.sub_addr = f"unix:{bus}"
                self.pub_proto = self.sub_proto = "sbus"
                self.side = self.procs[-1:]
                return
            if path.startswith("floor-"):
                acks = "thread" if path == "floor-acked-export" else "after-send"
                self._spawn("bridge", [sys.executable, str(bench.ROOT / "tools" /
                                                            "bridge_floor.py"),
                                       "--address", bus, "--port", str(port),
                                       "--qos", str(qos), "--acks", acks,
                                       "--loop", "c" if path == "floor-c-export"
                                       else "python"], env=env)
                self.bridge = self.procs[-1]
                self.side = self.procs[-2:]
                wait_for("bridge_floor", lambda: "READY" in (tmp / "bridge.log").read_text())
                self.pub_addr, self.pub_proto = f"unix:{bus}", "sbus"
                return
            notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            notify.bind(str(tmp / "notify"))
            side = ["--export", ""] if path == "sbus-export" else ["--import", ""]
            code = Path(self.code or bench.ROOT)
            if (code / "sbus" / "bridge" / "spool.py").exists():  # a bridge with a spool
                side += ["--state-dir", str(tmp / "state")]
            self._spawn("bridge", [sys.executable, "-m", "sbus.cli", "bridge", "--address",
                                   bus, "--mqtt", f"mqtt://127.0.0.1:{port}", *side,
                                   "--export-qos", str(qos), "--import-qos", str(qos),
                                   "--session-expiry", "0", "--client-id", f"bench{port}",
                                   *self.extra],
                        env={**env, "NOTIFY_SOCKET": str(tmp / "notify")})
            self.bridge = self.procs[-1]
            self.side = self.procs[-2:]  # sbus serve and the bridge
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
        if name == "m2":
            self.m2_proc = self.procs[-1]
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


def cpu_seconds(*procs: subprocess.Popen | None) -> float:
    """CPU time of *procs* so far (0 without any): the scheduler's nanoseconds of each
    thread (/proc/PID/task/*/schedstat; the clock ticks of /proc/PID/stat are 10 ms)."""
    total = 0
    for proc in procs:
        if proc is None:
            continue
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that ended meanwhile
    return total / 1e9


def cpu_of(stack: Stack) -> tuple[float, float, float]:
    """CPU seconds so far of the bridge, of the bridging host's side, of M2."""
    return (cpu_seconds(stack.bridge), cpu_seconds(*stack.side), cpu_seconds(stack.m2_proc))


def measure(lg: Path, stack: Stack, count: int, rate: int) -> dict:
    budget = max(20.0, count / 5000)
    sub = subprocess.Popen([str(lg), "sub", "-p", stack.sub_proto, "-a", stack.sub_addr,
                            "-n", "1", "-K", "1", "-e", str(count), "-T", str(budget),
                            "-I", "2000"], stdout=subprocess.PIPE, text=True)
    assert sub.stdout.readline().strip() == "READY"
    time.sleep(0.3)
    cpu = cpu_of(stack)
    subprocess.run([str(lg), "pub", "-p", stack.pub_proto, "-a", stack.pub_addr, "-n", "1",
                    "-c", str(count), "-K", "1", "-r", str(rate), "-T", str(budget)],
                   stdout=subprocess.DEVNULL, check=True)
    result = json.loads(sub.stdout.readline())
    sub.wait(10)
    after = cpu_of(stack)
    for name, a, b in zip(("cpu_us", "side_us", "m2_us"), after, cpu, strict=True):
        result[name] = (a - b) * 1e6 / max(1, result["recv"])
    return result


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stacks on the way out
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100_000, help="messages of the burst")
    ap.add_argument("--steady", type=int, default=8000, help="msg/s for 3 s (default 8000)")
    ap.add_argument("--light", type=int, default=3000, help="messages at 1,000 msg/s")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--qos", default="0",
                    help="QoS of the bridges' MQTT leg: 0 (default), 1, or both (1,0)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="also run the sbus paths with the sbus of checkout DIR (@base)")
    ap.add_argument("--paths", help="comma-separated subset of the paths to run")
    ap.add_argument("--bridge-args", default="", metavar="ARGS",
                    help="more options of the sbus bridge, e.g. '--linger 0'")
    ap.add_argument("--base-args", default="", metavar="ARGS",
                    help="the same for the @base bridge (--baseline)")
    args = ap.parse_args()
    levels = [int(q) for q in args.qos.split(",")]
    if not levels or any(q not in (0, 1) for q in levels):
        ap.error("--qos: 0, 1 or 1,0")
    _, lg = bench.build()
    names = PATHS + (["sbus-export@base", "sbus-import@base"] if args.baseline else [])
    if args.paths:
        names = [p for p in names + EXTRA_PATHS if p in args.paths.split(",")]
    # (path, QoS): the baseline paths have no bridge, so no QoS of their own
    paths = [(p, q) for q in levels for p in names
             if not p.endswith("-direct") or q == levels[0]]
    results: dict[tuple[str, int], list[tuple[dict, dict, dict]]] = {p: [] for p in paths}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = []
    for run in range(args.runs):
        for path, qos in paths:
            loads.append(os.getloadavg()[0])
            with tempfile.TemporaryDirectory(prefix="sbus-bb-") as d:
                extra = args.base_args if path.endswith("@base") else args.bridge_args
                stack = Stack(path, Path(d), qos, args.baseline, shlex.split(extra))
                try:
                    burst = measure(lg, stack, args.count, 0)
                    steady = measure(lg, stack, args.steady * 3, args.steady)
                    light = measure(lg, stack, args.light, 1000)
                finally:
                    stack.stop()
            results[path, qos].append((burst, steady, light))
            print(f"run {run + 1} {label(path, qos)}: {burst['recv']}/{args.count} at "
                  f"{burst['rate']:.0f} msg/s; steady {steady['recv']}/{args.steady * 3}; "
                  f"p50 {light['p50_us']:.0f} us; bridge CPU {burst['cpu_us']:.1f} / "
                  f"{steady['cpu_us']:.1f} us/msg, with its host's side {burst['side_us']:.1f}"
                  f" / {steady['side_us']:.1f}", file=sys.stderr)
    print(f"\n{started}, {args.count} messages at full speed, {args.steady} msg/s for 3 s, "
          f"{args.light} at 1,000 msg/s, 64-byte payloads; medians of {args.runs} "
          f"alternating runs; load average {min(loads):.1f}–{max(loads):.1f} "
          f"on {os.cpu_count()} cores\n")
    print(f"| path | burst msg/s | burst lost | lost at {args.steady:,} msg/s | p50 µs "
          f"| p99 µs | added p50 µs | p50 / p99 µs at {args.steady:,} msg/s "
          "| bridge CPU µs/msg burst | steady | bridging side µs/msg burst | steady |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    direct = [r for (p, _), rs in results.items() if p == "mqtt-direct" for r in rs]
    base = statistics.median(light["p50_us"] for _, _, light in direct) if direct else 0.0
    med: dict[tuple[str, int], dict[str, float]] = {}
    for (path, qos), runs in results.items():
        m = med[path, qos] = {
            "rate": statistics.median(b["rate"] for b, _, _ in runs),
            "lost": statistics.median(1 - b["recv"] / args.count for b, _, _ in runs),
            "steady_lost": statistics.median(1 - s["recv"] / (args.steady * 3)
                                             for _, s, _ in runs),
            "p50": statistics.median(light["p50_us"] for _, _, light in runs),
            "p99": statistics.median(light["p99_us"] for _, _, light in runs),
            "steady_p50": statistics.median(s["p50_us"] for _, s, _ in runs),
            "steady_p99": statistics.median(s["p99_us"] for _, s, _ in runs)}
        for phase, i in (("burst", 0), ("steady", 1)):
            for what in ("cpu_us", "side_us"):
                m[f"{phase}_{what}"] = statistics.median(r[i][what] for r in runs)
        bridged = not path.endswith("-direct")
        added = f"{m['p50'] - base:.0f}" if path != "mqtt-direct" else "—"
        cpu = [f"{m[k]:.1f}" if bridged else "—" for k in
               ("burst_cpu_us", "steady_cpu_us", "burst_side_us", "steady_side_us")]
        print(f"| {label(path, qos)} | {m['rate']:,.0f} | {m['lost']:.1%} | "
              f"{m['steady_lost']:.1%} | {m['p50']:.0f} | {m['p99']:.0f} | {added} | "
              f"{m['steady_p50']:.0f} / {m['steady_p99']:.0f} | "
              f"{' | '.join(cpu)} |")
    goals(med, base, levels)
    return 0


def label(path: str, qos: int) -> str:
    return path if path.endswith("-direct") else f"{path} q{qos}"


def goals(med: dict[tuple[str, int], dict[str, float]], base: float, levels: list[int]) -> None:
    """Issue 26's figures: each sbus path against mosquitto's bridge in the same direction
    at the same QoS (goals: throughput ≥ 0.8×, CPU per message ≤ 3×, added p50 ≤ 100 µs).
    CPU: the sbus bridge alone, and with its `sbus serve`, against M1 (mosquitto's broker
    and bridge in one process)."""
    print("\nAgainst mosquitto's bridge (goals: throughput ≥ 0.8×, CPU per message ≤ 3×, "
          "added p50 ≤ 100 µs); CPU ratios: the sbus bridge alone / with its sbus serve, "
          "against mosquitto M1 (its broker and bridge)\n")
    print("| path | burst throughput | CPU/msg burst: bridge / with serve | steady: bridge / "
          "with serve | added p50 µs (mosquitto's) |")
    print("|---|---|---|---|---|")
    for qos in levels:
        for path, m in ((p, m) for (p, q), m in med.items() if q == qos):
            if not path.startswith(("sbus-", "floor-")):
                continue
            ref = med.get(("mosquitto-" + path.rsplit("-", 1)[1].removesuffix("@base"), qos))
            if ref is None:
                continue
            burst = [m["burst_cpu_us"] / ref["burst_side_us"],
                     m["burst_side_us"] / ref["burst_side_us"]]
            steady = [m["steady_cpu_us"] / ref["steady_side_us"],
                      m["steady_side_us"] / ref["steady_side_us"]]
            print(f"| {label(path, qos)} | {m['rate'] / ref['rate']:.2f}× | "
                  f"{burst[0]:.1f}× / {burst[1]:.1f}× | {steady[0]:.1f}× / {steady[1]:.1f}× | "
                  f"{m['p50'] - base:.0f} ({ref['p50'] - base:.0f}) |")


if __name__ == "__main__":
    sys.exit(main())
