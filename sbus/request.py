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
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable

import anyio

from .client import AsyncClient, Client, SbusError
from .display import brief
from .protocol import Control, Publish

__all__ = ["request", "request_async", "make_request", "parse_request", "inbox_root", "NotARequest"]

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


def _start(key: bytes | str, cred: bytes) -> tuple[bytes, bytes, bytes]:
    """(key, inbox root, a fresh inbox) for one request."""
    key = key.encode() if isinstance(key, str) else bytes(key)
    root = inbox_root(cred)
    return key, root, root + secrets.token_hex(8).encode()


def _body(payload: bytes | str) -> bytes:
    return payload.encode() if isinstance(payload, str) else bytes(payload)


def request(bus: Client, key: bytes | str, payload: bytes | str = b"",
            timeout: float = 5.0, keep: Callable[[Publish | Control], None] | None = None
            ) -> bytes:
    """Publish a request on *key* and return the first reply's payload.

    Raises `TimeoutError` when no reply came within *timeout* seconds.  Other messages
    that arrive meanwhile go to *keep* (`Client.request` keeps them for `receive`), but
    a late reply to an earlier request (on another of this client's inboxes) is dropped.
    The inbox is unsubscribed on the way out; a second reply already on its way can still
    reach `receive` afterwards, on an ``!/cred/…/inbox/…`` key."""
    key, root, inbox = _start(key, bus.whoami(timeout))
    bus.subscribe(inbox)
    kept: list = []
    try:
        bus.publish(key, make_request(inbox, _body(payload)))
        deadline = time.monotonic() + timeout
        while True:
            try:
                event = bus.receive(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"no reply to the request on {brief(key)} within "
                                   f"{timeout:g} s") from None
            if isinstance(event, Publish) and event.key == inbox:
                return event.payload
            if not (isinstance(event, Publish) and event.key.startswith(root)):
                kept.append(event)
    finally:
        if keep is not None:
            for event in kept:
                keep(event)
        with contextlib.suppress(SbusError):  # the connection may be what failed
            bus.unsubscribe(inbox)


async def request_async(bus: AsyncClient, key: bytes | str, payload: bytes | str = b"",
                        timeout: float = 5.0,
                        keep: Callable[[Publish | Control], None] | None = None) -> bytes:
    """`request` for an `AsyncClient` (trio or asyncio)."""
    with anyio.fail_after(timeout):  # the whoami is part of the wait
        cred = await bus.whoami()
    key, root, inbox = _start(key, cred)
    await bus.subscribe(inbox)
    kept: list = []
    try:
        await bus.publish(key, make_request(inbox, _body(payload)))
        try:
            with anyio.fail_after(timeout):
                while True:
                    event = await bus.receive()
                    if isinstance(event, Publish) and event.key == inbox:
                        return event.payload
                    if not (isinstance(event, Publish) and event.key.startswith(root)):
                        kept.append(event)
        except TimeoutError:
            raise TimeoutError(f"no reply to the request on {brief(key)} within "
                               f"{timeout:g} s") from None
    finally:
        if keep is not None:
            for event in kept:
                keep(event)
        with contextlib.suppress(SbusError), anyio.CancelScope(shield=True):
            await bus.unsubscribe(inbox)
