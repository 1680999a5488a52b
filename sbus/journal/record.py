"""The recorder behind ``sbus record`` (`sbus.cmd.record`): a thin I/O shell around
`JournalWriter`.

It must never be the slow reader: the socket is drained up to 256 packets per system
call, each such batch split into columns by array operations (`columns.split`) and
stamped with one receive time, and the columns are buffered into blocks of about a
megabyte, written with one ``writev`` each.  The broker is asked for soft *queue* mode so
bursts are queued for us rather than dropped; ``--block`` also asks for hard *block*, so
publishers wait rather than lose messages once that queue is full.  A block is written
(to the OS) at least every ``--flush`` seconds, so ``kill -9`` loses at most that much;
SIGTERM/SIGINT flush and seal.  If the broker goes away the recorder reconnects and
re-subscribes; a journal write that fails (disk full) ends it with one line, leaving what
was written readable.
"""

from __future__ import annotations

import logging
import signal
import socket
import struct
import sys
import time

import numpy as np

from .. import protocol
from ..client import Client
from ..defaults import RECV_BUFFER
from ..errors import ConnectError, ConnectionLost, SbusError
from ..packetio import PacketBatch
from ..protocol import Publish
from ..session import Backoff, Dropped, Refusal
from .columns import split
from .store import JournalError, JournalWriter

log = logging.getLogger("sbus.record")

RECV_SLOTS = 256  # packets per system call: `split` costs less per packet in larger batches


class _Stopper:
    """SIGTERM/SIGINT set a flag the loop checks between batches (never mid-write)."""

    def __init__(self) -> None:
        self.stop = False

    def __call__(self, signum, frame) -> None:
        self.stop = True


def _connect(address: str | None, patterns: list[bytes], block: bool) -> Client:
    bus = Client(address)
    try:
        bus.set_flood(soft="queue", hard="block" if block else None)
        for pattern in patterns:
            bus.subscribe(pattern, wait=False)
        bus.sync()  # the subscriptions are in place from here on (or refused: raised)
    except BaseException:
        bus.close()
        raise
    return bus


def _reconnect(address: str | None, patterns: list[bytes], block: bool,
               writer: JournalWriter, stopper: _Stopper, reason: str) -> Client | None:
    """After the broker went away: flush, then retry (the session's `Backoff`) until it is
    back or we are told to stop.  Messages published meanwhile are not recorded (the bus keeps
    nothing); the sequence numbers simply continue."""
    log.warning("%s; reconnecting", reason)
    print(f"sbus record: {reason}; reconnecting", file=sys.stderr, flush=True)
    writer.flush()
    backoff = Backoff()
    while not stopper.stop:
        try:
            bus = _connect(address, patterns, block)
        except (ConnectionLost, ConnectError, TimeoutError):
            time.sleep(backoff.next())
            writer.tick()
            continue
        print("sbus record: reconnected", file=sys.stderr, flush=True)
        return bus
    return None


def record(address: str | None, patterns: list[bytes], directory: str, *, flush: float,
           block: bool = False, **writer_options) -> int:
    """Record what *patterns* match into the journal in *directory* (a `JournalWriter`
    with *writer_options*) until SIGTERM/SIGINT; the exit status."""
    if flush <= 0:
        raise SbusError("--flush must be positive")
    try:
        writer = JournalWriter(directory, **writer_options)
    except JournalError as exc:
        raise SbusError(str(exc)) from None
    dropped = 0
    started = time.monotonic()
    first_seq = writer.next_seq
    stopper = _Stopper()
    old = {s: signal.signal(s, stopper) for s in (signal.SIGTERM, signal.SIGINT)}
    failure: OSError | None = None
    try:
        bus: Client | None = _connect(address, patterns, block)  # the first must work
        print(f"sbus record: recording into {directory} from seq {first_seq}",
              file=sys.stderr, flush=True)
        while bus is not None:
            try:
                dropped += _loop(bus, writer, flush, stopper)
                bus.close()
                bus = None
            except ConnectionLost as exc:  # the broker went away (EOF, reset): come back
                bus.close()
                bus = _reconnect(address, patterns, block, writer, stopper, str(exc))
    except OSError as exc:  # the journal's disk: full, read-only, gone
        failure = exc
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        try:
            writer.close()
        except OSError as exc:
            failure = failure or exc
    if failure is not None:
        raise SbusError(f"writing the journal in {directory} failed: "
                        f"{failure.strerror or failure}; the records written before are intact "
                        "(a restarted sbus record seals them)") from None
    took = time.monotonic() - started
    n = writer.next_seq - first_seq
    print(f"sbus record: {n} messages in {took:.1f} s (seq {first_seq}..{writer.next_seq - 1})"
          + (f", broker dropped {dropped}" if dropped else "")
          + (f", {writer.export_failures} Parquet export(s) failed (logged)"
             if writer.export_failures else ""), file=sys.stderr)
    return 0


