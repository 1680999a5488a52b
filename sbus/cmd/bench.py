"""sbus bench: publish/subscribe throughput and latency against the running broker.

Like ``nats bench``: N publisher and M subscriber processes on one key; each message
carries its sequence number and send time, so the subscribers measure one-way latency
(CLOCK_MONOTONIC is one clock for every process of the machine) and see drops and
reordering.  Subscribers use ``block`` by default (a publisher of the same user waits
rather than a message being lost); ``--lossy`` keeps the broker's default policy.
For the broker against the C reference under a C load generator, see tools/bench.py.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import struct
import sys
import time

from ..client import Client, Publish, SbusError

_HEAD = struct.Struct("!IQq")  # publisher, sequence, send time (ns)
SAMPLES = 20_000  # latency samples kept per subscriber at most


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key", nargs="?", default="bench/sbus", help="key to publish on")
    p.add_argument("--pub", type=int, default=1, metavar="N", help="publishers (default 1)")
    p.add_argument("--sub", type=int, default=1, metavar="N", help="subscribers (default 1)")
    p.add_argument("--msgs", type=int, default=100_000, metavar="N",
                   help="messages to publish in all (default 100,000)")
    p.add_argument("--size", type=int, default=128, metavar="BYTES",
                   help=f"payload bytes, at least {_HEAD.size} (default 128)")
    p.add_argument("--lossy", action="store_true",
                   help="subscribers keep the broker's default flood policy (drops counted)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="give up after this long (default 60)")


def _quietly(target, *args) -> None:
    """A child's work; a failure is one line on stderr and exit status 1, no traceback."""
    try:
        target(*args)
    except (SbusError, OSError) as exc:
        print(f"sbus bench: {exc}", file=sys.stderr)
        sys.exit(1)


def _publisher(address, key, index, count, size, start, sent) -> None:
    with Client(address) as bus:
        publish = bus.publisher(key)  # the key checked once: each message is one send
        pad = b"x" * (size - _HEAD.size)
        pack, clock = _HEAD.pack, time.monotonic_ns
        start.wait()
        for seq in range(count):
            publish(pack(index, seq, clock()) + pad)
            if seq & 1023 == 1023:
                sent[index] = seq + 1
        sent[index] = count


def _subscriber(address, key, index, lossy, expected, ready, got, results) -> None:
    with Client(address) as bus:
        if not lossy:
            bus.set_flood(soft="queue", hard="block")
        bus.subscribe(key)  # in force on return
        ready.release()
        samples, step, received, disorder = [], 1, 0, 0
        last: dict[int, int] = {}
        receive, unpack, clock = bus.receive_batch, _HEAD.unpack_from, time.monotonic_ns
        while received + bus.dropped < expected:
            batch = receive()  # many messages per system call, decoded in one pass
            now = clock()
            for event in batch:
                if type(event) is not Publish:
                    continue  # drop reports: counted by the client (bus.dropped)
                pub, seq, sent_ns = unpack(event.payload)
                if seq <= last.get(pub, -1):
                    disorder += 1
                last[pub] = seq
                received += 1
                if received % step == 0:
                    samples.append(now - sent_ns)
                    if len(samples) >= SAMPLES:
                        samples, step = samples[::2], step * 2
            got[index] = received
        results.put((received, bus.dropped, disorder, samples))


