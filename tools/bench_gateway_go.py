#!/usr/bin/env python3
"""`sbus gateway` against the getlantern/pubsub Go broker, with the same Go client.

Builds, in a temporary GOPATH, the Go broker (`pubsub.NewBroker` on a plain TCP
listener: tools/lantern/broker) and a load client (tools/lantern/load: 1 publisher
-> N subscribers through the repository's own client.go, at most --window messages
in flight past the slowest subscriber), from a git directory of
github.com/getlantern/pubsub.  Then, in alternating rounds, runs that client
against (a) the Go broker and (b) `sbus gateway` + `sbus serve` (and (c) the same
from another tree with --before), and prints msgs/s and server CPU per delivered
message, read from /proc/PID/stat (utime + stime) of the Go broker's process and
of the gateway's and the bus broker's processes, medians over the rounds.

Needs Go and two Debian packages (bookworm), installed once as root:

    apt-get install -y --no-install-recommends golang-go golang-glog-dev \\
        golang-gopkg-vmihailenco-msgpack.v2-dev

bookworm's msgpack.v2 package is msgpack 4.3.1, whose `Encoder.Encode` takes one
value: the build patches common.go's `EncodeMsgpack` to write the same bytes with
`EncodeUint`/`EncodeBytes` (docs/security.md, "The real Go client at the gateway's
doors").  Nothing else of the repository is changed.

Usage:  .venv/bin/python tools/bench_gateway_go.py [--rounds 5] [--messages 50000]
            [--fanout 1,10] [--before TREE] [--gateway-args ARGS] [--lantern-src GITDIR]
            [--cpus 0:1]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gateway import ROOT, SECRET, Stack, cpu_seconds  # noqa: E402

LANTERN_SRC = "/work/.mirror/getlantern+pubsub/repo"
GOCODE = "/usr/share/gocode"
APT = ("apt-get install -y --no-install-recommends golang-go golang-glog-dev "
       "golang-gopkg-vmihailenco-msgpack.v2-dev")
#: common.go's encoder for msgpack v2, and the same bytes for msgpack 4.3.1.
PATCH = [
    ("return enc.EncodeUint64(0)", "return enc.EncodeUint(0)"),
    ("return enc.Encode(int8(m.Type), m.Topic, m.Body)",
     "if err := enc.EncodeUint(uint64(m.Type)); err != nil {\n\t\treturn err\n\t}\n"
     "\tif err := enc.EncodeBytes(m.Topic); err != nil {\n\t\treturn err\n\t}\n"
     "\treturn enc.EncodeBytes(m.Body)"),
]


def build(src: str, work: Path) -> tuple[Path, Path]:
    """The Go broker and load client built from *src* (a git dir) into *work*."""
    if shutil.which("go") is None or not Path(
            GOCODE, "src/gopkg.in/vmihailenco/msgpack.v2").exists():
        raise SystemExit(f"Go or its packages are missing; as root: {APT}")
    gopath = work / "gopath"
    pkg = gopath / "src/github.com/getlantern/pubsub"
    pkg.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", src, "archive", "HEAD"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive, check=True)
    common = pkg / "common.go"
    text = common.read_text()
    for old, new in PATCH:
        if old not in text:
            raise SystemExit(f"{common}: {old!r} not found; is this getlantern/pubsub?")
        text = text.replace(old, new)
    common.write_text(text)
    for name in ("broker", "load"):
        shutil.copytree(ROOT / "tools/lantern" / name, gopath / "src/sbusbench" / name)
    env = dict(os.environ, GOPATH=f"{gopath}:{GOCODE}", GO111MODULE="off",
               GOCACHE=str(work / "gocache"), GOFLAGS="")
    out = []
    for name in ("broker", "load"):
        binary = work / f"lantern-{name}"
        subprocess.run(["go", "build", "-o", str(binary), f"sbusbench/{name}"], env=env,
                       check=True, cwd=str(work))
        out.append(binary)
    return out[0], out[1]


def _pinned(cpus: set[int] | None):
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def run_load(load: Path, port: int, servers: list[int], subscribers: int, messages: int,
             window: int, size: int, client_cpus: set[int] | None = None) -> dict:
    """One run of the Go client; CPU of *servers* (PIDs) over the measured phase."""
    proc = subprocess.Popen(
        [str(load), "-addr", f"127.0.0.1:{port}", "-authkey", SECRET.decode(),
         "-subscribers", str(subscribers), "-messages", str(messages),
         "-window", str(window), "-size", str(size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        preexec_fn=_pinned(client_cpus))
    try:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit("the Go load client did not get ready")
        cpu0 = [cpu_seconds(pid) for pid in servers]
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline().split()
        cpu = [cpu_seconds(pid) - c for pid, c in zip(servers, cpu0, strict=True)]
    finally:
        proc.kill()
        proc.wait()
    sent, delivered, seconds = int(line[0]), int(line[1]), float(line[2])
    return {"rate": sent / seconds, "delivered": delivered,
            "lost": sent * subscribers - delivered,
            "us": [1e6 * c / max(delivered, 1) for c in cpu]}


def go_round(broker: Path, load: Path, server_cpus: set[int] | None = None, **kw) -> dict:
    proc = subprocess.Popen([str(broker), "-authkey", SECRET.decode()],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=_pinned(server_cpus))
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().rsplit(":", 1)[1])
        r = run_load(load, port, [proc.pid], **kw)
    finally:
        proc.kill()
        proc.wait()
    r["server_us"] = r["us"][0]
    r["detail"] = f"{r['us'][0]:.1f}"
    return r


def sbus_round(root: Path, load: Path, server_cpus: set[int] | None = None,
               extra: tuple[str, ...] = (), **kw) -> dict:
    stack = Stack(False, list(extra), root, server_cpus)
    try:
        r = run_load(load, stack.port, [stack.gateway.pid, stack.broker.pid], **kw)
    finally:
        stack.close()
    r["server_us"] = sum(r["us"])
    r["detail"] = f"{r['us'][0]:.1f} + {r['us'][1]:.1f}"
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lantern-src", default=LANTERN_SRC,
                   help="git dir of github.com/getlantern/pubsub (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--messages", type=int, default=50000)
    p.add_argument("--fanout", default="1,10", help="subscriber counts, comma-separated")
    p.add_argument("--window", type=int, default=50,
                   help="messages in flight past the slowest subscriber (Go broker's "
                        "per-client buffer: 100)")
    p.add_argument("--size", type=int, default=100, help="body bytes")
    p.add_argument("--before", type=Path, help="another sbus tree to measure alongside "
                   "(also with each --gateway-args)")
    p.add_argument("--gateway-args", action="append", default=[], metavar="ARGS",
                   help="also this tree's gateway with these options (a row of its own; "
                        "e.g. '--linger 1ms'); may be repeated")
    p.add_argument("--cpus", default="0:1",
                   help="SERVER:CLIENT CPU lists (comma-separated) the servers' processes "
                        "and the Go client are pinned to, or 'none' (default: %(default)s)")
    args = p.parse_args()
    pins: dict = {}
    if args.cpus != "none":
        server, client = ({int(c) for c in part.split(",")} for part in args.cpus.split(":"))
        pins = {"server_cpus": server, "client_cpus": client}
    work = Path(tempfile.mkdtemp(prefix="sbus-bench-go-", dir="/tmp"))
    try:
        broker, load = build(args.lantern_src, work)
        servers = {"Go broker": lambda **kw: go_round(broker, load, **kw)}
        trees = {"sbus": ROOT, **({"sbus before": args.before.resolve()} if args.before
                                  else {})}
        for label, root in trees.items():  # each tree plain, then with each --gateway-args
            for text in ["", *args.gateway_args]:
                extra = tuple(shlex.split(text))
                servers[f"{label} {text}".rstrip()] = (
                    lambda root=root, extra=extra, **kw: sbus_round(root, load, extra=extra,
                                                                    **kw))
        fanouts = [int(n) for n in args.fanout.split(",")]
        results: dict[tuple[str, int], list[dict]] = {}
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(f"# gateway vs getlantern/pubsub broker ({os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f}, {when})")
        print(f"# {args.messages} messages of {args.size} B per run, window {args.window}, "
              f"{args.rounds} rounds, servers in turn (order rotated each round), "
              f"CPUs server:client {args.cpus}")
        names = list(servers)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for n in fanouts:
                for name in order:
                    r = servers[name](subscribers=n, messages=args.messages,
                                      window=args.window, size=args.size, **pins)
                    results.setdefault((name, n), []).append(r)
                    print(f"round {rnd + 1} 1->{n} {name}: {r['rate']:,.0f} msg/s, "
                          f"{r['server_us']:.1f} us/delivery ({r['detail']}), "
                          f"lost {r['lost']}", file=sys.stderr, flush=True)
        print("\n| load | server | msg/s | deliveries/s | server CPU µs per delivery "
              "| of which gateway + bus broker | vs Go broker | lost |")
        print("|---|---|---:|---:|---:|---|---:|---:|")
        for n in fanouts:
            go_us = statistics.median(r["server_us"] for r in results[("Go broker", n)])
            for name in names:
                rs = results[(name, n)]
                rate = statistics.median(r["rate"] for r in rs)
                us = statistics.median(r["server_us"] for r in rs)
                parts = ("—" if name == "Go broker" else
                         " + ".join(f"{statistics.median(r['us'][i] for r in rs):.1f}"
                                    for i in (0, 1)))
                print(f"| 1→{n} | {name} | {rate:,.0f} | {rate * n:,.0f} | {us:.1f} "
                      f"| {parts} | {us / go_us:.2f}× | {sum(r['lost'] for r in rs)} |")
        print(f"\n(load average at the end: {os.getloadavg()[0]:.1f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
