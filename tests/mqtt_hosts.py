"""Real parts for the bridge tests: Debian's mosquitto with a config of our own, network
namespaces as "hosts" (each with its own `sbus serve` and `sbus bridge`), and a paho
client that talks to mosquitto over a unix socket (reachable from any namespace).

Topology made by `Hosts`: a hub namespace runs mosquitto, listening on 10.77.N.1 of a
veth pair to each host namespace (the host's end is 10.77.N.2) and on a unix socket.
The namespaces are private, so these addresses meet nothing outside the test.
"""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import paho.mqtt.client as mqtt
from conftest import SBUS, stop_process, wait_for_socket
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

MQTT_PORT = 1883


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Mosquitto:
    """A mosquitto process with its own config: TCP listeners on *addresses* (host, port),
    a unix socket, persistence in its own directory if asked."""

    def __init__(self, tmp: Path, addresses: list[tuple[str, int]], netns: str | None = None,
                 persistence: bool = False) -> None:
        self.tmp = tmp
        self.sock = str(tmp / "mqtt.sock")
        self.netns = netns
        lines = [f"listener {port} {host}" for host, port in addresses]
        lines += [f"listener 0 {self.sock}", "allow_anonymous true",
                  f"persistence {'true' if persistence else 'false'}",
                  f"persistence_location {tmp}/", "max_queued_messages 100000"]
        if os.getuid() == 0:
            lines.append("user root")  # else it would switch to a user that cannot read tmp
        self.conf = tmp / "mosquitto.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        self.log = tmp / "mosquitto.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Mosquitto:
        cmd = ["mosquitto", "-c", str(self.conf)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + 10
        while not self._listening():  # (the socket file is there at bind, before listen)
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "mosquitto did not start"
            time.sleep(0.02)
        return self

    def _listening(self) -> bool:
        """Does mosquitto take connections on its unix socket yet?  (A client that came
        between its bind and its listen was refused: ECONNREFUSED in CI.)"""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.sock)
            return True
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        finally:
            probe.close()

    def stop(self) -> None:
        stop_process(self.proc)
        try:
            os.unlink(self.sock)
        except FileNotFoundError:
            pass


class Peer:
    """A plain MQTT 5 client on mosquitto's unix socket, collecting what it receives."""

    def __init__(self, sock: str, filters: list[str] = (),
                 auth: tuple[str, str] | None = None, session: bool = False) -> None:
        """*session*: a session the broker keeps for 10 minutes (QoS 1 deliveries are
        queued for it while it is away; paho reconnects and resumes it)."""
        self.got: list[tuple[str, bytes, list]] = []
        self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"peer-{uuid.uuid4().hex}",
                             protocol=mqtt.MQTTv5, transport="unix")
        self.qos: dict[str, int] = {}  # topic -> QoS of its last delivery

        def take(c, u, m) -> None:
            self.qos[m.topic] = m.qos
            self.got.append((m.topic, m.payload, getattr(m.properties, "UserProperty", [])))

        self.c.on_message = take
        self._subacks = threading.Semaphore(0)
        self.c.on_subscribe = lambda *_: self._subacks.release()
        if auth:
            self.c.username_pw_set(*auth)
        kept = None
        if session:
            kept = Properties(PacketTypes.CONNECT)
            kept.SessionExpiryInterval = 600
            self.c.reconnect_delay_set(0.1, 0.5)
        self.c.connect(sock, 1, clean_start=not session,  # (a unix socket has no port)
                       properties=kept)
        self.c.loop_start()
        for f in filters:
            self.subscribe(f, qos=1)

    def subscribe(self, topic: str, **options) -> None:
        """Subscribe, and wait for the broker's SUBACK (the subscription is in force)."""
        assert self.c.subscribe(topic, **options)[0] == 0
        assert self._subacks.acquire(timeout=10), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        self.c.publish(topic, payload, qos).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


