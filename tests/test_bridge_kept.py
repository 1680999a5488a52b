"""`sbus bridge` keeps its bus connection across its own restart and crash: under a real
systemd user manager, the unit leaves the connection in the fd store
(``FileDescriptorStoreMax=1``), the next process takes it up, and what local publishers
sent while no bridge ran waited in the broker's queue for it.  Counted end to end with
sequence numbers; the docs' fault table (docs/bridge.md) quotes this test."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SBUS, stop_process, wait_for_socket
from faultkit import until
from mqtt_hosts import Bridge, Mosquitto, Peer, _counters
from test_bridge import _free_port, publish, user_units
from test_bridge_faults import Stream

from sbus import Client
from sbus.bridge.shell import _kept_patterns
from sbus.packetio import discard, start_peeking

pytestmark = pytest.mark.timeout(240)

UNIT = "sbus-bridge@t.service"


def _status(manager) -> str:
    return manager.show(UNIT, "StatusText")["StatusText"]


def subscriptions(manager) -> int | None:
    """The broker's count of subscriptions (its STATUS=, every second)."""
    found = re.search(r"(\d+) subscriptions", manager.show("sbus.service", "StatusText")[
        "StatusText"])
    return int(found.group(1)) if found else None


class Managed:
    """A bridge exporting ``seq/`` at QoS 1 as its unit runs it, in a user manager with
    sbus.socket, mosquitto with an MQTT peer on ``seq/#``; a numbered `Stream`."""

    def __init__(self, manager, config: Path, peer: Peer) -> None:
        self.manager, self.config, self.peer = manager, config, peer
        self.stream: Stream | None = None

    def status(self) -> str:
        return _status(self.manager)

    def start_stream(self, rate: float) -> Stream:
        self.stream = Stream(str(self.manager.runtime / "sbus.socket"), rate=rate)
        return self.stream

    def kill(self, restarts: int) -> None:
        """kill -9 of the bridge; back (its *restarts*-th automatic restart) and up."""
        os.kill(int(self.manager.show(UNIT, "MainPID")["MainPID"]), signal.SIGKILL)
        until(lambda: self.manager.show(UNIT, "NRestarts")["NRestarts"] == str(restarts)
              and self.status().startswith("bus up, mqtt up"), "back after the kill", 30)

    def copies_counted(self, sent: int) -> dict[str, int]:
        """Every number of *sent* reached the peer; the copies are at most `resent`."""
        got = Counter(collect_numbers(self.peer, sent, timeout=40))
        lost = sorted(set(range(sent)) - set(got))
        assert not lost, (len(lost), lost[:20], sent)
        counters = _counters(self.status())
        assert sum(got.values()) - sent <= counters["resent"], (got.total(), counters)
        assert counters["dropped"] == 0, counters
        return counters


@contextlib.contextmanager
def managed_bridge(tmp: Path, client_id: str, unit_extra: str = "") -> Iterator[Managed]:
    """`Managed`, started (*unit_extra*: a drop-in for the bridge's unit), torn down."""
    from systemd_usermgr import UserManager

    port = _free_port()
    broker = Mosquitto(tmp, [("127.0.0.1", port)]).start()
    base = Path(tempfile.mkdtemp(prefix="sbus-kept-", dir="/tmp"))
    manager = UserManager(base).start()
    m = None
    try:
        config = user_units(manager) / "bridge-t.toml"
        config.write_text(
            f'mqtt = "mqtt://127.0.0.1:{port}"\nclient-id = "{client_id}"\n'
            '[[export]]\npatterns = ["seq/"]\nqos = 1\n')
        if unit_extra:
            dropin = manager.unit_dir / f"{UNIT}.d"
            dropin.mkdir(parents=True)
            (dropin / "extra.conf").write_text(unit_extra)
            manager.systemctl("daemon-reload")
        m = Managed(manager, config, Peer(broker.sock, ["seq/#"]))
        manager.systemctl("start", "sbus.socket", UNIT)
        until(lambda: m.status().startswith("bus up, mqtt up"), "the bridge up", 30)
        yield m
    finally:
        if m is not None:
            if m.stream is not None and not m.stream._stop.is_set():
                m.stream.stop()
            m.peer.close()
        leftover = manager.stop()
        broker.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert not leftover


