"""A recorded journal without Spark, as ``sbus journal`` (`sbus.cmd.journal`) shows it:
`cat` prints records, `tail` the last ones and, with *follow*, those recorded from then
on, `export` writes sealed segments as Parquet (`sbus.journal.export`), `lag` tells where
a streaming query's checkpoint stands, `show_gaps` where the journal misses messages.
Lines escape control bytes (`sbus.display`), as ``sbus sub``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from ..defaults import decimal, parse_duration
from ..display import json_bytes, printable, timestamp
from ..errors import SbusError
from ..extras import install_command
from ..files import NotRegular, open_regular, read_small
from ..routing import matches
from . import gaps
from .format import FormatError
from .gaps import Gap
from .store import JournalError, journal_id, list_segments, read_seq_range, segment_blocks

#: A file of a checkpoint's offset log is read up to this size (a few hundred bytes each).
OFFSET_FILE_BYTES = 16 << 20

Record = tuple[int, int, bytes, bytes]  # seq, ts_ns, key, payload


def since_ns(text: str | None, now: float | None = None) -> int | None:
    """``--since``: a duration before *now*, or an ISO 8601 time."""
    if text is None:
        return None
    try:
        return int(((time.time() if now is None else now) - parse_duration(text)) * 1e9)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise SbusError(f"--since: {text!r} is neither a duration (10m, 2h) nor an ISO 8601 "
                        "time (2026-05-01T12:00:00)") from None
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp() * 1e9)


def records_from(directory: str, seq: int, pattern: bytes | None = None,
                 since: int | None = None,
                 damaged: list[JournalError] | None = None) -> Iterator[Record]:
    """Records with sequence number >= *seq*, in order, as the journal is now.

    A segment that cannot be read to its end raises JournalError; with a *damaged* list,
    the error is appended to it instead and the later segments are read (the caller
    says what was skipped)."""
    for seg in list_segments(directory):
        try:
            blocks = [b for b in segment_blocks(seg) if b.next_seq > seq and
                      (since is None or b.max_ts >= since)]
            if not blocks:
                continue
            for block in read_seq_range(directory, seg.first_seq, blocks[0].pos,
                                        blocks[-1].end, seq, blocks[-1].next_seq):
                for rec in block.records():
                    if rec[0] >= seq and (since is None or rec[1] >= since) and \
                            (pattern is None or matches(pattern, rec[2])):
                        yield rec
        except FileNotFoundError:
            continue  # removed by retention while we read: its rows are gone
        except JournalError as exc:
            if damaged is None:
                raise
            damaged.append(exc)


def read_gaps(directory: str | os.PathLike) -> Iterator[Gap]:
    """The gaps noted in *directory*'s ``gaps.jsonl`` (`sbus.journal.gaps`), in the order
    noted; none without the file.  A damaged line is a JournalError naming it."""
    path = Path(directory) / gaps.FILE
    fd = _open_gaps(path)
    if fd is None:
        return
    with os.fdopen(fd, "rb") as f:
        for n, line in enumerate(iter(lambda: f.readline(gaps.LINE_BYTES + 1), b""), 1):
            if not line.endswith(b"\n") and len(line) <= gaps.LINE_BYTES:
                return  # the last line, still being written (or torn by a crash)
            yield _decoded(line, path, f", line {n}")


def _open_gaps(path: Path) -> int | None:
    """A descriptor on the gaps file (never a FIFO's wait), None if there is none."""
    try:
        return open_regular(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalError(f"cannot read {printable(str(path))}: {exc.strerror or exc}") \
            from None


def _decoded(line: bytes, path: Path, where: str = "") -> Gap:
    try:
        return gaps.decode(line)
    except FormatError as exc:
        raise JournalError(f"{printable(str(path))}{where}: {exc}") from None


def describe_gap(gap: Gap) -> str:
    """One line for a person: where, what, how many."""
    where = f"{timestamp(gap.to_ns / 1e9)} between seq {gap.after} and {gap.before}:"
    since = "" if gap.from_ns is None else f" from {timestamp(gap.from_ns / 1e9)}"
    if gap.kind == gaps.DROPPED:
        what = f"{gap.lost:,} message(s) dropped by the broker (the recorder's queue was full)"
    elif gap.kind == gaps.OVERSIZED:
        what = f"{gap.lost:,} message(s) over the recorder's receive limit"
    elif gap.kind == gaps.AWAY:
        what = f"the broker was away{since}: what was published until then is not recorded"
    elif gap.kind == gaps.DAMAGED:
        what = (f"the records of segment {gap.after + 1:020d}, damaged, were moved aside "
                "(its file + '.corrupt') and are not read")
    else:
        what = f"no recorder ran{since}: what was published until then is not recorded"
    return f"{where} {what}"


def show_gaps(directory: str, since: int | None, as_json: bool, out) -> None:
    """Every gap noted (at or after *since* ns), a line each (*as_json*: as noted)."""
    list_segments(directory)  # (no journal there: one clear error)
    for gap in read_gaps(directory):
        if since is None or gap.to_ns >= since:
            out.write(gaps.encode(gap) if as_json else (describe_gap(gap) + "\n").encode())
    out.flush()


def _gaps_among(directory: str, first: int, last: int) -> None:
    """On stderr, whether the gaps noted fall among records *first*..*last* printed (a
    segment moved aside just after the last counts too: its records were there)."""
    among = [g for g in read_gaps(directory) if g.before > first and (
        g.after < last or g.kind == gaps.DAMAGED and g.after == last)]
    if among:
        print(f"sbus journal: these records may miss messages at {len(among)} place(s) "
              f"({gaps.said(among)}): sbus journal gaps {printable(directory)}",
              file=sys.stderr, flush=True)


def skipped(damaged: list[JournalError], consequence: str) -> SbusError:
    """One line for the segments *damaged* left out (the first named, the rest counted)."""
    more = f" (and {len(damaged) - 1} more damaged segment(s))" if len(damaged) > 1 else ""
    return SbusError(f"{damaged[0]}{more}: {consequence}")


def format_record(rec: Record, fmt: str) -> bytes:
    seq, ts, key, payload = rec
    if fmt == "raw":
        return payload
    when = timestamp(ts / 1e9)
    if fmt == "lines":
        text = printable(payload.rstrip(b"\n"))
        return f"{when} {seq} {printable(key)} {text}\n".encode()
    obj: dict = {"seq": seq, "ts": when}
    json_bytes(obj, "key", key)
    json_bytes(obj, "payload", payload)
    return json.dumps(obj).encode() + b"\n"


def _batches(directory: Path) -> list[int]:
    try:
        return sorted(int(p.name) for p in directory.iterdir() if decimal(p.name))
    except FileNotFoundError:
        return []


def _source_offsets(path: Path) -> list[dict]:
    """The ``sbus`` source offsets in one file of a checkpoint's offset log (``v1``, the
    batch's metadata, then one line per source of the query)."""
    found = []
    try:
        text = read_small(path, OFFSET_FILE_BYTES).decode()
    except UnicodeDecodeError:
        raise SbusError(f"{printable(str(path))}: not a checkpoint's offset file (not "
                        "text)") from None
    except NotRegular as exc:  # a FIFO would wait for a writer; a huge file is not one
        raise SbusError(f"{printable(str(path))}: not a checkpoint's offset file "
                        f"({exc.strerror})") from None
    for line in text.splitlines()[2:]:
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):  # (nested too deep for the parser)
            continue
        if isinstance(doc, dict) and _count(doc.get("seq")):
            lost = doc.get("lost", 0)
            if not _count(lost):
                raise SbusError(f"{printable(str(path))}: its rows lost are not a count: "
                                f"{printable(repr(lost), 40)}")
            found.append(doc)
    return found


def _count(value: object) -> bool:
    """A whole number of rows (JSON may hold a float, a string, a list, a boolean...)."""
    return type(value) is int and value >= 0


def checkpoint_lag(directory: str, checkpoint: str) -> dict:
    """Where a streaming query with checkpoint *checkpoint* stands against the journal in
    *directory*: the last committed batch and its end offset, the batch planned after it
    if any, the journal's end, the rows recorded after the committed offset that the
    journal still holds (``behind``), and the rows the query counted lost."""
    ck = Path(checkpoint)
    planned = _batches(ck / "offsets")
    if not planned:
        raise SbusError(f"{checkpoint} holds no offsets of a streaming query (yet)")
    committed = [b for b in _batches(ck / "commits") if b in planned]
    end = _next_seq(directory)
    out: dict = {"journal_end": end}
    at = None
    if committed:
        offsets = _source_offsets(ck / "offsets" / str(committed[-1]))
        if len(offsets) != 1:
            raise SbusError(f"{checkpoint}: batch {committed[-1]} has {len(offsets)} sbus "
                            "source offsets; lag is shown for queries of one sbus source")
        at = offsets[0]["seq"]
        out |= {"committed_batch": committed[-1], "committed_seq": at,
                "lost": offsets[0].get("lost", 0)}
        theirs, ours = offsets[0].get("journal"), journal_id(directory)
        if isinstance(theirs, str) and ours is not None and theirs != ours:
            out["replaced"] = True  # removed and recorded anew: every row is new to it
            at = None
    if planned[-1] != (committed[-1] if committed else None):
        offsets = _source_offsets(ck / "offsets" / str(planned[-1]))
        if offsets:
            out |= {"planned_batch": planned[-1], "planned_seq": offsets[0]["seq"]}
    held = 0
    for seg in list_segments(directory):
        for b in segment_blocks(seg):
            lo = b.first_seq if at is None else max(b.first_seq, at)
            held += max(0, b.next_seq - lo)
    out["behind"] = held
    return out


def lag(directory: str, checkpoint: str, as_json: bool = False) -> None:
    """One line (or JSON object) on stdout: where the query stands (`checkpoint_lag`)."""
    lag = checkpoint_lag(directory, checkpoint)
    if as_json:
        print(json.dumps(lag))
        return
    if "committed_seq" in lag:
        text = (f"batch {lag['committed_batch']} committed up to seq "
                f"{lag['committed_seq'] - 1}")
    else:
        text = "no batch committed yet"
    if "planned_batch" in lag:
        text += (f"; batch {lag['planned_batch']} planned up to seq "
                 f"{lag['planned_seq'] - 1}, not committed")
    text += (f"; the journal ends at seq {lag['journal_end'] - 1}: {lag['behind']:,} rows "
             "behind")
    if lag.get("lost"):
        text += f"; {lag['lost']:,} rows counted lost"
    if lag.get("replaced"):
        text += ("; but the journal is another one than the query read (removed and "
                 "recorded anew): all its rows are new to it")
    print(f"{printable(checkpoint)}: {text}")


def cat(directory: str, pattern: bytes | None, since: int | None, fmt: str, out) -> None:
    """Every record (matching *pattern*, received since *since* ns) to *out* (binary).
    A damaged segment does not end the listing: the rows of the later segments are
    printed too, then an error names what was skipped."""
    damaged: list[JournalError] = []
    first = last = None
    for rec in records_from(directory, 0, pattern, since, damaged):
        out.write(format_record(rec, fmt))
        first, last = first or rec[0], rec[0]
    out.flush()
    if damaged:
        raise skipped(damaged, "its rows from the damage on were not printed (all of "
                               "them if its index cannot be read); the other segments' "
                               "rows were")
    if first is not None:  # (the whole journal: also what lies before its first record)
        _gaps_among(directory, first if since is not None else 0, last)


def tail(directory: str, lines: int, follow: bool, pattern: bytes | None,
         since: int | None, fmt: str, out, poll: float = 0.2) -> None:
    """The last *lines* records, then (*follow*) every new one until interrupted."""
    if lines < 0:
        raise SbusError("-n must be 0 or more")
    last: deque[Record] = deque(maxlen=lines)
    nxt = 0
    if pattern is None and since is None:  # the last N are the last N sequence numbers
        nxt = max(0, _next_seq(directory) - lines)
    noted = _NewGaps(directory) if follow else None  # (before: none noted meanwhile missed)
    for rec in records_from(directory, nxt, pattern, since):
        last.append(rec)
        nxt = rec[0] + 1
    for rec in last:
        out.write(format_record(rec, fmt))
    out.flush()
    if last:
        _gaps_among(directory, last[0][0], last[-1][0])
    while noted is not None:
        time.sleep(poll)
        for rec in records_from(directory, nxt, pattern, since):
            out.write(format_record(rec, fmt))
            nxt = rec[0] + 1
        out.flush()
        for gap in noted.read():
            print(f"sbus journal: {describe_gap(gap)}", file=sys.stderr, flush=True)


class _NewGaps:
    """The gaps noted since it was made, as they come (``tail -f``): the file is read
    from where the last look ended, and from its start again when retention replaced it
    (then the gaps up to the last one seen, by their time, are not new)."""

    def __init__(self, directory: str) -> None:
        self.path = Path(directory) / gaps.FILE
        self.file: tuple[int, int] | None = None  # (device, inode) read
        self.offset = 0
        self.seen_to = 0  # the time of the last gap seen
        self.read()  # what is there now is not new

    def read(self) -> list[Gap]:
        fd = _open_gaps(self.path)
        if fd is None:
            return []
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.file or st.st_size < self.offset:
                self.file, self.offset = (st.st_dev, st.st_ino), 0
            data = os.pread(fd, st.st_size - self.offset, self.offset)
        finally:
            os.close(fd)
        whole = data[:data.rfind(b"\n") + 1]  # (a last line still being written waits)
        self.offset += len(whole)
        new = []
        for line in whole.splitlines():
            gap = _decoded(line, self.path)
            if gap.to_ns > self.seen_to:
                new.append(gap)
                self.seen_to = gap.to_ns
        return new


def _next_seq(directory: str) -> int:
    for seg in reversed(list_segments(directory)):
        blocks = segment_blocks(seg)
        if blocks:
            return blocks[-1].next_seq
    return 0


def export(directory: str, out: str, force: bool) -> None:
    """Export the sealed segments not exported yet (all with *force*), a line each."""
    try:
        from .export import export_journal
    except ImportError as exc:
        raise SbusError(f"export needs pyarrow ({exc}): {install_command('spark')}") from None

    def progress(e) -> None:
        print(f"{e.segment}.parquet: {e.rows:,} rows, {e.journal_bytes:,} -> "
              f"{e.parquet_bytes:,} bytes", file=sys.stderr, flush=True)

    damaged: list[JournalError] = []
    done = export_journal(directory, out, force=force, progress=progress, damaged=damaged)
    rows = sum(e.rows for e in done)
    print(f"sbus journal export: {len(done)} segment(s), {rows:,} rows into {out}",
          file=sys.stderr)
    if damaged:
        raise skipped(damaged, "not exported (its rows stay readable from the journal up "
                               "to the damage); the other segments were")
