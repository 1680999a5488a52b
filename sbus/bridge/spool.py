"""The bridge's state on disk, so that a crash (``kill -9``) loses nothing it had taken.

* **The export spool**: every QoS 1 message taken from the bus is appended here before it
  is handed to paho, and stays until the MQTT broker acknowledges it.  A restarted bridge
  publishes what is left again (counted as ``resent``: those the broker had acknowledged
  just before the crash arrive twice, the rest once).  Writes go to the page cache (one
  ``write`` per batch, no ``fsync``): a crash of the process keeps them, a crash of the
  machine may not.  Bounded by message count and bytes: when full, new exports are
  dropped and counted (``dropped``), what is queued stays.
* **The counters**, saved with every STATUS= update and at exit: a crash loses at most
  the last half second of counts; ``exported`` is made exact from the spool's sequence.
* **The import filters of the MQTT session**: a bridge whose imports changed unsubscribes
  the old ones, so they neither pull traffic nor deliver twice.

Files: ``NNN.spool`` segments named by their first sequence number, beginning with
`MAGIC`, each record a ``<QHII`` header (sequence, topic length, payload length, CRC-32
of those three and the record's bytes) then the topic and payload (segments of older
bridges have no `MAGIC` and ``<QHI`` headers, no check: read as they are); a torn
record at the end (the crash came mid-write) is cut off.  ``acked`` holds the
sequence number of the oldest unacknowledged record (8 bytes, rewritten in place), the
epoch of this run (4 random bytes, new each run: a spool that went back gives numbers
again, and receivers must not take those exports for copies) and a CRC-32 of both.
``epochs`` (JSON) holds the first number and the epoch of each run whose records are
left, so that a record sent again keeps the stamp it was first sent with.

Damage is said, never a crash (`Spool.problems`, logged by the bridge): an ``acked``
that fails its check sends every record left again under a new epoch (receivers may get
copies, none is lost); a record that is cut short, or whose number is not the next one
(or is past `MAX_SEQ`), ends its segment there: the bytes from it are cut off, and the
line says how many; a record that fails its check is dropped and counted as lost (a byte
changed on disk: it is not sent as it is), or ends its segment there if the next record
does not follow it whole (its lengths may be the damaged bytes); a segment whose name is
past `MAX_SEQ` is set aside as ``NNN.spool.damaged``.
``state.json`` the counters and the MQTT session's import filters.  ``lock`` is held
(``flock``) while a bridge uses the directory.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import os
import re
import struct
import zlib
from collections import deque
from pathlib import Path

from ..errors import SbusError
from ..files import read_small

__all__ = ["Spool", "StateDir", "SpoolFull"]

#: Begins a segment whose records carry a check (`RECORD`): older ones have `HEADER`s.
MAGIC = b"sbus-spool 2\n"
HEADER = struct.Struct("<QHI")  # sequence number, topic length, payload length
RECORD = struct.Struct("<QHII")  # and the CRC-32 of those and of the topic and payload
ACKED = struct.Struct("<Q")
EPOCH = struct.Struct("<4s")  # after the sequence number in ``acked``
CHECK = struct.Struct("<I")  # CRC-32 of the two, after them (a file without it is older)
#: No sequence number reaches this (2^62 exports): beyond it a number is damage.
MAX_SEQ = 1 << 62
_EPOCH = re.compile(rf"[0-9a-f]{{{2 * EPOCH.size}}}")  # as the bridge writes one
#: ``state.json`` and ``epochs`` are read up to this size (they hold a few kilobytes; the
#: senders remembered, `core.STAMP_BYTES`, at most about a megabyte): a larger one is damage.
STATE_BYTES = 16 << 20
#: A segment is closed (and a new one begun) once it holds this many bytes.
SEGMENT_BYTES = 4 << 20
SUFFIX = ".spool"


class SpoolFull(Exception):
    """No room for another message (count or bytes): the caller drops it and counts it."""


def _acked(raw: bytes) -> tuple[int, str] | None:
    """The oldest unacknowledged number and the epoch ``acked`` holds, if it is whole
    (with its check, or as older bridges wrote it) and the number plausible."""
    head = ACKED.size + EPOCH.size
    if len(raw) == head + CHECK.size:
        if CHECK.unpack_from(raw, head)[0] != zlib.crc32(raw[:head]):
            return None
    elif len(raw) != head:
        return None
    oldest = ACKED.unpack_from(raw)[0]
    if oldest >= MAX_SEQ:
        return None
    return oldest, EPOCH.unpack_from(raw, ACKED.size)[0].hex()


def _record(data: memoryview, pos: int, seq: int, checked: bool) -> tuple[int, bool] | tuple[()]:
    """Where the record numbered *seq* at *pos* ends and whether it passes its check (one
    without a check passes), or ``()`` if there is no whole record numbered *seq* there."""
    body = pos + (RECORD.size if checked else HEADER.size)
    if body > len(data):
        return ()
    number, tlen, plen = HEADER.unpack_from(data, pos)
    end = body + tlen + plen
    if number != seq or end > len(data):
        return ()
    if not checked:
        return end, True
    crc = zlib.crc32(data[body:end], zlib.crc32(data[pos:pos + HEADER.size]))
    return end, crc == CHECK.unpack_from(data, pos + HEADER.size)[0]


class StateDir:
    """The directory of one bridge, locked for its life."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._lock = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                 0o600)
        except OSError as exc:
            why = "it is not a directory" if self.path.exists() and not self.path.is_dir() \
                else exc.strerror or exc
            raise SbusError(f"cannot use the state directory {self.path}: {why}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise SbusError(f"another bridge uses the state directory {self.path} "
                            "(give each bridge its own --client-id or --state-dir)") from None

    def load_state(self) -> tuple[dict, str]:
        """What the last bridge saved, and why it cannot be used if it cannot (damage:
        the bridge starts from nothing, and says so)."""
        path = self.path / "state.json"
        try:
            data = json.loads(read_small(path, STATE_BYTES))
        except FileNotFoundError:
            return {}, ""
        except (OSError, ValueError, RecursionError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not JSON" \
                if isinstance(exc, ValueError) else "nested too deep"
            return {}, f"{path} cannot be read ({why})"
        if not isinstance(data, dict):
            return {}, f"{path} is not what the bridge saves"
        return data, ""

    def save_state(self, state: dict) -> str:
        """Save *state*; "" or why it could not be (the next save tries again; the
        counters are also in STATUS=)."""
        tmp = self.path / "state.json.new"
        try:
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path / "state.json")
        except OSError as exc:
            return f"cannot save {self.path / 'state.json'}: {exc.strerror or exc}"
        return ""

    def close(self) -> None:
        os.close(self._lock)


