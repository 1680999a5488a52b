"""Receive cost of the client library's fast reader: CPU microseconds per message.

A broker (this tree's) with a large queue limit; a subscriber with ``soft queue / hard
block``; a publisher sends N messages of 128 bytes, all of which wait in the broker's
queue; then the subscriber alone is timed while it reads them with each way the client
offers (``receive``, ``receive_batch``, ``recv_packet``).  CPU time is the reader
process's own (user + system), so the figure moves less with the machine's load than
the wall-clock rate, which is printed beside it.

    python tools/bench_client.py [--msgs 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time

from sbus.client import Client, wait_for_broker

WAYS = ("receive", "receive_batch", "recv_packet")


def _publish(address: str, n: int) -> None:
    with Client(address) as bus:
        publish = bus.publisher(b"bench/client")
        pad = b"x" * 120
        for i in range(n):
            publish(b"%08d" % i + pad)
        bus.sync(None)


def _read(bus: Client, way: str, n: int) -> None:
    got = 0
    if way == "receive":
        while got < n:
            bus.receive().payload[:8]
            got += 1
    elif way == "receive_batch":
        while got < n:
            for event in bus.receive_batch():
                event.payload[:8]
                got += 1
    else:  # raw packets: what a reader that frames bytes itself would do
        while got < n:
            bus.recv_packet()
            got += 1


def measure(address: str, way: str, n: int) -> tuple[float, float]:
    """(messages per second, CPU µs per message) of one reader reading *n* messages."""
    with Client(address) as bus:
        bus.set_flood(soft="queue", hard="block")
        bus.subscribe(b"bench/client")
        pub = multiprocessing.get_context("fork").Process(target=_publish, args=(address, n))
        pub.start()
        pub.join()
        before, began = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        _read(bus, way, n)
        after, ended = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return n / (ended - began), cpu / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--msgs", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sbus-bc-", dir="/tmp") as tmp:
        address = os.path.join(tmp, "bus.sock")
        broker = subprocess.Popen([sys.executable, "-m", "sbus.cli", "serve", "--address",
                                   address, "--queue-limit", "512m"],
                                  stderr=subprocess.DEVNULL)
        try:
            wait_for_broker(address, alive=lambda: broker.poll() is None)
            for _ in range(args.rounds):
                for way in WAYS:
                    rate, cpu = measure(address, way, args.msgs)
                    print(f"{way:14} {rate:>10,.0f} msgs/s  {cpu:5.2f} µs CPU per message",
                          flush=True)
        finally:
            broker.terminate()
            broker.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
