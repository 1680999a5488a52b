"""The recorder's journal: format, sealing, recovery after kill -9, retention, and
``sbus record`` against a real broker."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from array import array
from pathlib import Path

import pytest
from conftest import SBUS, raw, sync
from faultkit import until

from sbus.defaults import parse_duration, parse_size
from sbus.journal import format as fmt
from sbus.journal import gaps
from sbus.journal.read import read_gaps
from sbus.journal.record import QUIET
from sbus.journal.retention import SegmentAge, expired
from sbus.journal.store import (
    OPEN_SUFFIX,
    SUFFIX,
    TMP_SUFFIX,
    JournalError,
    JournalWriter,
    list_segments,
    records,
    segment_blocks,
)

KEYS = [b"a/b", b"\xff\xfe/not-utf8", b"", b"x" * 300]
PAYLOADS = [b"\0\0nul\0", b"", b"\xff" * 1000, b"plain"]


def test_block_round_trip_keeps_bytes_exact():
    data = fmt.encode_block(7, array("q", [1, 2, 3, 4]), KEYS, PAYLOADS)
    assert len(data) % 8 == 0 and len(data) == fmt.block_size(4, sum(map(len, KEYS)),
                                                               sum(map(len, PAYLOADS)))
    block, end = fmt.decode_block(data + b"tail")
    assert end == len(data)
    assert list(block.records()) == [(7 + i, i + 1, KEYS[i], PAYLOADS[i]) for i in range(4)]


def test_torn_or_corrupt_block_is_rejected():
    data = fmt.encode_block(1, array("q", [5, 5]), [b"k", b"k"], [b"p1", b"p2"])
    with pytest.raises(fmt.FormatError, match="truncated"):
        fmt.decode_block(data[:-3])
    bad = bytearray(data)
    bad[-9] ^= 1
    with pytest.raises(fmt.FormatError, match="checksum"):
        fmt.decode_block(bytes(bad))
    with pytest.raises(ValueError):
        fmt.encode_block(1, array("q"), [], [])


def fill(w: JournalWriter, n: int, start: int = 0, ts: int = 10**18) -> list[tuple]:
    out = []
    for i in range(start, start + n):
        key, payload = b"k/%d" % (i % 5), b"\0payload %d\0" % i
        w.append(ts + i, [key], [payload])
        out.append((key, payload))
        if i % 37 == 0:
            w.flush()
    return out


def test_writer_rotates_seals_and_reads_back(tmp_path: Path):
    with JournalWriter(tmp_path, segment_bytes=4096, fsync=False) as w:
        sent = fill(w, 500)
    segs = list_segments(tmp_path)
    assert len(segs) > 3 and all(s.sealed for s in segs)
    assert not list(tmp_path.glob("*" + OPEN_SUFFIX))
    got = list(records(tmp_path))
    assert [r[0] for r in got] == list(range(1, 501))
    assert [(r[2], r[3]) for r in got] == sent
    # The index of a sealed segment agrees with a scan of its blocks.
    with open(segs[0].path, "rb") as f:
        from sbus.journal.store import scan_blocks
        assert scan_blocks(f) == segment_blocks(segs[0])


def test_time_rotation_and_sequence_resume(tmp_path: Path):
    w = JournalWriter(tmp_path, segment_seconds=10, fsync=False)
    fill(w, 10)
    w.flush()
    w.tick(time.monotonic() + 11)
    assert [s.sealed for s in list_segments(tmp_path)] == [True]
    fill(w, 5, start=10)
    w.close()
    w2 = JournalWriter(tmp_path, fsync=False)
    assert w2.next_seq == 16
    w2.close()


def test_one_writer_per_directory(tmp_path: Path):
    with JournalWriter(tmp_path, fsync=False):
        with pytest.raises(JournalError, match="in use"):
            JournalWriter(tmp_path)


def test_recovery_cuts_torn_tail_and_resumes(tmp_path: Path):
    """A writer killed mid-write: the torn block goes, whole blocks stay, seq resumes."""
    script = f"""
import os, signal
from sbus.journal.store import JournalWriter
w = JournalWriter({str(tmp_path)!r}, fsync=False)
for i in range(100):
    w.append(1, [b"k"], [b"%d" % i])
    if i % 10 == 9:
        w.flush()