def test_a_restarted_or_killed_bridge_takes_up_its_bus_connection(short_tmp) -> None:
    """Numbered messages at 200/s on the local bus, exported at QoS 1: `systemctl restart`
    of the bridge, then `kill -9` of it (back after the unit's RestartSec=5s): the MQTT
    subscriber gets every number; copies (MQTT's at-least-once after the crash) are at
    most what the bridge counted as `resent`.  A pattern added to the configuration
    before the restart and taken out before the crash is subscribed and unsubscribed on
    the connection taken up; the one kept throughout is never held twice."""
    with managed_bridge(short_tmp, "kept") as m:
        manager, config = m.manager, m.config
        stream = m.start_stream(rate=200)
        stream.wait_sent(200)
        config.write_text(config.read_text().replace('"seq/"', '"seq/", "more/"'))
        manager.systemctl("restart", UNIT)  # with one pattern more
        stream.wait_sent(stream.sent + 300)
        until(lambda: subscriptions(manager) == 2, "seq/ held once, more/ added", 30)
        config.write_text(config.read_text().replace(', "more/"', ''))
        m.kill(1)  # and back, with more/ gone again
        stream.wait_sent(stream.sent + 200)
        until(lambda: subscriptions(manager) == 1, "more/ unsubscribed", 30)
        m.copies_counted(stream.stop())  # across a restart and a kill -9
        assert manager.show(UNIT, "NFileDescriptorStore")["NFileDescriptorStore"] == "1"
        manager.systemctl("stop", UNIT)
        assert manager.show(UNIT, "Result")["Result"] == "success"


def test_kill9s_of_a_busy_exporting_bridge_lose_nothing(short_tmp) -> None:
    """Numbered messages at 5,000/s, exported at QoS 1, and the bridge killed (-9) five
    times, each time once it is back and exporting (the unit restarts it at once here):
    whatever batch a kill catches between its read and the spool's write is read again
    by the next bridge (`AsyncClient`'s *confirm_reads*), so the MQTT subscriber gets
    every number, and the copies are at most what the bridges counted as `resent`."""
    quick = "[Unit]\nStartLimitIntervalSec=0\n[Service]\nRestartSec=100ms\n"
    with managed_bridge(short_tmp, "kills", quick) as m:
        stream = m.start_stream(rate=5000)
        for kills in range(1, 6):
            stream.wait_sent(stream.sent + 1500)
            m.kill(kills)
        stream.wait_sent(stream.sent + 1500)
        m.copies_counted(stream.stop())


def test_a_kept_connection_is_taken_up_only_with_the_record_of_that_very_socket() -> None:
    """The patterns state.json records are believed only for the socket they were
    recorded with (its inode): another socket's record, or a damaged one, lets the kept
    connection go instead of taking it up with the wrong patterns."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        mine = {"inode": os.fstat(a.fileno()).st_ino, "patterns": ["seq/", "x/\udcff"]}
        assert _kept_patterns(mine, a) == [b"seq/", b"x/\xff"]
        assert _kept_patterns(mine, b) is None  # the other end: another socket
        assert _kept_patterns(mine, None) is None
        for damaged in (None, [], {"inode": mine["inode"]}, {**mine, "patterns": "seq/"},
                        {**mine, "inode": str(mine["inode"])}, {**mine, "patterns": [1]},
                        {**mine, "patterns": [f"p{i}" for i in range(4097)]}):
            assert _kept_patterns(damaged, a) is None, damaged


#: Runs a command as descriptor 3 of the process the service manager would have started,
#: named as the fd store names it (sd_listen_fds(3)): the hand-over without a manager.
AS_STORED = ("import os, sys; os.dup2(int(sys.argv[1]), 3); "
             "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', "
             "LISTEN_FDNAMES='bus'); os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


class Rig:
    """A local broker, mosquitto with an MQTT peer on ``seq/#``, and a bridge exporting
    ``seq/`` (not started: `start_as_stored` starts it on a connection `left`)."""

    def __init__(self, tmp: Path, *serve_args: str) -> None:
        self.bus = str(tmp / "bus.sock")
        self.serve = subprocess.Popen([*SBUS, "serve", "--address", self.bus, *serve_args],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port = _free_port()
        self.broker = Mosquitto(tmp, [("127.0.0.1", port)]).start()
        self.peer = Peer(self.broker.sock, ["seq/#"])
        self.br = Bridge(tmp, "kept", self.bus, f"mqtt://127.0.0.1:{port}",
                         ["--export", "seq/"])
        wait_for_socket(self.bus, self.serve)

    def left(self) -> Client:
        """A connection as a bridge leaves it: subscribed to seq/, its opening answered."""
        c = Client(self.bus)
        c.set_flood(soft="queue", hard="discard")
        c.subscribe("seq/")
        c.whoami()
        return c

    def saved(self, state: dict) -> Path:
        """The bridge's state directory, holding *state* as its state.json."""
        path = Path(self.br.state_dir)
        path.mkdir()
        (path / "state.json").write_text(json.dumps(state))
        return path

    def close(self) -> None:
        self.serve.send_signal(signal.SIGCONT)
        self.br.close()
        self.peer.close()
        self.broker.stop()
        stop_process(self.serve)


