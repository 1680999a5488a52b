#!/usr/bin/env python3
"""Python time of the broker's readiness loop per delivery, without the kernel's.

The whole-broker benchmark (tools/bench.py) measures the broker's CPU with the system
calls in it, and on this shared 2-core machine its figures move by ±15 % between runs
of the same code: too much to see a change of a few hundred nanoseconds per batch.
This runs the real `Broker.serve` loop in-process on scenario S1–S5's shape (publishers
sending full batches of 64 ``MSG k.NNN`` packets of 64-byte payload, subscribers
reading everything) with the system calls replaced by no-ops: ``recvmmsg`` reports the
batch already in the buffer, ``sendmmsg`` and ``os.write`` take everything (replaced
before the broker is imported, so whatever the shell wraps around them is timed; the
C loop of sbus/_sendeach.c, where built, is a no-op too),
``epoll`` reports every publisher readable.  What is left is the Python the broker spends per
round, timed with the thread's CPU clock (time slices given to other processes do not
count).

    .venv/bin/python tools/bench_loop.py --before /tmp/before --runs 5

Each run is a fresh interpreter; the trees take turns within each round.  Printed: the
median nanoseconds of Python per delivery of each tree and after/before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: name: (subscribers, keys, publishers), as in tools/bench.py
SCENARIOS = {"S1": (1, 1, 1), "S2": (10, 1, 1), "S3": (100, 100, 1), "S4": (1, 1, 4),
             "S5": (1000, 1, 1)}
WARM_ROUNDS = 2000  # a new client earns its full batch over its first few turns

# Runs in a child interpreter with the tree first on the path: argv = scenario, rounds.
CHILD = r"""
import os, select, socket, sys, time
os.write = lambda fd, data: len(data)  # before the broker binds it: its own port is timed
from sbus import broker as broker_mod, packetio
from sbus.broker import Broker
from sbus.flood import Hard, Order, Soft
if getattr(packetio, "HAS_SEND_EACH", False):  # sbus/_sendeach.c's loop: its sends too
    packetio._send_each = lambda msgs, n, picks, fds: n

name, rounds, nsub, nkeys, npub, warm, held = sys.argv[1], *map(int, sys.argv[2:])

class Filled(packetio.PacketBatch):
    # every batch holds a publisher's packets: a fan-out in steps keeps one and the
    # broker reads into another meanwhile
    def __init__(self, *args):
        super().__init__(*args)
        for i in range(self.slots):
            packet = b"MSG k.%03d\0" % (i % nkeys) + b"x" * 64
            at = self.offsets[i]
            self.buffer[at:at + len(packet)] = packet
            self._rmsgs[i].msg_len = len(packet)

    def trim(self, n):
        pass  # it would hand back the pages of the slots past *n*: the packets

broker_mod.PacketBatch = Filled
broker = Broker(defaults=(Soft.QUEUE, Hard.BLOCK, Order.QUEUE))
peers = []

def admit():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    peers.append(ours)
    return broker._admit(theirs)

subs = [admit() for _ in range(nsub)]
for i, c in enumerate(subs):
    broker.core.subscribe(c, b"k.%03d" % (i % nkeys))
holder = admit()  # patterns that match nothing (tools/bench_scale.py's "patterns")
for i in range(held):
    broker.core.subscribe(holder, b"p/%d/x" % i)
pubs = [admit() for _ in range(npub)]
packetio._recvmmsg = lambda fd, msgs, vlen, flags, timeout: vlen
packetio._sendmmsg = lambda fd, msgs, vlen, flags: vlen

class Done(Exception):
    pass

class Epoll:
    # every publisher readable at once; the time between two waits is the broker's
    def __init__(self, real):
        self.register, self.modify, self.unregister = real.register, real.modify, real.unregister
        self.events = [(c.link, select.EPOLLIN) for c in pubs]
        self.n, self.spent, self.left = 0, 0, None

    def poll(self, timeout=-1, maxevents=-1):
        now = time.thread_time_ns()
        if self.left is not None and self.n > warm:
            self.spent += now - self.left
        self.n += 1
        if self.n > warm + rounds:
            raise Done
        if self.n == warm + 1:
            self.delivered = broker.core.delivered
        self.left = time.thread_time_ns()
        return self.events

epoll = broker._epoll = Epoll(broker._epoll)
try:
    broker.serve(socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET))
except Done:
    pass
print(epoll.spent / (broker.core.delivered - epoll.delivered))
"""


def once(tree: Path, name: str, rounds: int, held: int = 0) -> float:
    nsub, nkeys, npub = SCENARIOS[name]
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r})\n" + CHILD,
         name, str(rounds), str(nsub), str(nkeys), str(npub), str(WARM_ROUNDS), str(held)],
        check=True, capture_output=True, text=True, cwd=tree)
    return float(out.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, help="another checkout, timed in turn with this one")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5000, help="rounds of the loop per run")
    ap.add_argument("--scenarios", default="S1,S2,S3,S4")
    ap.add_argument("--held", type=int, default=0, metavar="N",
                    help="N patterns that match nothing held by another client (with "
                         "--before: the same tree with N and with none)")
    ap.add_argument("--json", metavar="FILE", help="also write the raw figures here")
    args = ap.parse_args()
    trees = {"after": (ROOT, args.held)}
    if args.before:
        trees["before"] = (args.before.resolve(), args.held)
    elif args.held:
        trees = {"held": (ROOT, args.held), "none": (ROOT, 0)}
    results: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    for name in args.scenarios.split(","):
        for _ in range(args.runs):
            for label, (tree, held) in trees.items():
                results[label].setdefault(name, []).append(
                    once(tree, name, args.rounds, held))
    print(f"\nPython ns per delivery in the broker's loop (system calls as no-ops), "
          f"median of {args.runs}\n")
    ratio = " | after/before |" if args.before else " | held/none |" if args.held else " |"
    head = "| scenario | " + " | ".join(trees) + ratio
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in args.scenarios.split(","):
        med = {t: statistics.median(results[t][name]) for t in trees}
        row = f"| {name} | " + " | ".join(f"{med[t]:.0f}" for t in trees)
        if len(trees) > 1:
            first, second = trees
            row += f" | {med[first] / med[second]:.2f}"
        print(row + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
