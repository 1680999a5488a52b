"""What the broker tells a client about itself: the answer to ``CMSG broker/status``.

`sbus status`, `sbus ping` and sbus-top's clients pane read it.  A client sees the
broker's totals and its own user's clients in full (credentials, patterns, queue,
drops, flood policy); root sees every client.  The answer is one packet, so it is
bounded (`ANSWER_BYTES`): a longer list is cut and says where to go on
(``{"after": ID}`` in the request's payload), and building it costs no more than
what it holds plus one pass over the asker's own clients.
"""

from __future__ import annotations

import codecs
import json

from . import protocol

__all__ = ["answer", "entry_bytes", "ANSWER_BYTES", "PATTERNS_SHOWN"]

#: Bytes of JSON in one answer at most (well under the smallest --max-message in use).
ANSWER_BYTES = 60 * 1024
#: Patterns listed per client at most (the count is always given).
PATTERNS_SHOWN = 50
#: Bytes of one pattern or status shown at most: every entry then has a size bounded
#: before it is encoded (at most 6 JSON characters a byte), so one client's long or
#: invalid patterns cannot make an answer costly; `_entry` keeps it within half a page.
ENTRY_BYTES = 200
#: Bytes of the broker's packet left for other than the page (header, totals) when
#: ``--max-message`` is below `ANSWER_BYTES`: a page then fits what the broker may send.
PAGE_MARGIN = 1024
#: Bytes of a request's payload (``{"after": ID}``) read at most; a longer one is ignored.
REQUEST_BYTES = 64


def _text(data: bytes) -> str:
    """At most `ENTRY_BYTES` of client bytes for JSON: UTF-8 as it is (JSON escapes
    control bytes) with each backslash doubled, and from the first byte that is not UTF-8,
    every byte outside printable ASCII as ``\\xNN`` (escaped in one C call: an error
    handler called per invalid byte took ~36 µs per entry, 1.6 ms per answer); a cut entry
    says how much it left out.  Doubling the backslash keeps a byte 0xFF and the four
    characters ``\\xff`` apart: `entry_bytes` gives back the bytes."""
    cut = data[:ENTRY_BYTES]
    try:
        text = cut.decode("utf-8")
    except UnicodeDecodeError as exc:
        tail = codecs.escape_encode(cut[exc.start:])[0].decode("ascii").replace("\\'", "'")
        text = cut[:exc.start].decode("utf-8").replace("\\", "\\\\") + tail
    else:
        text = text.replace("\\", "\\\\")
    if len(data) > ENTRY_BYTES:
        text += f"…(+{len(data) - ENTRY_BYTES} bytes)"
    return text


def entry_bytes(text: str) -> bytes:
    """The client bytes an answer's pattern or status stands for (`_text` undone), for a
    view to escape as it escapes every client byte.  A broker older than the doubled
    backslash may send an escape that does not parse: then the text as it is."""
    raw = text.encode("utf-8")
    if b"\\" not in raw:
        return raw
    try:
        return codecs.escape_decode(raw)[0]
    except ValueError:
        return raw


def _after(payload: bytes | None) -> int:
    """The client id a request asks to go on after (0: from the start).  Anything but a
    small JSON object with an integer ``after`` means 0: no payload can raise here."""
    if not payload or len(payload) > REQUEST_BYTES:
        return 0
    try:
        doc = json.loads(payload)
    except (ValueError, RecursionError):
        return 0
    after = doc.get("after", 0) if isinstance(doc, dict) else 0
    return after if type(after) is int else 0


def _entry(conn, index, limit: int) -> str:
    """One client's JSON, at most *limit* bytes (half a page): control bytes take 6
    characters each in JSON (``\\u0001``), so 50 patterns of 200 could outgrow a page,
    and a page that could not hold its first entry ended the listing for everyone after
    it; the patterns that would not fit are left out (`subscriptions` counts them)."""
    shown = PATTERNS_SHOWN
    while True:
        entry = json.dumps(_client(conn, index, shown))
        if len(entry) <= limit or not shown:
            return entry
        shown //= 2


def _client(conn, index, shown_at_most: int) -> dict:
    out = conn.out
    shown = [_text(p) for p in index.first_patterns(conn, shown_at_most)]
    return {
        "id": conn.id, "pid": conn.cred.pid, "uid": conn.cred.uid, "gid": conn.cred.gid,
        "subscriptions": conn.subscriptions, "patterns": shown,
        "queued": len(out), "queued_bytes": out.nbytes, "dropped_unreported": out.dropped,
        "soft": out.soft.value.decode(), "hard": out.hard.value.decode(),
        "order": out.order.value.decode(), "nowait": conn.nowait,
        "publishing_for": None if conn.owner == conn.cred.uid else conn.owner,
        "publishers_paused": len(conn.paused), "status": _text(conn.status),
    }


def answer(broker, asker, payload: bytes | None) -> bytes:
    """The ``CMSG broker/status`` packet that answers *asker*'s request."""
    after = _after(payload)
    uid = asker.cred.uid
    mine = broker.connections_of(None if uid == 0 else uid)
    totals = {
        "clients": len(broker.connections), "subscriptions": broker.subscription_count,
        "published": broker.published, "delivered": broker.delivered,
        "dropped": broker.dropped, "uptime": round(broker.now - broker.started, 3),
        "you": asker.id, "visible": "all" if uid == 0 else f"uid {uid}",
    }
    # each entry is encoded once, and the page is joined from them: the answer costs
    # what it holds (`ENTRY_BYTES` per shown string), whatever the clients hold
    entries, ids, size, more = [], [], 0, False
    page = min(ANSWER_BYTES, max(broker.max_message - PAGE_MARGIN, 4 * PAGE_MARGIN))
    for conn in mine:
        if conn.id <= after:
            continue
        entry = _entry(conn, broker.index, page // 2)
        size += len(entry) + 1
        if size > page:
            more = True
            break
        entries.append(entry)
        ids.append(conn.id)
    tail = f', "next": {{"after": {ids[-1]}}}' if more and ids else ""
    body = (f'{{"broker": {json.dumps(totals)}, "clients": [{", ".join(entries)}], '
            f'"more": {json.dumps(more)}{tail}}}')
    return protocol.encode(protocol.Control(protocol.STATUS, body.encode()))
