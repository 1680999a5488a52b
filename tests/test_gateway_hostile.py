"""The gateway under hostile use (issue 13), tried as an attacker would: a real
`sbus gateway` process, real TCP/TLS sockets on loopback, a real broker.

Each test runs the gateway with its default bounds unless the bound itself is what
is tested, and measures what matters to other users: the gateway's RSS, another
client's round trip, the number of log lines and reconnects a refusal causes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import select
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import trustme
from conftest import SBUS, BrokerProcess, raw, sync
from faultkit import rss_kib, until
from test_gateway import (
    SECRET,
    GatewayProcess,
    closed_by_gateway,
    free_port,
    gateway_side_open,
    gateway_side_states,
    next_loopback,
    read_exactly,
    roundtrip,
    subscribe_bridged,
)

from sbus.gateway import codec, notices
from sbus.gateway.codec import FrameDecoder


@pytest.fixture
def hdir():
    d = Path(tempfile.mkdtemp(prefix="sbus-gwh-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def bus(hdir):
    b = BrokerProcess(str(hdir / "bus.sock")).start()
    yield b
    b.stop()


@pytest.fixture
def local(bus):
    s = raw(bus.address)
    yield s
    s.close()


def start(hdir: Path, bus: BrokerProcess, *args: str, **kw) -> GatewayProcess:
    """A gateway with the default refusal delay and log level (what a service runs)."""
    kw.setdefault("quick", False)
    kw.setdefault("verbose", False)
    return GatewayProcess(hdir, bus.address, *args, **kw).start()


@pytest.fixture
def gw(hdir, bus):
    g = start(hdir, bus)
    yield g
    g.stop()


def log_lines(gw: GatewayProcess, text: str) -> int:
    return sum(text in line for line in gw.log().splitlines())


# -- issue 16: the real port in the log ----------------------------------------------------

def test_listening_line_names_the_real_port_also_for_port_0(hdir, bus):
    keyfile = hdir / "k"
    keyfile.write_bytes(SECRET)
    keyfile.chmod(0o600)
    logfile = hdir / "port0.log"
    proc = subprocess.Popen([*SBUS, "gateway", "--listen", "127.0.0.1:0", "--auth-key-file",
                             str(keyfile), "--address", bus.address],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=logfile.open("w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        port = None
        while port is None and time.monotonic() < deadline:
            for line in logfile.read_text().splitlines():
                if "listening on 127.0.0.1:" in line:
                    port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
            time.sleep(0.05)
        assert port, f"no listening line at the default log level:\n{logfile.read_text()}"
        assert port != 0
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        roundtrip(s)  # it is the gateway that listens there
        s.close()
    finally:
        proc.terminate()
        proc.wait(10)


# -- class 7: secrets follow the broker's separator --------------------------------------

def test_secret_inboxes_of_a_dot_separator_broker_stay_local(hdir):
    bus = BrokerProcess(str(hdir / "dot.sock"), "--separator", ".").start()
    gw = start(hdir, bus)
    local = raw(bus.address)
    try:
        local.send(b"CMSG !/cred/whoami")
        me = local.recv(1 << 16).split(b"\0", 1)[1]
        assert me.startswith(b"!.cred.")
        local.send(b"SUB " + me + b".")
        sync(local)
        # a remote publisher with the key forges a message into a local secret inbox
        forger = gw.connect()
        forger.sendall(codec.authenticate(SECRET) + codec.publish(me + b".inbox", b"forged"))
        roundtrip(forger)
        local.send(b"MSG " + me + b".inbox\0genuine")
        assert local.recv(1 << 16) == b"MSG " + me + b".inbox\0genuine"
        # a remote subscriber asks for the gateway's own secret inbox (empty fields are
        # filled with the subscriber's credentials: the gateway's) and for everything
        spy = gw.connect()
        spy.sendall(codec.subscribe(b"!.cred..."))
        subscribe_bridged(spy, b"", local, b"probe")
        secret_key = b"!.cred.0.0.%d.private" % gw.proc.pid
        local.send(b"MSG " + secret_key + b"\0leak")
        # on a "." bus the gateway's notices topic is an ordinary key: a local user forges
        # a notice, and a remote one tries; neither reaches a client that asked for them
        spy.sendall(codec.subscribe(notices.TOPIC))
        roundtrip(spy)
        local.send(b"MSG " + notices.TOPIC + b'\0{"event":"bus-away"}')
        forger.sendall(codec.publish(notices.TOPIC, b'{"event":"bus-away"}'))
        roundtrip(forger)
        local.send(b"MSG public\0ok")
        expected = codec.publish(b"public", b"ok")
        assert read_exactly(spy, len(expected)) == expected  # neither came first
        gw.wait_log("is a secret (!.) key")
        gw.wait_log("refused: the gateway's notices are its own")
    finally:
        local.close()
        gw.stop()
        bus.stop()


# -- class 7: refusals do not make reconnect storms ---------------------------------------

def storm(gw: GatewayProcess, first: bytes, seconds: float = 3.0,
          source: str | None = None) -> int:
    """A client that, like the getlantern/pubsub Go client, reconnects as soon as it is
    disconnected and sends *first* again; returns how many connections it made."""
    source = source or next_loopback()
    attempts = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            s = gw.connect(source=source)
        except OSError:
            continue
        attempts += 1
        try:
            s.sendall(first)
            s.settimeout(max(0.01, deadline - time.monotonic()))
            while s.recv(65536):
                pass
        except (OSError, TimeoutError):
            pass
        finally:
            s.close()
    return attempts


REFUSALS = [
    (codec.authenticate(b"wrong"), "wrong authentication secret"),
    (codec.subscribe(b"!/cred/0/0/1/"), "secret"),
    (codec.publish(b"a", b"before auth"), "before authenticating"),
    (b"\xc1", "malformed"),
]


def test_a_refusal_does_not_make_a_reconnect_storm(gw):
    """One reconnecting client per kind of refusal, all at once, each from its own
    address (one storm's 3 s for all four)."""
    sources = [next_loopback() for _ in REFUSALS]
    with concurrent.futures.ThreadPoolExecutor(len(REFUSALS)) as pool:
        attempts = list(pool.map(lambda case, source: storm(gw, case[0], source=source),
                                 REFUSALS, sources))
    time.sleep(0.5)
    log = gw.log()
    for (_, what), source, made in zip(REFUSALS, sources, attempts, strict=True):
        # at most one connection per refusal delay (5 s by default): the old gateway took
        # hundreds, each with a log line
        assert made <= 2, f"{what}: {made} connections in 3 s"
        said = [line for line in log.splitlines() if f"remote {source}:" in line]
        assert 1 <= len(said) <= 2 * made, log  # a refusal, and a connection's summary
        assert what in said[0], log
    others = [line for line in log.splitlines() if not any(s in line for s in sources)]
    assert len(others) <= 2, log  # connected to the bus, listening
    ok = gw.connect()
    roundtrip(ok)


def test_log_lines_quote_client_input_briefly_and_escaped(gw):
    s = gw.connect()
    s.sendall(codec.subscribe(b"!/" + b"\x1b[2J" * 5000))
    roundtrip(s)
    line = next(x for x in gw.wait_log("secret").splitlines() if "secret" in x)
    assert "\x1b" not in line and "\\x1b[2J" in line
    assert len(line) < 400


# -- class 1: connection caps --------------------------------------------------------------

def test_one_address_gets_at_most_its_cap_of_connections(gw):
    source = next_loopback()
    conns = []
    for _ in range(300):  # the default cap per address is 256
        try:
            conns.append(gw.connect(source=source))
        except OSError:
            break
    served = echoing(conns, wait=5)  # (300 connects just before: a loaded gateway lags)
    try:
        assert served == 256, f"{served} of 300 connections served"
        roundtrip(conns[0])  # the first ones are served
        other = gw.connect()  # another address is still served
        roundtrip(other)
        time.sleep(0.2)
        # refusals at the cap are counted in one line, not logged one by one
        assert 1 <= log_lines(gw, "refused") <= 2, gw.log()
    finally:
        for c in conns:
            c.close()


# -- class 1: memory an unauthenticated client causes -------------------------------------

def half_frames(gw: GatewayProcess, n: int, source: str, sent: int,
                first: bytes = b"") -> list[socket.socket]:
    """*n* connections, each sending *first*, then *sent* bytes of a 200 KB publish
    frame and no more."""
    head = b"\x04\xc4\x01a\xc6" + (200_000).to_bytes(4, "big")
    conns = []
    for _ in range(n):
        s = gw.connect(source=source)
        s.sendall(first + head + bytes(sent))
        conns.append(s)
    return conns


def deep_subscriptions(gw: GatewayProcess, n: int = 4096, depth: int = 64) -> socket.socket:
    """One connection subscribing *n* distinct patterns of *depth* segments each."""
    s = gw.connect()
    tail = b"/s" * (depth - 1)
    batch = b"".join(codec.subscribe(b"%d" % i + tail) for i in range(n))
    threading.Thread(target=s.sendall, args=(batch,), daemon=True).start()
    return s


def test_unauthenticated_clients_cannot_grow_the_gateway(gw):
    pid = gw.proc.pid
    warm = gw.connect()
    roundtrip(warm)
    before = rss_kib(pid)
    conns = half_frames(gw, 200, next_loopback(), 60_000)  # over the bound: closed
    conns += half_frames(gw, 200, next_loopback(), 15_000)  # just under it: kept
    conns.append(deep_subscriptions(gw))
    time.sleep(2.0)
    peak = rss_kib(pid)
    growth_mib = (peak - before) / 1024
    print(f"gateway RSS {before} KiB -> {peak} KiB under attack (+{growth_mib:.1f} MiB)")
    try:
        # the documented bounds: 16 KiB of a half-sent frame before authenticating,
        # 256 KiB of subscriptions per client; 401 connections cost far below 40 MiB
        # (the old gateway held every half frame and 262144 trie nodes: ~150 MiB)
        assert growth_mib < 40, f"RSS grew by {growth_mib:.1f} MiB"
        roundtrip(warm)
    finally:
        for c in conns:
            c.close()


def test_key_holders_half_frames_are_bounded_per_address_and_in_all(hdir, bus):
    """Clients with the key, 150 from each of two addresses, each send 190 KB of a
    200 KB frame and stop.  `--max-frame` bounds each connection; what an address's
    incomplete frames hold together is bounded too (a sixteenth of 256 MiB): past it
    a growing frame is refused and its connection closed after the refusal delay, and
    another address still gets its own share.  Before, every such frame was held: 1,024
    connections of 4 addresses grew the gateway by 292 MB (the audit of 2026-11-27)."""
    gw = start(hdir, bus, quick=True)
    conns: list[socket.socket] = []
    try:
        pid = gw.proc.pid
        warm = gw.connect()
        roundtrip(warm)
        before = rss_kib(pid)
        key = codec.authenticate(SECRET)
        conns += half_frames(gw, 150, next_loopback(), 190_000, first=key)
        conns += half_frames(gw, 150, next_loopback(), 190_000, first=key)
        time.sleep(1.5)  # past the refusal delay
        growth_mib = (rss_kib(pid) - before) / 1024

        def count_closed() -> int:
            return sum(not gateway_side_open(c.getsockname()[1], gw.port) for c in conns)
        deadline = time.monotonic() + 10  # (a loaded machine closes them later: CI)
        while (closed := count_closed()) < 100 and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"{closed} of 300 closed; gateway RSS +{growth_mib:.1f} MiB")
        other = half_frames(gw, 5, next_loopback(), 190_000, first=key)
        conns += other
        time.sleep(0.6)
        assert all(gateway_side_open(c.getsockname()[1], gw.port) for c in other)
        # about 71 held per address
        assert 100 <= closed <= 250, (closed, gateway_side_states(gw.port))
        assert growth_mib < 60, f"RSS grew by {growth_mib:.1f} MiB (300 half frames: 85)"
        assert "incomplete frames would hold" in gw.log()
        roundtrip(warm)
    finally:
        for c in conns:
            c.close()
        gw.stop()


