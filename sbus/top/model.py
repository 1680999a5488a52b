"""The traffic model behind ``sbus-top``: pure aggregation, no I/O, no clock of its own.

Every function takes the current time as an argument, so the whole model can be
driven by tests with made-up times.  The hot path (`TrafficModel.feed`) does a few
dict/attribute updates per message; everything costly (rates, grouping, sorting,
filtering) happens in `TrafficModel.tick` once a second or in
`TrafficModel.snapshot` a few times a second, over the bounded set of keys.
"""

from __future__ import annotations

import heapq
import json
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from ..protocol import DROPPED, Control, ProtocolError, Publish, encode, parse, publish_key
from ..routing import matches

__all__ = [
    "KeyStats", "Row", "Message", "Snapshot", "SortBy", "ViewOptions", "TrafficModel",
    "group_key", "compile_filter", "preview", "CLIENT_SORT", "client_value", "KEYS_PANE",
    "CLIENTS_PANE",
]

SEP = b"/"
#: The broker's report that it dropped messages meant for us (payload: a decimal count).


class SortBy(Enum):
    """Table sort columns, in the order `s` cycles through them."""

    RATE = "msg/s"
    BYTE_RATE = "bytes/s"
    TOTAL = "total"
    LAST = "last seen"
    KEY = "key"

    def next(self) -> SortBy:
        members = list(SortBy)
        return members[(members.index(self) + 1) % len(members)]


#: `ViewOptions.pane` values.
KEYS_PANE, CLIENTS_PANE = "keys", "clients"
#: The clients pane's columns sort as the keys table's do (id for the name).
CLIENT_SORT = {"RATE": "queued_bytes", "BYTE_RATE": "queued_bytes", "TOTAL": "dropped",
               "LAST": "subscriptions", "KEY": "id"}


def client_value(client: dict, name: str) -> object:
    """A field of the broker's answer about one client; ``dropped`` is the total if the
    broker gives one, else what it has not reported yet (``dropped_unreported``)."""
    if name == "dropped" and "dropped" not in client:
        name = "dropped_unreported"
    return client.get(name)


#: Payload bytes kept per key and per recent message for previews (a preview shows less).
PREVIEW_BYTES = 2048
#: Bytes a key's counters cost besides its key and packet (KeyStats, dict entry).
KEY_COST = 300
#: Pages of one status answer taken at most (about 60 KiB each), and rounds of asking
#: skipped while one is still coming before it is given up (a lost connection).
STATUS_PAGES = 32
STATUS_PATIENCE = 5
#: Bytes of a recent message's key kept (the pane shows far fewer): the recent messages are
#: not charged to *max_bytes*, and fifty 256 KB keys would hold 12.5 MB beyond it.
RECENT_KEY_BYTES = 1024


#: A message with an empty key and payload: its length is what a ``MSG`` adds to both.
_EMPTY = encode(Publish(b"", b""))


@dataclass(slots=True)
class KeyStats:
    """Counters for one routing key; `rate`/`byte_rate` are refreshed by `tick`."""

    count: int = 0
    nbytes: int = 0
    last_seen: float = 0.0
    last_packet: bytes = _EMPTY  # the packet, cut after `PREVIEW_BYTES` of payload
    mark_count: int = 0
    mark_bytes: int = 0
    rate: float = 0.0
    byte_rate: float = 0.0

    @property
    def last_payload(self) -> bytes:
        return parse(self.last_packet).payload  # type: ignore[union-attr]


@dataclass(frozen=True, slots=True)
class Row:
    """One table line: a key, or a prefix standing for the keys below it."""

    name: bytes
    rate: float
    byte_rate: float
    count: int
    age: float  # seconds since the last message
    payload: bytes  # the most recent payload in the row
    keys: int = 1  # keys folded into this row (grouping)


@dataclass(frozen=True, slots=True)
class Message:
    """A recent message as the screen keeps it: its key cut to `RECENT_KEY_BYTES` (*cut*:
    the bytes left out) and its payload to `PREVIEW_BYTES`."""

    at: float
    key: bytes
    payload: bytes
    cut: int = 0


