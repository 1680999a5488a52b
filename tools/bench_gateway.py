#!/usr/bin/env python3
"""Benchmark `sbus gateway`: fan-out throughput and the cost of idle connections.

Starts a real broker and a real gateway (child processes), then, from this
process (trio, raw sockets, hand-made frames):

* fan-out: one remote publisher, N remote subscribers (default 100) on the same
  topic.  "windowed" keeps at most W messages (default 50, half the default
  per-client buffer) in flight past the slowest subscriber, so nothing is
  discarded and the rate is what the gateway sustains; "flood" publishes as fast
  as it can and reports how much each subscriber lost (buffers overflowing is
  the design's answer to subscribers slower than the publisher).
* idle: C connections (default 10,000) that each subscribe to one of 100
  topics and then only send a keep-alive; reports the gateway's resident memory
  before and after (VmRSS from /proc), and checks every connection still echoes.

Against the getlantern/pubsub Go broker with the same Go client: tools/bench_gateway_go.py.

Usage:  .venv/bin/python tools/bench_gateway.py [--subscribers 100] [--messages 20000]
            [--connections 10000] [--tls] [--only fanout|idle]
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sbus.gateway import codec  # noqa: E402

SBUS = [sys.executable, "-m", "sbus.cli"]
SECRET = b"bench-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time used so far by *pid*."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of *pid* in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields["VmRSS"], fields["VmHWM"]


class Stack:
    """A broker and a gateway in child processes."""

    def __init__(self, tls: bool, extra: list[str], root: Path = ROOT,
                 cpus: set[int] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sbus-bench-gw-", dir="/tmp"))
        self.bus = str(self.dir / "bus.sock")
        self.port = free_port()
        (self.dir / "key").write_bytes(SECRET)
        (self.dir / "key").chmod(0o600)
        env = dict(os.environ, PYTHONPATH=str(root))
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
        self.broker = subprocess.Popen([*SBUS, "serve", "--address", self.bus], env=env,
                                       cwd=str(root), stderr=subprocess.DEVNULL,
                                       preexec_fn=pin)
        while not os.path.exists(self.bus):
            time.sleep(0.02)
        # every benchmark client comes from 127.0.0.1: lift the per-address cap
        args = ["--listen", f"127.0.0.1:{self.port}", "--auth-key-file", str(self.dir / "key"),
                "--address", self.bus, "--max-clients", "100000",
                "--max-clients-per-address", "100000", *extra]
        self.client_ctx = None
        if tls:
            import trustme

            ca = trustme.CA()
            cert = ca.issue_cert("127.0.0.1")
            (self.dir / "cert.pem").write_bytes(b"".join(b.bytes() for b in
                                                         cert.cert_chain_pems))
            cert.private_key_pem.write_to_path(str(self.dir / "tls.key"))
            args += ["--tls-cert", str(self.dir / "cert.pem"),
                     "--tls-key", str(self.dir / "tls.key")]
            self.client_ctx = ssl.create_default_context()
            ca.configure_trust(self.client_ctx)
        self.gateway = subprocess.Popen([*SBUS, "gateway", *args], env=env, cwd=str(root),
                                        preexec_fn=pin)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.gateway.poll() is not None:
                    raise SystemExit("the gateway did not start") from None
                time.sleep(0.05)

    async def connect(self) -> trio.abc.Stream:
        stream = await trio.open_tcp_stream("127.0.0.1", self.port)
        if self.client_ctx is not None:
            stream = trio.SSLStream(stream, self.client_ctx, server_hostname="127.0.0.1")
            await stream.do_handshake()
        return stream

    def close(self) -> None:
        for proc in (self.gateway, self.broker):
            proc.terminate()
            proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


async def echo(stream: trio.abc.Stream) -> None:
    """Keep-alive round trip: everything sent before has been acted upon."""
    await stream.send_all(b"\x00")
    while (await stream.receive_some(1)) != b"\x00":
        pass


def fanout(stack: Stack, subscribers: int, messages: int, window: int | None,
           size: int) -> dict:
    """One plain epoll loop drives the publisher and reads every subscriber, so the
    clients cost the gateway's two CPUs as little as possible."""
    topic = b"bench/fanout"
    frame = codec.publish(topic, b"x" * size)
    pub = socket.create_connection(("127.0.0.1", stack.port))
    pub.sendall(codec.authenticate(SECRET))
    subs = []
    for _ in range(subscribers):
        s = socket.create_connection(("127.0.0.1", stack.port))
        s.sendall(codec.subscribe(topic) + codec.KEEPALIVE)
        subs.append(s)
    for s in subs:  # the echo: the gateway has acted on the subscription
        assert s.recv(1) == codec.KEEPALIVE
    # the gateway's bus subscription may still be on its way: probe until all see one
    probe = codec.publish(topic, b"probe")
    waiting = set(subs)
    for s in subs:
        s.settimeout(0.01)
    while waiting:
        pub.sendall(probe)
        time.sleep(0.05)
        for s in list(waiting):
            try:
                if s.recv(65536):
                    waiting.discard(s)
            except TimeoutError:
                pass
    time.sleep(0.3)
    for s in subs:
        try:
            while s.recv(65536):
                pass
        except TimeoutError:
            pass
        s.setblocking(False)
    ep = select.epoll()
    index = {s.fileno(): i for i, s in enumerate(subs)}
    for s in subs:
        ep.register(s.fileno(), select.EPOLLIN)
    got = [0] * subscribers  # bytes
    want = messages * len(frame)
    burst = max(1, (window or 20) // 2)
    batch = frame * burst
    sent = 0
    cpu0 = [cpu_seconds(p.pid) for p in (stack.gateway, stack.broker)]
    own0 = time.process_time()
    t0 = last = time.perf_counter()
    t_pub = None
    low = 0
    while True:
        if sent < messages and (window is None or sent - low // len(frame) < window):
            n = min(burst, messages - sent)
            pub.sendall(batch if n == burst else frame * n)
            sent += n
            if sent == messages:
                t_pub = time.perf_counter() - t0
            timeout = 0
        else:
            timeout = 1.0
        events = ep.poll(timeout)
        if not events and sent == messages and timeout:
            break  # a second of silence: everything that will arrive has
        for fd, _ in events:
            i = index[fd]
            got[i] += len(subs[i].recv(262144))
        if events:
            last = time.perf_counter()
            low = min(got)
            if low >= want:
                break
    elapsed = last - t0
    cpu = [cpu_seconds(p.pid) - c for p, c in zip((stack.gateway, stack.broker), cpu0,
                                                  strict=True)]
    own = time.process_time() - own0
    delivered = sum(g // len(frame) for g in got)
    for s in [pub, *subs]:
        s.close()
    return {
        "mode": "windowed" if window else "flood",
        "publish_rate": messages / (t_pub or elapsed),
        "msg_rate": messages / elapsed,
        "delivery_rate": delivered / elapsed,
        "lost_pct": 100 * (1 - delivered / (messages * subscribers)),
        "cpu": f"gateway {cpu[0]:.1f} s, broker {cpu[1]:.1f} s, clients {own:.1f} s",
        "us_per_delivery": 1e6 * cpu[0] / max(delivered, 1),
    }


async def idle(stack: Stack, connections: int) -> dict:
    base_rss, _ = rss_kib(stack.gateway.pid)
    streams: list[trio.abc.Stream] = []
    t0 = time.perf_counter()
    limiter = trio.CapacityLimiter(200)

    async def open_one(i: int) -> None:
        async with limiter:
            s = await stack.connect()
            await s.send_all(codec.subscribe(b"idle/%d" % (i % 100)))
            streams.append(s)

    async with trio.open_nursery() as nursery:
        for i in range(connections):
            nursery.start_soon(open_one, i)
    t_connect = time.perf_counter() - t0
    # every connection alive: each echoes a keep-alive
    async with trio.open_nursery() as nursery:
        for s in streams:
            nursery.start_soon(echo, s)
    await trio.sleep(1)
    rss, hwm = rss_kib(stack.gateway.pid)
    for s in streams:
        await trio.aclose_forcefully(s)
    return {"connections": len(streams), "connect_s": t_connect, "base_mib": base_rss / 1024,
            "rss_mib": rss / 1024, "hwm_mib": hwm / 1024,
            "per_conn_kib": (rss - base_rss) / len(streams)}


def design(stack: Stack, connections: int, messages: int) -> dict:
    """What the rejected design (one bus connection per remote client) would cost the
    broker: memory per local connection, and broker CPU per message when a message
    goes to 100 subscriber connections instead of the gateway's one."""
    broker = stack.broker.pid
    base, _ = rss_kib(broker)
    held = []
    for i in range(connections):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(stack.bus)
        s.send(b"SUB remote/%d" % (i % 100))
        held.append(s)
    held[-1].send(b"CMSG !/cred/whoami")
    held[-1].recv(4096)  # the broker has caught up
    time.sleep(0.5)
    rss, _ = rss_kib(broker)
    for s in held:
        s.close()
    result = {"per_conn_kib": (rss - base) / connections, "held": connections}
    payload = b"x" * 100
    for fanout_to in (1, 100):
        subs = []
        for _ in range(fanout_to):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(stack.bus)
            s.send(b"SUB design/t")
            subs.append(s)
        pub = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pub.connect(stack.bus)
        for s in subs:  # subscriptions in place
            s.send(b"CMSG !/cred/whoami")
            s.recv(4096)
        ep = select.epoll()
        for s in subs:
            s.setblocking(False)
            ep.register(s.fileno(), select.EPOLLIN)
        got = 0
        cpu0 = cpu_seconds(broker)
        sent = 0
        while got < messages * fanout_to:
            if sent < messages and sent * fanout_to - got < 50 * fanout_to:
                pub.send(b"MSG design/t\0" + payload)
                sent += 1
            for fd, _ in ep.poll(0 if sent < messages else 1):
                while True:
                    try:
                        os.read(fd, 4096)
                        got += 1
                    except BlockingIOError:
                        break
        result[f"us_per_msg_{fanout_to}"] = 1e6 * (cpu_seconds(broker) - cpu0) / messages
        for s in [pub, *subs]:
            s.close()
    return result


def raise_nofile(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need + 100:
        if hard < need + 100:
            raise SystemExit(f"RLIMIT_NOFILE hard limit {hard} is below {need + 100}: "
                             "raise it (ulimit -Hn) to hold that many connections")
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--subscribers", type=int, default=100)
    p.add_argument("--messages", type=int, default=20000)
    p.add_argument("--size", type=int, default=100, help="body bytes")
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--connections", type=int, default=10000)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--only", choices=["fanout", "idle", "design"])
    args = p.parse_args()
    raise_nofile(args.connections)
    kind = "TLS" if args.tls else "TCP"
    print(f"# sbus gateway benchmark ({kind}, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.1f})")
    if args.only in (None, "fanout"):
        print(f"\n1 publisher -> {args.subscribers} subscribers, {args.messages} messages "
              f"of {args.size} B (topic+body {args.size + 12} B)\n")
        print("| mode | published msg/s | msg/s (all delivered) | deliveries/s | lost "
              "| gateway CPU per delivery | CPU time |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for window in (args.window, None):
            stack = Stack(args.tls, [])
            try:
                r = fanout(stack, args.subscribers, args.messages, window, args.size)
            finally:
                stack.close()
            print(f"| {r['mode']}{f' (W={window})' if window else ''} "
                  f"| {r['publish_rate']:,.0f} | {r['msg_rate']:,.0f} "
                  f"| {r['delivery_rate']:,.0f} | {r['lost_pct']:.1f} % "
                  f"| {r['us_per_delivery']:.1f} µs | {r['cpu']} |",
                  flush=True)
    if args.only in (None, "idle"):
        stack = Stack(args.tls, ["--idle-timeout", "600"])
        try:
            r = trio.run(idle, stack, args.connections)
        finally:
            stack.close()
        print(f"\n{args.connections} idle connections, each subscribed to one of 100 topics\n")
        print("| connections | connect time | gateway RSS before | after | peak | per connection |")
        print("|---:|---:|---:|---:|---:|---:|")
        print(f"| {r['connections']:,} | {r['connect_s']:.1f} s | {r['base_mib']:.0f} MiB "
              f"| {r['rss_mib']:.0f} MiB | {r['hwm_mib']:.0f} MiB "
              f"| {r['per_conn_kib']:.1f} KiB |")
    if args.only in (None, "design"):
        stack = Stack(False, [])
        try:
            r = design(stack, min(args.connections, 4000), 20000)
        finally:
            stack.close()
        print("\nThe rejected design, one bus connection per remote client, seen from the "
              "broker\n")
        print("| broker memory per local connection | broker CPU per message: to 1 connection "
              "| to 100 connections |")
        print("|---:|---:|---:|")
        print(f"| {r['per_conn_kib']:.1f} KiB ({r['held']:,} held) | {r['us_per_msg_1']:.1f} µs "
              f"| {r['us_per_msg_100']:.1f} µs |")
    print(f"\n(load average at the end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
