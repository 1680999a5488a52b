"""The one escaping of client bytes for people (sbus/display.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sbus.display import brief, printable


def test_controls_and_invalid_utf8_are_escaped():
    assert printable(b"a\x1b[2Jb\n\r\t\x7f\xff") == "a\\x1b[2Jb\\n\\r\\t\\x7f\\xff"


def test_a_backslash_cannot_forge_an_escape():
    assert printable(b"\\x1b") == "\\\\x1b"


def test_bidi_overrides_and_c1_controls_are_escaped():
    assert printable("\u202eevil\u009b".encode()) == "\\u202eevil\\x9b"


def test_brief_cuts_and_counts():
    assert brief(b"x" * 250) == "'" + "x" * 100 + "…(+150 bytes)'"


@given(st.binary(max_size=300))
def test_output_never_holds_a_control_character(data):
    text = printable(data)
    assert all(c.isprintable() or c == " " for c in text)
    assert "\n" not in brief(data) and len(brief(data)) < 4 * 100 + 40