class Bridge:
    """`sbus bridge` in a child process (in *netns* if given), STATUS= caught on a
    NOTIFY_SOCKET of our own."""

    def __init__(self, tmp: Path, name: str, address: str, mqtt_url: str, args: list[str],
                 netns: str | None = None) -> None:
        self.address, self.mqtt_url, self.args, self.netns = address, mqtt_url, args, netns
        self.notify_path = str(tmp / f"{name}.notify")
        self.state_dir = str(tmp / f"{name}.state")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(self.notify_path)
        self.notify.setblocking(False)
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.last_status = ""
        self.sbus = SBUS  # (the command that runs the CLI)

    def start(self, wait: bool = True) -> Bridge:
        cmd = [*self.sbus, "-vv", "bridge", "--address", self.address,
               *(["--mqtt", self.mqtt_url] if self.mqtt_url else []),
               "--backoff-max", "0.5", "--state-dir", self.state_dir, *self.args]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self.status()  # what the last process said is no news about this one
        self.last_status = ""
        env = {**os.environ, "NOTIFY_SOCKET": self.notify_path}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        if wait:
            self.wait_status(lambda s: "bus up, mqtt up" in s)
        return self

    def _take(self, data: bytes) -> None:
        for line in data.decode().splitlines():
            if line.startswith("STATUS="):
                self.last_status = line[7:]

    def status(self) -> str:
        """The newest STATUS= line received."""
        while True:
            try:
                self._take(self.notify.recv(4096))
            except BlockingIOError:
                return self.last_status

    def wait_status(self, ok, timeout: float = 10.0) -> str:
        """Wait until *ok*(the STATUS= line) is true; return the line."""
        deadline = time.monotonic() + timeout
        while not ok(self.status()):
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"bridge exited: {self.log.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"STATUS never right: {self.last_status!r}\n"
                                     f"{self.log.read_text()}")
            select.select([self.notify], [], [], max(0.01, deadline - time.monotonic()))
        return self.last_status

    def wait_counters(self, ok, timeout: float = 10.0) -> dict[str, int]:
        self.wait_status(lambda s: "; " in s and ok(_counters(s)), timeout)
        return _counters(self.last_status)

    def counters(self) -> dict[str, int]:
        return _counters(self.status())

    def stop(self) -> str:
        stop_process(self.proc)
        return self.log.read_text()

    def close(self) -> None:
        self.stop()
        self.notify.close()


def _counters(status: str) -> dict[str, int]:
    """``exported 3 (120 B), …`` -> {"exported": 3, "exported_bytes": 120, …}."""
    out = {}
    for name, count, size in re.findall(r"(\w+) (\d+)(?: \((\d+) B\))?", status.split("; ", 1)[1]):
        out[name] = int(count)
        if size:
            out[name + "_bytes"] = int(size)
    return out


class Hosts:
    """A hub namespace with mosquitto and *n* host namespaces joined to it by veth pairs."""

    def __init__(self, n: int = 2, persistence: bool = False) -> None:
        tag = uuid.uuid4().hex[:6]
        self.hub = f"sbh{tag}"
        self.names = [f"sb{i}{tag}" for i in range(n)]
        self.tmp = Path(tempfile.mkdtemp(prefix="sbus-br-", dir="/tmp"))
        self.made: list[str] = []
        try:
            for ns in [self.hub, *self.names]:
                _ip("netns", "add", ns)
                self.made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for i, ns in enumerate(self.names, 1):
                hub_end, host_end = f"h{i}{tag}", f"v{i}{tag}"
                _ip("link", "add", hub_end, "netns", self.hub, "type", "veth", "peer",
                    "name", host_end, "netns", ns)
                _ip("-n", self.hub, "addr", "add", f"10.77.{i}.1/24", "dev", hub_end)
                _ip("-n", self.hub, "link", "set", hub_end, "up")
                _ip("-n", ns, "addr", "add", f"10.77.{i}.2/24", "dev", host_end)
                _ip("-n", ns, "link", "set", host_end, "up")
            self.mosquitto = Mosquitto(
                self.tmp, [(f"10.77.{i}.1", MQTT_PORT) for i in range(1, n + 1)],
                netns=self.hub, persistence=persistence).start()
        except BaseException:
            self.close()
            raise
        self.buses: dict[str, subprocess.Popen] = {}
        self.bridges: list[Bridge] = []

    def link(self, i: int, up: bool) -> None:
        """Cut (or restore) host *i*'s (0-based) link to the hub, in its own namespace:
        its TCP connections stay open, unable to send or receive, until a keep-alive
        gives up; connecting fails at once (no route)."""
        _ip("-n", self.names[i], "link", "set", f"v{i + 1}{self.hub[3:]}",
            "up" if up else "down")

    def url(self, i: int) -> str:
        """The MQTT URL host *i* (0-based) reaches mosquitto at."""
        return f"mqtt://10.77.{i + 1}.1:{MQTT_PORT}"

    def bus_address(self, i: int) -> str:
        return str(self.tmp / f"bus{i}.sock")

    def start_bus(self, i: int) -> str:
        address = self.bus_address(i)
        with open(self.tmp / f"bus{i}.log", "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], *SBUS, "serve",
                                     "--address", address], stdout=log, stderr=log)
        self.buses[address] = proc
        wait_for_socket(address, proc)
        return address

    def stop_bus(self, i: int) -> None:
        stop_process(self.buses.pop(self.bus_address(i)))

    def bridge(self, i: int, *args: str, name: str | None = None) -> Bridge:
        b = Bridge(self.tmp, name or f"bridge{i}", self.bus_address(i), self.url(i),
                   list(args), netns=self.names[i])
        self.bridges.append(b)
        return b.start()

    def close(self) -> None:
        for b in getattr(self, "bridges", []):
            b.close()
        for proc in getattr(self, "buses", {}).values():
            stop_process(proc)
        if hasattr(self, "mosquitto"):
            self.mosquitto.stop()
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["rm", "-rf", str(self.tmp)])