# -- class 2: another client's round trip while one client does its worst ---------------

def round_trips(s: socket.socket, seconds: float) -> list[float]:
    times = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        roundtrip(s)
        times.append(time.perf_counter() - t0)
        time.sleep(0.005)
    return times


def served_promptly_under(attacker: socket.socket, blocks: list[bytes],
                          honest: socket.socket, seconds: float, what: str) -> None:
    """*honest*'s round trips stay fast while a thread sends *blocks* on *attacker* over
    and over (never reading a byte); the attacker is closed after.  Issue 13 asks p99 <
    50 ms; measured ~7-12 ms on a quiet machine.  The margins allow for 2 cores shared
    with other work (the old gateway: median 119, p99 319 ms)."""
    stop, attacking = threading.Event(), threading.Event()

    def attack() -> None:
        try:
            while not stop.is_set():
                for block in blocks:
                    attacker.sendall(block)
                attacking.set()
        except OSError:
            pass

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    assert attacking.wait(10), "the attacker sent nothing"
    loaded = round_trips(honest, seconds)
    stop.set()
    attacker.close()
    t.join(5)
    q = statistics.quantiles(loaded, n=100)
    print(f"honest round trip {what}: median {statistics.median(loaded) * 1e3:.2f} ms, "
          f"p99 {q[98] * 1e3:.1f} ms, max {max(loaded) * 1e3:.1f} ms ({len(loaded)} trips)")
    assert statistics.median(loaded) < 0.030, f"median {statistics.median(loaded) * 1e3:.1f} ms"
    assert q[98] < 0.100, f"p99 {q[98] * 1e3:.1f} ms"


@pytest.mark.alone  # round trips against the wall clock
def test_one_client_cannot_stall_the_others(gw):
    honest = gw.connect()
    roundtrip(honest)
    quiet = round_trips(honest, 1.0)
    attacker = gw.connect()
    # keep-alives by the 64 KiB and subscription churn
    churn = b"".join(codec.subscribe(b"c/%d" % i) + codec.unsubscribe(b"c/%d" % i)
                     for i in range(3000))
    served_promptly_under(attacker, [bytes(65536), churn], honest, 3.0,
                          f"(quiet median {statistics.median(quiet) * 1e3:.2f} ms) under attack")


