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


def _reference(data: bytes) -> str:
    """The escaping spelled out run by run (what `printable` did before it decoded in one
    pass): valid UTF-8 cleaned, each invalid byte ``\\xNN``."""
    def clean(text: str) -> str:
        return "".join(c if c.isprintable() else ascii(c)[1:-1]
                       for c in text.replace("\\", "\\\\"))

    out = []
    while data:
        try:
            out.append(clean(data.decode()))
            break
        except UnicodeDecodeError as exc:
            out.append(clean(data[:exc.start].decode()))
            out.append("".join(f"\\x{b:02x}" for b in data[exc.start:exc.end]))
            data = data[exc.end:]
    return "".join(out)


@given(st.binary(max_size=200) | st.text(max_size=60).map(str.encode))
def test_one_pass_decoding_escapes_as_byte_by_byte_does(data):
    assert printable(data) == _reference(data)


def test_surrogates_in_text_stay_code_points_and_encoded_ones_are_bytes():
    assert printable("\udcff") == "\\udcff"  # a str's lone surrogate is a code point
    assert printable(b"\xed\xb3\xbf") == "\\xed\\xb3\\xbf"  # UTF-8 never encodes one


def test_one_line_escapes_what_controls_are_left_and_keeps_quoted_parts():
    from sbus.display import one_line

    quoted = printable(b"\x1b[2J")  # already escaped: its backslash stays single
    assert one_line(f"cannot listen on \x1b]0;x\x07:80 ({quoted})") == \
        "cannot listen on \\x1b]0;x\\x07:80 (\\x1b[2J)"
    assert one_line("plain") == "plain"


def test_a_commands_error_line_shows_its_arguments_literally(tmp_path):
    """An argument put into an error as it was given (here `--listen`) cannot rewrite the
    terminal or add a line: the command's error printer escapes it (before: raw)."""
    import subprocess
    import sys

    key = tmp_path / "k"
    key.write_text("secret\n")
    key.chmod(0o600)
    done = subprocess.run([sys.executable, "-m", "sbus.cli", "gateway", "--listen",
                           "\x1b]0;owned\x07\nforged:80", "--auth-key-file", str(key)],
                          capture_output=True, timeout=30)
    assert done.returncode == 1 and b"cannot listen on \\x1b]0;owned\\x07\\nforged" \
        in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