def _loop(bus: Client, writer: JournalWriter, interval: float, stopper: _Stopper) -> int:
    """Receive and hand the records to the writer until told to stop.

    Packets arrive up to `RECV_SLOTS` per system call (`PacketBatch`, as in the broker,
    which otherwise outruns a reader making one call per packet), and a batch of ``MSG``
    packets is split into columns by `split` without a Python object per message; a batch
    holding anything else goes through `protocol.parse` packet by packet.  The receive
    itself waits (up to the flush interval, as the socket's receive timeout), so an idle
    recorder sleeps and a busy one makes no other system call per batch."""
    sock = bus.sock
    fd = sock.fileno()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(interval))
    batch = PacketBatch(RECV_SLOTS, RECV_BUFFER)
    slots = np.frombuffer(batch.buffer, np.uint8).reshape(RECV_SLOTS, RECV_BUFFER)
    lengths = np.asarray(batch.received_lengths)
    dropped = 0
    next_flush = time.monotonic() + interval
    others: list = []
    pending = bus.receive_ready(0)  # set aside by whoami(), so received before the rest
    _append_events(writer, time.time_ns(), pending, others)
    while not stopper.stop:
        try:
            n = batch.receive(fd, wait=True)
        except (BlockingIOError, InterruptedError):  # the timeout, or a signal
            n = 0
        except OSError as exc:
            raise ConnectionLost(f"receiving from the broker at {bus.address} failed: "
                                 f"{exc.strerror or exc}") from None
        if n:
            ts = time.time_ns()
            records = split(slots, lengths[:n])
            if records is not None:
                writer.append_columns(ts, records)
            else:
                _append_events(writer, ts, _parse(bus, batch, n), others)
        for ev in others:
            if type(ev) is Dropped:
                dropped += ev.count
                log.warning("broker dropped %d messages for the recorder", ev.count)
            elif type(ev) is Refusal:
                log.warning("the broker refused the recorder's %s: %s", ev.verb, ev.reason)
        others.clear()
        now = time.monotonic()
        if now >= next_flush:
            writer.flush()
            writer.tick(now)
            next_flush = now + interval
    return dropped


def _timeval(seconds: float) -> bytes:
    usec = max(1, round(seconds * 1e6))  # zero would mean no timeout at all
    return struct.pack("@ll", usec // 1_000_000, usec % 1_000_000)


def _parse(bus: Client, batch: PacketBatch, n: int) -> list:
    """The events of a batch `split` did not take, one packet at a time."""
    events = []
    for i in range(n):
        if batch.lengths[i] == 0:  # the broker sends no empty packets: end of file
            raise ConnectionLost(f"the broker at {bus.address} closed the connection")
        try:
            events.append(bus.session.receive(batch.copy(i)))
        except protocol.ProtocolError as exc:
            raise SbusError(f"broker at {bus.address} sent a malformed packet: {exc}") from None
    return events


def _append_events(writer: JournalWriter, ts: int, events: list, others: list) -> None:
    """Publishes to the journal, in order; everything else to *others*."""
    keys = [ev.key for ev in events if type(ev) is Publish]
    writer.append(ts, keys, [ev.payload for ev in events if type(ev) is Publish])
    others.extend(ev for ev in events if type(ev) is not Publish)
