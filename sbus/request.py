"""Request/reply over private inboxes: a convention on top of publish/subscribe.

The protocol leaves replies to applications; secret keys make them private.  A request
is an ordinary message whose payload starts with the key to reply to::

    MSG <key>\\0<reply key>\\0<body>

The reply key is a secret key of the requester, ``!/cred/G/U/P/inbox/<random>``: only
that process can subscribe to it, so only it reads the reply, and the random part (16
hex digits, fresh per request) tells its replies apart and cannot be guessed by anyone
who did not see the request.  A replier publishes its answer as an ordinary message on
the reply key.  The requester subscribes to its inbox *before* publishing the request;
the broker handles one client's packets in order, so no reply can miss it.
docs/protocol.md describes it for other languages.

This module is the convention only (pure functions); the requester's loop is
`Client.request` / `AsyncClient.request` (sbus/client.py) with the inbox kept by the
session (`Session.new_inbox`, `Session.reply_to`).
"""

from __future__ import annotations

from .display import brief

__all__ = ["make_request", "parse_request", "inbox_root", "NotARequest", "INBOX"]

#: The segment under a process's ``!/cred/G/U/P`` that holds its reply inboxes.
INBOX = b"inbox"


class NotARequest(ValueError):
    """A message that does not follow the request convention."""


def inbox_root(cred: bytes) -> bytes:
    """``!/cred/G/U/P`` (a whoami answer) -> ``!/cred/G/U/P/inbox/``; the separator is
    the one the broker uses (the character after ``!``)."""
    sep = cred[1:2] or b"/"
    return cred + sep + INBOX + sep


def make_request(reply_key: bytes, body: bytes) -> bytes:
    """The payload of a request that wants its reply on *reply_key*."""
    if b"\0" in reply_key:
        raise ValueError("a reply key cannot contain NUL")
    return reply_key + b"\0" + body


def parse_request(payload: bytes) -> tuple[bytes, bytes]:
    """A request's payload -> (reply key, body); `NotARequest` if it names no secret key
    to reply to (a replier must not publish to a key a requester cannot own)."""
    nul = payload.find(b"\0")
    if nul < 0:
        raise NotARequest(f"no reply key (no NUL) in {brief(payload, 40)}")
    reply = payload[:nul]
    if not (reply.startswith(b"!/cred/") or reply.startswith(b"!.cred.")):
        raise NotARequest(f"the reply key {brief(reply, 60)} is not a secret !/cred/ key")
    return reply, payload[nul + 1:]
