"""The bridge's shell on the anyio loop: the bus connection is the client library's (the
first one too), and nothing blocks the loop (paho's connect runs in a worker thread)."""

from __future__ import annotations

import functools
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from conftest import BrokerProcess
from mqtt_hosts import Bridge, Hosts, Peer
from test_bridge import publish

from sbus.client import AsyncClient, ConnectError
from sbus.session import Backoff


def test_async_open_retry_waits_for_a_broker_not_there_yet(short_tmp: Path) -> None:
    """``AsyncClient.open(retry=True)``: no broker yet is waited for by the reconnect
    driver (said once through *on_connection*), then the connection works; without
    *retry* it is the one clear `ConnectError`."""
    address = str(short_tmp / "bus.sock")
    b = BrokerProcess(address)
    said: list[tuple[bool, str]] = []

    async def main() -> bytes:
        with pytest.raises(ConnectError):
            await AsyncClient(address).open()
        bus = AsyncClient(address, reconnect=True, backoff=Backoff(0.02, 0.1),
                          on_connection=lambda up, line: said.append((up, line)))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(bus.open, retry=True))
            while not said:
                await trio.sleep(0.01)
            await trio.sleep(0.2)  # a few attempts fail meanwhile
            await trio.to_thread.run_sync(b.start)
        await bus.subscribe("x/y")
        await bus.publish("x/y", b"1")
        got = await bus.receive()
        await bus.aclose()
        return got.payload

    try:
        assert trio.run(main) == b"1"
    finally:
        if b.proc is not None:
            b.stop()
    assert [up for up, _ in said] == [False, True]
    assert "cannot be reached yet" in said[0][1]


@pytest.fixture
def one_host() -> Iterator[Hosts]:
    h = Hosts(1)
    yield h
    h.close()


def test_a_bridge_started_before_its_bus_waits_for_it(one_host: Hosts) -> None:
    """The first connection to the bus failing is waited for as a lost one is (the
    client's reconnect driver, no code of the bridge's own): STATUS= says ``bus down``,
    then the bus comes, and exports flow."""
    h = one_host
    br = Bridge(h.tmp, "early", h.bus_address(0), h.url(0),
                ["--client-id", "early", "--export", "seq/"], netns=h.names[0])
    h.bridges.append(br)
    br.start(wait=False)
    br.wait_status(lambda s: s.startswith("bus down"))
    peer = Peer(h.mosquitto.sock, ["seq/#"])
    try:
        h.start_bus(0)
        br.wait_status(lambda s: s.startswith("bus up, mqtt up"))
        publish(h.bus_address(0), [("seq/x", b"%d" % i) for i in range(10)])
        br.wait_counters(lambda c: c["exported"] == 10 and c["spooled"] == 0)
        deadline = time.monotonic() + 10
        while len(peer.got) < 10:
            assert time.monotonic() < deadline, peer.got
            time.sleep(0.02)
        assert [p for _, p, _ in peer.got] == [b"%d" % i for i in range(10)]
    finally:
        peer.close()
    assert br.log.read_text().count("cannot be reached yet") == 1