def run(args: argparse.Namespace) -> int:
    if args.size < _HEAD.size:
        raise SbusError(f"--size must be at least {_HEAD.size} bytes")
    if min(args.pub, args.sub, args.msgs) < 1:
        raise SbusError("--pub, --sub and --msgs must be at least 1")
    key = args.key.encode()
    Client(args.address).close()  # no broker: say so once, before any process starts
    ctx = multiprocessing.get_context("fork")
    ready, start = ctx.Semaphore(0), ctx.Event()
    # a counter per process, each written by its process alone: `+=` on one shared
    # counter from several processes loses updates
    sent, got = ctx.Array("q", args.pub, lock=False), ctx.Array("q", args.sub, lock=False)
    results = ctx.Queue()
    per_pub = [args.msgs // args.pub + (i < args.msgs % args.pub) for i in range(args.pub)]
    subs = [ctx.Process(target=_quietly, daemon=True, args=(
                _subscriber, args.address, key, i, args.lossy, args.msgs, ready, got, results))
            for i in range(args.sub)]
    pubs = [ctx.Process(target=_quietly, daemon=True,
                        args=(_publisher, args.address, key, i, n, args.size, start, sent))
            for i, n in enumerate(per_pub)]
    for p in subs + pubs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for _ in subs:
        while not ready.acquire(timeout=0.2):
            if time.monotonic() > deadline or not all(p.is_alive() for p in subs):
                for p in subs + pubs:
                    p.kill()
                raise SbusError("the subscribers could not subscribe (see above)")
    began = time.monotonic()
    start.set()
    total = args.msgs * args.sub
    done_pub = done_sub = None
    outcome: list[tuple] = []
    while time.monotonic() < deadline:
        _progress(sum(sent), args.msgs, sum(got), total, time.monotonic() - began)
        if done_pub is None and all(not p.is_alive() for p in pubs):
            done_pub = time.monotonic()
        try:  # read results as they come: a child cannot exit with unread results
            outcome.append(results.get(timeout=0.2))
        except queue.Empty:
            continue
        if len(outcome) == len(subs):
            done_sub = time.monotonic()
            break
    _progress(sum(sent), args.msgs, sum(got), total, time.monotonic() - began, end=True)
    if done_sub is None:
        for p in subs + pubs:
            p.kill()
        raise SbusError(f"not done after {args.timeout:.0f} s: {sum(got):,} of {total:,} "
                        "messages received")
    _summary(args, outcome, (done_pub or done_sub) - began, done_sub - began)
    return 0 if all(d == 0 and o == 0 for _, d, o, _ in outcome) or args.lossy else 1


def _progress(sent: int, msgs: int, got: int, total: int, seconds: float,
              end: bool = False) -> None:
    """One line on the terminal, rewritten in place (only the last one elsewhere)."""
    rate = got / seconds if seconds > 0 else 0.0
    line = (f"published {sent:,}/{msgs:,}  received {got:,}/{total:,} "
            f"({100 * got // max(total, 1)}%)  {rate:,.0f} msgs/s received  {seconds:.1f} s")
    if sys.stderr.isatty():
        print("\r" + line + "\x1b[K", end="\n" if end else "", file=sys.stderr, flush=True)
    elif end:
        print(line, file=sys.stderr)


def _summary(args, outcome, pub_seconds: float, sub_seconds: float) -> None:
    received = sum(r for r, _, _, _ in outcome)
    dropped = sum(d for _, d, _, _ in outcome)
    disorder = sum(o for _, _, o, _ in outcome)
    lat = sorted(s / 1000 for *_, samples in outcome for s in samples)
    mb = args.size / 1e6
    print(f"\nsbus bench: {args.pub} publisher(s), {args.sub} subscriber(s), "
          f"{args.msgs:,} messages of {args.size} bytes on {args.key!r}\n")
    print(f"{'':12}{'messages':>12}{'msgs/s':>12}{'MB/s':>9}")
    print(f"{'published':12}{args.msgs:>12,}{args.msgs / pub_seconds:>12,.0f}"
          f"{args.msgs * mb / pub_seconds:>9.1f}")
    print(f"{'received':12}{received:>12,}{received / sub_seconds:>12,.0f}"
          f"{received * mb / sub_seconds:>9.1f}")
    if lat:
        q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
        print(f"\nlatency (µs): p50 {q[49]:,.0f}  p90 {q[89]:,.0f}  p99 {q[98]:,.0f}  "
              f"max {lat[-1]:,.0f}")
    print(f"dropped: {dropped:,}  out of order: {disorder:,}")
