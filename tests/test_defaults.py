"""The one size parser (sbus/defaults.py)."""

from __future__ import annotations

import argparse

import pytest

from sbus.defaults import parse_size, size_arg


@pytest.mark.parametrize("text,value", [("4096", 4096), ("256k", 262144), ("4M", 4 << 20),
                                        ("1.5KiB", 1536), (" 2 GB ", 2 << 30)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "k", "-1", "4 X", "1e3"])
def test_bad_sizes_say_what_to_write(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)
    with pytest.raises(argparse.ArgumentTypeError, match="256k"):
        size_arg(text)


@pytest.mark.parametrize("text,value", [("90", 90), ("90s", 90), ("30min", 1800), ("30m", 1800),
                                        ("1.5h", 5400), ("7d", 604800), ("250ms", 0.25)])
def test_durations(text, value):
    from sbus.defaults import parse_duration

    assert parse_duration(text) == value


def test_bad_durations_say_what_to_write():
    from sbus.defaults import duration_arg, parse_duration

    for text in ("", "soon", "-1s", "5 years"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(text)
    with pytest.raises(argparse.ArgumentTypeError, match="30min"):
        duration_arg("x")