def test_a_hanging_mqtt_connect_blocks_nothing(broker: BrokerProcess, short_tmp: Path) -> None:
    """paho's connect blocks (here: a listener whose queue is full drops the SYN, for
    paho's 5 s connect timeout): the loop goes on meanwhile, STATUS= says the bus is up,
    and SIGTERM ends the bridge at once."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(2):  # the accept queue full: further SYNs are dropped
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(server.getsockname())
        fillers.append(s)
    br = Bridge(short_tmp, "hang", broker.address,
                f"mqtt://127.0.0.1:{server.getsockname()[1]}", ["--export", "a/"])
    try:
        br.start(wait=False)
        br.wait_status(lambda s: s.startswith("bus up, mqtt down"), timeout=10)
        # the connect ends (paho's 5 s timeout) with a line in the log: not yet
        assert "cannot reach the MQTT broker" not in br.log.read_text(), \
            "STATUS= waited for the MQTT connect"
        assert br.proc is not None
        stopping = time.monotonic()
        br.proc.send_signal(signal.SIGTERM)
        assert br.proc.wait(10) == 0
        assert time.monotonic() - stopping < 2, "SIGTERM waited for the MQTT connect"
        assert "Traceback" not in br.log.read_text()
    finally:
        br.close()
        for s in fillers:
            s.close()
        server.close()


def mqtt_packets(conn: socket.socket, buffer: bytearray, until_time: float,
                 want: int = 0) -> list[bytes]:
    """Whole MQTT packets read from *conn* until *until_time*, or until *want* of them
    came (first byte: type and flags; then the remaining length as a variable-length
    integer)."""
    packets = []
    while True:
        while len(buffer) >= 2:
            size, shift, at = 0, 0, 1
            while at < len(buffer) and buffer[at] & 0x80:
                size |= (buffer[at] & 0x7F) << shift
                shift, at = shift + 7, at + 1
            if at >= len(buffer):
                break
            size |= buffer[at] << shift
            if len(buffer) < at + 1 + size:
                break
            packets.append(bytes(buffer[:at + 1 + size]))
            del buffer[:at + 1 + size]
        left = until_time - time.monotonic()
        if left <= 0 or want and len(packets) >= want:
            return packets
        conn.settimeout(left)
        try:
            data = conn.recv(65536)
        except TimeoutError:
            return packets
        if not data:
            return packets
        buffer += data


def test_exports_keep_within_the_brokers_receive_maximum(broker: BrokerProcess,
                                                        short_tmp: Path) -> None:
    """MQTT 5 forbids more unacknowledged QoS 1 messages than the broker's Receive Maximum
    (mosquitto announces 20 by default, and does not enforce it, so a peer that does is
    played here: CONNACK with Receive Maximum 3, PUBACKs held back).  The bridge sends 3,
    then one more for each acknowledgement, and all 10 in the end."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    br = Bridge(short_tmp, "rmax", broker.address,
                f"mqtt://127.0.0.1:{server.getsockname()[1]}",
                ["--export", "rm/", "--export-qos", "1"])
    try:
        br.start(wait=False)
        server.settimeout(10)
        conn, _ = server.accept()
        buffer = bytearray()
        (connect,) = mqtt_packets(conn, buffer, time.monotonic() + 5, want=1)[:1]
        assert connect[0] == 0x10
        conn.sendall(bytes([0x20, 6, 0, 0, 3, 0x21, 0, 3]))  # CONNACK: Receive Maximum 3
        br.wait_status(lambda s: s.startswith("bus up, mqtt up"), timeout=10)
        publish(broker.address, [(b"rm/%d" % i, b"m%d" % i) for i in range(10)])

        def publishes(want: int) -> list[bytes]:  # *want* PUBLISH, then 0.3 s of no more
            got: list[bytes] = []
            deadline = time.monotonic() + 10
            while len(got) < want and time.monotonic() < deadline:
                got += [p for p in mqtt_packets(conn, buffer, time.monotonic() + 0.05)
                        if p[0] >> 4 == 3]
            return got + [p for p in mqtt_packets(conn, buffer, time.monotonic() + 0.3)
                          if p[0] >> 4 == 3]

        sent = publishes(3)
        assert len(sent) == 3, f"{len(sent)} unacknowledged, the broker takes 3"
        total = 3
        while total < 10:
            for p in sent:  # PUBACK each: its packet identifier follows the topic
                at = 2 + (p[1] >> 7)  # a short packet: one or two length bytes
                topic_length = int.from_bytes(p[at:at + 2], "big")
                conn.sendall(bytes([0x40, 2]) + p[at + 2 + topic_length:at + 4 + topic_length])
            sent = publishes(min(3, 10 - total))
            assert len(sent) == min(3, 10 - total), len(sent)
            total += len(sent)
        assert total == 10
        assert "takes at most 3 unacknowledged messages" in br.log.read_text()
        conn.close()
    finally:
        br.close()
        server.close()


def test_async_receive_ready_never_waits_and_leaves_a_loss_to_receive_batch(
        short_tmp: Path) -> None:
    """``AsyncClient.receive_ready``: what waits, [] when nothing does or the broker went
    (no reconnect there: ``receive_batch`` reconnects, and the session's subscription is
    in force again)."""
    address = str(short_tmp / "bus.sock")
    b = BrokerProcess(address).start()

    async def main() -> None:
        bus = AsyncClient(address, reconnect=True, backoff=Backoff(0.02, 0.1),
                          on_connection=lambda up, line: None)
        await bus.open()
        await bus.subscribe("r/x")
        assert bus.receive_ready() == []
        await bus.publish("r/x", b"1")
        await bus.sync()  # the message is on its way back before the answer
        assert [e.payload for e in bus.receive_ready()] == [b"1"]
        await trio.to_thread.run_sync(b.stop)
        assert bus.receive_ready() == []
        await trio.to_thread.run_sync(b.start)
        with trio.fail_after(10):
            while True:  # until the reconnect's opening is in force
                await bus.publish("r/x", b"2")
                got = await bus.receive_batch()
                if any(getattr(e, "payload", None) == b"2" for e in got):
                    break
                await trio.sleep(0.05)
        assert bus.connections == 2
        await bus.aclose()

    try:
        trio.run(main)
    finally:
        b.stop()
