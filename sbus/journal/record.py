"""The recorder behind ``sbus record`` (`sbus.cmd.record`): a thin I/O shell around
`JournalWriter`.

It must never be the slow reader: the client (`Client.receive_frames`) drains up to 256
packets per system call, each such batch split into columns by array operations
(`columns.split`) and stamped with one receive time, and the columns are buffered into
blocks of about a megabyte, written with one ``writev`` each.  The broker is asked for
soft *queue* mode so bursts are queued for us rather than dropped; ``--block`` also asks
for hard *block*, so publishers wait rather than lose messages once that queue is full.
A block is written (to the OS) at least every ``--flush`` seconds, so ``kill -9`` loses
at most that much; SIGTERM/SIGINT record what the broker still holds for us, flush and
seal.  If the broker goes away the client reconnects and re-subscribes
(``reconnect=True``: the recorder has no connection code of its own); a refused pattern,
or a journal write that fails (disk full), ends it with one line, leaving what was
written readable.  What it knows it missed (dropped, oversized, while the broker was away,
while no recorder ran) it notes in the journal's ``gaps.jsonl`` (`gaps`), where readers
find it.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

import numpy as np

from .. import protocol
from ..client import SLOT_BYTES, Client, Frames
from ..display import brief, printable
from ..errors import SbusError
from ..protocol import Publish
from . import gaps
from .columns import split
from .store import JournalError, JournalWriter

RECV_SLOTS = 256  # packets per system call: `split` costs less per packet in larger batches
#: The longest packet received whole (`client.SLOT_BYTES`): a longer message arrives cut,
#: and is counted, told (`_Complaints`) and never recorded.
RECV_LIMIT = SLOT_BYTES - 1
#: Seconds between two lines about messages of one cause not recorded (the count goes on).
COMPLAINT_INTERVAL = 5.0


class _Complaints:
    """Messages not recorded, told on stderr at most every `COMPLAINT_INTERVAL` seconds per
    cause (another user's flood must not flood the log): those too large to receive whole,
    the last one's key quoted briefly, and those the broker dropped for the recorder."""

    def __init__(self) -> None:
        self.told = {"cut": 0, "dropped": 0}
        self.told_at = dict.fromkeys(self.told, -COMPLAINT_INTERVAL)

    def tell(self, bus: Client, now: float) -> None:
        self._tell("cut", bus.cut, now, lambda n: f"{n} message(s) over the {RECV_LIMIT}-byte "
                   f"receive limit not recorded (the last under key {brief(bus.cut_key)})")
        self._tell("dropped", bus.dropped, now, lambda n: f"the broker dropped {n} message(s) "
                   "for the recorder (its queue there was full)")

    def _tell(self, cause: str, total: int, now: float, line: Callable[[int], str]) -> None:
        if total > self.told[cause] and now - self.told_at[cause] >= COMPLAINT_INTERVAL:
            print(f"sbus record: {line(total - self.told[cause])}; {total} so far",
                  file=sys.stderr, flush=True)
            self.told[cause], self.told_at[cause] = total, now


#: Seconds the receive waits at most, so a stop asked for by a signal is seen promptly.
WAKE = 0.25
#: Seconds without a packet after which the broker surely holds nothing for the recorder
#: (a broker with a queue for it writes as soon as its socket has room).
QUIET = 1.0
#: Seconds a stop waits for the broker to hand over what it holds for the recorder.
REST_TIMEOUT = 5.0


class _Losses:
    """What the broker's reports and the client's counts say was not received, noted in
    the journal where it lies (`JournalWriter.note_gap`) after each batch.

    The broker reports drops once the recorder's queue is empty again, so the messages it
    counts came after its previous report: a ``dropped`` gap spans from the batch that held
    the previous report, or the last time the recorder had waited `QUIET` seconds for
    nothing (its queue there was empty), to the batch that holds this one.  A broker that goes away
    before it reports may have dropped some since then, so an ``away`` gap spans from there
    too.  An oversized message is cut out of the batch it came in."""

    def __init__(self, writer: JournalWriter) -> None:
        self.writer = writer
        self.dropped = self.cut = 0  # the client's counts already noted
        self.drops_after = writer.position - 1
        self.batch_after = self.drops_after  # the last record before this batch

    def before_batch(self) -> None:
        self.batch_after = self.writer.position - 1

    def quiet(self) -> None:
        """`QUIET` seconds without a packet: the broker holds nothing for us, and drops it
        has not reported yet (none) would lie after this."""
        self.drops_after = self.batch_after

    def after_batch(self, bus: Client) -> None:
        if bus.dropped > self.dropped:
            self.writer.note_gap(gaps.DROPPED, self.drops_after, bus.dropped - self.dropped)
            self.dropped, self.drops_after = bus.dropped, self.batch_after
        if bus.cut > self.cut:
            self.writer.note_gap(gaps.OVERSIZED, self.batch_after, bus.cut - self.cut)
            self.cut = bus.cut

    def reconnected(self, away_from: int) -> None:
        """Subscribed again: what was published since *away_from* is not in the journal,
        and the new connection's drop reports start afresh."""
        self.writer.note_gap(gaps.AWAY, self.drops_after, from_ns=away_from)
        self.drops_after = self.batch_after = self.writer.position - 1


class _Stopped(Exception):
    """A stop asked for while the client waits for the broker to come back."""


class _Stopper:
    """SIGTERM/SIGINT set a flag the loop checks between batches (never mid-write); while
    the client is reconnecting (nothing of ours in flight) they end the wait at once."""

    def __init__(self) -> None:
        self.stop = False
        self.reconnecting = False
        self.reconnects = 0  # made so far: the summary says what they cost
        self.away_from = 0  # when the broker was last found gone (ns since the epoch)

    def __call__(self, signum, frame) -> None:
        self.stop = True
        if self.reconnecting:
            raise _Stopped


def _connect(address: str | None, patterns: list[bytes], block: bool,
             writer: JournalWriter, stopper: _Stopper, losses: _Losses) -> Client:
    """The recorder's client: the first connection must work; later ones are the client's
    to make (`reconnect`, the session's `Backoff`), said on stderr.  Messages published
    while the broker is away are not recorded (the bus keeps nothing); the sequence
    numbers simply continue, and the gap is noted."""

    def said(up: bool, line: str) -> None:
        stopper.reconnecting = False
        print(f"sbus record: {line}", file=sys.stderr, flush=True)
        if up:
            stopper.reconnects += 1
            losses.reconnected(stopper.away_from)
        else:
            stopper.away_from = time.time_ns()
            writer.flush()  # what was received is written before the wait
            if stopper.stop:
                raise _Stopped
            stopper.reconnecting = True

    # A refused pattern (here, or when the broker comes back) is `Refused`: one line, exit 1.
    bus = Client(address, reconnect=True, on_connection=said,
                 on_drop=lambda n: None)  # (counted by the client, told by `_Complaints`)
    try:
        bus.set_flood(soft="queue", hard="block" if block else None)
        for pattern in patterns:
            bus.subscribe(pattern, wait=False)
        bus.sync()  # the subscriptions are in place from here on
    except BaseException:
        bus.close()
        raise
    return bus


def record(address: str | None, patterns: list[bytes], directory: str, *, flush: float,
           block: bool = False, **writer_options) -> int:
    """Record what *patterns* match into the journal in *directory* (a `JournalWriter`
    with *writer_options*) until SIGTERM/SIGINT; the exit status."""
    if flush <= 0:
        raise SbusError("--flush must be positive")
    try:
        if writer_options.get("export_dir") is not None:  # needs pyarrow: only then
            from .export import ExportingWriter as writer_class
        else:
            writer_class = JournalWriter
        writer = writer_class(directory, **writer_options)
    except JournalError as exc:
        raise SbusError(str(exc)) from None
    dropped = cut = 0
    away = False  # stopped while waiting for the broker to come back (`_Stopped`)
    started = time.monotonic()
    first_seq = writer.next_seq
    stopper = _Stopper()
    losses = _Losses(writer)
    old = {s: signal.signal(s, stopper) for s in (signal.SIGTERM, signal.SIGINT)}
    failure: OSError | None = None
    try:
        bus = _connect(address, patterns, block, writer, stopper, losses)
        if writer.resumed:  # a journal recorded before: nothing was recorded in between
            writer.note_gap(gaps.STOPPED, from_ns=writer.last_ts)
        print(f"sbus record: recording into {printable(str(directory))} from seq {first_seq}",
              file=sys.stderr, flush=True)
        try:
            _loop(bus, writer, flush, stopper, losses)
            _record_the_rest(bus, writer, patterns, losses)
        except _Stopped:
            away = True
        finally:
            stopper.reconnecting = False
            dropped, cut = bus.dropped, bus.cut
            bus.close()
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
          + (f", {stopper.reconnects} reconnect(s): what was published while the broker "
             "was away is not in the journal" if stopper.reconnects else "")
          + (", stopped while waiting for the broker to come back" if away else "")
          + (f", {cut} over {RECV_LIMIT} bytes not recorded" if cut else "")
          + (f", {writer.export_failures} Parquet export(s) failed (logged)"
             if writer.export_failures else "")
          + (f"; where the journal misses messages: sbus journal gaps "
             f"{printable(str(directory))}"
             if dropped or cut or stopper.reconnects or writer.resumed else ""),
          file=sys.stderr)
    return 0


