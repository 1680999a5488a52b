#!/usr/bin/env python3
"""MQTT client libraries per message, in one run: is paho the bridge's floor?

Each client, in a process of its own against one mosquitto (TCP on 127.0.0.1), once per
round, clients taking turns:

* send: --count QoS 1 PUBLISHes of 64 bytes, at most 1,000 unacknowledged (the bridge's
  window), until every one is acknowledged;
* receive: subscribed at QoS 1, takes --count messages that the C load generator (lg,
  ../shared/bench) publishes, raised to QoS 1 by the broker (each acknowledged).

It reports the client process's CPU time (user + system) per message of each phase.
Clients: ``paho`` (paho-mqtt 2, its own loop), ``paho-sbus`` (the bridge's
`sbus.bridge.buffered.BufferedClient` with `QuickProperties`, the same loop), ``gmqtt``
(asyncio; skipped if not installed: ``pip install gmqtt``).

Usage: tools/bench_mqtt_clients.py [--count N] [--rounds R] [--clients a,b]
"""

from __future__ import annotations

import argparse
import os
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

WINDOW = 1000
PAYLOAD = b"x" * 64


def paho_client(kind: str, port: int, phase: str, count: int) -> float:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    cls = mqtt.Client
    if kind == "paho-sbus":
        from sbus.bridge.buffered import BufferedClient, quick_properties
        quick_properties()
        cls = BufferedClient
    c = cls(CallbackAPIVersion.VERSION2, client_id=f"{kind}-{phase}", protocol=mqtt.MQTTv5)
    c.max_inflight_messages_set(0)
    state = {"acked": 0, "got": 0, "subscribed": False}
    c.on_publish = lambda *_: state.__setitem__("acked", state["acked"] + 1)
    c.on_message = lambda *_: state.__setitem__("got", state["got"] + 1)
    c.on_subscribe = lambda *_: state.__setitem__("subscribed", True)
    c.connect("127.0.0.1", port)
    flush = getattr(c, "flush", None)

    def turn() -> None:
        c.loop(0.05)
        if flush is not None:  # BufferedClient: paho's poll cannot see what it has read,
            while c.pending():  # and what paho wrote is gathered until flushed
                c.loop_read()
            flush()

    if phase == "receive":
        c.subscribe("#", 1)
        while not state["subscribed"]:
            turn()
        print("READY", flush=True)
    start = time.process_time()
    if phase == "send":
        sent = 0
        while state["acked"] < count:
            while sent < count and sent - state["acked"] < WINDOW:
                c.publish("b/t", PAYLOAD, 1)
                sent += 1
            turn()
    else:
        while state["got"] < count:
            turn()
    used = time.process_time() - start
    c.disconnect()
    return used


def gmqtt_client(port: int, phase: str, count: int) -> float:
    import asyncio

    from gmqtt import Client

    async def run() -> float:
        c = Client(f"gmqtt-{phase}")
        got = asyncio.Event()
        state = {"got": 0}

        def on_message(client, topic, payload, qos, properties) -> int:
            state["got"] += 1
            if state["got"] >= count:
                got.set()
            return 0

        subscribed = asyncio.Event()
        c.on_message = on_message
        c.on_subscribe = lambda *_: subscribed.set()
        await c.connect("127.0.0.1", port)
        if phase == "receive":
            c.subscribe("#", qos=1)
            await subscribed.wait()
            print("READY", flush=True)
        start = time.process_time()
        if phase == "send":
            storage = c._persistent_storage  # what is unacknowledged (gmqtt keeps no window)
            for _ in range(count):
                while len(storage._messages) >= WINDOW:
                    await asyncio.sleep(0)
                c.publish("b/t", PAYLOAD, qos=1)
            while not storage.is_empty:
                await asyncio.sleep(0.001)
        else:
            await got.wait()
        used = time.process_time() - start
        await c.disconnect()
        return used

    return asyncio.run(run())


def child(kind: str, port: int, phase: str, count: int) -> None:
    used = (gmqtt_client(port, phase, count) if kind == "gmqtt"
            else paho_client(kind, port, phase, count))
    print(f"CPU {used}", flush=True)


def measure(lg: Path, sock: str, port: int, kind: str, phase: str, count: int) -> float:
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(port), phase,
                             str(count)], stdout=subprocess.PIPE, text=True)
    try:
        if phase == "receive":
            assert proc.stdout.readline().strip() == "READY"
            subprocess.run([str(lg), "pub", "-p", "mqtt", "-a", f"unix:{sock}", "-n", "1",
                            "-c", str(count), "-K", "1", "-r", "0", "-T", "60"],
                           stdout=subprocess.DEVNULL, check=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return float(out.split("CPU ")[1]) * 1e6 / count


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", default="paho,paho-sbus,gmqtt")
    args = ap.parse_args()
    clients = args.clients.split(",")
    if "gmqtt" in clients:
        try:
            import gmqtt  # noqa: F401
        except ImportError:
            print("gmqtt not installed: skipped", file=sys.stderr)
            clients.remove("gmqtt")
    _, lg = bench.build()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="sbus-mc-") as d:
        sock = f"{d}/m.sock"
        conf = Path(d) / "m.conf"
        conf.write_text("\n".join([f"listener {port} 127.0.0.1", f"listener 0 {sock}",
                                   "allow_anonymous true", "max_queued_messages 0",
                                   "max_inflight_messages 0", "upgrade_outgoing_qos true",
                                   *(["user root"] if os.getuid() == 0 else [])]) + "\n")
        broker = subprocess.Popen(["mosquitto", "-c", str(conf)], stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(sock):
                time.sleep(0.05)
            for r in range(args.rounds):
                for kind in clients:
                    for phase in ("send", "receive"):
                        us = measure(lg, sock, port, kind, phase, args.count)
                        results.setdefault((kind, phase), []).append(us)
                        print(f"round {r + 1} {kind} {phase}: {us:.1f} µs/msg", file=sys.stderr)
        finally:
            broker.terminate()
            broker.wait()
    load = os.getloadavg()[0]
    print(f"\n{args.count} QoS 1 messages of 64 bytes each way per client, medians of "
          f"{args.rounds} alternating rounds, load average {load:.1f}\n")
    print("| client | send: CPU µs/msg | receive: CPU µs/msg |")
    print("|---|---|---|")
    for kind in clients:
        cells = [f"{statistics.median(results[kind, p]):.1f}" for p in ("send", "receive")]
        print(f"| {kind} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