@dataclass(slots=True)
class ViewOptions:
    """What the user asked to see: changes with the keyboard, never with traffic."""

    sort: SortBy = SortBy.RATE
    filter: str = ""
    depth: int = 0  # 0: one row per key; N: one row per prefix of N segments
    reverse: bool = False  # smallest first (names: Z to A)
    scroll: int = 0  # rows skipped at the top of the table (clamped by `snapshot`)
    pane: str = KEYS_PANE  # or CLIENTS_PANE


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a screen shows, computed at one instant."""

    now: float
    uptime: float
    address: str
    state: str
    rate: float
    byte_rate: float
    total: int
    total_bytes: int
    keys: int
    evicted: int
    dropped: int
    history: list[float]
    rows: list[Row]
    row_count: int  # rows before `limit` cut them
    recent: list[Message]
    options: ViewOptions = field(default_factory=ViewOptions)
    #: the clients pane: the rows shown (the broker's words, see sbus/introspect.py),
    #: how many there are, and a note when there are none to show (why)
    clients: list[dict] = field(default_factory=list)
    client_count: int = 0
    clients_note: str = ""
    problem: str = ""


def group_key(key: bytes, depth: int) -> bytes:
    """The prefix of *key* made of its first *depth* segments (with a trailing ``/`` when
    something was cut), i.e. the pattern that would match the keys in the group."""
    if depth <= 0:
        return key
    parts = key.split(SEP, depth)
    if len(parts) <= depth:
        return key
    return SEP.join(parts[:depth]) + SEP


def compile_filter(text: str) -> Callable[[bytes], bool]:
    """A key predicate from what the user typed after ``/``.

    Text with a ``*`` or ending in ``/`` is an sbus routing pattern (same rules as
    subscriptions); anything else is a plain substring, which is what one wants when
    hunting for a key by eye."""
    if not text:
        return lambda key: True
    needle = text.encode()
    if b"*" in needle or needle.endswith(SEP):
        return lambda key: matches(needle, key)
    return lambda key: needle in key


def preview(payload: bytes, limit: int = 64) -> str:
    """A one-line preview: text as text, anything else as hex; at most *limit* chars.

    Text means valid UTF-8 with nothing unprintable but tabs and line ends (shown as a
    space and ``↵``); a cut is marked with an ellipsis so a short payload is never
    mistaken for a cut one."""
    if limit <= 0:
        return ""
    head = payload[: limit * 4]
    cut = len(head) < len(payload)
    try:
        text: str | None = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character split by our own cut is still text.
        text = head[: exc.start].decode("utf-8") if cut and exc.start >= len(head) - 3 else None
    if text is not None:
        text = text.replace("\r\n", "\n").replace("\n", "↵").replace("\t", " ")
        if text.isprintable():
            if cut or len(text) > limit:
                return text[: limit - 1] + "…"
            return text
    if len(payload) * 3 - 1 <= limit:
        return payload.hex(" ")
    return payload[: max(limit // 3, 0)].hex(" ") + "…"


class TrafficModel:
    """Per-key counters (an LRU bounded to *max_keys* and *max_bytes*), totals, a minute of
    rate history and the most recent messages.

    Every key is charged its bytes, the packet kept for its preview and `KEY_COST`; a
    packet is kept whole only up to `PREVIEW_BYTES` of payload (a preview shows less), so
    publishers of many or long keys and payloads cost the viewer at most *max_bytes*."""

    def __init__(self, now: float, *, max_keys: int = 10_000, max_bytes: int = 32 << 20,
                 history: int = 60, recent: int = 50, address: str = "") -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        self.started = now
        self.address = address
        self.state = "connecting"
        self.problem = ""  # why the reader is not connected (shown while it retries)
        self.clients: list[dict] = []
        self.clients_note = "asking the broker…"
        self._pages: list[list[dict]] | None = None  # an answer's pages so far (`take_status`)
        self._waited = 0  # status rounds not asked for while its pages were coming
        self._history_len = history
        self._recent_len = recent
        self.clear(now)

    def clear(self, now: float) -> None:
        """Forget all counters (the `c` key); uptime and connection state stay."""
        self.keys: OrderedDict[bytes, KeyStats] = OrderedDict()
        self.held = 0  # bytes charged for `keys` (see the class docstring)
        self.total = 0
        self.total_bytes = 0
        self.evicted = 0
        self.dropped = 0
        self.rate = 0.0
        self.byte_rate = 0.0
        self.history: deque[float] = deque(maxlen=self._history_len)
        self.recent: deque[Message] = deque(maxlen=self._recent_len)
        self._mark_total = 0
        self._mark_bytes = 0
        self._last_tick = now

    # -- the hot path ------------------------------------------------------------------

    def feed_packets(self, packets: Iterable[bytes], now: float) -> list[Control]:
        """Count a batch of raw packets that arrived at *now*.

        Raw packets rather than parsed events because this is the whole per-message
        cost of sbus-top: a ``MSG`` is counted from its key and length without building
        an event or copying the payload (a key keeps a reference to its last packet).
        Returns the control messages other than drop reports, for the caller."""
        keys = self.keys
        count = nbytes = 0
        last: list[bytes] = []
        other: list[Control] = []
        overhead = len(_EMPTY)
        for packet in packets:
            key = publish_key(packet)
            if key is None:
                try:
                    ev = parse(packet)
                except ProtocolError:
                    continue  # the broker never sends these; nothing to count
                if type(ev) is Control and not self._control(ev):
                    other.append(ev)
                continue
            head = len(key) + overhead
            size = len(packet) - head
            if size > PREVIEW_BYTES:
                packet = packet[:head + PREVIEW_BYTES]
            st = keys.get(key)
            if st is None:
                st = keys[key] = KeyStats()
                self.held += KEY_COST + 2 * len(key) + len(st.last_packet)
            else:
                keys.move_to_end(key)
            self.held += len(packet) - len(st.last_packet)
            if self.held > self.max_bytes or len(keys) > self.max_keys:
                self._evict()
            st.count += 1
            st.nbytes += size
            st.last_seen = now
            st.last_packet = packet
            count += 1
            nbytes += size
            last.append(packet)
            if len(last) > 2 * self._recent_len:
                del last[: self._recent_len]
        self.total += count
        self.total_bytes += nbytes
        recent = self.recent
        for packet in last[-self._recent_len:]:
            ev = parse(packet)
            key = ev.key
            cut = max(0, len(key) - RECENT_KEY_BYTES)
            recent.append(Message(now, key[:RECENT_KEY_BYTES] if cut else key, ev.payload, cut))
        return other

    def _evict(self) -> None:
        """Forget the least recently seen keys (never the newest) until within bounds."""
        keys = self.keys
        while len(keys) > 1 and (len(keys) > self.max_keys or self.held > self.max_bytes):
            key, st = keys.popitem(last=False)
            self.held -= KEY_COST + 2 * len(key) + len(st.last_packet)
            self.evicted += 1

    def feed(self, events: Iterable[Publish | Control], now: float) -> list[Control]:
        """`feed_packets` for events (tests, callers that already parsed)."""
        return self.feed_packets([encode(ev) for ev in events], now)

    def status_round(self) -> bool:
        """Whether to ask the broker for its status now: not while the pages of the last
        answer are still coming (`take_status`), unless they stopped coming."""
        if self._pages is not None and self._waited < STATUS_PATIENCE:
            self._waited += 1
            return False
        self._pages, self._waited = [], 0
        return True

    def take_status(self, payload: bytes | None) -> bytes | None:
        """A page of the broker's answer to ``CMSG broker/status``: its clients are kept
        (only dicts, so a strange answer cannot break the screen) until the last page,
        then shown.  Returns the request for the next page, if any: a client of many or
        strange patterns fills a page by itself, and the first page alone let one user
        hide every later client from root's pane.  `STATUS_PAGES` pages at most."""
        pages = self._pages if self._pages is not None else []
        try:
            answer = json.loads(payload or b"{}")
            clients = [c for c in answer.get("clients", []) if isinstance(c, dict)]
        except (ValueError, AttributeError, TypeError, RecursionError):
            self.clients, self.clients_note = [], "the broker's status answer was not JSON"
            self._pages = None
            return None
        you = answer.get("broker", {}).get("you") if isinstance(answer.get("broker"), dict) \
            else None
        for c in clients:
            c["you"] = c.get("id") == you
        pages.append(clients)
        after = answer.get("next")
        if answer.get("more") and isinstance(after, dict) and len(pages) < STATUS_PAGES:
            self._pages = pages
            return json.dumps(after).encode()
        self._pages = None
        self.clients = [c for page in pages for c in page]
        more = f" (the first {len(pages)} pages of the broker's answer)" \
            if answer.get("more") else ""
        self.clients_note = ("no clients visible to you" if not self.clients else "") + more
        return None

    def _control(self, ev: Control) -> bool:
        """Take in a drop report (True), or say this control message is not one."""
        if ev.key != DROPPED:
            return False
        try:
            self.dropped += int(ev.payload or b"0")
        except ValueError:
            pass
        return True

    # -- once a second -----------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Turn the counts since the previous tick into rates; extend the history."""
        dt = now - self._last_tick
        if dt <= 0:
            return
        self._last_tick = now
        for st in self.keys.values():
            dc = st.count - st.mark_count
            if dc or st.rate:
                st.rate = dc / dt
                st.byte_rate = (st.nbytes - st.mark_bytes) / dt
                st.mark_count = st.count
                st.mark_bytes = st.nbytes
        self.rate = (self.total - self._mark_total) / dt
        self.byte_rate = (self.total_bytes - self._mark_bytes) / dt
        self._mark_total = self.total
        self._mark_bytes = self.total_bytes
        self.history.append(self.rate)

    # -- for the screen ----------------------------------------------------------------

    def _entries(self, options: ViewOptions) -> list[tuple[bytes, KeyStats | _Group]]:
        """(name, stats) per row to be: the filtered keys, or their groups."""
        if options.filter:
            keep = compile_filter(options.filter)
            items = [(k, st) for k, st in self.keys.items() if keep(k)]
        else:
            items = list(self.keys.items())
        if options.depth <= 0:
            return items
        groups: dict[bytes, _Group] = {}
        depth = options.depth
        for k, st in items:
            name = group_key(k, depth)
            g = groups.get(name)
            if g is None:
                groups[name] = _Group(st)
            else:
                g.add(st)
        return list(groups.items())

    def rows(self, now: float, options: ViewOptions,
             limit: int | None = None) -> tuple[list[Row], int]:
        """*limit* rows in *options*' order from row ``options.scroll`` on (moved back so
        that a full page shows), and how many rows there are in all.

        Only the rows shown are built: with 10 000 keys a redraw ranks 10 000 entries
        but makes ~20 `Row` objects."""
        entries = self._entries(options)
        start = _first_row(options.scroll, limit, len(entries))
        rank = _RANKS[options.sort]
        if limit is not None and start + limit < len(entries):
            pick = heapq.nlargest if options.reverse else heapq.nsmallest
            chosen = pick(start + limit, entries, key=rank)[start:]
        else:
            chosen = sorted(entries, key=rank, reverse=options.reverse)[start:]
        rows = [Row(name, st.rate, st.byte_rate, st.count, now - st.last_seen,
                    st.last_payload, getattr(st, "keys", 1)) for name, st in chosen]
        return rows, len(entries)

    def client_rows(self, options: ViewOptions, limit: int | None) -> list[dict]:
        """The clients pane's rows: sorted like the keys (queue bytes, drops,
        subscriptions, or id), scrolled."""
        field_ = CLIENT_SORT[options.sort.name]

        def rank(c: dict):
            value = client_value(c, field_)
            return value if isinstance(value, int | float) else 0

        ordered = sorted(self.clients, key=rank, reverse=(field_ != "id") != options.reverse)
        start = _first_row(options.scroll, limit, len(ordered))
        return ordered[start:] if limit is None else ordered[start:start + limit]

    def snapshot(self, now: float, options: ViewOptions | None = None,
                 limit: int | None = None, recent: int | None = None) -> Snapshot:
        """What to show now: the first *limit* rows in *options*' order, *recent* messages."""
        options = options or ViewOptions()
        clients = options.pane == CLIENTS_PANE
        count = len(self.clients) if clients else None
        rows, row_count = ([], len(self._entries(options))) if clients else \
            self.rows(now, options, limit)
        scroll = _first_row(options.scroll, limit, count if clients else row_count)
        keep = compile_filter(options.filter)
        messages = [m for m in self.recent if keep(m.key)]
        if recent is not None:
            messages = messages[-recent:] if recent > 0 else []
        return Snapshot(
            now=now, uptime=now - self.started, address=self.address, state=self.state,
            rate=self.rate, byte_rate=self.byte_rate, total=self.total,
            total_bytes=self.total_bytes, keys=len(self.keys), evicted=self.evicted,
            dropped=self.dropped, history=list(self.history), rows=rows,
            row_count=row_count, recent=messages,
            options=ViewOptions(options.sort, options.filter, options.depth, options.reverse,
                                scroll, options.pane),
            clients=self.client_rows(options, limit) if clients else [],
            client_count=len(self.clients), clients_note=self.clients_note,
            problem=self.problem,
        )


