#!/usr/bin/env python3
"""What one wake-up per message costs a Python process, by event loop: the floor of the
bridge's CPU per message at a steady moderate rate (issue 26).

A child process sends --count packets of 80 bytes at --rate over a unix SOCK_SEQPACKET
pair; the parent waits for each (``select``, trio's ``wait_readable``, anyio's on trio,
asyncio's ``add_reader``), reads what is there, and waits again; it reports its own CPU
time (user + system) per packet.  Loops take turns, --rounds times; medians.

Usage: tools/bench_wakeup.py [--count N] [--rate R] [--rounds K]
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import time

LOOPS = ["select", "trio", "anyio-trio", "asyncio", "uvloop", "anyio-uvloop"]


def child(loop: str, count: int, rate: float) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        a.close()
        start = time.monotonic()
        for i in range(count):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            b.send(b"x" * 80)
        b.close()
        os._exit(0)
    b.close()
    a.setblocking(False)
    done = False

    def drain() -> None:
        nonlocal done
        while True:
            try:
                if not a.recv(4096):
                    done = True
                    return
            except BlockingIOError:
                return

    before = resource.getrusage(resource.RUSAGE_SELF)
    if loop == "select":
        while not done:
            select.select([a], [], [])
            drain()
    elif loop == "anyio-uvloop":
        import anyio

        async def main_u() -> None:
            async def beat() -> None:
                while not done:
                    await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                tg.start_soon(beat)
                while not done:
                    await anyio.wait_readable(a)
                    drain()

        anyio.run(main_u, backend="asyncio", backend_options={"use_uvloop": True})
    elif loop in ("trio", "anyio-trio"):
        import anyio
        import trio

        async def main() -> None:
            async def beat() -> None:  # a timer, as the bridge's housekeeper
                while not done:
                    await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                tg.start_soon(beat)
                while not done:
                    if loop == "trio":
                        await trio.lowlevel.wait_readable(a)
                    else:
                        await anyio.wait_readable(a)
                    drain()

        anyio.run(main, backend="trio")
    else:
        import asyncio

        async def main() -> None:
            ended = asyncio.get_running_loop().create_future()

            def ready() -> None:
                drain()
                if done and not ended.done():
                    ended.set_result(None)

            asyncio.get_running_loop().add_reader(a, ready)
            await ended

        if loop == "uvloop":
            import uvloop
            uvloop.run(main())
        else:
            asyncio.run(main())
    after = resource.getrusage(resource.RUSAGE_SELF)
    os.waitpid(pid, 0)
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    print(used * 1e6 / count)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=24000)
    ap.add_argument("--rate", type=float, default=8000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    got: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    for _ in range(args.rounds):
        for loop in LOOPS:
            out = subprocess.run([sys.executable, __file__, "--child", loop, str(args.count),
                                  str(args.rate)], capture_output=True, text=True, check=True,
                                 timeout=120).stdout
            got[loop].append(float(out))
    print(f"\n{args.count} packets at {args.rate:,.0f}/s, one wake-up each; medians (range) "
          f"of {args.rounds} alternating rounds; load average {os.getloadavg()[0]:.1f}\n")
    print("| loop | CPU µs per wake-up |")
    print("|---|---|")
    for loop in LOOPS:
        print(f"| {loop} | {statistics.median(got[loop]):.1f} "
              f"({min(got[loop]):.1f}–{max(got[loop]):.1f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
