"""How ``sbus sub`` shows a message: the fixed formats and ``-F`` format strings.

Pure: a message and the time it arrived in, bytes out.  Everything a person reads is
escaped (`sbus.display.printable`) unless the user asked for raw bytes (``--format raw``,
``%r``).  The protocol carries no timestamps, so a time is when this subscriber received
the message.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

from .display import brief, printable, timestamp
from .protocol import Publish

__all__ = ["FORMATS", "DIRECTIVES", "compile_format", "format_message", "wildcard_hint"]

#: ``--format`` choices.
FORMATS = ("lines", "raw", "json")

Part = Callable[[Publish, float], bytes]


def _json_text(data: bytes) -> bytes:
    """A JSON string literal; invalid UTF-8 bytes as ``\\xNN`` text (JSON has no bytes)."""
    return json.dumps(data.decode("utf-8", "backslashreplace")).encode()


#: ``-F`` directive -> (what it shows, how).
DIRECTIVES: dict[str, tuple[str, Part]] = {
    "t": ("receive time, RFC 3339 with microseconds, UTC (--local-time: local)",
          lambda m, at: timestamp(at).encode()),
    "T": ("receive time, seconds since 1970 (microseconds)",
          lambda m, at: f"{at:.6f}".encode()),
    "k": ("key, control bytes and invalid UTF-8 escaped", lambda m, at: printable(m.key).encode()),
    "K": ("key as a JSON string", lambda m, at: _json_text(m.key)),
    "p": ("payload, control bytes and invalid UTF-8 escaped",
          lambda m, at: printable(m.payload).encode()),
    "j": ("payload as a JSON string", lambda m, at: _json_text(m.payload)),
    "x": ("payload in hex", lambda m, at: m.payload.hex().encode()),
    "r": ("payload bytes as they are (raw: may drive the terminal)", lambda m, at: m.payload),
    "l": ("payload length in bytes", lambda m, at: str(len(m.payload)).encode()),
    "%": ("a literal %", lambda m, at: b"%"),
}


def compile_format(text: str, *, local: bool = False) -> list[bytes | Part]:
    """``'%t %k %p'`` -> parts; `ValueError` names an unknown or dangling directive.
    ``\\n`` and ``\\t`` in *text* stand for newline and tab; a newline ends each message.
    *local*: ``%t`` in local time rather than UTC."""
    text = text.replace("\\n", "\n").replace("\\t", "\t")
    parts: list[bytes | Part] = []
    literal, i = [], 0
    while i < len(text):
        c = text[i]
        if c != "%":
            literal.append(c)
            i += 1
            continue
        if i + 1 == len(text):
            raise ValueError(f"the format {text!r} ends in a lone %")
        d = text[i + 1]
        if d not in DIRECTIVES:
            known = " ".join("%" + k for k in DIRECTIVES)
            raise ValueError(f"unknown directive %{d} in {text!r} (known: {known})")
        if literal:
            parts.append("".join(literal).encode())
            literal = []
        parts.append(_local_time if d == "t" and local else DIRECTIVES[d][1])
        i += 2
    parts.append(("".join(literal) + "\n").encode())
    return parts


def _pretty_json(payload: bytes) -> str | None:
    """The payload as indented JSON, escaped line by line; None if it is not JSON."""
    try:
        value = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict | list):
        return None
    text = json.dumps(value, indent=2, ensure_ascii=False)  # controls come out escaped
    if not text.isprintable():  # ... but not bidi overrides, line separators & co
        text = "".join(c if c.isprintable() or c == "\n" else json.dumps(c)[1:-1]
                       for c in text)
    return "\n".join("  " + line for line in text.splitlines())


def _local_time(m: Publish, at: float) -> bytes:
    return timestamp(at, local=True).encode()


def format_message(msg: Publish, fmt: str | list, at: float, *, timestamps: bool = False,
                   pretty: bool = False, local: bool = False) -> bytes:
    """One message as *fmt* (a `FORMATS` name or a `compile_format` result) shows it;
    *timestamps* with the receive time (`sbus.display.timestamp`, *local* or UTC)."""
    if not isinstance(fmt, str):
        return b"".join(p if isinstance(p, bytes) else p(msg, at) for p in fmt)
    if fmt == "raw":
        return msg.payload
    if fmt == "lines":
        head = (timestamp(at, local=local) + " " if timestamps else "") + printable(msg.key)
        body = _pretty_json(msg.payload) if pretty else None
        if body is not None:
            return (head + "\n" + body + "\n").encode()
        return (head + " " + printable(msg.payload.rstrip(b"\n")) + "\n").encode()
    obj: dict[str, str] = {"time": timestamp(at, local=local)} if timestamps else {}
    for name, value in (("key", msg.key), ("payload", msg.payload)):
        try:
            obj[name] = value.decode()
        except UnicodeDecodeError:
            obj[name + "_base64"] = base64.b64encode(value).decode()
    return json.dumps(obj, indent=2 if pretty else None).encode() + b"\n"


_FOREIGN = {b"#": "MQTT's '#'", b"+": "MQTT's '+'", b">": "NATS's '>'"}


def wildcard_hint(pattern: bytes, sep: bytes = b"/") -> str | None:
    """One line for a pattern that uses another tool's wildcard as a segment (which sbus
    takes literally), saying what sbus writes instead; None for an ordinary pattern."""
    segments = pattern.split(sep)
    for i, seg in enumerate(segments):
        if seg in _FOREIGN:
            if seg == b"+":
                fix = sep.join([*segments[:i], b"*", *segments[i + 1:]])
            else:
                fix = sep.join(segments[:i]) + sep if i else b""
            return (f"{brief(pattern)}: {_FOREIGN[seg]} is a literal segment in sbus; "
                    f"for {'one segment' if seg == b'+' else 'everything below'} write "
                    f"{brief(fix)} ('*' is one segment, a trailing '/' everything "
                    "below, '' everything)")
    return None