w.append(1, [b"k"], [b"lost"])          # buffered only: a kill loses it
os.write(w._fd, b"SBJB" + b"\\x07" * 40)  # and a torn block in the file
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([SBUS[0], "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    (seg,) = list_segments(tmp_path)
    assert not seg.sealed
    with JournalWriter(tmp_path, fsync=False) as w:
        assert w.next_seq == 101
        w.append(2, [b"k"], [b"after"])
    segs = list_segments(tmp_path)
    assert all(s.sealed for s in segs)
    got = list(records(tmp_path))
    assert [r[0] for r in got] == list(range(1, 102))
    assert [r[3] for r in got] == [b"%d" % i for i in range(100)] + [b"after"]


def test_sealed_segment_corruption_is_reported(tmp_path: Path):
    with JournalWriter(tmp_path, fsync=False) as w:
        fill(w, 20)
    (seg,) = list_segments(tmp_path)
    with open(seg.path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"zzz")
    with pytest.raises(JournalError, match="corrupt"):
        segment_blocks(seg)


def test_retention_policy_pure():
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90
    assert parse_size("10G") == 10 << 30 and parse_size("512k") == 512 << 10
    for bad in ("7x", "", "-1d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    day = 86400 * 10**9
    segs = [SegmentAge("a", 100, 1 * day), SegmentAge("b", 100, 5 * day),
            SegmentAge("c", 100, 9 * day)]
    assert expired(segs, 10 * day, keep_seconds=7 * 86400) == ["a"]
    assert expired(segs, 10 * day, keep_bytes=250) == ["a"]
    assert expired(segs, 10 * day, keep_bytes=250, live_bytes=100) == ["a", "b"]
    assert expired(segs, 10 * day) == []


def test_retention_deletes_oldest_sealed_segments(tmp_path: Path):
    now = time.time_ns()
    with JournalWriter(tmp_path, segment_bytes=2048, fsync=False, keep_bytes=6000) as w:
        fill(w, 400, ts=now)
    segs = list_segments(tmp_path)
    assert sum(s.path.stat().st_size for s in segs) <= 6000
    got = list(records(tmp_path))
    assert got[-1][0] == 400 and got[0][0] > 1  # the newest kept, the oldest gone
    assert [r[0] for r in got] == list(range(got[0][0], 401))
    w = JournalWriter(tmp_path, fsync=False, keep_seconds=3600)
    assert list_segments(tmp_path) == segs  # nothing is an hour old yet
    old = w.apply_retention(now_ns=now + 10**9 * 7200)
    assert len(old) == len(segs) and list_segments(tmp_path) == []
    assert w.next_seq == 401  # sequence numbers never go back, even over an emptied journal
    w.close()


# -- sbus record against a real broker --------------------------------------------------


def start_recorder(address: str, directory: Path, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([*SBUS, "record", "", "--dir", str(directory), "--address", address,
                             *args], stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert "recording into" in line, line + proc.stderr.read()
    return proc


def wait_records(directory: Path, n: int, timeout: float = 10) -> list[tuple]:
    deadline = time.monotonic() + timeout
    while True:
        got = list(records(directory))
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_record_survives_kill9_and_resumes_sequence(broker, tmp_path: Path):
    jdir = tmp_path / "journal"
    rec = start_recorder(broker.address, jdir)
    pub = raw(broker.address)
    for i in range(1000):
        pub.send(b"MSG t/%d\0\0bin\xff%d" % (i % 7, i))
    sync(pub)
    got = wait_records(jdir, 1000)
    assert len(got) == 1000
    rec.send_signal(signal.SIGKILL)
    rec.wait()
    assert [s.sealed for s in list_segments(jdir)] == [False]

    rec = start_recorder(broker.address, jdir)
    for i in range(1000, 1500):
        pub.send(b"MSG t/%d\0\0bin\xff%d" % (i % 7, i))
    sync(pub)
    wait_records(jdir, 1500)
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(10) == 0
    assert "500 messages" in rec.stderr.read()
    assert all(s.sealed for s in list_segments(jdir))
    got = list(records(jdir))
    assert [r[0] for r in got] == list(range(1, 1501))
    assert [(r[2], r[3]) for r in got] == [
        (b"t/%d" % (i % 7), b"\0bin\xff%d" % i) for i in range(1500)]
    assert all(a[1] <= b[1] for a, b in zip(got, got[1:], strict=False))
    # what no recorder was there to receive is noted: since record 1000's receive time
    (gap,) = read_gaps(jdir)
    assert (gap.kind, gap.after, gap.before, gap.lost) == (gaps.STOPPED, 1000, 1001, None)
    assert gap.from_ns == got[999][1] and gap.from_ns < gap.to_ns <= got[1000][1]
    pub.close()


def test_a_recorder_killed_before_it_wrote_anything_still_leaves_a_gap(broker, tmp_path: Path):
    """kill -9 within the first flush of a new journal: nothing was written, so the next
    recorder starts again at seq 1, and still notes that nothing was recorded before."""
    jdir = tmp_path / "journal"
    rec = start_recorder(broker.address, jdir, "--flush", "60")
    pub = raw(broker.address)
    for i in range(10):
        pub.send(b"MSG k\0lost %d" % i)
    sync(pub)
    rec.kill()
    rec.wait()
    assert list(records(jdir)) == [] and list(read_gaps(jdir)) == []
    rec = start_recorder(broker.address, jdir)
    pub.send(b"MSG k\0kept")
    sync(pub)
    wait_records(jdir, 1)
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(10) == 0
    assert [(r[0], r[3]) for r in records(jdir)] == [(1, b"kept")]
    assert [(g.kind, g.after, g.before) for g in read_gaps(jdir)] == [(gaps.STOPPED, 0, 1)]
    pub.close()


def test_record_keeps_runs_many_keys_and_large_payloads_in_order(broker, tmp_path: Path):
    """Bursts mixing one-key runs, a new key per message and payloads beyond what the
    batch splitter takes (columns.WIDEST) must all come back byte for byte, in order."""
    jdir = tmp_path / "journal"
    rec = start_recorder(broker.address, jdir)
    pub = raw(broker.address)
    sent = []
    for i in range(3000):
        key = b"run/x" if i % 1000 < 600 else b"many/%d" % i
        size = 200_000 if i % 250 == 7 else 3000 if i % 97 == 0 else i % 90
        payload = (b"\0%d\0" % i + bytes(range(256)) * (size // 256 + 1))[:size]
        pub.send(b"MSG " + key + b"\0" + payload)
        sent.append((key, payload))
    sync(pub)
    got = wait_records(jdir, len(sent))
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(10) == 0
    assert [r[0] for r in got] == list(range(1, len(sent) + 1))
    assert [(r[2], r[3]) for r in got] == sent
    pub.close()


def _stop(proc: subprocess.Popen) -> None:
    """SIGSTOP *proc* and wait until every thread of it is stopped (acted on, not just
    sent)."""
    proc.send_signal(signal.SIGSTOP)
    until(lambda: all(Path(t, "stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
                      for t in Path(f"/proc/{proc.pid}/task").iterdir()),
          "the recorder stopped", every=0.005)


@pytest.mark.parametrize("block", [False, True])
def test_record_behind_by_more_than_the_queue_limit(make_broker, tmp_path: Path, block: bool):
    """A stopped recorder and a 3 MB burst against a 256 KiB queue limit: by default the
    broker drops for the recorder and the recorder reports how many; with ``--block`` the
    publisher waits and nothing is lost."""
    broker = make_broker("--queue-limit", "256k")
    jdir = tmp_path / "journal"
    rec = start_recorder(broker.address, jdir, *(["--block"] if block else []))
    pub = raw(broker.address, timeout=30)
    sent = [b"MSG burst\0%d\0" % i + bytes(30_000) for i in range(100)]
    # Stopped for real before the burst: a signal is acted on only when the recorder next
    # runs, and a recorder woken late in recvmmsg first takes what the broker had already
    # written, so room opens after the broker began dropping and the record has a gap.
    _stop(rec)
    try:
        publisher = threading.Thread(target=lambda: [pub.send(p) for p in sent])
        publisher.start()
        publisher.join(2)
        assert publisher.is_alive() == block  # paused by the broker only when asked to
        if not block:  # all of the burst acted on (dropped or queued) while it is stopped:
            sync(pub)  # else what the broker reads after SIGCONT fits again, after a gap
    finally:
        rec.send_signal(signal.SIGCONT)
    publisher.join(30)
    sync(pub)
    wait_records(jdir, len(sent), timeout=5 if block else 2)
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(10) == 0
    got = list(records(jdir))  # (a stop records what the broker still held: read after it)
    tail = rec.stderr.read()
    payloads = [r[3] for r in got]
    if block:
        assert payloads == [p[len(b"MSG burst\0"):] for p in sent] and "dropped" not in tail
        assert list(read_gaps(jdir)) == []
    else:
        lost = len(sent) - len(got)
        assert lost > 0 and f"broker dropped {lost}" in tail
        assert payloads == [p[len(b"MSG burst\0"):] for p in sent][:len(got)]
        # the journal says so too: the lost end of the burst lies after the last record
        assert [(g.kind, g.lost, g.before) for g in read_gaps(jdir)] == [
            (gaps.DROPPED, lost, len(got) + 1)]
        assert "sbus journal gaps" in tail
    pub.close()


def test_drops_a_killed_broker_never_reported_lie_inside_its_away_gap(make_broker,
                                                                     tmp_path: Path):
    """The broker drops for a stopped recorder (its queue full), then is killed -9 before
    its queue empties, so the drops are never reported: the ``away`` gap spans back to the
    last quiet second, and every message missing lies inside it."""
    broker = make_broker("--queue-limit", "256k")
    jdir = tmp_path / "journal"
    rec = start_recorder(broker.address, jdir)
    pub = raw(broker.address, timeout=30)
    pub.send(b"MSG n\0first")
    sync(pub)
    wait_records(jdir, 1)
    time.sleep(QUIET + 0.2)
    _stop(rec)
    try:
        for i in range(100):  # 3 MB against a 256 KiB queue: most are dropped
            pub.send(b"MSG n\0%04d" % i + bytes(30_000))
        sync(pub)
        broker.proc.kill()
        broker.proc.wait()
    finally:
        rec.send_signal(signal.SIGCONT)
    pub.close()
    broker.start()
    pub = raw(broker.address)
    until(lambda: _reach(pub, b"n").endswith(b"\0" + b"1"), "the recorder subscribed again")
    pub.send(b"MSG n\0last")
    sync(pub)
    until(lambda: list(records(jdir))[-1][3] == b"last", "the last message recorded")
    rec.send_signal(signal.SIGTERM)
    assert rec.wait(10) == 0
    tail = rec.stderr.read()
    got = [(seq, p[:4]) for seq, _, _, p in records(jdir)]
    assert got[0] == (1, b"firs") and got[-1][1] == b"last"
    kept = {int(p) for _, p in got[1:-1]}
    assert len(kept) < 100 and "broker dropped" not in tail, tail  # lost, never reported
    (gap,) = read_gaps(jdir)
    assert gap.kind == gaps.AWAY and gap.after <= 1 and gap.before == got[-1][0], gap


def _reach(sock, key: bytes) -> bytes:
    """The broker's answer to "how many would a message on *key* reach?" """
    sock.send(b"CMSG broker/reach\0" + key)
    return sock.recv(1000)


@pytest.mark.parametrize("block", [False, True])
def test_a_stopped_recorder_records_what_the_broker_held_for_it(broker, tmp_path: Path,
                                                                block: bool):
    """SIGTERM while the broker holds a backlog for the recorder (the recorder was
    stopped while 5,000 messages came): the recorder unsubscribes, takes what was queued
    for it up to the broker's answer to a whoami, and only then seals; every message is
    in the journal, in order, and the exit line counts them."""
    jdir = tmp_path / "journal"
    rec = start_recorder(broker.address, jdir, *(["--block"] if block else []))
    _stop(rec)
    try:
        pub = raw(broker.address)
        for i in range(5000):
            pub.send(b"MSG held/%d\0seq %d" % (i % 3, i))
        sync(pub)  # all of it routed: in the recorder's socket and its queue at the broker
        rec.send_signal(signal.SIGTERM)  # acted on as soon as it runs again
    finally:
        rec.send_signal(signal.SIGCONT)
    assert rec.wait(20) == 0
    tail = rec.stderr.read()
    assert [r[3] for r in records(jdir)] == [b"seq %d" % i for i in range(5000)], tail
    assert "sbus record: 5000 messages in" in tail and "dropped" not in tail
    pub.close()


def test_record_reconnects_through_the_client_and_stops_while_waiting(broker, tmp_path: Path):
    """The broker restarts under a recording: the client says so on stderr, comes back with
    the subscription, and the sequence numbers continue over the gap; a SIGTERM while the
    broker is away ends the wait at once, every segment sealed."""
    jdir = tmp_path / "journal"
    rec = start_recorder(broker.address, jdir)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in rec.stderr], daemon=True).start()
    seen: list[str] = []

    def said(word: str) -> str:
        while True:
            line = lines.get(timeout=10)
            seen.append(line)
            if word in line:
                return line

    def publish(start: int, end: int) -> None:
        pub = raw(broker.address)
        for i in range(start, end):
            pub.send(b"MSG r/%d\0seq %d" % (i % 3, i))
        sync(pub)
        pub.close()

    try:
        publish(0, 300)
        wait_records(jdir, 300)
        time.sleep(QUIET + 0.2)  # a quiet second: the broker surely held nothing for it
        broker.stop()
        assert "reconnecting" in said("reconnecting")
        broker.start()
        assert "not received" in said("reconnected")
        publish(300, 600)
        got = wait_records(jdir, 600)
        assert [r[0] for r in got] == list(range(1, 601))
        assert [r[3] for r in got] == [b"seq %d" % i for i in range(600)]
        broker.stop()
        said("reconnecting")
        started = time.monotonic()
        rec.send_signal(signal.SIGTERM)
        assert rec.wait(10) == 0
        # not after a reconnect that never comes: the stop seals and exports the open
        # segment (pyarrow's import, a Parquet write), 3.5 s once beside four busy loops
        assert time.monotonic() - started < 6
        assert all(s.sealed for s in list_segments(jdir))
        summary = said("messages in")
        assert "600 messages" in summary
        assert "1 reconnect(s): what was published while the broker was away is not in " \
            "the journal" in summary
        assert ", stopped while waiting for the broker to come back; where the journal " \
            "misses messages: sbus journal gaps" in summary
        assert sum("reconnected to" in line for line in seen) == 1  # said once, not logged too
        # the journal notes the one time the broker was away, between records 300 and 301
        # (from the last quiet second on: a broker killed may have dropped messages it had
        # not reported yet; `_Losses`)
        (gap,) = read_gaps(jdir)
        assert (gap.kind, gap.after, gap.before, gap.lost) == (gaps.AWAY, 300, 301, None)
        assert got[299][1] < gap.from_ns < gap.to_ns < got[300][1]
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()


def test_record_bad_options_change_nothing(tmp_path: Path):
    jdir = tmp_path / "j"
    proc = subprocess.run([*SBUS, "record", "a/", "--dir", str(jdir), "--keep", "7x"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert "not a duration" in proc.stderr and "Traceback" not in proc.stderr
    assert not jdir.exists()


def test_record_without_broker_fails_cleanly(short_tmp: Path):
    proc = subprocess.run([*SBUS, "record", "", "--dir", str(short_tmp / "j"),
                           "--address", str(short_tmp / "none.sock")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "cannot connect" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((short_tmp / "j").glob("*" + SUFFIX))


def test_sealing_re_blocks_small_blocks_and_recovery_removes_its_leftovers(tmp_path: Path):
    """A segment of many small (clock-flushed) blocks is sealed as few large ones with the
    same records; a crash inside that re-write leaves a temporary file or an open twin of
    the sealed file, which the next writer removes (readers already prefer the sealed)."""
    import shutil

    from sbus.journal.store import segment_blocks

    with JournalWriter(tmp_path, fsync=False) as w:
        for i in range(500):
            w.append(1_000 + i, [b"k/%d" % (i % 3)], [b"v%d" % i])
            w.flush()
    (seg,) = list_segments(tmp_path)
    assert seg.sealed and len(segment_blocks(seg)) == 1
    rows = list(records(tmp_path))
    assert [r[0] for r in rows] == list(range(1, 501)) and rows[7][2:] == (b"k/1", b"v7")
    shutil.copy(seg.path, tmp_path / (seg.name + ".sbj.open"))  # crash before the unlink
    (tmp_path / (seg.name + ".sbj.tmp")).write_bytes(b"half")   # or during the write
    assert list_segments(tmp_path) == [seg] and list(records(tmp_path)) == rows
    JournalWriter(tmp_path, fsync=False).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", seg.path.name,
                                                          "journal.id"]
    assert list(records(tmp_path)) == rows


def test_a_reader_never_meets_a_segment_being_created(tmp_path, monkeypatch):
    """A reader listing a live journal while the writer opens a segment never meets an
    open segment shorter than its header: the file appears under its ``.open`` name with
    its header written.  (Created first and written after, a Spark read or the
    recorder's lag report could hit "damaged: segment shorter than its header".)  The
    reader looks at the worst moment: while the header is being made."""
    seen: list[str] = []
    encode = fmt.encode_header

    def look_then_encode(first_seq: int, created_ns: int) -> bytes:
        try:
            for seg in list_segments(tmp_path):
                segment_blocks(seg)
            seen.append("whole")
        except JournalError as exc:
            seen.append(str(exc))
        return encode(first_seq, created_ns)

    monkeypatch.setattr(fmt, "encode_header", look_then_encode)
    with JournalWriter(tmp_path, fsync=False, segment_bytes=200) as w:
        for _ in range(5):
            w.append(time.time_ns(), [b"k"] * 3, [b"x" * 50] * 3)
            w.flush()
    assert seen == ["whole"] * 5
    assert len(list_segments(tmp_path)) == 5
    assert not list(tmp_path.glob("*" + TMP_SUFFIX))
