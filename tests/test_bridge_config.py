"""`sbus bridge --config FILE` and several broker addresses, against real mosquitto
(issue 29): maps per direction each with its QoS, credentials from files (never in argv),
fail-over in order with the address in use in STATUS=, byte counters."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from conftest import SBUS, stop_process, wait_for_socket
from mqtt_hosts import Bridge, Mosquitto, Peer
from test_bridge import _free_port, collect, publish, subscriber


def _bus(tmp: Path) -> tuple[str, subprocess.Popen]:
    address = str(tmp / "bus.sock")
    proc = subprocess.Popen([*SBUS, "serve", "--address", address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_socket(address, proc)
    return address, proc


def _wait_got(peer: Peer, n: int) -> list[tuple[str, bytes, int]]:
    deadline = time.monotonic() + 10
    while len(peer.got) < n:
        assert time.monotonic() < deadline, peer.got
        time.sleep(0.02)
    return peer.got


def test_config_file_maps_qos_and_password_file(short_tmp: Path) -> None:
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(short_tmp / "passwd"), "robot",
                    "s3cret pw"], check=True, capture_output=True)
    port = _free_port()
    broker = Mosquitto(short_tmp, [("127.0.0.1", port)])
    broker.conf.write_text(broker.conf.read_text().replace(
        "allow_anonymous true", "allow_anonymous false") +
        f"password_file {short_tmp}/passwd\nper_listener_settings false\n")
    broker.start()
    (short_tmp / "mqtt.pw").write_text("s3cret pw\n")
    config = short_tmp / "bridge.toml"
    config.write_text(f"""
# two brokers: the first is not there, the second is used
mqtt = ["mqtt://127.0.0.1:{_free_port()}", "mqtt://127.0.0.1:{port}"]
username = "robot"
password-file = "mqtt.pw"        # next to this file
client-id = "cfg"

[[export]]
patterns = ["sensors/"]
map = "sensors/=site/h/sensors/"
qos = 1

[[export]]
patterns = ["logs/"]
map = "logs/=site/h/logs/"
qos = 0

[[import]]
patterns = ["fleet/"]
map = "fleet/=site/"

