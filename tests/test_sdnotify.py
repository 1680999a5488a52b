"""What a service only reports to its manager (`sdnotify.Reporter`) never ends it nor
makes it wait: a ``NOTIFY_SOCKET`` that names nothing, and one nobody drains, against
the reporter itself and against a real broker and a real gateway (before: the gateway
ended with a traceback at start, the broker with "No such file or directory", and both
sent their status lines blocking, so a manager that stopped reading froze them)."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path

import pytest
from conftest import BrokerProcess, raw, sync
from test_gateway import GatewayProcess, read_exactly, roundtrip, subscribe_bridged

from sbus.gateway import codec
from sbus.sdnotify import Reporter

log = logging.getLogger("test.sdnotify")


def full_socket(path: Path) -> socket.socket:
    """A datagram socket at *path* whose queue is full, and which nobody reads."""
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(path))
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    try:
        while True:
            filler.sendto(b"x" * 64, str(path))
    except BlockingIOError:
        pass
    filler.close()
    return sink


def test_reporter_says_each_spell_once_and_sends_again_after(short_tmp, monkeypatch,
                                                             caplog):
    path = short_tmp / "notify"
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    notify = Reporter(log)
    caplog.set_level(logging.WARNING, "test.sdnotify")
    assert [notify(f"STATUS={i}") for i in range(3)] == [False] * 3  # names nothing
    assert notify.skipped == 3
    assert [r.getMessage() for r in caplog.records] == [
        "cannot notify the service manager at $NOTIFY_SOCKET: No such file or directory"]
    sink = full_socket(path)
    caplog.clear()
    t0 = time.monotonic()
    assert [notify("STATUS=full") for _ in range(3)] == [False] * 3  # not waited for
    assert time.monotonic() - t0 < 0.5
    assert notify.skipped == 6
    assert [r.getMessage() for r in caplog.records] == [
        "the service manager does not read its notify socket: status lines are skipped "
        "until it does"]
    sink.setblocking(False)
    while True:  # the manager reads again: lines go through
        try:
            sink.recv(100)
        except BlockingIOError:
            break
    assert notify("STATUS=back") is True
    assert sink.recv(100) == b"STATUS=back"
    sink.close()
    path.unlink()
    caplog.clear()
    assert notify("STATUS=gone") is False  # a new spell: said again, once
    assert len(caplog.records) == 1 and "No such file" in caplog.records[0].getMessage()


def test_reporter_is_silent_without_a_manager(monkeypatch, caplog):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notify = Reporter(log)
    assert notify("READY=1") is False
    assert notify.skipped == 0 and not caplog.records


def _keeps_answering(s: socket.socket, seconds: float) -> float:
    """Whoami round trips on a raw broker connection for *seconds*: the slowest, in s."""
    slowest, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        sync(s)
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    return slowest


@pytest.mark.parametrize("manager", ["names nothing", "does not read"])
def test_the_broker_serves_whatever_its_notify_socket_does(short_tmp, monkeypatch, manager):
    """Past a STATUS= report (every 2 s): served, said once, no traceback."""
    path = short_tmp / "notify"
    sink = full_socket(path) if manager == "does not read" else None
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    bus = BrokerProcess(str(short_tmp / "bus.sock")).start()
    monkeypatch.delenv("NOTIFY_SOCKET")
    try:
        s = raw(bus.address)
        assert _keeps_answering(s, 2.5) < 1.0
        s.close()
        assert bus.proc is not None and bus.proc.poll() is None
    finally:
        text = bus.stop()
        if sink is not None:
            sink.close()
    said = ("does not read its notify socket" if sink
            else "cannot notify the service manager at $NOTIFY_SOCKET")
    assert text.count(said) == 1 and "Traceback" not in text, text
    if sink is not None:  # its clients cannot be stored there for its successor: said
        assert "cannot store" in text and "timed out" in text, text
    assert bus.proc.returncode == 0, text


@pytest.mark.parametrize("manager", ["names nothing", "does not read"])
def test_the_gateway_serves_whatever_its_notify_socket_does(short_tmp, monkeypatch,
                                                            manager):
    """Past a STATUS= report (every 5 s): remote clients served, said once."""
    path = short_tmp / "notify"
    sink = full_socket(path) if manager == "does not read" else None
    bus = BrokerProcess(str(short_tmp / "bus.sock")).start()
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    gw = GatewayProcess(short_tmp, bus.address).start()
    monkeypatch.delenv("NOTIFY_SOCKET")
    try:
        local = raw(bus.address)
        remote = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
        subscribe_bridged(remote, b"n/", local, b"n/probe")
        end = time.monotonic() + 6
        i = 0
        while time.monotonic() < end:
            t0 = time.monotonic()
            local.send(b"MSG n/x\0%d" % i)
            expected = codec.publish(b"n/x", b"%d" % i)
            assert read_exactly(remote, len(expected)) == expected
            roundtrip(remote)
            assert time.monotonic() - t0 < 1.0
            i += 1
            time.sleep(0.05)
        assert gw.proc is not None and gw.proc.poll() is None, gw.log()
        said = ("does not read its notify socket" if sink
                else "cannot notify the service manager at $NOTIFY_SOCKET")
        assert gw.log().count(said) == 1 and "Traceback" not in gw.log(), gw.log()
        remote.close()
        local.close()
    finally:
        gw.stop()
        bus.stop()
        if sink is not None:
            sink.close()
