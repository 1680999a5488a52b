"""Trust, round 3: what shows or keeps client bytes — the recorder, sbus-top, the printing
commands — attacked by another user (a forked child that setuid, as in
tests/test_attacks_broker.py), through real processes.

Each must survive what the attacker sends, count what it cannot keep, stay responsive,
and show every byte the attacker chose escaped and brief.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import SBUS, raw, recorded_pairs, stop_process, sync
from faultkit import NOBODY, as_user

from sbus.defaults import RECV_BUFFER as RECV_LIMIT  # about what the recorder receives whole
from sbus.journal.gaps import DROPPED, OVERSIZED
from sbus.journal.read import read_gaps
from sbus.journal.store import records


def _publish(pipe, address: str, packets: list[bytes]) -> None:
    """As the attacker: send *packets*, wait until the broker took them, say how many."""
    with raw(address, timeout=30) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        for p in packets:
            s.send(p)
        sync(s)
    pipe.send(len(packets))


def attack(address: str, packets: list[bytes]) -> int:
    proc, pipe = as_user(NOBODY, _publish, address, packets)
    assert pipe.poll(60), "the attacker never finished"
    sent = pipe.recv()
    proc.join(10)
    return sent


def _recorder(address: str, journal: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([*SBUS, "record", "", "--dir", str(journal), "--address", address],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def _wait_recorded(journal: Path, key: bytes, timeout: float = 20) -> list[tuple[bytes, bytes]]:
    deadline = time.monotonic() + timeout
    while True:
        pairs = recorded_pairs(journal)
        if any(k == key for k, _ in pairs):
            return pairs
        assert time.monotonic() < deadline, f"{key!r} never recorded"
        time.sleep(0.1)


def _wait_line(log: Path, text: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in {log.read_text()}"
        time.sleep(0.1)
    return log.read_text(errors="replace")


def test_recorder_counts_messages_over_its_receive_limit_and_never_records_them_cut(
        make_broker, short_tmp):
    """A broker started with ``--max-message 4M`` forwards a 2 MB message; the recorder
    receives at most `RECV_LIMIT` bytes a packet.  Before: the message was recorded cut to
    1 MiB, silently.  Now: not recorded, counted, one escaped line, and recording goes on."""
    os.chmod(short_tmp, 0o755)
    b = make_broker("--max-message", "4M")
    journal, log = short_tmp / "j", short_tmp / "record.log"
    rec = _recorder(b.address, journal, log)
    try:
        _wait_line(log, "recording into")
        evil = b"big/\x1b]0;owned\x07\xff"
        sent = attack(b.address, [b"MSG first\0a",
                                  *[b"MSG " + evil + b"\0" + b"B" * (2 * RECV_LIMIT)] * 3,
                                  b"MSG ctl/\x1b[2J\xfe\0x" + b"y" * (RECV_LIMIT - 20),
                                  b"MSG !/cred/0/0/%d/x\0secret" % rec.pid,  # not its own
                                  b"CMSG client/status\0\x1b[2J", b"MSG last\0z"])
        assert sent == 8
        pairs = _wait_recorded(journal, b"last")
        assert [k for k, _ in pairs] == [b"first", b"ctl/\x1b[2J\xfe", b"last"]
        assert all(len(p) < RECV_LIMIT for _, p in pairs)
        text = _wait_line(log, "receive limit not recorded")
        assert rec.poll() is None, text
    finally:
        stop_process(rec)
    text = log.read_text(errors="replace")
    told = [line for line in text.splitlines() if "receive limit" in line]
    assert len(told) == 1, text  # three in a burst: one line
    assert "'big/\\x1b]0;owned\\x07\\xff'" in told[0] and "\x1b" not in text, text
    assert re.search(r"3 over \d+ bytes not recorded", text), text
    assert rec.returncode == 0
    # noted where they were, between "first" (seq 1) and "ctl/…" (seq 2), as closely as
    # the batches they came in say
    gaps = list(read_gaps(journal))
    assert sum(g.lost for g in gaps) == 3 and all(
        g.kind == OVERSIZED and g.after <= 1 and g.before >= 2 for g in gaps), gaps


def test_recorder_stopped_under_a_flood_counts_every_message_it_lost(broker, short_tmp):
    """SIGSTOP the recorder while another user floods 12 MB (three times the broker's queue
    for it), SIGCONT: every message is either recorded, in order, or counted as dropped by
    the broker in the recorder's summary; the recorder goes on recording after it."""
    os.chmod(short_tmp, 0o755)
    journal, log = short_tmp / "j", short_tmp / "record.log"
    rec = _recorder(broker.address, journal, log)
    try:
        _wait_line(log, "recording into")
        attack(broker.address, [b"MSG first\0a"])
        _wait_recorded(journal, b"first")
        rec.send_signal(signal.SIGSTOP)
        n = 12_000
        try:
            attack(broker.address, [b"MSG flood/%d\0" % i + b"%08d" % i + b"f" * 992
                                    for i in range(n)])
        finally:
            rec.send_signal(signal.SIGCONT)
        attack(broker.address, [b"MSG last\0z"])
        pairs = _wait_recorded(journal, b"last")
    finally:
        stop_process(rec)
    seqs = [int(p[:8]) for k, p in pairs if k.startswith(b"flood/")]
    assert seqs == sorted(set(seqs)) and seqs, "recorded out of order or twice"
    text = log.read_text(errors="replace")
    m = re.search(r", broker dropped (\d+)", text)  # (the exit line's total)
    dropped = int(m.group(1)) if m else 0
    assert dropped > 0, text  # 12 MB cannot all wait in a 4 MB queue
    told = re.findall(r"the broker dropped (\d+) message\(s\) for the recorder .*; (\d+) so far",
                      text)  # a line at most every 5 s, however many reports came
    assert 1 <= len(told) <= 2 and int(told[-1][1]) <= dropped, text
    assert len(seqs) + dropped == n, (len(seqs), dropped, text)
    assert rec.returncode == 0
    # The journal itself says where the dropped messages were: every one of them lies in a
    # `dropped` gap, between the records the gap names (0: before the first, one past the
    # last: the next one recorded), and the gaps count them all.
    gaps = [g for g in read_gaps(journal) if g.kind == DROPPED]
    assert sum(g.lost for g in gaps) == dropped, gaps
    number = {seq: int(p[:8]) if k.startswith(b"flood/") else (-1 if k == b"first" else n)
              for seq, _, k, p in records(journal)}
    for m in set(range(n)) - set(seqs):
        assert any(number.get(g.after, -2) < m < number.get(g.before, n) for g in gaps), (m, gaps)