@pytest.mark.alone  # round trips against the wall clock
def test_many_connections_of_one_address_take_one_turn(gw):
    """250 connections from one address, each kept full of SUB/UNSUB of 61-segment
    patterns (no key needed): each connection's turn is bounded, but each got one in
    every turn of trio's loop, so another address waited for 250 of them.  19976cb:
    median 866 ms in one run; in another median 0.15 ms with 7 of 125 round trips
    over 50 ms, the longest 1.25 s."""
    honest = gw.connect()
    roundtrip(honest)
    source = next_loopback()
    crowd = [gw.connect(source=source) for _ in range(250)]
    tail = b"/x" * 60
    churn = b"".join(codec.subscribe(b"c/%d" % i + tail) + codec.unsubscribe(b"c/%d" % i + tail)
                     for i in range(300))
    stop, sent = threading.Event(), []

    def attack() -> None:
        for c in crowd:
            c.setblocking(False)
        while not stop.is_set():
            moved = 0
            for c in crowd:
                try:
                    moved += c.send(churn)
                except (BlockingIOError, OSError):
                    pass
            sent.append(moved)
            if not moved:
                time.sleep(0.002)

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    try:
        time.sleep(1.0)  # every connection full
        loaded = round_trips(honest, 4.0)
    finally:
        stop.set()
        t.join(5)
        for c in crowd:
            c.close()
    q = statistics.quantiles(loaded, n=100)
    print(f"honest round trip beside 250 busy connections of one address: median "
          f"{statistics.median(loaded) * 1e3:.2f} ms, p99 {q[98] * 1e3:.1f} ms, max "
          f"{max(loaded) * 1e3:.1f} ms ({len(loaded)} trips, {sum(sent)} bytes sent)")
    assert sum(sent) > 10_000_000  # the crowd was busy
    assert statistics.median(loaded) < 0.030, f"median {statistics.median(loaded) * 1e3:.1f} ms"
    assert max(loaded) < 0.200, f"max {max(loaded) * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms"


@pytest.mark.alone  # against the wall clock
def test_a_new_client_is_not_queued_behind_every_connection_before_it(gw):
    """256 connections of 16 addresses that churn subscriptions from their first byte:
    a client that connects while they are still being taken gets its first keep-alive
    echoed promptly (before: 3.5 s, as trio's listener took one connection per turn of
    a loop the taken ones made slow, the audit; now a run of them per turn)."""
    crowd = []
    for _ in range(16):
        source = next_loopback()
        crowd += [gw.connect(source=source) for _ in range(16)]
    pattern = b"/".join([b"a*"] * 200)
    churn = (codec.subscribe(pattern) + codec.unsubscribe(pattern)) * 50
    stop = threading.Event()

    def attack() -> None:
        for c in crowd:
            c.setblocking(False)
        while not stop.is_set():
            for c in crowd:
                try:
                    c.send(churn)
                except OSError:
                    pass

    t = threading.Thread(target=attack, daemon=True)
    t.start()
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        honest = gw.connect()
        roundtrip(honest)
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join(5)
        for c in crowd:
            c.close()
    print(f"first keep-alive echoed after {took * 1e3:.0f} ms")
    assert took < 1.0, f"{took:.2f} s"


@pytest.mark.alone  # round trips against the wall clock
@pytest.mark.parametrize("keys,linger", [(1, "0"), (3000, "0"), (1, "1ms")],
                         ids=["one-key", "key-churn", "linger"])
def test_a_publishing_flood_does_not_stall_the_others(hdir, bus, local, keys, linger):
    """An authenticated client floods publishes over plain TCP (read on its descriptor,
    publishes sent to the bus in runs, no turn of the loop per read): an honest client's
    keep-alive round trips stay fast, and the flood does reach the bus.  With 3,000 keys
    in turn it also churns the gateway's shared cache of checked keys (1,024 kept, then
    all forgotten): that costs the others a key check, never a stall.  With ``--linger``
    the flooder's reader waits between turns: the honest client is not held by it."""
    gw = start(hdir, bus, "--linger", linger)
    try:
        local.send(b"SUB flood/")
        sync(local)
        honest = gw.connect()
        roundtrip(honest)
        attacker = gw.connect()
        attacker.sendall(codec.authenticate(SECRET))
        roundtrip(attacker)
        block = b"".join(codec.publish(b"flood/%d" % (i % keys), b"f" * 40)
                         for i in range(3000))
        served_promptly_under(attacker, [block], honest, 2.0,
                              f"under a publish flood on {keys} key(s), linger {linger}")
        assert local.recv(65536).startswith(b"MSG flood/")  # it did publish
    finally:
        gw.stop()