def _loop(bus: Client, writer: JournalWriter, interval: float, stopper: _Stopper,
          losses: _Losses) -> None:
    """Receive and hand the records to the writer until told to stop.

    Packets arrive up to `RECV_SLOTS` per system call (`Client.receive_frames`: the broker
    otherwise outruns a reader making one call per packet), and a batch of ``MSG`` packets
    is split into columns by `split` without a Python object per message; a batch holding
    anything else (the client has taken in its control packets) goes message by message.
    A busy recorder makes no other system call per batch; an idle one wakes every `WAKE`
    seconds to see a stop and the flush interval."""
    seen = None
    slots = lengths = np.empty(0)
    complaints = _Complaints()
    last_packet = time.monotonic()
    next_flush = last_packet + interval
    while not stopper.stop:
        losses.before_batch()
        try:
            frames = bus.receive_frames(RECV_SLOTS, timeout=min(interval, WAKE))
        except TimeoutError:
            frames = None
            if time.monotonic() - last_packet >= QUIET:
                losses.quiet()
        if frames is not None:
            last_packet = time.monotonic()
            ts = time.time_ns()
            if frames.kept:
                _append_events(writer, ts, frames.kept)
            batch, n = frames.batch, frames.count
            if n:
                if batch is not seen:  # array views of the client's receive buffer
                    slots = np.frombuffer(batch.buffer, np.uint8).reshape(batch.slots,
                                                                          batch.slot_size)
                    lengths = np.asarray(batch.received_lengths)
                    seen = batch
                records = None if frames.others else split(slots, lengths[:n])
                if records is not None:
                    writer.append_columns(ts, records)
                else:
                    _append_events(writer, ts, _messages(bus, frames))
        losses.after_batch(bus)
        now = time.monotonic()
        complaints.tell(bus, now)
        if now >= next_flush:
            writer.flush()
            writer.tick(now)
            next_flush = now + interval


