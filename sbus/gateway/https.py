"""The optional HTTPS publish endpoint: ``POST`` a JSON ``{"topic", "body"}`` message.

For publishers that cannot hold a connection open (scripts, webhooks).  Both
fields are base64 (topics and bodies are bytes); the secret travels in the
``X-Authentication-Key`` header, so the endpoint is only served over TLS.
Answers: 201 published, 400 bad request, 401 missing or wrong key, 405 not a
POST, 413 too large, 415 not JSON, 503 the bus is down.  Any path is accepted.

HTTP/1.1 parsing is h11's (a small, strict, sans-IO parser); the decision for
one request is the pure `decide`, the rest is a thin trio shell.  Every answer but
201 closes the connection (a 401 too: a key guess costs a new TLS handshake, and
pipelined guesses after it are never read), and is sent only after the refusal delay;
connections count against the gateway's caps like protocol clients.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
import math
import ssl
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import h11
import trio

from ..errors import SbusError
from ..keys import KeyRules
from .admission import peer_of
from .checks import FrameRefused, check_key

if TYPE_CHECKING:  # the gateway serves this endpoint; this module does not import it
    from .server import Gateway

log = logging.getLogger("sbus.gateway.https")

__all__ = ["Answer", "decide", "serve_https"]

#: Largest request head (request line and headers) accepted, in bytes.
MAX_HEADER = 16 * 1024


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    text: str
    #: What to publish when the request is accepted (status 201).
    topic: bytes | None = None
    body: bytes | None = None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def decide_head(method: bytes, headers: list[tuple[bytes, bytes]],
                secret: bytes) -> Answer | None:
    """The answer a request gets from its head alone, before its body is read (pure):
    an unauthenticated peer never makes the gateway hold a body."""
    if method != b"POST":
        return Answer(405, "only POST is supported")
    key = _header(headers, b"x-authentication-key")
    if key is None:
        return Answer(401, "X-Authentication-Key header missing")
    if not hmac.compare_digest(key, secret):
        return Answer(401, "wrong authentication key")
    return None


def decide(method: bytes, headers: list[tuple[bytes, bytes]], content: bytes,
           secret: bytes, max_frame: int, rules: KeyRules | None = None) -> Answer:
    """What to answer to one complete request (pure)."""
    early = decide_head(method, headers, secret)
    if early is not None:
        return early
    ctype = (_header(headers, b"content-type") or b"").split(b";")[0].strip().lower()
    if ctype != b"application/json":
        return Answer(415, "Content-Type must be application/json")
    try:
        doc = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        return Answer(400, f"body is not JSON: {exc}")
    except RecursionError:
        return Answer(400, "body is not JSON this gateway reads: nested too deeply")
    if not isinstance(doc, dict) or not isinstance(doc.get("topic"), str) \
            or not isinstance(doc.get("body", ""), str):
        return Answer(400, 'expected {"topic": base64, "body": base64}')
    try:
        topic = base64.b64decode(doc["topic"], validate=True)
        body = base64.b64decode(doc.get("body", ""), validate=True)
    except (binascii.Error, ValueError) as exc:
        return Answer(400, f"topic and body must be base64: {exc}")
    if len(topic) + len(body) > max_frame:
        return Answer(413, f"topic and body exceed {max_frame} bytes")
    try:
        check_key(rules or KeyRules(b"/"), topic)
    except FrameRefused as exc:
        return Answer(400, str(exc))
    return Answer(201, "published", topic, body)


def _max_content(max_frame: int) -> int:
    return max_frame * 4 // 3 + 4096  # base64 and JSON around a full frame


async def _respond(stream: trio.abc.Stream, conn: h11.Connection, answer: Answer,
                   idle: float) -> None:
    """Send *answer*; `trio.TooSlowError` if the client takes it not within *idle*
    seconds (`--idle-timeout`: it reads nothing)."""
    text = (answer.text + "\n").encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"),
               ("Content-Length", str(len(text)))]
    if answer.status == 405:
        headers.append(("Allow", "POST"))
    if answer.status >= 400:
        headers.append(("Connection", "close"))
    data = conn.send(h11.Response(status_code=answer.status, headers=headers))
    data += conn.send(h11.Data(data=text)) + conn.send(h11.EndOfMessage())
    with trio.fail_after(idle):  # a client that never reads is not held for ever
        await stream.send_all(data)


async def _handle(gw: Gateway, stream: trio.abc.Stream, host: str, peer: str) -> None:
    """One admitted HTTPS connection (`Gateway.accept`)."""
    try:
        if await gw.handshake(stream, host, peer):
            await _serve(gw, stream, host)
    except Exception as exc:  # the one top-level guard: see `Gateway.crashed`
        gw.crashed(peer, exc)
    finally:
        gw.caps.release(host)


class Reading:
    """One request being read (sans-IO): what `advance` has seen of it so far."""

    __slots__ = ("request", "body")

    def __init__(self) -> None:
        self.request: h11.Request | None = None
        #: One buffer, however many chunks it came in: a body of 2-byte chunks held as a
        #: list of them cost 15 MB for 350 KB (the audit)
        self.body = bytearray()


#: What `advance` returns when it needs more bytes, when the peer is gone, and when it
#: took its share of events for one turn (the caller lets the others run, then goes on).
NEED_DATA, CLOSED, MORE = "need data", "closed", "more"
#: h11 events worked on before the others get a turn: a 64 KiB read of 2-byte chunks
#: is ~10,000 of them, which held the loop for tens of ms without one (the audit).
EVENTS_PER_TURN = 256
#: Bytes read from a connection at once.
READ_BYTES = 16 * 1024


def advance(conn: h11.Connection, reading: Reading, secret: bytes, max_frame: int,
            rules: KeyRules | None = None, budget: float = math.inf) -> Answer | str:
    """Take the events h11 has parsed until the request has its answer (pure): an
    `Answer`, `NEED_DATA`, `CLOSED`, or `MORE` after *budget* events.  Raises only
    `h11.RemoteProtocolError`."""
    limit = _max_content(max_frame)
    taken = 0
    while True:
        if taken >= budget:
            return MORE
        taken += 1
        event = conn.next_event()
        if event is h11.NEED_DATA:
            return NEED_DATA
        if isinstance(event, h11.Request):
            reading.request = event
            length = _header(event.headers, b"content-length")
            answer = decide_head(event.method, event.headers, secret)
            if answer is not None:
                return answer
            if length is not None and int(length) > limit:  # h11 checked: digits only
                return Answer(413, f"request body over {limit} bytes")
        elif isinstance(event, h11.Data):
            if len(reading.body) + len(event.data) > limit:
                return Answer(413, f"request body over {limit} bytes")
            reading.body += event.data
        elif isinstance(event, h11.EndOfMessage):
            request = reading.request
            if request is None:
                return CLOSED
            return decide(request.method, request.headers, bytes(reading.body),
                          secret, max_frame, rules)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return CLOSED


async def _serve(gw: Gateway, stream: trio.abc.Stream, host: str) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER)
    turn = gw.turn_of(gw.caps.peer(host))
    try:
        while True:
            reading = Reading()
            answer: Answer | str | None = None
            with trio.move_on_after(gw.idle_timeout):
                while True:
                    # one connection of an address at a time, `EVENTS_PER_TURN` a turn
                    # (as for TCP clients: `Gateway._read`)
                    async with turn:
                        answer = advance(conn, reading, gw.secret, gw.max_frame, gw.rules,
                                         EVENTS_PER_TURN)
                    if answer is MORE:
                        continue
                    if answer is not NEED_DATA:
                        break
                    conn.receive_data(await stream.receive_some(READ_BYTES))
            if answer is CLOSED:
                return
            if not isinstance(answer, Answer):
                return  # idle
            if answer.status == 201:
                assert answer.topic is not None and answer.body is not None
                if not await gw.bridge.publish(answer.topic, answer.body,
                                               gw.caps.peer(host).owner):
                    answer = Answer(503, "the bus is not available; try again")
                elif not await gw.bridge.confirmed():  # a 201 means the broker has it
                    answer = Answer(503, "the bus did not confirm the message (it went "
                                    "away, or did not answer within "
                                    f"{gw.bridge.bus_wait:g} s): it may not have been "
                                    "published; try again")
            elif answer.status == 401 and "wrong" in answer.text:
                gw.say(host, logging.WARNING, "HTTPS %s: wrong authentication key",
                       peer_of(stream)[1])
            if answer.status >= 400 and answer.status != 503:
                # turned away (a wrong key too): the ANSWER waits, nothing more is read,
                # the connection keeps its slot.  A client that retries at once makes
                # one attempt per delay: one that waits for its answer (Go's HTTP
                # client) opens no other connection meanwhile, where an answer at once
                # and a delayed close let it redial every slot of its address
                await trio.sleep(gw.refusal_delay)
            await _respond(stream, conn, answer, gw.idle_timeout)
            if conn.our_state is h11.MUST_CLOSE or answer.status >= 400:
                return
            conn.start_next_cycle()
    except h11.RemoteProtocolError as exc:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            try:
                await _respond(stream, conn, Answer(exc.error_status_hint,
                                                    f"bad HTTP request: {exc}"),
                               gw.idle_timeout)
            except (trio.BrokenResourceError, trio.ClosedResourceError,
                    h11.LocalProtocolError):
                pass
            except trio.TooSlowError:
                return
        await trio.sleep(gw.refusal_delay)  # turned away: see above
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        if isinstance(exc.__cause__, ssl.SSLError):  # e.g. plaintext: the same delay
            await trio.sleep(gw.refusal_delay)
    except trio.TooSlowError:  # an answer not taken within the idle timeout: closed
        pass
    finally:
        await trio.aclose_forcefully(stream)


async def serve_https(gw: Gateway, host: str, port: int, ctx: ssl.SSLContext, *,
                      task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accept HTTPS publishes on *host*:*port* until cancelled."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host or None)
    except OSError as exc:
        raise SbusError(f"cannot listen on {host}:{port} for HTTPS: "
                        f"{exc.strerror or exc}") from None
    await gw.accept(listeners, partial(_handle, gw), ctx, https_compatible=True,
                    task_status=task_status)