[[import]]
patterns = ["cmd/"]
map = "cmd/=control/h/"
qos = 0
""")
    address, bus = _bus(short_tmp)
    br = None
    try:
        br = Bridge(short_tmp, "cfg", address, "", ["--config", str(config)]).start()
        assert f"mqtt up at 127.0.0.1:{port};" in br.status()
        argv = Path(f"/proc/{br.proc.pid}/cmdline").read_bytes()
        assert b"s3cret" not in argv
        peer = Peer(broker.sock, ["site/#"], auth=("robot", "s3cret pw"))
        publish(address, [("sensors/t", b"1"), ("logs/a", b"2"), ("other/x", b"3")])
        assert sorted((t, p) for t, p, _ in _wait_got(peer, 2)) == [
            ("site/h/logs/a", b"2"), ("site/h/sensors/t", b"1")]
        assert peer.qos == {"site/h/logs/a": 0, "site/h/sensors/t": 1}   # QoS per map
        local = subscriber(address, "fleet/", "cmd/")
        peer.publish("site/b/sensors/t", b"in1")
        peer.publish("control/h/go", b"in2")
        peer.publish("control/other/go", b"not for us")
        assert sorted(collect(local, want=2, quiet=0.3)) == [
            (b"cmd/go", b"in2"), (b"fleet/b/sensors/t", b"in1")]
        c = br.wait_counters(lambda c: c["imported"] >= 2)
        assert c["exported"] == 2 and c["exported_bytes"] == len("site/h/sensors/t1") + \
            len("site/h/logs/a2")
        peer.close()
    finally:
        if br is not None:
            br.close()
        stop_process(bus)
        broker.stop()


def test_fail_over_in_order_and_back(short_tmp: Path) -> None:
    """Two brokers: the first down, the second used; the second goes, the first comes:
    the bridge moves to it; STATUS= names the one in use."""
    p1, p2 = _free_port(), _free_port()
    (short_tmp / "m1").mkdir()
    (short_tmp / "m2").mkdir()
    m1 = Mosquitto(short_tmp / "m1", [("127.0.0.1", p1)])
    m2 = Mosquitto(short_tmp / "m2", [("127.0.0.1", p2)]).start()
    address, bus = _bus(short_tmp)
    br = None
    try:
        br = Bridge(short_tmp, "fo", address, f"mqtt://127.0.0.1:{p1},mqtt://127.0.0.1:{p2}",
                    ["--export", "x/", "--client-id", "fo"]).start()
        assert f"mqtt up at 127.0.0.1:{p2};" in br.status()
        m2.stop()
        br.wait_status(lambda s: "mqtt down" in s)
        m1.start()
        br.wait_status(lambda s: f"mqtt up at 127.0.0.1:{p1};" in s)
        peer = Peer(m1.sock, ["x/#"])
        publish(address, [("x/1", b"via m1")])
        assert [(t, p) for t, p, _ in _wait_got(peer, 1)] == [("x/1", b"via m1")]
        peer.close()
    finally:
        if br is not None:
            br.close()
        stop_process(bus)
        m1.stop()
        m2.stop()


def test_config_mistakes_are_one_line(short_tmp: Path) -> None:
    cases = {
        "mqtt = 'mqtt://h'\nexport = [{patterns = ['a/'], qos = 2}]\n": "QoS is 0 or 1",
        "mqtt = 'mqtt://h'\nfrobnicate = 1\n": "unknown setting 'frobnicate'",
        "mqtt = 'mqtt://h'\n[[import]]\npatterns = ['a*b']\n": "can never match",
        "mqtt = 'mqtt://h'\nlinger = '1s'\n[[export]]\npatterns = ['a/']\n":
            "linger: at most 100ms",
        "mqtt = 'mqtt://h'\nlinger = 'soon'\n[[export]]\npatterns = ['a/']\n":
            "not a duration",
        "mqtt = 'mqtt://h'\n[[export]]\npatterns = ['a/']\nmap = 'a=b/'\n":
            "must be empty or end with '/'",
        "mqtt = [1\n": "not valid TOML",
        "mqtt = 'ftp://h'\n[[export]]\npatterns = ['a/']\n": "must be mqtt://",
        # a broker hangs up on it, and the bridge retried for ever blaming the port
        "mqtt = 'mqtt://h'\nclient-id = \"x\\u001b[2Jy\"\n[[export]]\npatterns = ['a/']\n":
            "--client-id x\\x1b[2Jy: MQTT takes no control characters",
    }
    for text, why in cases.items():
        (short_tmp / "c.toml").write_text(text)
        done = subprocess.run([*SBUS, "bridge", "--address", str(short_tmp / "none.sock"),
                               "--config", str(short_tmp / "c.toml"), "--state-dir",
                               str(short_tmp / "st")], capture_output=True, text=True,
                              timeout=30)
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1 and why in lines[0], (text,
                                                                            done.stderr)


def test_damaged_config_and_password_files_are_one_line(short_tmp: Path) -> None:
    """A configuration nested too deep, one not UTF-8, a FIFO in its place (before: a
    RecursionError or UnicodeDecodeError traceback, or a start that waited without a
    word), and a password file that is not one: a line, exit status 1, at once."""
    conf = short_tmp / "c.toml"
    secret = short_tmp / "pw"
    cases = [
        (lambda: conf.write_text("a = " + "[" * 100_000), "nested too deep"),
        (lambda: conf.write_bytes(b"mqtt = 'mqtt://h\xff'\n"), "not UTF-8 at byte 16"),
        (lambda: (conf.unlink(), os.mkfifo(conf)), "not a regular file"),
        (lambda: (conf.unlink(), conf.write_text(
            f"mqtt = 'mqtt://h'\npassword-file = '{secret}'\n"
            "[[export]]\npatterns = ['a/']\n"), os.mkfifo(secret)), "not a regular file"),
        (lambda: (secret.unlink(), secret.write_bytes(b"\xff\xfe\n")),
         "the password is not UTF-8"),
        (lambda: secret.write_bytes(b"x" * (1 << 20)), "larger than 65536 bytes"),
    ]
    for make, why in cases:
        make()
        done = subprocess.run([*SBUS, "bridge", "--address", str(short_tmp / "none.sock"),
                               "--config", str(conf), "--state-dir", str(short_tmp / "st")],
                              capture_output=True, text=True, timeout=30)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and why in lines[0], (why,
                                                                             done.stderr)
