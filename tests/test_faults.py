"""Faults injected into a real broker: kill -9 under load, dying subscribers, fd exhaustion,
junk packets and disconnect storms.  Each test asserts that the rest of the bus is unharmed.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

from conftest import raw, sync, wait_for_socket
from faultkit import SBUS, HeldSocket, broker_clients, open_fds, served, until

SEQ = struct.Struct("!Q")


# -- kill -9 under load, with the listening socket held (socket activation) ------------------

class Reconnecting:
    """A raw client that reconnects whenever the broker goes away, counting what it sees."""

    def __init__(self, address: str, setup: list[bytes]) -> None:
        self.address = address
        self.setup = setup
        self.refused = 0
        self.reconnects = 0
        self.sock = self._connect()

    def _connect(self) -> socket.socket:
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(5)
            try:
                s.connect(self.address)
            except ConnectionRefusedError:
                self.refused += 1
                s.close()
                time.sleep(0.01)
                continue
            for packet in self.setup:
                s.send(packet)
            return s

    def reconnect(self) -> None:
        self.sock.close()
        self.reconnects += 1
        self.sock = self._connect()


def test_kill_9_under_load_with_socket_activation(short_tmp) -> None:
    """Three kill -9s while a publisher floods: clients reconnect, never refused, and the
    next broker (started on the same held socket) serves them, including clients that
    connected while no broker ran."""
    held = HeldSocket(short_tmp)
    held.start()
    stop = threading.Event()
    generations_seen: set[int] = set()
    errors: list[BaseException] = []
    pub = Reconnecting(held.address, [])
    sub = Reconnecting(held.address, [b"SUB load/"])
    sent = [0]

    def publish() -> None:
        generation = 0
        try:
            while not stop.is_set():
                try:
                    for _ in range(50):
                        pub.sock.send(b"MSG load/x\0" + SEQ.pack(generation))
                        sent[0] += 1
                    time.sleep(0.0005)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    pub.reconnect()
                    generation += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def receive() -> None:
        try:
            while not stop.is_set():
                try:
                    p = sub.sock.recv(1 << 16)
                except TimeoutError:
                    continue
                except ConnectionResetError:
                    p = b""
                if not p:
                    sub.reconnect()
                elif p.startswith(b"MSG load/x\0"):
                    generations_seen.add(SEQ.unpack(p[-8:])[0])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=publish), threading.Thread(target=receive)]
    for t in threads:
        t.start()
    kills = 3
    try:
        for n in range(kills):
            # the load flows through this broker: its generation reached the subscriber
            until(lambda n=n: any(g >= n for g in generations_seen), f"generation {n} delivered")
            assert held.proc.poll() is None
            held.kill()
            # while no broker runs, a new client connects: it waits in the backlog
            waiting = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            waiting.connect(held.address)  # would raise ConnectionRefusedError without the hold
            waiting.send(b"CMSG !/cred/whoami")
            # and the flooding clients have found the broker gone and connected again
            until(lambda n=n: min(pub.reconnects, sub.reconnects) > n, "clients reconnecting")
            held.start()
            assert served(waiting, timeout=5), f"restart {n + 1}: queued client not served"
            waiting.close()
        deadline = time.monotonic() + 10
        while kills not in generations_seen and time.monotonic() < deadline:
            time.sleep(0.05)
        until(lambda: sent[0] > 1000, "a flood through the brokers")  # not a trickle
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        held.stop()
    assert not errors, errors
    assert pub.refused == 0 and sub.refused == 0, "a client was refused during a restart"
    assert pub.reconnects >= kills and sub.reconnects >= kills
    assert set(range(kills + 1)) <= generations_seen, \
        f"subscriber saw publisher generations {sorted(generations_seen)}"
    assert "Traceback" not in held.log_text()
    assert sent[0] > 1000


def test_systemd_socket_activate_passes_the_socket(short_tmp) -> None:
    """The real systemd-socket-activate tool hands the broker its socket (one run)."""
    tool = "/usr/bin/systemd-socket-activate"
    assert os.path.exists(tool), "systemd-socket-activate missing (tools/setup.sh installs systemd)"
    address = str(short_tmp / "act.sock")
    env = {k: v for k, v in os.environ.items() if k != "SBUS_ADDRESS"}
    proc = subprocess.Popen([tool, "--seqpacket", "-l", address, *SBUS, "serve"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_socket(address, proc)
        a, b = raw(address), raw(address)
        a.send(b"SUB act/")
        sync(a)
        b.send(b"MSG act/1\0hello")
        assert a.recv(100) == b"MSG act/1\0hello"
        proc.send_signal(signal.SIGKILL)
        proc.wait(5)
        assert a.recv(100) == b"", "clients see EOF when the broker dies"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# -- subscribers killed mid-fanout -----------------------------------------------------------

VICTIM = r"""
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
for packet in sys.argv[2:]:
    s.send(packet.encode())
