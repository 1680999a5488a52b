"""`sbus bridge` for real: Debian's mosquitto in a hub network namespace, "hosts" as
network namespaces each with its own `sbus serve` and `sbus bridge` (tests/mqtt_hosts.py).
Needs root (ip netns) and mosquitto, as tools/setup.sh provides."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SBUS, stop_process, wait_for_socket
from faultkit import until
from mqtt_hosts import Bridge, Hosts, Mosquitto, Peer

from sbus import Client
from sbus.protocol import Publish

# The suite runs as root (network namespaces, other UIDs) with Debian's mosquitto, which
# tools/setup.sh installs: without them these tests fail and say why, they do not skip.
assert shutil.which("mosquitto"), "mosquitto is missing: tools/setup.sh test installs it"


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    h = Hosts(2)
    h.start_bus(0)
    h.start_bus(1)
    yield h
    h.close()


@pytest.fixture
def persistent_hosts() -> Iterator[Hosts]:
    h = Hosts(2, persistence=True)
    h.start_bus(0)
    h.start_bus(1)
    yield h
    h.close()


def subscriber(address: str, *patterns: str) -> Client:
    c = Client(address)
    for p in patterns:
        c.subscribe(p)
    c.whoami()  # the subscriptions are in place once this is answered
    return c


def collect(c: Client, want: int | None = None, quiet: float = 0.5, timeout: float = 10.0,
            others: list[object] | None = None) -> list[tuple[bytes, bytes]]:
    """Messages until *want* arrived (then *quiet* more seconds) or none for *quiet*;
    any other event (a drop report) goes to *others* if given."""
    got: list[tuple[bytes, bytes]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wait = quiet if want is None or len(got) >= want else deadline - time.monotonic()
        try:
            event = c.receive(timeout=max(0.01, wait))
        except TimeoutError:
            if want is None or len(got) >= want:
                break
            continue
        if isinstance(event, Publish):
            got.append((event.key, event.payload))
        elif others is not None:
            others.append(event)
    return got


def publish(address: str, messages: list[tuple[str | bytes, bytes]]) -> None:
    with Client(address) as c:
        for key, payload in messages:
            c.publish(key, payload)
        c.whoami()  # the broker has read them all


def test_export_import_refusals_and_status(hosts: Hosts) -> None:
    peer = Peer(hosts.mosquitto.sock, ["#"])
    br = hosts.bridge(0, "--client-id", "bridge-a",
                      "--export", "sensors/", "--export-map", "sensors/=site/a/sensors/",
                      "--import", "cmd/*", "--import-map", "cmd/=site/a/cmd/")
    bus = hosts.bus_address(0)
    local = subscriber(bus, "cmd/")
    whoami = local.whoami().decode()
    publish(bus, [("sensors/t1", b"20.5"), ("sensors/a+b", b"bad"),
                  (b"sensors/\xff", b"x"), (whoami + "/inbox", b"secret"),
                  ("other/x", b"not exported")])
    c = br.wait_counters(lambda c: c["exported"] + c["refused"] >= 3)
    assert (c["exported"], c["refused"]) == (1, 2)
    until(lambda: peer.got, "the export reached the MQTT peer")
    topics = [(t, p) for t, p, _ in peer.got]
    assert topics == [("site/a/sensors/t1", b"20.5")]
    assert ("sbus-bridge", "bridge-a") in peer.got[0][2]   # the loop marker
    peer.publish("site/a/cmd/go", b"now")
    peer.publish("site/a/cmd/x/y", b"too deep")
    peer.publish("site/b/cmd/go", b"other site")
    assert collect(local, want=1) == [(b"cmd/go", b"now")]
    c = br.wait_counters(lambda c: c["imported"] >= 1)
    assert c["imported"] == 1
    # the same counters beside the bridge's connection in `sbus status` (and sbus-top)
    deadline = time.monotonic() + 10
    while True:
        shown = subprocess.run([*SBUS, "status", "--address", bus], capture_output=True,
                               text=True, timeout=30).stdout
        if "status: bus up, mqtt up at 10.77.1.1:1883;" in shown and "imported 1" in shown:
            break
        assert time.monotonic() < deadline, shown
        time.sleep(0.1)
    log = br.stop()
    assert "refused 'sensors/a+b'" in log and "'+' cannot be sent" in log
    assert "not valid UTF-8" in log
    peer.close()


def test_bad_configuration_is_one_line(short_tmp) -> None:
    """The last line says what is wrong (argparse's usage may come before it)."""
    for args, why in ((["--export", "!/cred////"], "never leave the host"),
                      (["--import", "a*b"], "can never match"),
                      (["--export-map", "sensors=x/"], "must be empty or end with '/'"),
                      ([], "nothing to bridge")):
        done = subprocess.run([*SBUS, "bridge", "--address", str(short_tmp / "none.sock"),
                               "--mqtt", "mqtt://127.0.0.1:1", *args],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode != 0
        assert why in done.stderr.strip().splitlines()[-1], done.stderr


def test_two_hosts_both_ways_with_patterns(hosts: Hosts) -> None:
    common = ["--export", "sensors/", "--import", "remote/*/sensors/",
              "--import-map", "remote/=site/"]
    hosts.bridge(0, "--client-id", "a", "--export-map", "sensors/=site/a/sensors/", *common)
    hosts.bridge(1, "--client-id", "b", "--export-map", "sensors/=site/b/sensors/", *common)
    a, b = hosts.bus_address(0), hosts.bus_address(1)
    sub_a, sub_b = subscriber(a, "remote/"), subscriber(b, "remote/")
    publish(a, [("sensors/t", b"a1"), ("sensors/deep/er", b"a2"), ("private/x", b"stays")])
    publish(b, [("sensors/t", b"b1")])
    assert collect(sub_b, want=2) == [(b"remote/a/sensors/t", b"a1"),
                                      (b"remote/a/sensors/deep/er", b"a2")]
    # A's import filter (site/+/sensors/#) covers A's own exports: No Local keeps them away
    assert collect(sub_a, want=1) == [(b"remote/b/sensors/t", b"b1")]


def test_two_hosts_everything_both_ways_no_loops_secrets_stay_home(hosts: Hosts) -> None:
    """The loop-prone set-up: both export everything and import everything, unchanged."""
    peer = Peer(hosts.mosquitto.sock, ["#"])
    br_a = hosts.bridge(0, "--client-id", "a", "--export", "", "--import", "")
    br_b = hosts.bridge(1, "--client-id", "b", "--export", "", "--import", "")
    a, b = hosts.bus_address(0), hosts.bus_address(1)
    sub_a, sub_b = subscriber(a, ""), subscriber(b, "")
    secret_a = sub_a.whoami().decode() + "/inbox"
    sub_a.subscribe(secret_a)
    sub_a.whoami()
    publish(a, [("x/1", b"from a"), (secret_a, b"for a's eyes")])
    publish(b, [("y/1", b"from b")])
    got_a = collect(sub_a, quiet=1.0)
    got_b = collect(sub_b, quiet=1.0)
    assert sorted(got_a) == sorted([(b"x/1", b"from a"), (secret_a.encode(), b"for a's eyes"),
                                    (b"y/1", b"from b")])
    assert sorted(got_b) == sorted([(b"x/1", b"from a"), (b"y/1", b"from b")])
    assert sorted((t, p) for t, p, _ in peer.got) == [("x/1", b"from a"), ("y/1", b"from b")]
    ca, cb = br_a.counters(), br_b.counters()
    # each bridge saw its one import come back on its own bus and kept it home
    assert (ca["exported"], ca["imported"], ca["looped"]) == (1, 1, 1), ca
    assert (cb["exported"], cb["imported"], cb["looped"]) == (1, 1, 1), cb
    peer.close()


def _bridges_a_to_b(hosts: Hosts, *b_args: str) -> None:
    hosts.bridge(0, "--client-id", "a", "--export", "sensors/")
    hosts.bridge(1, "--client-id", "b", "--import", "sensors/", *b_args)


def test_bridge_restart_import_qos1_loses_nothing(hosts: Hosts) -> None:
    _bridges_a_to_b(hosts)
    a, b = hosts.bus_address(0), hosts.bus_address(1)
    sub_b = subscriber(b, "sensors/")
    hosts.bridges[1].stop()
    sent = [(f"sensors/{i}", b"%d" % i) for i in range(50)]
    publish(a, sent)
    hosts.bridges[0].wait_counters(lambda c: c["exported"] == 50)
    hosts.bridges[1].start()           # same client id: its session waited at mosquitto
    assert collect(sub_b, want=50) == [(k.encode(), p) for k, p in sent]


def test_bridge_restart_import_qos0_loses_what_came_meanwhile(hosts: Hosts) -> None:
    _bridges_a_to_b(hosts, "--import-qos", "0", "--session-expiry", "0")
    a, b = hosts.bus_address(0), hosts.bus_address(1)
    sub_b = subscriber(b, "sensors/")
    hosts.bridges[1].stop()
    publish(a, [(f"sensors/{i}", b"lost") for i in range(20)])
    hosts.bridges[0].wait_counters(lambda c: c["exported"] == 20)
    hosts.bridges[1].start()
    publish(a, [("sensors/after", b"kept")])
    assert collect(sub_b, want=1) == [(b"sensors/after", b"kept")]


def _bus_behind_subscriber(hosts: Hosts, i: int,
                           pattern: str) -> tuple[subprocess.Popen, Client]:
    """A new bus for host *i*, and a subscriber to *pattern* on it: the bus listens under
    another name until the subscriber is in, then moves to the address the bridge knows,
    so the bridge cannot deliver before the subscriber is there."""
    address = hosts.bus_address(i)
    hidden = address + ".new"
    with open(hosts.tmp / f"bus{i}.log", "ab") as log:
        proc = subprocess.Popen(["ip", "netns", "exec", hosts.names[i], *SBUS, "serve",
                                 "--address", hidden], stdout=log, stderr=log)
    try:
        wait_for_socket(hidden, proc)
        sub = subscriber(hidden, pattern)
        os.rename(hidden, address)
    except BaseException:
        stop_process(proc)
        raise
    return proc, sub


def test_bus_restart_keeps_qos1_imports_waiting(hosts: Hosts) -> None:
    _bridges_a_to_b(hosts)
    a = hosts.bus_address(0)
    hosts.stop_bus(1)
    hosts.bridges[1].wait_status(lambda s: s.startswith("bus down"))
    sent = [(f"sensors/{i}", b"%d" % i) for i in range(30)]
    publish(a, sent)
    hosts.bridges[0].wait_counters(lambda c: c["exported"] == 30)
    proc, sub_b = _bus_behind_subscriber(hosts, 1, "sensors/")
    try:
        assert collect(sub_b, want=30) == [(k.encode(), p) for k, p in sent]
        assert hosts.bridges[1].counters()["dropped"] == 0
    finally:
        stop_process(proc)


def test_qos1_imports_a_killed_bus_never_read_are_sent_again(hosts: Hosts) -> None:
    """Imports sent into the bus's socket while the local broker is stopped, then a
    ``kill -9``: the broker never read them, so the bridge has not acknowledged them to
    the MQTT broker (an import's PUBACK waits for the bus to confirm it), and it sends
    them again to the next broker: all 30 arrive (before: acknowledged once sent, lost
    without a word)."""
    _bridges_a_to_b(hosts)
    a, b = hosts.bus_address(0), hosts.bus_address(1)
    sub_b = subscriber(b, "sensors/")
    publish(a, [("sensors/first", b"x")])
    assert collect(sub_b, want=1) == [(b"sensors/first", b"x")]
    proc = hosts.buses.pop(b)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        sent = [(f"sensors/{i}", b"%d" % i) for i in range(30)]
        publish(a, sent)
        # (as many as the MQTT broker sends before their PUBACKs: its in-flight window)
        until(lambda: hosts.bridges[1].counters()["imported"] >= 11,
              "the imports sent into the stopped broker's socket")
        time.sleep(0.5)
        sent_into = hosts.bridges[1].counters()["imported"] - 1
    finally:
        proc.kill()  # (stopped: never left behind)
        proc.wait()
    os.unlink(b)
    proc, sub_b = _bus_behind_subscriber(hosts, 1, "sensors/")
    try:
        got = collect(sub_b, want=30, quiet=2.0)
        assert sorted(set(got)) == sorted((k.encode(), p) for k, p in sent), got
        log = hosts.bridges[1].log.read_text()
        said = re.search(r"the bus connection was lost before the broker confirmed (\d+) "
                         r"import\(s\): (\d+) QoS 1 sent again", log)
        assert said and said[1] == said[2], log
        assert sent_into <= int(said[1]) <= 30, (sent_into, log)  # (STATUS= may lag)
    finally:
        stop_process(proc)


@pytest.mark.parametrize("qos", [1, 0])
def test_mqtt_broker_restart(persistent_hosts: Hosts, qos: int) -> None:
    """Export QoS 1: what was published while the broker was away is delivered once it is
    back (held by the bridge, up to --max-queued). QoS 0: dropped, and counted."""
    hosts = persistent_hosts
    hosts.bridge(0, "--client-id", "a", "--export", "sensors/", "--export-qos", str(qos))
    hosts.bridge(1, "--client-id", "b", "--import", "sensors/")
    a, b = hosts.bus_address(0), hosts.bus_address(1)
    sub_b = subscriber(b, "sensors/")
    publish(a, [("sensors/before", b"x")])
    assert collect(sub_b, want=1) == [(b"sensors/before", b"x")]
    hosts.mosquitto.stop()
    hosts.bridges[0].wait_status(lambda s: "mqtt down" in s)
    sent = [(f"sensors/{i}", b"%d" % i) for i in range(25)]
    publish(a, sent)
    if qos == 0:
        hosts.bridges[0].wait_counters(lambda c: c["dropped"] == 25)
    hosts.mosquitto.start()
    for br in hosts.bridges:
        br.wait_status(lambda s: "mqtt up" in s)
    publish(a, [("sensors/after", b"y")])
    expected = ([(k.encode(), p) for k, p in sent] if qos else []) + [(b"sensors/after", b"y")]
    assert collect(sub_b, want=len(expected)) == expected


def test_bridge_unit_under_a_user_manager(short_tmp) -> None:
    """sbus-bridge@NAME.service as install-units writes it, under a real systemd user
    manager: settings from %E/sbus/bridge-NAME.toml, READY=1, counters in StatusText."""
    from systemd_usermgr import UserManager

    port = _free_port()
    broker = Mosquitto(short_tmp, [("127.0.0.1", port)]).start()
    base = Path(tempfile.mkdtemp(prefix="sbus-um-", dir="/tmp"))
    manager = UserManager(base).start()
    try:
        (user_units(manager) / "bridge-t.toml").write_text(
            f'mqtt = "mqtt://127.0.0.1:{port}"\nclient-id = "u"\n'
            '[[export]]\npatterns = ["unit/"]\n')
        manager.systemctl("start", "sbus.socket", "sbus-bridge@t.service")
        peer = Peer(broker.sock, ["#"])
        publish(str(manager.runtime / "sbus.socket"), [("unit/x", b"1"), ("unit/a+b", b"2")])
        deadline = time.monotonic() + 10
        while "refused 1" not in (status := manager.show("sbus-bridge@t.service",
                                                         "StatusText")["StatusText"]):
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status.startswith(f"bus up, mqtt up at 127.0.0.1:{port}; exported 1 (7 B), "
                                 "imported 0 (0 B), dropped 0, refused 1")
        assert [(t, p) for t, p, _ in peer.got] == [("unit/x", b"1")]
        peer.close()
        manager.systemctl("stop", "sbus-bridge@t.service", "sbus.socket", "sbus.service")
        assert manager.show("sbus-bridge@t.service", "Result")["Result"] == "success"
    finally:
        leftover = manager.stop()
        broker.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert not leftover


def user_units(manager) -> Path:
    """sbus's units installed in a user *manager* (systemd_usermgr) as `sbus install-units`
    writes them, running this checkout if PYTHONPATH names one: their configuration
    directory (%E/sbus)."""
    if os.environ.get("PYTHONPATH"):  # a checkout under test, not the installed copy
        manager.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        manager.systemctl("set-environment", f"PYTHONPATH={os.environ['PYTHONPATH']}")
    manager.run(str(Path(sys.executable).parent / "sbus"), "install-units", "--user")
    (manager.config / "sbus").mkdir()
    return manager.config / "sbus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tls_with_a_client_certificate_and_a_password(short_tmp) -> None:
    """mqtts:// against mosquitto requiring TLS, a client certificate signed by its CA and
    a password: the bridge gets in with --cafile --cert --key --password-file; without
    the password it is refused and says so, retrying with backoff."""
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("bridge-client")
    for name, blob in (("ca.pem", ca.cert_pem), ("server.pem", server.cert_chain_pems[0]),
                       ("server.key", server.private_key_pem), ("client.pem",
                       client.cert_chain_pems[0]), ("client.key", client.private_key_pem)):
        blob.write_to_path(str(short_tmp / name))
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(short_tmp / "passwd"), "robot",
                    "s3cret pw"], check=True, capture_output=True)
    port = _free_port()
    broker = Mosquitto(short_tmp, [("127.0.0.1", port)])
    conf = broker.conf.read_text().replace(
        f"listener {port} 127.0.0.1\n",
        f"listener {port} 127.0.0.1\ncafile {short_tmp}/ca.pem\n"
        f"certfile {short_tmp}/server.pem\nkeyfile {short_tmp}/server.key\n"
        "require_certificate true\n").replace("allow_anonymous true", "allow_anonymous false")
    broker.conf.write_text(conf + f"password_file {short_tmp}/passwd\n"
                           "per_listener_settings false\n")
    broker.start()
    (short_tmp / "pw").write_text("s3cret pw\n")
    common = ["--export", "tls/", "--cafile", str(short_tmp / "ca.pem"),
              "--cert", str(short_tmp / "client.pem"), "--key", str(short_tmp / "client.key")]
    address = str(short_tmp / "bus.sock")
    bus = subprocess.Popen([*SBUS, "serve", "--address", address],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wrong = good = None
    try:
        wait_for_socket(address, bus)
        wrong = Bridge(short_tmp, "wrong", address, f"mqtts://robot@127.0.0.1:{port}",
                       [*common, "--client-id", "wrong"])
        wrong.start(wait=False)
        deadline = time.monotonic() + 10
        while "refused the connection: Not authorized" not in wrong.log.read_text():
            assert time.monotonic() < deadline, wrong.log.read_text()
            time.sleep(0.05)
        assert "mqtt down" in wrong.status()
        wrong.stop()
        good = Bridge(short_tmp, "good", address, f"mqtts://robot@127.0.0.1:{port}",
                      [*common, "--client-id", "good", "--password-file",
                       str(short_tmp / "pw")]).start()
        peer = Peer(broker.sock, ["tls/#"], auth=("robot", "s3cret pw"))
        publish(address, [("tls/x", b"over TLS")])
        deadline = time.monotonic() + 10
        while not peer.got:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [(t, p) for t, p, _ in peer.got] == [("tls/x", b"over TLS")]
        peer.close()
    finally:
        for b in (wrong, good):
            if b is not None:
                b.close()
        stop_process(bus)
        broker.stop()


@pytest.fixture
def one_host() -> Iterator[Hosts]:
    h = Hosts(1)
    h.start_bus(0)
    yield h
    h.close()


def test_stalled_mqtt_never_stalls_local_publishers(one_host: Hosts) -> None:
    """mosquitto stopped (SIGSTOP): the bridge's TCP fills, it stops reading the bus, the
    local broker queues for it and then drops, and the publisher never waits. Every
    message is counted, exported or dropped."""
    hosts = one_host
    br = hosts.bridge(0, "--export", "flood/", "--export-qos", "0")
    mosq = hosts.mosquitto.proc
    assert mosq is not None
    n, payload = 20000, b"x" * 1024   # 20 MiB: far beyond TCP buffers and the 4 MiB queue
    os.kill(mosq.pid, signal.SIGSTOP)
    try:
        with Client(hosts.bus_address(0), timeout=10) as pub:  # a stall would time out
            for i in range(n):
                pub.publish(b"flood/%d" % (i % 10), payload)
            pub.whoami()
    finally:
        os.kill(mosq.pid, signal.SIGCONT)
    c = br.wait_counters(lambda c: c["exported"] + c["dropped"] == n, timeout=20)
    assert c["dropped"] > 0 and c["exported"] > 0, c


def test_slow_local_subscriber_never_stalls_imports(one_host: Hosts) -> None:
    """A local subscriber that blocks and never reads (same user as the bridge, so its
    block would pause the bridge) costs the bridge nothing: it publishes with
    blocking/publisher/nowait, the slow one loses messages, a reading one gets them all."""
    hosts = one_host
    br = hosts.bridge(0, "--import", "in/")
    bus = hosts.bus_address(0)
    slow = Client(bus)
    slow.set_flood(soft="block")
    slow.subscribe("in/")
    slow.whoami()
    fast = subscriber(bus, "in/")
    peer = Peer(hosts.mosquitto.sock)
    n = 3000
    # the reading subscriber reads while the burst comes (12 MB: more than its queue limit)
    box: dict[str, list] = {}
    reader = threading.Thread(target=lambda: box.update(got=collect(fast, n + 1, timeout=30)))
    reader.start()
    for i in range(n):
        peer.c.publish("in/x", b"%06d" % i + b"y" * 4096, qos=0)
    peer.publish("in/x", b"last")
    reader.join(40)
    got = box["got"]
    assert len(got) == n + 1 and got[-1] == (b"in/x", b"last")
    assert br.wait_counters(lambda c: c["imported"] == n + 1)["dropped"] == 0
    slow.close()
    peer.close()


def test_qos1_queue_while_the_broker_is_away_is_bounded_in_bytes(one_host: Hosts) -> None:
    hosts = one_host
    br = hosts.bridge(0, "--export", "q/", "--max-queued-bytes", "10k")
    hosts.mosquitto.stop()
    br.wait_status(lambda s: "mqtt down" in s)
    publish(hosts.bus_address(0), [(f"q/{i}", b"z" * 1000) for i in range(20)])
    # with MQTT away the bus is read while the spool is under half its room (5 of these),
    # a batch at a time: those past 10 KiB in a batch are dropped, the rest wait in the
    # local broker's queue (docs/bridge.md, "The spool")
    br.wait_counters(lambda c: c["exported"] >= 5)
    time.sleep(0.5)
    c = br.counters()
    assert 5 <= c["exported"] <= 10 and c["exported"] * 1003 <= 10 * 1024, c
    assert c["exported"] + c["dropped"] <= 20 and c["spooled"] == c["exported"], c


def test_own_message_returned_by_a_relay_is_recognised_by_its_marker(one_host: Hosts) -> None:
    """What a broker bridge or cluster does, done by a relay client: it republishes what
    the bridge exported, user properties included, so No Local does not apply (the relay
    is the publisher). The bridge knows its own marker and does not import it again."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from paho.mqtt.subscribeoptions import SubscribeOptions

    hosts = one_host
    br = hosts.bridge(0, "--client-id", "a", "--export", "out/", "--import", "out/")
    relay = Peer(hosts.mosquitto.sock)

    def republish(client, userdata, msg: mqtt.MQTTMessage) -> None:
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = list(msg.properties.UserProperty)
        client.publish(msg.topic, msg.payload, 0, properties=props)

    relay.c.on_message = republish
    relay.subscribe("out/#", options=SubscribeOptions(qos=0, noLocal=True))
    bus = hosts.bus_address(0)
    local = subscriber(bus, "out/")
    publish(bus, [("out/x", b"once")])
    c = br.wait_counters(lambda c: c["looped"] >= 1)
    assert collect(local, quiet=0.5) == [(b"out/x", b"once")]
    c = br.counters()
    assert (c["exported"], c["imported"], c["looped"]) == (1, 0, 1), c
    relay.close()