@contextlib.contextmanager
def rig(tmp: Path, *serve_args: str) -> Iterator[Rig]:
    r = Rig(tmp, *serve_args)
    try:
        yield r
    finally:
        r.close()


def test_what_the_broker_dropped_for_a_kept_connection_is_counted(short_tmp) -> None:
    """A connection left subscribed with an answer unread and a backlog larger than the
    broker's queue for it (16 KiB) is taken up: every message the broker did not drop
    is exported, the dropped ones are the bridge's `dropped` (the broker's report on that
    connection), and the sum is every message published; the earlier process's unread
    answer is not taken for one of the bridge's (it comes up, and its export works).  No
    clean exit is on record: the log says that what a kill -9 caught is read again."""
    with rig(short_tmp, "--queue-limit", "16K") as r:
        left = r.left()
        left.send_packet(left.session.ask())  # its answer stays unread
        sent = 3000
        publish(r.bus, [("seq/x", b"%d:%s" % (i, b"." * 100)) for i in range(sent)])
        r.saved({"bus": {"inode": os.fstat(left.fileno()).st_ino, "patterns": ["seq/"]}})
        start_as_stored(r.br, left)
        c = r.br.wait_counters(lambda c: c["exported"] + c["dropped"] >= sent, timeout=30)
        assert c["exported"] + c["dropped"] == sent, c
        assert 0 < c["dropped"] < sent, c  # the backlog was over the broker's queue
        got = collect_numbers(r.peer, c["exported"])
        assert len(got) == c["exported"] == len(set(got)), (len(got), c)
        log = r.br.log.read_text()
        assert "took up the bus connection" in log
        assert "what it had read from the bus and not yet spooled is read again" in log
        assert "read again" not in log.split("is read again")[1]  # (it read nothing)
        publish(r.bus, [("seq/x", b"%d:after" % sent)])  # its subscription works on
        assert collect_numbers(r.peer, c["exported"] + 1)[-1] == sent


@pytest.mark.parametrize("before", ["first time", "died reading it again"])
def test_what_a_killed_bridge_had_read_and_not_dealt_with_is_read_again(short_tmp,
                                                                        before) -> None:
    """The kill -9 between a read and the spool's write, made exact: the earlier process
    dealt with messages 0-29 (took them off the socket, as `confirm_reads` does), had
    read 30-69 (a peek: still on the socket) and not 70-99 when it died.  The bridge
    that takes the connection up exports 30-99, each once; 30-69 are counted in
    `resent` (perhaps second copies) and the log says how many packets it read again;
    state.json says it is reading them again until it has dealt with them.  Had the
    earlier process itself died while reading them again (its state.json says so),
    they may be what kills bridges: dropped, counted, said, and 70-99 exported."""
    with rig(short_tmp) as r:
        left = r.left()
        publish(r.bus, [("seq/x", b"%d:" % i) for i in range(100)])
        fd = left.fileno()
        start_peeking(fd)

        def queued() -> int:  # (peeked, then peeked again from the first: nothing taken)
            n = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    left.sock.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    n += 1
            start_peeking(fd)
            return n
        until(lambda: queued() == 100, "the 100 messages queued on the connection", 10)
        assert discard(fd, 30) == 30  # dealt with
        read = [left.sock.recv(64, socket.MSG_PEEK) for _ in range(40)]  # read, no more
        assert read[0].endswith(b"30:") and read[-1].endswith(b"69:")
        again = before != "first time"
        state = r.saved({"bus": {"inode": os.fstat(fd).st_ino, "patterns": ["seq/"]},
                         "rereading": again})
        start_as_stored(r.br, left)
        want = range(70, 100) if again else range(30, 100)
        r.br.wait_counters(lambda c: c["exported"] >= len(want), timeout=30)
        got = collect_numbers(r.peer, len(want))
        time.sleep(0.5)  # (none more comes)
        assert sorted(got + [int(p.split(b":")[0]) for _, p, _ in list(r.peer.got)[
            len(got):]]) == list(want)
        c = r.br.counters()
        log = r.br.log.read_text()
        if again:
            assert (c["exported"], c["resent"], c["dropped"]) == (30, 0, 40), c
            assert "those 40 messages are dropped (counted), not read a third time" in log
        else:
            assert (c["exported"], c["resent"], c["dropped"]) == (70, 40, 0), c
            assert "held 40 packets its earlier process had received" in log, log
        until(lambda: json.loads((state / "state.json").read_text())["rereading"] is False,
              "state.json: nothing left to read again", 10)