def _first_row(scroll: int, limit: int | None, count: int) -> int:
    """The first row shown: *scroll*, but never past the last full page."""
    if limit is None:
        return 0
    return max(0, min(scroll, count - limit))


class _Group:
    """Summed stats of the keys under one prefix (what a grouped row shows)."""

    __slots__ = ("rate", "byte_rate", "count", "last_seen", "last_packet", "keys")

    def __init__(self, st: KeyStats) -> None:
        self.rate, self.byte_rate, self.count = st.rate, st.byte_rate, st.count
        self.last_seen, self.last_packet, self.keys = st.last_seen, st.last_packet, 1

    def add(self, st: KeyStats) -> None:
        self.rate += st.rate
        self.byte_rate += st.byte_rate
        self.count += st.count
        self.keys += 1
        if st.last_seen >= self.last_seen:
            self.last_seen, self.last_packet = st.last_seen, st.last_packet

    last_payload = KeyStats.last_payload


#: Ascending sort keys for (name, stats): numbers biggest first, ties by name.
_RANKS: dict[SortBy, Callable[[tuple[bytes, KeyStats | _Group]], tuple]] = {
    SortBy.RATE: lambda e: (-e[1].rate, -e[1].count, e[0]),
    SortBy.BYTE_RATE: lambda e: (-e[1].byte_rate, -e[1].rate, e[0]),
    SortBy.TOTAL: lambda e: (-e[1].count, -e[1].rate, e[0]),
    SortBy.LAST: lambda e: (-e[1].last_seen, e[0]),
    SortBy.KEY: lambda e: (e[0],),
}
