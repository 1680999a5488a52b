"""`sbus sub`'s formatting, pure: format strings, fixed formats, wildcard hints."""

from __future__ import annotations

import json

import pytest

from sbus.msgformat import compile_format, format_message, wildcard_hint
from sbus.protocol import Publish

AT = 1_764_028_800.123456  # a receive time


def show(fmt: str, key: bytes = b"k", payload: bytes = b"p") -> bytes:
    return format_message(Publish(key, payload), compile_format(fmt), AT)


def test_format_string_directives():
    assert show("%T|%k|%p|%x|%l|%%") == b"1764028800.123456|k|p|70|1|%\n"
    assert show("%p", payload=b"\x1b[2J\n") == b"\\x1b[2J\\n\n"
    assert show("%r", payload=b"\x1b") == b"\x1b\n"  # asked for raw: raw
    assert json.loads(show('{"k": %K, "p": %j}', b"a\x1b", b"\xff\"")) == \
        {"k": "a\x1b", "p": '\\xff"'}
    assert show(r"%k\t%l\n") == b"k\t1\n\n"


@pytest.mark.parametrize("fmt, error", [("%", "ends in a lone %"), ("%k %y", "unknown "
                                        "directive %y")])
def test_format_string_errors_say_what_is_wrong(fmt, error):
    with pytest.raises(ValueError, match=error):
        compile_format(fmt)


def test_lines_pretty_and_timestamps():
    msg = Publish(b"k", b'{"a": "\xe2\x80\xae"}')
    assert format_message(msg, "lines", AT, pretty=True).decode().splitlines() == \
        ["k", "  {", '    "a": "\\u202e"', "  }"]
    assert format_message(Publish(b"k", b"[1"), "lines", AT, pretty=True) == b"k [1\n"
    line = format_message(Publish(b"k", b"v"), "lines", AT, timestamps=True).decode()
    assert line.endswith(" k v\n") and line[:10].count("-") == 2


def test_wildcard_hints():
    assert wildcard_hint(b"a/b/*") is None and wildcard_hint(b"a#b/x+") is None
    assert "write 'a/'" in wildcard_hint(b"a/#")
    assert "write ''" in wildcard_hint(b"#")
    assert "write 'a/*/c'" in wildcard_hint(b"a/+/c")
    assert "NATS" in wildcard_hint(b"x/>")
    hint = wildcard_hint(b"\x1b]0;x\x07/#")
    assert "\x1b" not in hint and "\\x1b" in hint
