#!/usr/bin/env python3
"""Restart under load: what clients see while the broker hands itself over.

A publisher (the C load generator ``lg`` from ../shared/bench, paced at ``--rate``
messages/s over as many keys as there are subscribers) and ``--clients - 1``
subscribers, one per key, ``--reliable`` of them with the flood policy ``block`` (of
the publisher's own user: they may hold it back, so nothing may be lost for them) and
the others with the default.  In the middle of the stream the broker restarts:

    usr2     ``sbus serve`` re-executes itself on SIGUSR2 (no systemd)
    systemd  ``systemctl --user restart sbus.service`` under a real user manager (the
             test harness tests/systemd_usermgr.py; the fd store carries the clients)

The subscribers (one Python process, epoll) check every message's sequence number:
disconnects (end-of-file), lost, reordered, the longest gap between two deliveries
(to any subscriber) and the one-way latency (``lg`` stamps the send time).  The broker
runs on core 0, the load on core 1.

Usage: tools/restart_bench.py [--clients 100] [--rate 20000] [--seconds 4]
                              [--reliable 50] [--runs 2] [--modes usr2,systemd]
                              [--idle N]
``--idle N`` adds N idle clients (the hand-over carries them too; each must still be
answered afterwards), to see what many clients do to the gap.
Results belong in docs/performance.md with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import CORE_BROKER, CORE_LOAD, ROOT, build, taskset, wait_socket

SBUS_EXE = Path(sys.executable).parent / "sbus"
STAMP = struct.Struct("<QII")  # lg's payload: send time (ns), publisher id, sequence


class Usr2Broker:
    """`sbus serve` started by us; a restart is SIGUSR2 (re-exec in place)."""

    name = "usr2"

    def __init__(self, tmp: Path) -> None:
        self.address = str(tmp / "bus.sock")
        self.log = open(tmp / "broker.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            taskset(CORE_BROKER, [sys.executable, "-m", "sbus.cli", "serve", "--address",
                                  self.address]), stdout=subprocess.DEVNULL, stderr=self.log)
        wait_socket(self.address)

    def restart(self) -> None:
        self.proc.send_signal(signal.SIGUSR2)

    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()
        return Path(self.log.name).read_text(errors="replace")


class SystemdBroker:
    """The project's user units under a real ``systemd --user``; a restart is
    ``systemctl --user restart sbus.service``."""

    name = "systemd"

    def __init__(self, tmp: Path) -> None:
        sys.path.insert(0, str(ROOT / "tests"))
        from systemd_usermgr import UserManager

        self.manager = UserManager(tmp).start()
        m = self.manager
        m.run(str(SBUS_EXE), "install-units", "--user")
        dropin = m.unit_dir / "sbus.service.d"
        dropin.mkdir()
        self.logfile = tmp / "broker.log"
        cpu = f"CPUAffinity={CORE_BROKER}\n" if (os.cpu_count() or 1) > 1 else ""
        (dropin / "bench.conf").write_text(
            f"[Service]\nStandardError=append:{self.logfile}\n{cpu}")
        m.systemctl("daemon-reload")
        m.systemctl("start", "sbus.socket")
        self.address = str(m.runtime / "sbus.socket")

    def restart(self) -> None:
        self.manager.systemctl("restart", "sbus.service")

    def pid(self) -> int:
        return int(self.manager.show("sbus.service", "MainPID")["MainPID"])

    def stop(self) -> str:
        self.manager.systemctl("stop", "sbus.socket", "sbus.service", check=False)
        self.manager.stop()
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""


class HupBroker(Usr2Broker):
    """`sbus serve` started by us; a restart is SIGHUP (make-before-break reload)."""

    name = "hup"

    def restart(self) -> None:
        self.proc.send_signal(signal.SIGHUP)

    def pid(self) -> int:  # the successor is our child's child: find the listener's owner
        out = subprocess.run(["pgrep", "-f", f"serve --address {self.address}"],
                             capture_output=True, text=True).stdout.split()
        return max(int(p) for p in out) if out else self.proc.pid

    def stop(self) -> str:
        subprocess.run(["pkill", "-f", f"serve --address {self.address}"], check=False)
        self.proc.wait(20)
        self.log.close()
        return Path(self.log.name).read_text(errors="replace")


class SystemdReloadBroker(SystemdBroker):
    """The user units under a real ``systemd --user``; a restart is
    ``systemctl --user reload sbus.service`` (make-before-break)."""

    name = "reload"

    def restart(self) -> None:
        self.manager.systemctl("reload", "sbus.service")


MODES = {"usr2": Usr2Broker, "systemd": SystemdBroker, "hup": HupBroker,
         "reload": SystemdReloadBroker}


def startup_ms(runs: int = 3) -> float:
    """Wall time of a new ``sbus serve`` process up to its argument parsing (interpreter
    and imports; ``--help`` imports the command's modules): the floor of the gap, as
    every restart starts a new process image."""
    times = []
    for _ in range(runs):
        t = time.monotonic()
        subprocess.run(taskset(CORE_BROKER, [sys.executable, "-m", "sbus.cli", "serve",
                                             "--help"]), check=True, stdout=subprocess.DEVNULL)
        times.append(time.monotonic() - t)
    return statistics.median(times) * 1e3


def connect_subscribers(address: str, n: int, reliable: int) -> list[socket.socket]:
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(address)
        if i < reliable:
            s.send(b"CMSG blocking/hard/block")
        s.send(b"SUB k.%03d" % i)
        s.send(b"CMSG !/cred/whoami")
        socks.append(s)
    for s in socks:  # every subscription is in place once its whoami is answered
        while not s.recv(4096).startswith(b"CMSG !/cred/whoami\0"):
            pass
        s.setblocking(False)
    return socks


def still_there(socks: list[socket.socket]) -> int:
    """How many of *socks* are still connected and answered (a whoami round trip)."""
    for s in socks:
        s.setblocking(True)
        s.settimeout(30)
        s.send(b"CMSG !/cred/whoami")
    return sum(1 for s in socks if s.recv(4096).startswith(b"CMSG !/cred/whoami\0"))


def one_run(lg: Path, broker, clients: int, rate: int, seconds: float,
            reliable: int, idle: int) -> dict:
    nsub = clients - 1
    count = int(rate * seconds)
    socks = connect_subscribers(broker.address, nsub, reliable)
    quiet = []  # idle clients: the hand-over carries them too
    for _ in range(idle):
        quiet.append(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
        quiet[-1].connect(broker.address)
    if quiet:
        still_there(quiet[-1:])  # all accepted
    pid_before = broker.pid()
    pub = subprocess.Popen(
        taskset(CORE_LOAD, [str(lg), "pub", "-p", "sbus", "-a", f"unix:{broker.address}",
                            "-n", "1", "-c", str(count), "-K", str(nsub), "-r", str(rate),
                            "-T", str(seconds * 4 + 30)]),
        stdout=subprocess.PIPE, text=True)
    timing: dict[str, float] = {}

    def restart_later() -> None:
        time.sleep(seconds * 0.4)
        timing["start"] = time.monotonic()
        broker.restart()
        timing["end"] = time.monotonic()

    restarter = threading.Thread(target=restart_later)
    restarter.start()
    expected_next = list(range(nsub))
    lost = reordered = disconnects = received = 0
    latencies: list[int] = []
    recv_times: list[float] = []
    ep = select.epoll()
    by_fd = {s.fileno(): (i, s) for i, s in enumerate(socks)}
    for fd in by_fd:
        ep.register(fd, select.EPOLLIN)
    last_data = time.monotonic()
    while True:
        events = ep.poll(0.05)
        now = time.monotonic()
        if not events and pub.poll() is not None and received >= count and \
                not restarter.is_alive():
            break
        if not events and now - last_data > 5 and pub.poll() is not None:
            break  # nothing more is coming
        for fd, _ in events:
            i, s = by_fd[fd]
            for _ in range(64):
                try:
                    p = s.recv(512)
                except BlockingIOError:
                    break
                except OSError:
                    p = b""
                if not p:
                    disconnects += 1
                    ep.unregister(fd)
                    break
                if not p.startswith(b"MSG "):
                    continue
                t_ns = time.monotonic_ns()
                sent_ns, _, seq = STAMP.unpack_from(p, p.index(b"\0", 4) + 1)
                latencies.append(t_ns - sent_ns)
                recv_times.append(t_ns / 1e9)
                received += 1
                want = expected_next[i]
                if seq == want:
                    expected_next[i] = seq + nsub
                elif seq > want:
                    lost += (seq - want) // nsub
                    expected_next[i] = seq + nsub
                else:
                    reordered += 1
            last_data = now
    restarter.join()
    out, _ = pub.communicate(timeout=30)
    sent = sum(json.loads(line)["sent"] for line in out.splitlines() if line.startswith("{"))
    # what never came after each subscriber's last message
    lost += sum(max(0, (sent - want + nsub - 1) // nsub) for want in expected_next)
    idle_kept = still_there(quiet) if quiet else 0
    for s in socks + quiet:
        s.close()
    ep.close()
    gaps = [b - a for a, b in zip(recv_times, recv_times[1:], strict=False)]
    latencies.sort()
    return {
        "sent": sent, "delivered": received, "disconnects": disconnects, "lost": lost,
        "reordered": reordered, "gap_ms": max(gaps, default=0) * 1e3,
        "p50_ms": latencies[len(latencies) // 2] / 1e6 if latencies else 0,
        "p99_ms": latencies[int(len(latencies) * 0.99)] / 1e6 if latencies else 0,
        "max_ms": latencies[-1] / 1e6 if latencies else 0,
        "restart_call_ms": (timing["end"] - timing["start"]) * 1e3,
        "same_pid": broker.pid() == pid_before, "idle_kept": idle_kept,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rate", type=int, default=20_000, help="messages/s offered")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of the stream")
    ap.add_argument("--reliable", type=int, default=50, help="subscribers on 'block'")
    ap.add_argument("--runs", type=int, default=2, help="runs per mode, modes alternating")
    ap.add_argument("--modes", default="usr2,systemd")
    ap.add_argument("--idle", type=int, default=0,
                    help="also this many idle clients, handed over with the others")
    args = ap.parse_args()
    if args.clients < 2 or args.clients > 1000:
        ap.error("--clients: 2 to 1000 (lg has 1000 keys)")
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in MODES:
            ap.error(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    if (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {int(CORE_LOAD)})
    if args.idle:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if args.idle + args.clients + 200 > hard:
            ap.error(f"--idle: RLIMIT_NOFILE allows {hard - args.clients - 200} here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the broker's too
    _, lg = build()
    results: list[tuple[str, dict]] = []
    load = os.getloadavg()
    for run in range(args.runs):
        for mode in modes:
            tmp = Path(tempfile.mkdtemp(prefix="sbus-rb-", dir="/tmp"))
            broker = MODES[mode](tmp)
            try:
                r = one_run(lg, broker, args.clients, args.rate, args.seconds, args.reliable,
                            args.idle)
            finally:
                log = broker.stop()
                shutil.rmtree(tmp, ignore_errors=True)
            total = args.clients + args.idle
            r["handed_over"] = f"handing over {total} clients" in log and \
                f"took over {total} clients" in log
            results.append((mode, r))
            print(f"run {run + 1} {mode}: " + json.dumps(
                {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}),
                file=sys.stderr)
    print(f"\n{args.clients} clients ({args.clients - 1} subscribers, {args.reliable} on "
          f"'block'), {args.rate} msg/s offered for {args.seconds:g} s, restart at 40 %; "
          f"load average before {load[0]:.1f}"
          + (f"; {args.idle} idle clients besides, kept = still answered after" if args.idle
             else ""))
    print("| restart | run | sent | delivered | disconnects | lost | reordered | "
          "longest gap ms | latency p50 / p99 / max ms | restart call ms | handed over |"
          + (" idle kept |" if args.idle else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.idle else ""))
    for n, (mode, r) in enumerate(results):
        print(f"| {mode} | {n // len(modes) + 1} | {r['sent']} | {r['delivered']} | "
              f"{r['disconnects']} | {r['lost']} | {r['reordered']} | {r['gap_ms']:.0f} | "
              f"{r['p50_ms']:.2f} / {r['p99_ms']:.1f} / {r['max_ms']:.0f} | "
              f"{r['restart_call_ms']:.0f} | {'yes' if r['handed_over'] else 'NO'} |"
              + (f" {r['idle_kept']} |" if args.idle else ""))
    for mode in modes:
        gaps = [r["gap_ms"] for m, r in results if m == mode]
        print(f"{mode}: median longest gap {statistics.median(gaps):.0f} ms")
    print(f"a new broker process takes {startup_ms():.0f} ms to start (interpreter and "
          "imports, median of 3): the floor of any gap")
    bad = [r for _, r in results if r["disconnects"] or r["lost"] or r["reordered"]
           or r["idle_kept"] != args.idle
           or not r["handed_over"] or r["delivered"] != r["sent"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