def _record_the_rest(bus: Client, writer: JournalWriter, patterns: list[bytes],
                     losses: _Losses) -> None:
    """At a stop, what the broker holds for the recorder is recorded too (with ``--block``
    a paused publisher's messages are in that queue, and nothing may be lost): its
    patterns are unsubscribed, and every message before the broker's answer to a whoami
    (at most its queue for us) is written.  A broker that does not answer within
    `REST_TIMEOUT` seconds leaves them unrecorded, said on stderr (the exit line's range
    says where the journal ends); one that is gone ends the wait (`_Stopped`)."""
    losses.before_batch()
    try:
        for pattern in patterns:
            bus.unsubscribe(pattern)
        bus.sync(REST_TIMEOUT)  # what arrives meanwhile is kept by the client
    except (SbusError, TimeoutError) as exc:
        print(f"sbus record: what the broker still held for the recorder is not recorded: "
              f"{exc}", file=sys.stderr, flush=True)
        return
    try:
        frames = bus.receive_frames(RECV_SLOTS, timeout=0.001)
    except TimeoutError:
        frames = None  # nothing was kept: the broker held nothing more for us
    if frames is not None:
        _append_events(writer, time.time_ns(), frames.kept)
    losses.after_batch(bus)


def _messages(bus: Client, frames: Frames) -> list:
    """The messages of a batch `split` did not take, in order."""
    batch = frames.batch
    try:
        events = protocol.parse_batch(batch.buffer, batch.offsets, batch.lengths)
    except protocol.ProtocolError as exc:
        raise SbusError(f"broker at {bus.address} sent a malformed packet: {exc}") from None
    return [ev for i, ev in enumerate(events) if i not in frames.others]


def _append_events(writer: JournalWriter, ts: int, events: list) -> None:
    """The messages among *events* to the journal, in order."""
    messages = [ev for ev in events if type(ev) is Publish]
    writer.append(ts, [ev.key for ev in messages], [ev.payload for ev in messages])