s.send(b"CMSG !/cred/whoami")
while not s.recv(1 << 20).startswith(b"CMSG !/cred/whoami"):
    pass
print("ready", flush=True)
while True:          # read slowly, or (with 'never') not at all
    time.sleep(0.01)
    if "never" not in sys.argv:
        s.recv(1 << 20)
"""

N_FANOUT = 20_000


def test_subscriber_killed_mid_fanout(broker) -> None:
    """Victims that read slowly, never, or asked to block the publisher are kill -9ed while
    the publisher floods; the healthy subscribers get every message in order and the
    publisher blocked by a victim is released."""
    victims = []
    for policy in (["SUB fan/"], ["SUB fan/", "never"], ["CMSG blocking/soft/block", "SUB fan/"],
                   ["CMSG blocking/hard/block", "SUB fan/", "never"]):
        p = subprocess.Popen([sys.executable, "-c", VICTIM, broker.address, *policy],
                             stdout=subprocess.PIPE, text=True)
        victims.append(p)
    for p in victims:
        assert p.stdout.readline().strip() == "ready"
    healthy = [raw(broker.address, timeout=20) for _ in range(2)]
    for h in healthy:
        h.send(b"SUB fan/")
        sync(h)
    got: dict[int, list[int]] = {i: [] for i in range(len(healthy))}

    def read(i: int) -> None:
        while len(got[i]) < N_FANOUT:
            p = healthy[i].recv(1 << 16)
            assert p.startswith(b"MSG fan/"), p[:40]
            got[i].append(SEQ.unpack(p[-8:])[0])

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(healthy))]
    for t in readers:
        t.start()
    pub = raw(broker.address, timeout=30)
    sent = [0]

    def kill_victims() -> None:
        until(lambda: any(c["publishers_paused"] for c in broker_clients(broker.address)),
              "the blocking victims holding the publisher back", timeout=30)
        sent.append(sent[0])
        for p in victims:
            p.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_victims)
    killer.start()
    for seq in range(N_FANOUT):
        pub.send(b"MSG fan/k\0" + b"p" * 48 + SEQ.pack(seq))
        sent[0] = seq + 1
    killer.join()
    assert sent[1] < N_FANOUT, "the blocking victims never held the publisher back"
    for t in readers:
        t.join(30)
    for p in victims:
        p.wait(5)
    for i in got:
        assert got[i] == list(range(N_FANOUT)), f"healthy subscriber {i} missed or reordered"
    sync(pub)
    log = broker.log()
    assert "Traceback" not in log


# -- file descriptor exhaustion --------------------------------------------------------------

NOFILE = 48


def fd_starved(directory, notify: bool) -> HeldSocket:
    """A broker whose RLIMIT_NOFILE is tiny (as by ``ulimit -n 48``)."""
    held = HeldSocket(directory, nofile=NOFILE, notify=notify)
    held.start()
    return held


def _fill(address: str, n: int) -> tuple[list[socket.socket], list[socket.socket]]:
    """Connect n clients; split them into the served and the not served (within 1 s each)."""
    ok, not_ok = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(address)
        (ok if served(s, timeout=1 if not not_ok else 0.2) else not_ok).append(s)
    return ok, not_ok


def _at_the_limit_existing_clients_are_served(held: HeldSocket) -> None:
    ok, not_ok = _fill(held.address, NOFILE + 10)
    assert 10 < len(ok) < NOFILE and not_ok, (len(ok), len(not_ok))
    assert open_fds(held.proc.pid) >= NOFILE - 2, "the broker should be at its fd limit"
    if held.use_notify:  # stay at the limit past a STATUS= report (every 2 s), which
        # cannot get a descriptor for its datagram here
        deadline = time.monotonic() + 5
        while "cannot notify the service manager" not in held.log_text():
            assert time.monotonic() < deadline, "no STATUS= report tried at the limit"
            time.sleep(0.05)
    assert held.proc.poll() is None, f"broker died at the fd limit: {held.log_text()[-1500:]}"
    # existing clients keep being served at the limit: subscribe, publish, fan out
    for s in ok:
        s.send(b"SUB fd/")
    for s in ok:
        sync(s)
    ok[0].send(b"MSG fd/x\0at the limit")
    for s in ok:
        assert s.recv(100) == b"MSG fd/x\0at the limit"
    # once clients leave, new ones are served again
    for s in not_ok + ok[:5]:
        s.close()
    fresh = raw(held.address)  # waits in the backlog until the broker has a descriptor
    assert served(fresh, timeout=5), "no recovery after clients left"
    ok[5].send(b"MSG fd/y\0after")
    for s in ok[5:]:
        assert s.recv(100) == b"MSG fd/y\0after"
    assert held.proc.poll() is None
    assert "Traceback" not in held.log_text()


def test_fd_exhaustion_keeps_serving_existing_clients(short_tmp) -> None:
    held = fd_starved(short_tmp, notify=False)
    try:
        _at_the_limit_existing_clients_are_served(held)
    finally:
        held.stop()


def test_fd_exhaustion_under_systemd_notify_keeps_serving(short_tmp) -> None:
    held = fd_starved(short_tmp, notify=True)
    try:
        _at_the_limit_existing_clients_are_served(held)
    finally:
        held.stop()


def test_fd_exhaustion_refuses_new_clients_promptly(short_tmp) -> None:
    """A client the broker has no descriptor for must be told (EOF), not left hanging."""
    held = fd_starved(short_tmp, notify=False)
    try:
        ok, not_ok = _fill(held.address, NOFILE + 3)
        assert ok
        late = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        late.connect(held.address)
        assert served(late, timeout=2) is False, "a client beyond the fd limit was left hanging"
    finally:
        held.stop()


def test_fd_exhaustion_does_not_flood_the_log(short_tmp) -> None:
    """While at the limit the broker retries accept(); it must not log every retry."""
    held = fd_starved(short_tmp, notify=False)
    try:
        ok, not_ok = _fill(held.address, NOFILE + 3)
        assert not_ok
        time.sleep(2)
        complaints = held.log_text().count("out of file descriptors")
        assert complaints <= 5, f"{complaints} log lines in 2 s about the same exhaustion"
    finally:
        held.stop()


# -- junk packets and disconnect storms ----------------------------------------------------------

def test_junk_packets_from_a_hostile_client(broker) -> None:
    """Random bytes, empty and oversized packets: the offender is ignored or dropped,
    a well-behaved pair keeps talking, and the broker stays up."""
    a, b = raw(broker.address), raw(broker.address)
    a.send(b"SUB ok/")
    sync(a)
    rng = random.Random(5)
    for round_ in range(20):
        evil = raw(broker.address)
        evil.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        try:
            for _ in range(50):
                kind = rng.random()
                if kind < 0.05:
                    junk = b"MSG ok/x\0" + b"z" * 300_000  # over the 256 KiB limit
                elif kind < 0.1:
                    junk = b""
                elif kind < 0.3:
                    junk = rng.choice([b"SUB ", b"UNSUB ", b"MSG ", b"CMSG "]) + rng.randbytes(20)
                else:
                    junk = rng.randbytes(rng.randint(1, 200))
                evil.send(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # disconnecting the offender is allowed
        b.send(b"MSG ok/%d\0fine" % round_)
        assert a.recv(100) == b"MSG ok/%d\0fine" % round_
        evil.close()
    # nothing the junk sent reached the subscriber (oversized was ignored, not forwarded)
    a.settimeout(0.3)
    try:
        extra = a.recv(1 << 20)
    except TimeoutError:
        extra = None
    assert extra is None or not extra.startswith(b"MSG ok/x\0zzz"), "oversized packet forwarded"
    assert "Traceback" not in broker.log()


STORMER = r"""
import os, socket, sys
addr, n = sys.argv[1], int(sys.argv[2])
socks = []
for i in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(addr)
    s.send(b"SUB storm/")
    s.send(b"SUB storm/")
    s.send(b"MSG storm/x\0" + os.urandom(64))
    socks.append(s)