def test_top_redraw_stays_quick_however_long_the_keys_it_shows(broker, short_tmp):
    """Twenty 250 KB keys of invalid UTF-8 from another user: each redraw escaped every
    key whole (twice), ~80 s for one ``sbus-top --once`` screen on this machine, the live
    screen frozen as long.  Now a key cell escapes at most a few hundred bytes."""
    os.chmod(short_tmp, 0o755)
    top = subprocess.Popen([sys.executable, "-m", "sbus.top", "--address", broker.address,
                            "--once", "--seconds", "3"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=dict(os.environ, COLUMNS="120",
                                                            LINES="40"))
    try:
        assert "counting" in top.stderr.readline().decode()  # subscribed, counts from now
        attack(broker.address, [b"MSG k%02d/" % i + b"\xff" * 250_000 + b"\0x"
                                for i in range(20)]
               + [b"MSG evil/\x1b[2J\xe2\x80\xae\0\x1b]0;owned\x07"])
        started = time.monotonic()
        out, err = top.communicate(timeout=120)
        took = time.monotonic() - started
    finally:
        stop_process(top)
    text = out.decode()
    assert top.returncode == 0, err
    assert took < 15, f"the screen took {took:.1f} s to draw"
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert "evil/\\x1b[2J\\u202e" in text, text
    assert "k01/\\xff\\xff" in text, text


def test_top_json_snapshot_shows_no_terminal_control_a_client_chose(broker, short_tmp):
    """``sbus-top --json`` printed keys with ``ensure_ascii=False``: JSON escapes C0
    controls but not C1 ones (``\\u009b`` is CSI to a terminal) nor bidi overrides, so
    another user's key reached the terminal raw.  Now the snapshot is ASCII."""
    os.chmod(short_tmp, 0o755)
    top = subprocess.Popen([sys.executable, "-m", "sbus.top", "--address", broker.address,
                            "--json", "--seconds", "2"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        assert "counting" in top.stderr.readline().decode()  # subscribed, counts from now
        attack(broker.address, [b"MSG evil/\xc2\x9b2J\xe2\x80\xae\xe2\x80\xa8\0x"])
        out, err = top.communicate(timeout=60)
    finally:
        stop_process(top)
    assert top.returncode == 0, err
    assert out.isascii(), out
    assert [r["key"] for r in json.loads(out)["rows"]] == ["evil/\x9b2J\u202e\u2028"]


def test_top_memory_stays_within_max_bytes_under_long_keys(broker, short_tmp):
    """Another user publishes 400 keys of 250 KB.  The keys table is bounded by
    ``--max-bytes`` (2M here), but the recent messages kept their whole keys besides: the
    real sbus-top grew ~14.7 MB.  Now a recent key keeps 1 KB (its cut is counted)."""
    from faultkit import rss_kib

    os.chmod(short_tmp, 0o755)
    top = subprocess.Popen([sys.executable, "-m", "sbus.top", "--address", broker.address,
                            "--json", "--seconds", "60", "--idle", "1", "--max-bytes", "2M",
                            "--limit", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert "counting" in top.stderr.readline().decode()  # started: its base size
        base = rss_kib(top.pid)
        attack(broker.address, [b"MSG %04d/" % i + b"k" * 250_000 + b"\0p" for i in range(400)])
        time.sleep(0.5)
        grown = rss_kib(top.pid) - base
        out, err = top.communicate(timeout=60)
    finally:
        stop_process(top)
    assert top.returncode == 0, err
    snap = json.loads(out)
    assert snap["total"] + snap["dropped_by_broker"] == 400, snap
    assert snap["evicted"] >= snap["total"] - 10, snap["evicted"]
    assert grown < 8 * 1024, f"sbus-top grew {grown} KiB with --max-bytes 2M"
    assert all(r["key"].endswith("…(+248981 bytes)") for r in snap["recent"]), snap["recent"][0]


def _counted(screen: str) -> int:
    """Keys sbus-top shows plus messages it says the broker dropped for it."""
    m = re.search(r"keys (\d+)(?:\s+dropped by broker (\d+))?", screen)
    return 0 if m is None else int(m.group(1)) + int(m.group(2) or 0)


def test_live_top_answers_keys_while_showing_long_hostile_keys(broker, short_tmp):
    """The live screen in a real terminal (tmux): after another user's twenty 250 KB keys
    of invalid UTF-8 and a key that would set the window title, the screen shows them
    escaped, keeps counting, and `q` quits at once (before: each redraw took ~80 s)."""
    from test_top_tmux import Tmux

    os.chmod(short_tmp, 0o755)
    tmux = Tmux(short_tmp)
    try:
        tmux.type_line(f"{sys.executable} -m sbus.top --address {broker.address} "
                       "--interval 0.1 --sort key")
        tmux.wait(lambda s: "● connected" in s, "sbus-top connected")
        attack(broker.address, [b"MSG k%02d/" % i + b"\xff" * 250_000 + b"\0x"
                                for i in range(20)]
               + [b"MSG a/\x1b]2;owned\x07\xe2\x80\xae\0\x1b[2J"])
        # every one counted: shown, or dropped by the broker for a top slow under load
        # (5 MB at once against its 4 MiB queue there)
        screen = tmux.wait(lambda s: _counted(s) == 21 and "a/\\x1b]2;owned\\x07\\u202e" in s,
                           "the hostile keys, escaped", timeout=10)
        assert "k01/\\xff\\xff" in screen or "dropped by broker" in screen
        title = subprocess.run([*tmux.base, "display-message", "-p", "-t", "top",
                                "#{pane_title}"], capture_output=True, text=True).stdout
        assert "owned" not in title
        started = time.monotonic()
        tmux.send("q")
        tmux.wait(lambda s: "sbus-top" not in s and s.rstrip().endswith(("$", "#")),
                  "the shell prompt back", timeout=10)
        assert time.monotonic() - started < 5
    finally:
        tmux.kill()
