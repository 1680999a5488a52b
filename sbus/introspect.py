"""What the broker tells a client about itself: the answer to ``CMSG broker/status``.

`sbus status`, `sbus ping` and sbus-top's clients pane read it.  A client sees the
broker's totals and its own user's clients in full (credentials, patterns, queue,
drops, flood policy); root sees every client.  The answer is one packet, so it is
bounded (`ANSWER_BYTES`): a longer list is cut and says where to go on
(``{"after": ID}`` in the request's payload), and building it costs no more than
what it holds plus one pass over the asker's own clients.
"""

from __future__ import annotations

import json

from . import protocol

__all__ = ["answer", "ANSWER_BYTES", "PATTERNS_SHOWN"]

#: Bytes of JSON in one answer at most (well under the smallest --max-message in use).
ANSWER_BYTES = 60 * 1024
#: Patterns listed per client at most (the count is always given).
PATTERNS_SHOWN = 50


def _text(data: bytes) -> str:
    """Bytes for JSON, losslessly where they are UTF-8 (JSON escapes control bytes)."""
    return data.decode("utf-8", "backslashreplace")


def _client(conn, index) -> dict:
    out = conn.out
    patterns = index.patterns(conn)
    shown = [_text(p) for p in list(patterns)[:PATTERNS_SHOWN]]
    return {
        "id": conn.id, "pid": conn.cred.pid, "uid": conn.cred.uid, "gid": conn.cred.gid,
        "subscriptions": conn.subscriptions, "patterns": shown,
        "queued": len(out), "queued_bytes": out.nbytes, "dropped_unreported": out.dropped,
        "soft": out.soft.value.decode(), "hard": out.hard.value.decode(),
        "order": out.order.value.decode(), "nowait": conn.nowait,
        "publishers_paused": len(conn.paused), "status": _text(conn.status),
    }


def answer(broker, asker, payload: bytes | None) -> bytes:
    """The ``CMSG broker/status`` packet that answers *asker*'s request."""
    after = 0
    if payload:
        try:
            after = int(json.loads(payload).get("after", 0))
        except (ValueError, AttributeError, TypeError):
            after = 0
    uid = asker.cred.uid
    mine = broker.connections_of(None if uid == 0 else uid)
    totals = {
        "clients": len(broker.connections), "subscriptions": broker.subscription_count,
        "published": broker.published, "delivered": broker.delivered,
        "dropped": broker.dropped, "uptime": round(broker.now - broker.started, 3),
        "you": asker.id, "visible": "all" if uid == 0 else f"uid {uid}",
    }
    clients, size, more = [], 0, False
    for conn in mine:
        if conn.id <= after:
            continue
        entry = _client(conn, broker.index)
        size += len(json.dumps(entry))
        if size > ANSWER_BYTES:
            more = True
            break
        clients.append(entry)
    body = {"broker": totals, "clients": clients, "more": more}
    if more and clients:
        body["next"] = {"after": clients[-1]["id"]}
    return b"CMSG " + protocol.STATUS + b"\0" + json.dumps(body).encode()