class Spool:
    """Unacknowledged exports, in order, on disk (module docstring)."""

    def __init__(self, path: Path, max_count: int, max_bytes: int,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self.path = path
        self.max_count, self.max_bytes = max_count, max_bytes
        self.segment_bytes = segment_bytes
        self._held: deque[tuple[int, int]] = deque()  # (seq, bytes) not yet acknowledged
        self._acked_early: set[int] = set()  # acknowledged out of order
        self.held_bytes = 0
        self._segments: list[int] = []  # first seq of each segment file, oldest first
        self._fd = -1
        self._size = 0
        self.next_seq = 0
        self.oldest = 0  # every record before this one is acknowledged
        #: names this run's numbering: receivers drop a sequence number from an epoch
        #: they saw it in before (a resent duplicate), and start over on a new epoch.  A
        #: new one each run: a spool that went back (a power loss, an older copy) gives
        #: its numbers again, and under the old epoch they would be taken for copies.
        self.epoch = ""
        #: (first sequence number, epoch) of each run whose records are left, in order
        self.epochs: list[tuple[int, str]] = []
        self._ack_fd = os.open(path / "acked", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._ack_written = -1
        #: what was found damaged at `load`, one line each (the bridge logs them)
        self.problems: list[str] = []
        self.lost = 0  # records found missing or damaged at `load`

    # -- start -----------------------------------------------------------------

    def load(self, given: int = 0) -> list[tuple[int, bytes, bytes]]:
        """The records left unacknowledged by the last bridge, oldest first; opens the
        spool for appending.  *given*: the numbers the last bridge had given, as it last
        saved them (``state.json``); records past the spool's end up to there were lost
        with a segment cut short or removed: said, counted in `lost`, and their numbers
        not given again (a receiver would take a new export under one for a copy)."""
        raw = os.pread(self._ack_fd, ACKED.size + EPOCH.size + CHECK.size + 1, 0)
        acked = _acked(raw)
        self.epoch = os.urandom(EPOCH.size).hex()  # this run's
        if acked is not None:
            self.oldest, last = acked
            self.epochs = self._read_epochs(last)
        else:  # a new spool (or its acknowledgements lost): numbers start again, anew
            given = 0
            if raw:
                self.problems.append(f"{self.path / 'acked'} is damaged: every record left "
                                     "in the spool is sent again, numbered anew (receivers "
                                     "may get copies of some)")
            self.oldest = 0
            os.ftruncate(self._ack_fd, 0)
            self._write_acked()
        self._segments = sorted(self._segment_names())
        left: list[tuple[int, bytes, bytes]] = []
        self.next_seq = self.oldest
        read_end = 0  # past the records of the segments read so far
        for first in list(self._segments):
            records, end = self._read(first)
            if records and first < read_end:  # numbers another segment holds: not ours
                name = self.path / f"{first:020d}{SUFFIX}"
                os.replace(name, name.with_name(name.name + ".damaged"))
                self._segments.remove(first)
                self.problems.append(f"{name}: numbers {first}.. overlap the segment before "
                                     f"it; set aside as {name.name}.damaged")
                continue
            for seq, topic, payload in records:
                if seq >= self.oldest:
                    left.append((seq, topic, payload))
            self.next_seq = max(self.next_seq, end)
            read_end = max(read_end, end)
        if given > self.next_seq:
            self.lost += given - self.next_seq
            self.problems.append(f"{self.lost} records numbered {self.next_seq} to "
                                 f"{given - 1} are missing from the spool (a segment cut "
                                 "short or removed): lost")
            self.next_seq = given
        self.oldest = left[0][0] if left else self.next_seq
        for seq, topic, payload in left:
            size = len(topic) + len(payload)
            self._held.append((seq, size))
            self.held_bytes += size
        self._drop_segments(self.oldest if left else self.next_seq)
        self._new_segment()
        # the runs whose records are left (a record before every run's first: this one's)
        runs = []
        if left:
            runs = [run for run in self.epochs if run[0] <= self.oldest][-1:]
            runs += [run for run in self.epochs if self.oldest < run[0] < self.next_seq]
        self.epochs = runs + [(self.next_seq, self.epoch)]
        self._write_epochs()
        self._write_acked()
        return left

    def epoch_of(self, seq: int) -> str:
        """The epoch record *seq* is stamped with: that of the run that wrote it."""
        i = bisect.bisect_right(self.epochs, seq, key=lambda run: run[0]) - 1
        return self.epochs[i][1] if i >= 0 else self.epoch

    def _read_epochs(self, last: str) -> list[tuple[int, str]]:
        """The runs of the records on disk (``epochs``); a spool written before there
        were runs has one epoch, the one ``acked`` holds (*last*).  A damaged file: the
        records left go under this run's epoch (receivers may get copies, lose none)."""
        path = self.path / "epochs"
        try:
            runs = json.loads(read_small(path, STATE_BYTES))
        except FileNotFoundError:
            return [(0, last)]
        except (OSError, ValueError, RecursionError):
            runs = None
        if isinstance(runs, list) and all(
                isinstance(r, list) and len(r) == 2 and type(r[0]) is int
                and 0 <= r[0] < MAX_SEQ and isinstance(r[1], str) and _EPOCH.fullmatch(r[1])
                for r in runs) and [r[0] for r in runs] == sorted(r[0] for r in runs):
            return [(first, epoch) for first, epoch in runs]
        self.problems.append(f"{path} is damaged: the records left are sent again under "
                             "a new epoch (receivers may get copies of some)")
        return []

    def _write_epochs(self) -> None:
        tmp = self.path / "epochs.new"
        tmp.write_text(json.dumps([list(run) for run in self.epochs]))
        os.replace(tmp, self.path / "epochs")

    def _segment_names(self) -> list[int]:
        """The first numbers of the segments; one past `MAX_SEQ` is set aside."""
        out = []
        for p in self.path.glob("*" + SUFFIX):
            first = p.name[:-len(SUFFIX)]
            if not first.isdigit():
                continue
            regular = p.is_file()
            if int(first) >= MAX_SEQ or not regular:
                os.replace(p, p.with_name(p.name + ".damaged"))
                why = "not a number the spool gives" if regular else "not a regular file"
                self.problems.append(f"{p}: {why}; set aside as {p.name}.damaged")
                continue
            out.append(int(first))
        return out

    def _read(self, first: int) -> tuple[list[tuple[int, bytes, bytes]], int]:
        """The whole records of segment *first* and the number after its last; what is
        damaged is cut off or dropped, and said (module docstring)."""
        name = self.path / f"{first:020d}{SUFFIX}"
        data = name.read_bytes()
        view = memoryview(data)
        checked = data.startswith(MAGIC)
        body = RECORD.size if checked else HEADER.size
        pos = len(MAGIC) if checked else 0
        out: list[tuple[int, bytes, bytes]] = []
        seq = first
        while found := _record(view, pos, seq, checked):
            end, intact = found
            if not intact:  # sent as it is, it would carry the damage to every receiver
                if end != len(data) and _record(view, end, seq + 1, checked)[1:] != (True,):
                    break  # its lengths may be what changed: the rest cannot be trusted
                if seq >= self.oldest:
                    self.lost += 1
                    self.problems.append(f"{name}: record {seq} at byte {pos} fails its "
                                         "check (changed on disk): dropped")
            else:
                tlen = HEADER.unpack_from(data, pos)[1]
                out.append((seq, data[pos + body:pos + body + tlen],
                            data[pos + body + tlen:end]))
            pos, seq = end, seq + 1
        if pos != len(data):
            # torn (the crash came while it was written) or damaged: cut off, so that
            # appending goes on after a whole record, and said
            self.problems.append(f"{name}: record {seq - first} at byte {pos} is cut short "
                                 f"or damaged; the {len(data) - pos} bytes from there are "
                                 "dropped")
            os.truncate(name, pos)
        return out, seq

    # -- running ---------------------------------------------------------------

    def room(self, size: int) -> bool:
        return len(self._held) < self.max_count and self.held_bytes + size <= self.max_bytes

    def append(self, records: list[tuple[bytes, bytes]]) -> list[int]:
        """Write *records* (topic, payload) in one go; their sequence numbers.  The caller
        checked `room` for each.  `OSError` (a full disk) leaves the spool as it was."""
        blob = bytearray()
        first = self.next_seq
        for seq, (topic, payload) in enumerate(records, first):
            head = HEADER.pack(seq, len(topic), len(payload))
            blob += head
            blob += CHECK.pack(zlib.crc32(payload, zlib.crc32(topic, zlib.crc32(head))))
            blob += topic
            blob += payload
        if not blob:
            return []
        try:
            written = os.write(self._fd, blob)
            if written != len(blob):
                raise OSError(f"short write to the spool ({written} of {len(blob)} bytes)")
        except OSError:
            os.ftruncate(self._fd, self._size)  # no torn record left behind
            raise
        self._size += len(blob)
        self.next_seq = first + len(records)
        for seq, (topic, payload) in enumerate(records, first):
            size = len(topic) + len(payload)
            self._held.append((seq, size))
            self.held_bytes += size
        if self._size >= self.segment_bytes:
            self._new_segment()
        return list(range(first, self.next_seq))

    def acked(self, seq: int) -> None:
        """The MQTT broker acknowledged (or refused) record *seq*: it is done."""
        held = self._held
        if not held or seq < held[0][0]:
            return
        if seq == held[0][0] and not self._acked_early:  # in order: the usual case
            self.held_bytes -= held.popleft()[1]
            self.oldest = held[0][0] if held else self.next_seq
            return
        self._acked_early.add(seq)
        while self._held and self._held[0][0] in self._acked_early:
            done, size = self._held.popleft()
            self._acked_early.discard(done)
            self.held_bytes -= size
        self.oldest = self._held[0][0] if self._held else self.next_seq

    def flush(self) -> None:
        """Record the acknowledgements so far (once per turn of the loop, not per ack)."""
        if self.oldest != self._ack_written:
            self._write_acked()
            if len(self._segments) > 1 and self._segments[1] <= self.oldest:
                self._drop_segments(self.oldest)

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self.flush()
        for fd in (self._fd, self._ack_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._ack_fd = -1

    # -- internals ---------------------------------------------------------------

    def _write_acked(self) -> None:
        head = ACKED.pack(self.oldest) + EPOCH.pack(bytes.fromhex(self.epoch))
        os.pwrite(self._ack_fd, head + CHECK.pack(zlib.crc32(head)), 0)
        self._ack_written = self.oldest

    def _new_segment(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        first = self.next_seq
        name = self.path / f"{first:020d}{SUFFIX}"
        self._fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size
        if not self._size:  # (one that is not empty is ours: its records are all before
            os.write(self._fd, MAGIC)  # *first*, and `load` cut off what was not whole)
            self._size = len(MAGIC)
        if first not in self._segments:
            self._segments.append(first)

    def _drop_segments(self, oldest: int) -> None:
        """Remove segments whose every record is before *oldest* (acknowledged)."""
        while len(self._segments) > 1 and self._segments[1] <= oldest:
            first = self._segments.pop(0)
            try:
                os.unlink(self.path / f"{first:020d}{SUFFIX}")
            except FileNotFoundError:
                pass
        if len(self._segments) == 1 and self._segments[0] < oldest and self._fd < 0 \
                and oldest >= self.next_seq:  # (records not yet acknowledged stay on disk)
            first = self._segments.pop(0)  # at start: all done, begin afresh
            try:
                os.unlink(self.path / f"{first:020d}{SUFFIX}")
            except FileNotFoundError:
                pass