@pytest.mark.alone  # round trips against the wall clock
def test_an_honest_publish_waits_for_a_piece_of_each_flood_not_all_of_it(gw):
    """Authenticated clients from 64 addresses publish tiny messages flat out; an honest
    client from another address publishes to a key it subscribes to, and gets each
    message back promptly.  Every run of publishes went to the bus whole (up to 64 KiB,
    ~2,600 of these) while the others waited their turn for the bus connection, so the
    honest one waited for all the runs ahead of it: p50 2.6-6.3 s behind 64 addresses
    in the audit of 2026-11-27.  Now, while others wait, a run goes `PIECE` publishes at
    a time."""
    stop = threading.Event()
    flood = b"".join(codec.publish(b"flood/x", b"f" * 16) for _ in range(4000))
    attackers = [gw.connect() for _ in range(64)]

    def attack(s: socket.socket) -> None:
        try:
            s.sendall(codec.authenticate(SECRET))
            while not stop.is_set():
                s.sendall(flood)
        except OSError:
            pass

    threads = [threading.Thread(target=attack, args=(s,), daemon=True) for s in attackers]
    honest = gw.connect()
    honest.settimeout(30)
    honest.sendall(codec.authenticate(SECRET) + codec.subscribe(b"vic/"))
    roundtrip(honest)
    for t in threads:
        t.start()
    delays: list[float] = []
    try:
        time.sleep(1.0)  # the flood under way
        for i in range(60):
            frame = codec.publish(b"vic/g", b"%d" % i)
            sent = time.monotonic()
            honest.sendall(frame)
            assert read_exactly(honest, len(frame)) == frame
            delays.append(time.monotonic() - sent)
            time.sleep(0.01)
    finally:
        stop.set()
        for s in attackers:
            s.close()
    delays.sort()
    p50, top = delays[len(delays) // 2], delays[-1]
    print(f"an honest publish's round trip under 64 flooding addresses: p50 "
          f"{p50 * 1000:.0f} ms, max {top * 1000:.0f} ms")
    assert p50 < 0.2 and top < 1.5, (p50, top)


# -- class 3: the shared publishing connection is never paused ----------------------------

@pytest.mark.alone  # round trips against the wall clock
def test_a_blocking_local_subscriber_does_not_stall_remote_publishers(gw, bus, local):
    slow = raw(bus.address)
    slow.send(b"SUB ")  # everything, and pause publishers rather than lose messages
    slow.send(b"CMSG blocking/soft/block")
    slow.send(b"CMSG blocking/hard/block")
    sync(slow)
    local.send(b"SUB x/")
    sync(local)
    flooder = gw.connect()
    flooder.sendall(codec.authenticate(SECRET))
    body = bytes(16384)
    done = threading.Event()

    def flood() -> None:
        try:
            for i in range(1000):  # 16 MB: far past the broker's queue for the slow one
                flooder.sendall(codec.publish(b"flood/%d" % i, body))
        except OSError:
            pass
        done.set()

    threading.Thread(target=flood, daemon=True).start()
    done.wait(20)
    other = gw.connect()
    other.sendall(codec.authenticate(SECRET) + codec.publish(b"x/probe", b"unrelated"))
    local.settimeout(10)
    try:
        while True:
            packet = local.recv(1 << 16)
            if packet == b"MSG x/probe\0unrelated":
                break
    except TimeoutError:
        raise AssertionError("a remote publish stalled behind one slow local subscriber") \
            from None
    finally:
        slow.close()
    assert done.is_set()


# -- HTTPS: 401 closes, pipelined guesses are not read, deep JSON is refused --------------

@pytest.fixture(params=[1.0])
def https_gw(request, hdir, bus):
    """A gateway with the HTTPS endpoint; a refused request is answered after the
    refusal delay (*request.param* s: short keeps the tests short)."""
    g = https_gateway(hdir, bus, "--refusal-delay", str(request.param))
    yield g
    g.stop()


def https_gateway(hdir: Path, bus: BrokerProcess, *args: str) -> GatewayProcess:
    """A gateway with the HTTPS endpoint (``g.https()`` connects, ``g.https_port``)."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile = hdir / "cert.pem", hdir / "key.pem"
    certfile.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(keyfile))
    port = free_port()
    g = start(hdir, bus, "--tls-cert", str(certfile), "--tls-key", str(keyfile),
              "--https-listen", f"127.0.0.1:{port}", *args, name="https")
    g.wait_log(f"HTTPS 127.0.0.1:{port}", timeout=15)  # logged once both listen
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    g.https = lambda: _tls(ctx, port)
    g.https_port = port
    g.tls = lambda: _tls(ctx, g.port)  # the gateway's own protocol, over TLS
    return g


def _tls(ctx: ssl.SSLContext, port: int) -> ssl.SSLSocket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return ctx.wrap_socket(s, server_hostname="localhost")


def _request(key: bytes, body: bytes) -> bytes:
    return (b"POST /publish HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"X-Authentication-Key: " + key + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body)


def _read_all(s: ssl.SSLSocket) -> bytes:
    out = b""
    s.settimeout(5)
    try:
        while chunk := s.recv(65536):
            out += chunk
    except (TimeoutError, ssl.SSLError, ConnectionResetError):
        pass
    return out


def _read_answer(s: ssl.SSLSocket) -> bytes:
    """One complete HTTP answer (head and Content-Length body), without waiting for the
    close (which a turned-away request gets only after the refusal delay)."""
    out = b""
    s.settimeout(5)
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def test_https_closes_after_401_and_reads_no_pipelined_guess(https_gw):
    body = b'{"topic": "YQ=="}'
    s = https_gw.https()
    s.sendall(b"".join(_request(b"guess%d" % i, body) for i in range(20)))
    answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert answer.count(b"HTTP/1.1") == 1, answer  # closed after the first answer
    assert log_lines(https_gw, "wrong authentication key") == 1


def test_https_deeply_nested_json_is_refused_and_the_gateway_lives(https_gw):
    s = https_gw.https()
    s.sendall(_request(SECRET, b"[" * 100_000 + b"]" * 100_000))
    answer = _read_answer(s)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert https_gw.proc.poll() is None
    s = https_gw.https()  # still serving
    s.sendall(_request(b"wrong", b"{}"))
    assert _read_answer(s).startswith(b"HTTP/1.1 401")


# -- class 1: the shared route cache and the outgoing buffers are bounded in bytes ----------

def reader(s: socket.socket, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                if not s.recv(1 << 20):
                    return
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_long_distinct_keys_cannot_grow_the_route_cache(gw, local):
    """Every key the bus sends the gateway is looked up once and cached: 400 distinct
    200 KB keys (80 MB) must not stay in the cache (4 MiB by default, in bytes)."""
    sub = gw.connect()
    subscribe_bridged(sub, b"", local, b"probe")
    stop = threading.Event()
    t = reader(sub, stop)
    pub = gw.connect()
    pub.sendall(codec.authenticate(SECRET))
    roundtrip(pub)
    before = rss_kib(gw.proc.pid)
    try:
        for i in range(400):
            pub.sendall(codec.publish(b"%06d" % i + b"k" * 200_000, b"v"))
        roundtrip(pub)
        time.sleep(1.0)
        growth_mib = (rss_kib(gw.proc.pid) - before) / 1024
        print(f"gateway RSS +{growth_mib:.1f} MiB after 80 MB of distinct keys")
        assert growth_mib < 16, f"RSS grew by {growth_mib:.1f} MiB"
    finally:
        stop.set()
        t.join(5)


def test_all_outgoing_buffers_together_are_bounded(hdir, bus, local):
    g = start(hdir, bus, "--buffer-pool", "4m")
    conns = []
    try:
        for n in range(20):  # each subscribes to its own topics and never reads
            s = g.connect(rcvbuf=4096)
            subscribe_bridged(s, b"fill/%d/" % n, local, b"fill/%d/probe" % n)
            conns.append(s)
        before = rss_kib(g.proc.pid)
        body = bytes(60_000)
        for i in range(60):  # 3.6 MB to each: 1 MiB buffers each would hold 20 MiB
            for n in range(20):
                local.send(b"MSG fill/%d/%d\0" % (n, i) + body)
        time.sleep(1.5)
        growth_mib = (rss_kib(g.proc.pid) - before) / 1024
        print(f"gateway RSS +{growth_mib:.1f} MiB with 20 readers that never read")
        # the 4 MiB pool, plus the bus connection's receive batch (up to 64 slots of what
        # arrives: ~4 MB of 60 KB messages), against 20 MiB if each reader had its own 1 MiB
        assert growth_mib < 14, f"RSS grew by {growth_mib:.1f} MiB"
        roundtrip(g.connect())
    finally:
        for s in conns:
            s.close()
        g.stop()


def echoing(conns: list[socket.socket], wait: float = 2.0) -> int:
    """How many of *conns* echo a keep-alive within *wait* seconds (are served)."""
    for c in conns:
        c.sendall(b"\x00")
    pending = set(conns)
    served = 0
    deadline = time.monotonic() + wait
    while pending and time.monotonic() < deadline:
        ready, _, _ = select.select(list(pending), [], [], 0.1)
        for c in ready:
            pending.discard(c)
            try:
                served += c.recv(1) == b"\x00"
            except OSError:
                pass
    return served


def test_total_connection_cap(hdir, bus):
    g = start(hdir, bus, "--max-clients", "10")
    conns = [g.connect() for _ in range(10)]
    try:
        for c in conns:
            roundtrip(c)
        extra = g.connect()
        assert not echoing([extra])  # held unserved (then closed after the delay)
        leaving = conns.pop()
        pair = leaving.getsockname()[1], leaving.getpeername()[1]
        leaving.close()
        until(lambda: not gateway_side_open(*pair), "the gateway closed its side")
        roundtrip(g.connect())  # a freed slot is taken again
        assert log_lines(g, "at the cap of 10 connections") == 1
    finally:
        for c in conns:
            c.close()
        g.stop()


# -- issue 28 item 6: no storm at any door ---------------------------------------------------

def test_a_client_over_the_per_address_cap_does_not_storm(hdir, bus):
    """Turned away at the cap, a client that redials at once (as the Go client does) made
    383,550 connections in 31 s from 1,000 clients; now the refused connection is held
    open and unread for the refusal delay, so it makes one per delay."""
    g = start(hdir, bus, "--max-clients-per-address", "2")
    source = next_loopback()
    held = [g.connect(source=source) for _ in range(2)]
    try:
        for c in held:
            roundtrip(c)
        attempts = storm(g, codec.subscribe(b"x/"), seconds=2.0, source=source)
        print(f"{attempts} connections in 2 s over the per-address cap")
        assert attempts <= 20, f"{attempts} connections in 2 s"
        roundtrip(g.connect())  # another address is served meanwhile
        assert log_lines(g, "at the cap of 2 connections from one address") == 1
    finally:
        for c in held:
            c.close()
        g.stop()


def test_many_clients_of_one_host_over_the_cap_do_not_storm(hdir, bus):
    """50 clients of one host against a cap of 10, each redialing at once for 2 s: each
    client makes at most 20 connections (the held ones 1), the tarpit holds the 40."""
    g = start(hdir, bus, "--max-clients-per-address", "10", "--max-clients", "1000")
    source = next_loopback()
    counts: list[int] = []
    lock = threading.Lock()

    def client() -> None:
        n = storm(g, codec.subscribe(b"x/"), seconds=2.0, source=source)
        with lock:
            counts.append(n)

    threads = [threading.Thread(target=client) for _ in range(50)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        print(f"connections per client in 2 s: max {max(counts)}, total {sum(counts)}")
        assert len(counts) == 50
        assert max(counts) <= 20, counts
        assert sum(counts) <= 100, counts
    finally:
        g.stop()


def test_the_tarpit_is_bounded_per_address(hdir, bus):
    """The tarpit holds at most 4 x the per-address cap for one address; past that a
    connection is closed at once, so an attacker cannot fill it for others."""
    g = start(hdir, bus, "--max-clients-per-address", "1", "--refusal-delay", "2")
    source = next_loopback()
    served = g.connect(source=source)
    roundtrip(served)
    held = [g.connect(source=source) for _ in range(4)]
    try:
        extra = g.connect(source=source)
        assert closed_by_gateway(extra, timeout=1)  # the tarpit is full for this address
        for c in held:
            assert not closed_by_gateway(c, timeout=0.1)  # held, not closed
        other = next_loopback()
        s = g.connect(source=other)
        roundtrip(s)  # other addresses are served
        assert all(closed_by_gateway(c, timeout=10) for c in held)  # after the delay
    finally:
        served.close()
        g.stop()


def test_https_wrong_keys_do_not_storm(https_gw):
    """A client that retries a wrong key at once: the 401 is answered at once, the close
    waits for the refusal delay (the connection keeps its slot)."""
    attempts = 0
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        s = https_gw.https()
        attempts += 1
        s.sendall(_request(b"wrong", b"{}"))
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            while s.recv(65536):
                pass
        except (OSError, TimeoutError):
            pass
        s.close()
    assert attempts <= 20, f"{attempts} connections in 2 s"


@pytest.mark.parametrize("https_gw", [5.0], indirect=True)  # the default refusal delay
def test_plaintext_on_the_tls_port_does_not_make_a_reconnect_storm(https_gw):
    attempts = storm(https_gw, codec.subscribe(b"plain"))
    assert attempts <= 2, f"{attempts} connections in 3 s"
    assert len(https_gw.log().splitlines()) <= 12, https_gw.log()
    https_gw.wait_log("TLS failed")


def test_a_broker_restarted_with_another_separator_is_followed(hdir):
    address = str(hdir / "swap.sock")
    slash = BrokerProcess(address).start()
    gw = start(hdir, slash)
    try:
        old = gw.connect()
        old.sendall(codec.subscribe(b"a/"))
        roundtrip(old)
        slash.stop()
        dot = BrokerProcess(address, "--separator", ".").start()
        try:
            gw.wait_log("the broker's separator is '.'", timeout=15)
            assert closed_by_gateway(old)  # its pattern meant something else
            s = gw.connect()
            s.sendall(codec.authenticate(SECRET) + codec.publish(b"!.cred.0.0.1.x", b"no"))
            roundtrip(s)
            gw.wait_log("is a secret (!.) key")
        finally:
            dot.stop()
    finally:
        gw.stop()


@pytest.mark.parametrize("https_gw", [30.0], indirect=True)  # no answer while measured
def test_https_bodies_of_unauthenticated_requests_are_never_held(https_gw):
    pid = https_gw.proc.pid
    warm = https_gw.https()
    warm.sendall(_request(b"wrong", b"{}"))
    time.sleep(0.5)
    before = rss_kib(pid)
    head = (b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"X-Authentication-Key: guess\r\nContent-Length: 300000\r\n\r\n")
    conns = []
    for _ in range(100):  # each sends most of a 300 KB body and then waits
        s = https_gw.https()
        try:
            s.sendall(head + b"[" * 200_000)
        except OSError:
            pass  # answered and closed before the body was all sent: as it should be
        conns.append(s)
    time.sleep(1.0)
    growth_mib = (rss_kib(pid) - before) / 1024
    print(f"gateway RSS +{growth_mib:.1f} MiB with 100 unauthenticated HTTPS bodies")
    for s in conns:
        s.close()
    # 100 x 300 KB held would be +30 MiB; what stays is each held TLS connection's own
    # state, about 100 KB (9.6-12 MiB measured at 100 on this machine kind)
    assert growth_mib < 15, f"RSS grew by {growth_mib:.1f} MiB"


def test_a_broker_restart_under_remote_publishing_is_survived(hdir):
    """Remote publishers keep sending while the broker restarts: whichever task of the
    gateway notices first reconnects (one at a time, under the bridge's lock), the
    publishes meanwhile are counted as lost, and the bus is served again afterwards."""
    address = str(hdir / "restart.sock")
    broker = BrokerProcess(address).start()
    gw = start(hdir, broker, "--refusal-delay", "0.3")
    stop = threading.Event()

    def publisher() -> None:
        s = gw.connect()
        s.sendall(codec.authenticate(SECRET))
        frame = codec.publish(b"load/x", b"y" * 100)
        s.sendall(frame * 50)
        sending.release()  # once each: all three are publishing
        while not stop.is_set():
            try:
                s.sendall(frame * 50)
            except OSError:
                return
            time.sleep(0.001)

    sending = threading.Semaphore(0)
    threads = [threading.Thread(target=publisher, daemon=True) for _ in range(3)]
    sub = gw.connect()
    try:
        for t in threads:
            t.start()
        for _ in threads:
            assert sending.acquire(timeout=10), "a publisher sent nothing"
        broker.stop()
        time.sleep(0.3)  # the publishers go on against a gateway without a bus a while
        broker = BrokerProcess(address).start()
        gw.wait_log("connected to the bus at", timeout=30, times=2)
        local = raw(address)
        subscribe_bridged(sub, b"after/", local, b"after/probe")  # forwarding again
        local.close()
        assert gw.proc.poll() is None
        assert "Traceback" not in gw.log(), gw.log()
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        sub.close()
        gw.stop()
        broker.stop()


# -- fan-out to subscribers that never read ------------------------------------------------

def _count_numbered(s: socket.socket, stop: threading.Event, got: dict[int, float]) -> None:
    """Record when each numbered message ("<n> <sent at>") arrives on *s*."""
    decoder = codec.FrameDecoder()
    s.settimeout(0.2)
    while not stop.is_set():
        try:
            data = s.recv(1 << 20)
        except TimeoutError:
            continue
        if not data:
            return
        now = time.perf_counter()
        for f in decoder.feed(data):
            if type(f) is codec.Publish:
                n, sent = f.body.split(b" ", 2)[:2]
                got[int(n)] = now - float(sent)


def _prompt_reader(g: GatewayProcess, local: socket.socket,
                   stop: threading.Event) -> dict[int, float]:
    """A remote subscriber to ``bulk/`` that reads at once, in a thread until *stop*:
    when each numbered message came (`_count_numbered`)."""
    honest = g.connect()
    subscribe_bridged(honest, b"bulk/", local, b"bulk/probe")
    got: dict[int, float] = {}
    threading.Thread(target=_count_numbered, args=(honest, stop, got)).start()
    return got


def _missed(got: dict[int, float], first: int, last: int, timeout: float = 10) -> list[int]:
    """The numbers ``first .. last-1`` the prompt reader has not got, once it has all of
    them or *timeout* seconds have passed (the gateway under this load may lag the
    publisher; a loss stays a loss)."""
    deadline = time.monotonic() + timeout
    while (missed := [n for n in range(first, last) if n not in got]) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    return missed


def _publish_numbered(bus: BrokerProcess, stop: threading.Event, sent: list[int],
                      body: bytes, rate: float) -> None:
    """Publish numbered messages (``<n> 0 <body>``) on ``bulk/x`` at *rate* a second until
    *stop*; *sent*[0] counts them."""
    pub = raw(bus.address)
    pub.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    start_at = time.perf_counter()
    while not stop.is_set():
        pub.send(b"MSG bulk/x\0%d 0 " % sent[0] + body)
        sent[0] += 1
        time.sleep(max(0.0, start_at + sent[0] / rate - time.perf_counter()))
    pub.close()


@pytest.mark.alone  # latency against the wall clock
def test_subscribers_that_never_read_cost_little_and_stall_nobody(hdir, bus, local):
    """Finding A: 1,000 subscribers to everything from 4 addresses never read (4 KiB
    receive buffers); a local publisher sends 1,000 small messages a second for 3 s.  A
    prompt subscriber gets them all promptly and another client's keep-alives are
    echoed within the documented turn, give or take.  Before (one writer wake-up, task
    switch and write per message and client): the gateway fell seconds behind (honest
    median 1.1 s, max 2 s) and round trips stalled (p99 70 ms)."""
    g = start(hdir, bus)
    crowd = []
    stop = threading.Event()
    try:
        for _ in range(4):
            source = next_loopback()
            for _ in range(250):
                s = g.connect(rcvbuf=4096, source=source)
                s.sendall(codec.subscribe(b""))
                crowd.append(s)
        roundtrip(crowd[-1])
        got = _prompt_reader(g, local, stop)
        pinger = g.connect()
        trips: list[float] = []
        pings = threading.Thread(target=lambda: trips.extend(round_trips(pinger, 3.5)))
        pings.start()
        start_at = time.perf_counter()
        for n in range(3000):
            local.send(b"MSG bulk/x\0%d %.6f" % (n, time.perf_counter()))
            time.sleep(max(0.0, start_at + (n + 1) / 1000 - time.perf_counter()))
        sync(local)
        pings.join(10)
        deadline = time.monotonic() + 30  # (the numbers are printed, not only a timeout)
        while len(got) < 3000 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for s in crowd:
            s.close()
        g.stop()
    lat = sorted(got.values())
    q = statistics.quantiles(trips, n=100)
    print(f"honest: {len(got)} of 3000, latency median {statistics.median(lat) * 1e3:.1f} ms, "
          f"max {lat[-1] * 1e3:.0f} ms; round trips median {statistics.median(trips) * 1e3:.2f}"
          f" ms, p99 {q[98] * 1e3:.1f} ms, max {max(trips) * 1e3:.1f} ms")
    assert len(got) == 3000
    assert statistics.median(lat) < 0.100, f"median latency {statistics.median(lat):.3f} s"
    assert q[98] < 0.050, f"round trip p99 {q[98] * 1e3:.1f} ms"


def test_a_backlog_larger_than_one_write_reaches_a_prompt_reader(hdir, bus, local):
    """The gateway was not scheduled for a moment (a busy machine) while 1 MB came for a
    prompt reader: its batch queued more than one write takes, the write took all it was
    given, and the writer was not woken for the rest; later messages found the queue
    not empty and woke nobody either, so the client got nothing ever again (600 of 600
    lost in a CI run; found by a helper session, which made this reproduction)."""
    g = start(hdir, bus)
    stop = threading.Event()
    got: dict[int, float] = {}
    body = b"z" * 50_000
    try:
        honest = g.connect()
        subscribe_bridged(honest, b"bulk/", local, b"bulk/probe")
        reader = threading.Thread(target=_count_numbered, args=(honest, stop, got))
        reader.start()
        local.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        for n in range(200):  # the reader's socket buffers grow to take a big write
            local.send(b"MSG bulk/x\0%d 0 " % n + body)
            time.sleep(0.002)
        time.sleep(0.5)
        os.kill(g.proc.pid, signal.SIGSTOP)
        try:
            for n in range(200, 220):
                local.send(b"MSG bulk/x\0%d 0 " % n + body)
            time.sleep(0.2)
        finally:
            os.kill(g.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while len(got) < 220 and time.monotonic() < deadline:
            time.sleep(0.05)
        missing = [n for n in range(220) if n not in got]
        assert not missing, f"{len(missing)} of 220 never came, from {missing[0]}"
    finally:
        stop.set()
        g.stop()


@pytest.mark.alone  # 3.6 MB/s to 251 clients: beside Spark's tests the prompt reader
# missed 10-13 of 180 (CI under load, this tree and the one before alike)
def test_unwritten_ends_held_by_clients_that_never_read_do_not_keep_the_pool(hdir, bus,
                                                                             local):
    """One address's 250 subscribers that never read each held the unwritten end of a
    60 KB message (their sockets took part of it): ends charged to the pool that no
    eviction could take, so the 4 MiB pool stayed full and a prompt reader got nothing
    (300 of 300 lost in the audit).  A client whose socket took nothing for a second
    gives its place when it is needed: its connection ends, and the line says why."""
    g = start(hdir, bus, "--buffer-pool", "4m")
    crowd = []
    stop = threading.Event()
    sent = [0]

    def publish() -> None:  # 3.6 MB/s
        _publish_numbered(bus, stop, sent, b"z" * 60_000, 60)

    try:
        got = _prompt_reader(g, local, stop)
        source = next_loopback()
        for _ in range(250):
            s = g.connect(rcvbuf=4096, source=source)
            s.sendall(codec.subscribe(b""))
            crowd.append(s)
        publisher = threading.Thread(target=publish)
        publisher.start()
        time.sleep(2.5)
        first = sent[0]
        time.sleep(3.0)
        last = sent[0]
        missed = _missed(got, first, last)
        assert not missed, f"the prompt reader missed {len(missed)} of {last - first}"
        g.wait_log("it read nothing for 1 s and held the unwritten end of a message in "
                   "the full buffer pool (4194304 bytes)")
    finally:
        stop.set()
        for s in crowd:
            s.close()
        g.stop()


def test_a_full_buffer_pool_is_taken_from_the_heaviest_not_a_prompt_reader(hdir, bus, local):
    """Finding B: the subscribers to everything of 8 addresses never read and join one
    after another, so each holds other frames: together they fill the pool (4 MiB, 1 MiB
    an address).  A subscriber that reads promptly still gets every message: room is
    made from the addresses holding the most.  The loss is said while it happens, by
    its cause, and again at disconnect.  Before: the prompt reader lost every message
    while the pool was full, and only a disconnect line blamed its own buffer."""
    g = start(hdir, bus, "--buffer-pool", "4m", "--buffer-bytes-per-address", "1m")
    crowd = []
    stop = threading.Event()
    body = b"z" * 50_000
    sent = [0]

    def publish() -> None:  # 5 MB/s: a prompt reader may lag 50 ms (its fair part)
        _publish_numbered(bus, stop, sent, body, 100)

    try:
        got = _prompt_reader(g, local, stop)
        publisher = threading.Thread(target=publish)
        publisher.start()
        attackers = [next_loopback() for _ in range(8)]
        for source in attackers:
            for _ in range(2):
                s = g.connect(rcvbuf=4096, source=source)
                s.sendall(codec.subscribe(b""))
                crowd.append(s)
                time.sleep(0.15)  # ~15 messages later: other frames than the last one's
        time.sleep(1.0)
        first = sent[0]
        time.sleep(3.0)  # the pool full throughout
        last = sent[0]
        missed = _missed(got, first, last)
        print(f"prompt reader missed {len(missed)} of {last - first} with the pool full")
        assert not missed
        log = g.wait_log("the buffer pool full (4194304 bytes)", timeout=15)
        # (under load an address's second client may be let go before the line: 1 or 2)
        assert re.search(r"127\.\S+: \d+ messages discarded for its [12] client\(s\) "
                         r"in 10 s \(", log), log
    finally:
        stop.set()
        for s in crowd:
            s.close()
        g.stop()
    said = g.wait_log("messages were discarded for it (", times=16)
    assert re.search(r"messages were discarded for it \(.*the buffer pool full", said), said


def test_an_https_client_that_never_reads_its_answers_is_let_go(hdir, bus):
    """Publishes pipelined until the client's buffers are full, answers never read: the
    gateway lets it go after --idle-timeout (before: held for good, and each such
    connection kept a slot of its address)."""
    g = https_gateway(hdir, bus, "--idle-timeout", "2")
    try:
        s = g.https()
        s.settimeout(0.5)
        doc = json.dumps({"topic": "eC95", "body": ""}).encode()
        sent = 0
        try:
            while sent < 200_000:
                s.sendall(_request(SECRET, doc) * 50)
                sent += 50
        except (TimeoutError, ssl.SSLWantWriteError):
            pass
        mine = s.getsockname()[1]
        until(lambda: not gateway_side_open(mine, g.https_port), "the gateway let it go",
              timeout=15)
        s.close()
    finally:
        g.stop()


@pytest.mark.alone  # against the wall clock
def test_https_bodies_of_tiny_chunks_cost_their_size_and_stall_nobody(hdir, bus):
    """Ten connections of one address, each a body of 150,000 two-byte chunks: the
    gateway holds about the bodies' size (before: ~15 MB per connection, a bytes object
    per chunk) and another client's round trips stay prompt (before: p50 335 ms, all of a
    64 KiB read's chunks taken at once, the address's turns not taken)."""
    g = https_gateway(hdir, bus)
    honest = g.tls()
    roundtrip(honest)
    before = rss_kib(g.proc.pid)
    head = (b"POST /publish HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"X-Authentication-Key: " + SECRET + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    body = b"2\r\nab\r\n" * 150_000  # (not JSON: refused at its end, after the reading)
    conns = [g.https() for _ in range(10)]
    stop = threading.Event()
    peak = [0]

    def attack(c: ssl.SSLSocket) -> None:
        try:
            c.sendall(head + body)
        except OSError:
            pass

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss_kib(g.proc.pid))
            time.sleep(0.05)

    threads = [threading.Thread(target=attack, args=(c,), daemon=True) for c in conns]
    threads.append(threading.Thread(target=watch, daemon=True))
    try:
        for t in threads:
            t.start()
        loaded = round_trips(honest, 3.0)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for c in conns:
            c.close()
        g.stop()
    grew = (peak[0] - before) / 1024
    print(f"honest round trips: median {statistics.median(loaded) * 1e3:.2f} ms, max "
          f"{max(loaded) * 1e3:.1f} ms; the gateway grew {grew:.1f} MiB")
    # (this process's own ten sending threads take a share of its round trips' time:
    # 25 ms median here, against 377 ms and 42 MiB before, 2026-11-27)
    assert grew < 20, f"{grew:.1f} MiB for ten 1.05 MB bodies"
    assert statistics.median(loaded) < 0.100, f"median {statistics.median(loaded) * 1e3:.1f} ms"
    assert max(loaded) < 0.300, f"max {max(loaded) * 1e3:.1f} ms"


# -- the bus connection under churn -------------------------------------------------------

def _churn(pipe, port: int, source: str, topic: bytes | None) -> None:
    """Subscribe and unsubscribe *topic* (None: send keep-alives) as fast as the gateway
    reads, until told to stop; the echoes are read."""
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.settimeout(0.2)
    chunk = b"\x00" * 1000 if topic is None else \
        (codec.subscribe(topic) + codec.unsubscribe(topic)) * 500
    pipe.send("ready")
    while not pipe.poll():
        try:
            s.sendall(chunk)
            if topic is None:
                s.recv(1 << 16)
        except (TimeoutError, ConnectionError):
            pass
    s.close()


def _flood(pipe, address: str, key: bytes) -> None:
    s = raw(address)
    s.setblocking(False)
    pipe.send("ready")
    while not pipe.poll():
        try:
            s.send(b"MSG " + key + b"\0" + b"y" * 300)
        except BlockingIOError:
            time.sleep(0.001)
    s.close()


@pytest.mark.alone  # latency against the wall clock
def test_churn_beside_a_flood_neither_stalls_nor_starves_the_bus_connection(hdir):
    """Two unauthenticated clients churn subscriptions and two flood keep-alives (another
    user's processes) while a local user floods a key remote clients hold, into the
    gateway's full 64 KiB queue in the broker.  An honest subscriber gets every message,
    promptly (the audit of 2026-11-28, before the fixes):

    * each SUB's question gets a reply forced past that full queue, so the broker stops
      reading the gateway until it reads; the gateway's reader waited for its bus lock,
      held by a sender waiting for the broker to read: every remote client stalled for
      good (1 of 500 messages).  Now the reader takes what waits without the lock.
    * the bus connection had one batch of 32 packets per turn of the loop beside each
      busy client's 2 ms: keep-alive floods held the honest messages back behind the
      local flood, p50 134-146 ms (17-21 after, in the audit's script; here 58-74 ms
      before, 3-16 after).  Now it takes batches for 2 ms too."""
    from faultkit import NOBODY, as_user

    os.chmod(hdir, 0o755)
    bus = BrokerProcess(str(hdir / "bus.sock"), "--queue-limit", "64k", "--mode",
                        "666").start()
    gw = start(hdir, bus)
    local = raw(bus.address)
    kids = []
    try:
        sinks = [gw.connect(rcvbuf=2048) for _ in range(50)]  # hold the flooded key,
        for sink in sinks:  # read nothing
            sink.sendall(codec.subscribe(b"m/q"))
        honest = gw.connect()
        subscribe_bridged(honest, b"h/", local, b"h/probe")
        kids.append(as_user(NOBODY, _flood, bus.address, b"m/q"))
        for k in range(4):
            kids.append(as_user(NOBODY, _churn, gw.port, next_loopback(),
                                b"c/x%d" % k if k < 2 else None))
        for _, pipe in kids:
            assert pipe.poll(10) and pipe.recv() == "ready"
        time.sleep(1)
        count, late = 200, []
        decoder = FrameDecoder()

        def read() -> None:
            honest.settimeout(15)
            try:
                while len(late) < count:
                    chunk = honest.recv(1 << 16)
                    if not chunk:
                        return
                    now = time.monotonic()
                    late.extend(now - float(f.body) for f in decoder.feed(chunk)
                                if f.topic == b"h/n")
            except TimeoutError:
                pass

        reader = threading.Thread(target=read)
        reader.start()
        for _ in range(count):
            local.send(b"MSG h/n\0%r" % time.monotonic())
            time.sleep(0.005)
        reader.join(20)
        assert len(late) == count, f"{len(late)} of {count} honest messages"
        p50 = statistics.median(late)
        print(f"honest p50 {p50 * 1000:.1f} ms, max {max(late) * 1000:.1f} ms")
        assert p50 < 0.035, f"honest p50 {p50 * 1000:.1f} ms"
    finally:
        for proc, pipe in kids:
            pipe.send("stop")
            proc.join(5)
            if proc.is_alive():
                proc.kill()
        local.close()
        gw.stop()
        bus.stop()


def _questions_full(gw: GatewayProcess) -> socket.socket:
    """With the broker stopped: a client whose SUBs take every unanswered question the
    gateway allows (`bridge.QUESTIONS`), and more; the next new pattern's SUB waits."""
    from sbus.gateway.bridge import QUESTIONS

    filler = gw.connect()
    filler.sendall(b"".join(codec.subscribe(b"f/%d" % i) for i in range(QUESTIONS + 8)))
    time.sleep(0.3)
    return filler


def test_a_subscription_that_waited_for_the_bus_and_lost_its_client_is_still_made(hdir):
    """The broker stopped (SIGSTOP): the gateway's SUB questions go unanswered, and past
    `bridge.QUESTIONS` a new pattern's SUB waits (its client's reader with it).  The client
    that asked first is let go meanwhile (its idle timeout) while another holds the same
    pattern: the SUB is still made once the broker answers, and the other client gets its
    messages."""
    bus = BrokerProcess(str(hdir / "bus.sock")).start()
    gw = start(hdir, bus, "--idle-timeout", "1")
    local = raw(bus.address)
    try:
        bus.proc.send_signal(signal.SIGSTOP)
        try:
            filler = _questions_full(gw)
            first = gw.connect()
            first.sendall(codec.subscribe(b"p/") + codec.keepalive())
            first.settimeout(0.3)
            with pytest.raises(TimeoutError):  # its SUB waits for room, its reader too
                first.recv(1)
            second = gw.connect()
            second.sendall(codec.subscribe(b"p/"))
            roundtrip(second)  # (the pattern is held already: nothing to wait for)
            for _ in range(6):  # the first is let go; the second stays
                time.sleep(0.3)
                roundtrip(second)
            assert closed_by_gateway(first, timeout=1)
        finally:
            bus.proc.send_signal(signal.SIGCONT)
        second.settimeout(0.2)
        decoder, frames = FrameDecoder(), []
        deadline = time.monotonic() + 10  # (the broker and the gateway catch up: CI, loaded)
        while codec.Publish(b"p/x", b"here") not in frames:
            if time.monotonic() > deadline:
                raise AssertionError(f"the pattern never reached the bus; the second client "
                                     f"got {frames[-5:]!r:.600}; the gateway's log ends "
                                     f"{gw.log()[-1500:]!r}")
            local.send(b"MSG p/x\0here")
            second.sendall(codec.keepalive())  # (it stays; the echoes are read below)
            try:
                frames += decoder.feed(second.recv(1 << 16))
            except TimeoutError:
                continue
        filler.close()
    finally:
        local.close()
        gw.stop()
        bus.stop()


def test_a_pattern_given_up_and_subscribed_again_is_held_once_on_the_bus(hdir):
    """The same stopped broker: the first client to subscribe ``p/`` is let go while its
    SUB waits; another then subscribes ``p/`` anew and waits too.  When the broker answers,
    the bus gets ``p/`` once (the reader sets it right; the waiting SUB finds it made), so
    one UNSUB leaves nothing behind (before: made twice, and the broker kept routing
    ``p/`` to the gateway for nobody, charged to its user: the audit of 2026-11-28)."""
    import json

    bus = BrokerProcess(str(hdir / "bus.sock")).start()
    gw = start(hdir, bus, "--idle-timeout", "2")
    local = raw(bus.address)

    def held_on_bus() -> list[str]:
        out = subprocess.run([*SBUS, "status", "--json", "--address", bus.address],
                             capture_output=True, text=True, timeout=30).stdout
        return [p for c in json.loads(out)["clients"] if c.get("pid") == gw.proc.pid
                for p in c.get("patterns") or [] if p.startswith("p/")]

    try:
        bus.proc.send_signal(signal.SIGSTOP)
        try:
            filler = _questions_full(gw)
            first = gw.connect()
            first.sendall(codec.subscribe(b"p/"))  # waits, and is let go (idle)
            assert closed_by_gateway(first, timeout=4)
            again = gw.connect()
            again.sendall(codec.subscribe(b"p/") + codec.keepalive())  # waits too
            time.sleep(0.3)
        finally:
            bus.proc.send_signal(signal.SIGCONT)
        roundtrip_deadline = time.monotonic() + 1.5
        again.settimeout(1.5)
        assert again.recv(1) == b"\x00" and time.monotonic() < roundtrip_deadline
        assert held_on_bus() == ["p/"]
        again.sendall(codec.unsubscribe(b"p/"))
        roundtrip(again)
        time.sleep(0.3)
        assert held_on_bus() == []
        again.close()
        filler.close()
    finally:
        local.close()
        gw.stop()
        bus.stop()
