"""The bridge against an MQTT peer that says or sends what a broker should not: a small
Maximum Packet Size learnt only after exports were taken, a packet far over the size
the bridge announced, a PUBLISH at QoS 2 it never asked for.  The peer is played here
on a real TCP socket (what mosquitto would never do is the point); the bridge and the
bus are real processes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from conftest import BrokerProcess
from mqtt_hosts import Bridge
from test_bridge import publish
from test_bridge_shell import mqtt_packets

from sbus.bridge.buffered import remaining_length

#: CONNACK, success, no properties (MQTT 5 section 3.2).
CONNACK = bytes([0x20, 3, 0, 0, 0])


def connack_with_limit(limit: int) -> bytes:
    """CONNACK, success, with a Maximum Packet Size (property 0x27)."""
    return bytes([0x20, 8, 0, 0, 5, 0x27]) + limit.to_bytes(4, "big")


def listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(15)
    return server


def accept_connect(server: socket.socket) -> tuple[socket.socket, bytearray]:
    conn, _ = server.accept()
    buffer = bytearray()
    packets = mqtt_packets(conn, buffer, time.monotonic() + 5, want=1)
    assert packets and packets[0][0] == 0x10, "no CONNECT"
    return conn, buffer


def test_exports_held_while_mqtt_was_away_that_are_over_its_limit_are_refused_once(
        broker: BrokerProcess, short_tmp: Path) -> None:
    """Exports taken while MQTT is away are checked against the broker's limit only
    once its CONNACK says what it is: one over it was sent on every connect, and the
    broker closed each (32 connects in 12 s in the audit, the 19 others stuck behind
    it, also across restarts, since it is in the spool).  Now it is refused, counted
    and said, and the others go."""
    server = listener()
    br = Bridge(short_tmp, "limit", broker.address,
                f"mqtt://127.0.0.1:{server.getsockname()[1]}",
                ["--export", "out/", "--export-qos", "1"])
    try:
        br.start(wait=False)
        conn, _ = accept_connect(server)
        conn.close()  # gone before its CONNACK: MQTT is away
        br.wait_status(lambda s: s.startswith("bus up, mqtt down"))
        publish(broker.address, [(b"out/big" if i == 5 else b"out/%d" % i,
                                  b"x" * (3000 if i == 5 else 10)) for i in range(20)])
        br.wait_counters(lambda c: c["exported"] == 20)
        conn, buffer = accept_connect(server)
        conn.sendall(connack_with_limit(2000))
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < 19 and time.monotonic() < deadline:
            got += [p for p in mqtt_packets(conn, buffer, time.monotonic() + 0.1)
                    if p[0] >> 4 == 3]
        assert len(got) == 19 and max(map(len, got)) <= 2000, [len(p) for p in got]
        assert b"out/big" not in b"".join(got)
        counters = br.wait_counters(lambda c: c["refused"] == 1)
        assert counters["exported"] == 20
        assert "over the broker's maximum packet size of 2000" in br.log.read_text()
        server.settimeout(1.0)
        try:
            server.accept()[0].close()
            raise AssertionError("the bridge connected again: its connection was ended")
        except TimeoutError:
            pass
        conn.close()
    finally:
        br.close()
        server.close()


def _hostile(broker: BrokerProcess, short_tmp: Path, name: str, send) -> Bridge:
    """A bridge importing ``in/`` from a peer that accepts it, then *send*(conn)."""
    server = listener()
    br = Bridge(short_tmp, name, broker.address, f"mqtt://127.0.0.1:{server.getsockname()[1]}",
                ["--import", "in/"])
    try:
        br.start(wait=False)
        conn, buffer = accept_connect(server)
        conn.sendall(CONNACK)
        (subscribe,) = mqtt_packets(conn, buffer, time.monotonic() + 5, want=1)[:1]
        assert subscribe[0] == 0x82
        at = 2 + (subscribe[1] >> 7)  # its packet identifier, after the length
        conn.sendall(bytes([0x90, 4]) + subscribe[at:at + 2] + b"\x00\x01")  # SUBACK
        br.wait_status(lambda s: s.startswith("bus up, mqtt up"))
        send(conn)
        conn.close()
        return br
    except BaseException:
        br.close()
        raise
    finally:
        server.close()


def test_a_packet_over_the_announced_size_ends_the_connection_before_it_is_held(
        broker: BrokerProcess, short_tmp: Path) -> None:
    """The bridge announces a Maximum Packet Size (``--max-message`` + 1 KiB) and read
    a 200 MB packet whole anyway (651 MB of memory in the audit).  Now the connection
    ends once its length is known: the peer cannot send 20 MB of it, the bridge's
    memory stays small, and the line says why."""
    sent = 0

    def send(conn: socket.socket) -> None:
        nonlocal sent
        size = 200 << 20
        conn.sendall(bytes([0x30]) + remaining_length(size) + b"\x00\x04in/x\x00")
        chunk = bytes(1 << 20)
        conn.settimeout(5)
        try:
            while sent < 20 << 20:
                conn.sendall(chunk)
                sent += len(chunk)
        except (ConnectionResetError, BrokenPipeError, TimeoutError):
            pass

    br = _hostile(broker, short_tmp, "huge", send)
    try:
        assert sent < 20 << 20, "the bridge read on into the packet"
        counters = br.wait_counters(lambda c: c["refused"] == 1)
        assert counters["imported"] == 0
        assert "a packet of 209715205 bytes, over the maximum" in br.log.read_text()
        assert br.proc is not None and br.proc.poll() is None
        peak = next(line for line in Path(f"/proc/{br.proc.pid}/status").read_text()
                    .splitlines() if line.startswith("VmHWM:"))
        assert int(peak.split()[1]) < 150_000, peak  # kB: the process, not the packet
    finally:
        br.close()


def test_a_publish_at_qos2_ends_the_connection_instead_of_waiting_in_memory(
        broker: BrokerProcess, short_tmp: Path) -> None:
    """The bridge subscribes at QoS 1 at most; paho kept each QoS 2 PUBLISH until a
    PUBREL that a hostile peer never sends (3,000 of 100 KB: 340 MB in the audit)."""
    def send(conn: socket.socket) -> None:
        body = b"\x00\x04in/x" + b"\x00\x07" + b"\x00" + b"q" * 100
        conn.sendall(bytes([0x34]) + remaining_length(len(body)) + body)
        conn.settimeout(5)
        try:
            while conn.recv(4096):
                pass
        except (ConnectionResetError, TimeoutError):
            pass

    br = _hostile(broker, short_tmp, "qos2", send)
    try:
        counters = br.wait_counters(lambda c: c["refused"] == 1)
        assert counters["imported"] == 0
        assert "a PUBLISH at QoS 2, which the bridge never asks for" in br.log.read_text()
    finally:
        br.close()


def test_a_spooled_record_no_broker_takes_is_dropped_and_said_at_start(
        broker: BrokerProcess, short_tmp: Path) -> None:
    """A damaged spool record whose topic MQTT cannot carry (a wildcard, here) ended
    the bridge with a traceback at every start (paho's ``publish`` raised); now it is
    dropped, counted and said, and the records around it are sent."""
    from sbus.bridge.spool import Spool

    server = listener()
    br = Bridge(short_tmp, "damaged", broker.address,
                f"mqtt://127.0.0.1:{server.getsockname()[1]}",
                ["--export", "out/", "--export-qos", "1"])
    state = Path(br.state_dir)
    state.mkdir(mode=0o700)
    spool = Spool(state, 100, 1 << 20)
    spool.load()
    spool.append([(b"out/0", b"a"), (b"out/+", b"b"), (b"out/2", b"c")])
    spool.close()
    try:
        br.start(wait=False)
        conn, buffer = accept_connect(server)
        conn.sendall(CONNACK)
        got: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += [p for p in mqtt_packets(conn, buffer, time.monotonic() + 0.1)
                    if p[0] >> 4 == 3]
        assert [p[4:9] for p in got] == [b"out/0", b"out/2"]
        counters = br.wait_counters(lambda c: c["dropped"] == 1)
        assert counters["resent"] == 2
        log = br.log.read_text()
        assert "1 records (the first numbered 1) have a topic no MQTT broker takes" in log
        assert "Traceback" not in log
        conn.close()
    finally:
        br.close()
        server.close()
