"""sbus ping: round trips to the broker (a whoami each), like ping(8)."""

from __future__ import annotations

import argparse
import statistics
import time

from ..client import Client
from ..defaults import ANSWER_TIMEOUT, count_arg, duration_arg


def round_trip(bus: Client, timeout: float) -> float:
    """Seconds one whoami takes to come back (messages meanwhile are skipped)."""
    started = time.perf_counter()
    bus.sync(timeout)
    return time.perf_counter() - started


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--count", type=count_arg, default=4, metavar="N",
                   help="round trips to make (default 4; Ctrl-C stops early and still "
                        "prints the summary)")
    p.add_argument("-i", "--interval", type=duration_arg, default=0.5, metavar="SECONDS",
                   help="pause between round trips (default 0.5)")
    p.add_argument("--timeout", type=duration_arg, default=ANSWER_TIMEOUT, metavar="SECONDS",
                   help=f"how long one round trip may take (default {ANSWER_TIMEOUT:g})")


def run(args: argparse.Namespace) -> int:
    """Like ping(8): the summary also after Ctrl-C, exit 0 once a round trip came back."""
    times: list[float] = []
    with Client(args.address) as bus:
        try:
            for n in range(args.count):
                if n:
                    time.sleep(args.interval)
                times.append(round_trip(bus, args.timeout) * 1e6)
                print(f"round trip {n + 1}: {times[-1]:.0f} µs", flush=True)
        except KeyboardInterrupt:
            if not times:
                raise
    print(f"{len(times)} round trips: min {min(times):.0f} µs, "
          f"median {statistics.median(times):.0f} µs, max {max(times):.0f} µs")
    return 0