os._exit(0)   # abrupt: every connection dies at once, unread packets and all
"""


def test_disconnect_storm_leaks_nothing(short_tmp) -> None:
    """Waves of clients that subscribe, publish and vanish at once: a steady client is
    unaffected, and the broker's descriptors and subscriptions return to baseline."""
    broker = HeldSocket(short_tmp)
    broker.start()
    try:
        _storm(broker)
    finally:
        broker.stop()


def _storm(broker: HeldSocket) -> None:
    steady, listener = raw(broker.address), raw(broker.address, timeout=10)
    listener.send(b"SUB storm/")
    sync(listener)
    sync(steady)
    pid = broker.proc.pid
    baseline = open_fds(pid)
    procs = [subprocess.Popen([sys.executable, "-c", STORMER, broker.address, "150"])
             for _ in range(4)]
    for p in procs:
        assert p.wait(30) == 0
    for wave in range(3):
        steady.send(b"MSG storm/steady\0%d" % wave)
    seen = []
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        p = listener.recv(1 << 16)
        if p.startswith(b"MSG storm/steady\0"):
            seen.append(p)
    assert seen == [b"MSG storm/steady\0%d" % w for w in range(3)]
    deadline = time.monotonic() + 10
    while open_fds(pid) > baseline and time.monotonic() < deadline:  # may dip below
        time.sleep(0.05)
    assert open_fds(pid) <= baseline, "descriptors leaked after the storm"
    # the broker's own account (systemd STATUS=): only the two steady clients remain
    broker.status(lambda s: s.startswith("2 clients, 1 subscriptions"))
    assert "Traceback" not in broker.log_text()