@pytest.mark.parametrize("record", ["none", "another socket's", "damaged"])
def test_a_kept_connection_without_its_record_is_let_go_and_said(short_tmp, record) -> None:
    """The fd store gives the bridge a connection that state.json has no record of (or a
    record of another socket, or a damaged one): it is not taken up (its patterns are
    not known), the log says so and that its queue is lost, and the bridge serves on a
    connection of its own, each message once."""
    with rig(short_tmp) as r:
        left = r.left()
        publish(r.bus, [("seq/x", b"0:queued")])
        r.saved({"none": {}, "another socket's": {"bus": {"inode": 1, "patterns": ["seq/"]}},
                 "damaged": {"bus": {"inode": os.fstat(left.fileno()).st_ino,
                                     "patterns": {"seq/": 1}}}}[record])
        start_as_stored(r.br, left)
        r.br.wait_status(lambda s: s.startswith("bus up, mqtt up"), timeout=20)
        until(lambda: "is not taken up" in r.br.log.read_text(), "said", 10)
        publish(r.bus, [("seq/x", b"1:after")])
        assert collect_numbers(r.peer, 1) == [1]  # once, on the bridge's own connection
        assert collect_numbers(r.peer, 2, timeout=0.5) == [1]


def test_a_bridge_killed_while_it_takes_up_the_connection_leaves_it_to_the_next(
        short_tmp) -> None:
    """kill -9 of a bridge that is taking the kept connection up while the local broker
    is stopped (SIGSTOP: nothing it sends is answered): state.json still records that
    connection, so the next bridge takes it up too and exports what waited on it, each
    message at least once, copies at most `resent`.  (A first version saved state.json
    without the record at its start, so the next bridge let the connection go; the next
    read the backlog into memory while it waited for the broker's answers, and lost it
    to the kill.)"""
    with rig(short_tmp) as r:
        left = r.left()
        publish(r.bus, [("seq/x", b"%d:queued" % i) for i in range(100)])
        record = {"inode": os.fstat(left.fileno()).st_ino, "patterns": ["seq/"]}
        state = r.saved({"bus": record, "clean_exit": True})
        r.serve.send_signal(signal.SIGSTOP)
        start_as_stored(r.br, left, keep=True)  # (the store keeps its copy)
        until(lambda: "took up the bus connection" in r.br.log.read_text(), "taking up", 20)
        assert json.loads((state / "state.json").read_text())["bus"] == record
        r.br.proc.kill()
        r.br.proc.wait()
        r.serve.send_signal(signal.SIGCONT)
        start_as_stored(r.br, left)
        got = collect_numbers(r.peer, 100)
        assert set(got) == set(range(100)), r.br.log.read_text()
        copies = len(got) - 100
        assert copies <= r.br.wait_counters(lambda c: c["resent"] >= copies)["resent"]
        assert "is not taken up" not in r.br.log.read_text()


def test_a_record_of_many_patterns_not_held_costs_a_few_log_lines(short_tmp) -> None:
    """A record (written by hand) of 1,000 patterns the broker does not hold: the bridge
    unsubscribes each, the broker refuses each, and the log gets the allowance's few
    lines, not a thousand (the audit saw one line per pattern); the bridge serves on."""
    with rig(short_tmp) as r:
        left = r.left()
        patterns = ["seq/", *(f"gone{i}/" for i in range(1000))]
        r.saved({"bus": {"inode": os.fstat(left.fileno()).st_ino, "patterns": patterns}})
        start_as_stored(r.br, left)
        r.br.wait_status(lambda s: s.startswith("bus up, mqtt up"), timeout=20)
        publish(r.bus, [("seq/x", b"0:after")])
        assert collect_numbers(r.peer, 1) == [0]
        refusals = r.br.log.read_text().count("the bus refused unsub")
        assert 1 <= refusals <= 10, refusals


def start_as_stored(br: Bridge, left: Client, keep: bool = False) -> None:
    """Start *br* as the unit would after a restart: *left*'s connection handed to it as
    the fd store's ``bus`` (`AS_STORED`); ours is closed unless *keep* (as the store
    keeps its copy), the bridge's copy stays."""
    cmd = [*SBUS, "-vv", "bridge", "--address", br.address, "--mqtt", br.mqtt_url,
           "--state-dir", br.state_dir, *br.args]
    env = {**os.environ, "NOTIFY_SOCKET": br.notify_path}
    with open(br.log, "ab") as log:
        br.proc = subprocess.Popen(
            [sys.executable, "-c", AS_STORED, str(left.fileno()), *cmd[1:]],
            pass_fds=(left.fileno(),), stdout=log, stderr=log, env=env)
    if not keep:
        left.close()


def collect_numbers(peer: Peer, n: int, timeout: float = 20.0) -> list[int]:
    """The numbers the MQTT peer got (copies too), once *n* distinct ones came (or after
    *timeout* seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        got = [int(p.split(b":")[0]) for _, p, _ in list(peer.got)]
        if len(set(got)) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)
