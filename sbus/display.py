"""Client bytes made safe to show a person: one place for every terminal, report and log.

Anything a client chose (keys, patterns, payloads) may hold escape sequences that
rewrite a terminal, newlines that forge log lines, or megabytes.  `printable` turns
bytes into text with every control byte and invalid UTF-8 escaped (``\\x1b``, ``\\n``);
`brief` does the same and cuts to a short quote for log lines and error messages.
"""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["printable", "brief", "one_line", "LOG_QUOTE", "timestamp"]

#: Bytes of client input quoted in a log line or error message at most.
LOG_QUOTE = 100

_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(c: str) -> str:
    named = _NAMED.get(c)
    if named:
        return named
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def _escape_byte(c: str) -> str:
    """`_escape`, but a lone surrogate U+DC80..U+DCFF stands for the invalid byte that
    ``surrogateescape`` decoded (valid UTF-8 never decodes to a surrogate)."""
    n = ord(c)
    return f"\\x{n - 0xDC00:02x}" if 0xDC80 <= n <= 0xDCFF else _escape(c)


def _clean(text: str, escape=_escape) -> str:
    """Backslashes doubled; every character Unicode calls "other" or "separator" (controls,
    bidi overrides, line separators, unassigned…) but the space escaped."""
    return _controls(text.replace("\\", "\\\\"), escape)


def _controls(text: str, escape=_escape) -> str:
    """Every character of *text* that `str.isprintable` refuses, escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else escape(c) for c in text)


def printable(data: bytes | str, limit: int | None = None) -> str:
    """*data* as one line of text that a terminal shows literally.

    Invalid UTF-8 becomes ``\\xNN``; controls become ``\\n``, ``\\x1b``…; a backslash is
    doubled, so an escape cannot be forged.  With *limit*, at most that many bytes (or
    characters, for text) are shown and the rest is counted: ``…(+N bytes)``.
    """
    more = 0
    if limit is not None and len(data) > limit:
        data, more = data[:limit], len(data) - limit
    if isinstance(data, str):
        text = _clean(data)
    else:
        text = _decode(bytes(data))
    return text + (f"…(+{more} bytes)" if more else "")


def _decode(data: bytes) -> str:
    """One decoding in C for the whole of *data*, however many invalid bytes it holds (a
    loop that resumed after each invalid byte took a second for 256 KB of them)."""
    return _clean(data.decode("utf-8", "surrogateescape"), _escape_byte)


def brief(data: bytes | str, limit: int = LOG_QUOTE) -> str:
    """A short quote of client input for a log line or an error: ``'printable…(+N bytes)'``."""
    return "'" + printable(data, limit).replace("'", "\\'") + "'"


def one_line(text: str) -> str:
    """*text*, a message already made of quoted parts, kept to one line a terminal shows
    literally: what control characters are left in it (an argument or a path put in as
    it was given) escaped, backslashes left as they are (the quoted parts doubled
    theirs).  The last defence of every command's error line."""
    return _controls(text)


def json_bytes(obj: dict, name: str, value: bytes) -> None:
    """Put *value* into a JSON object as text under *name*, or, when it is not UTF-8, as
    base64 under ``<name>_base64`` (JSON strings cannot hold arbitrary bytes)."""
    import base64

    try:
        obj[name] = value.decode()
    except UnicodeDecodeError:
        obj[name + "_base64"] = base64.b64encode(value).decode()


def timestamp(at: float, *, local: bool = False) -> str:
    """*at* (seconds since 1970) as every command shows a time: RFC 3339 with
    microseconds, in UTC (``2026-11-25T23:22:31.123456Z``) or, with *local*, in the local
    time zone with its offset (``2026-11-26T00:22:31.123456+01:00``)."""
    if local:
        return datetime.fromtimestamp(at).astimezone().isoformat(timespec="microseconds")
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
