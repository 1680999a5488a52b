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


# -- one place for each thing (issue 24) -----------------------------------------------------

SBUS_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent / "sbus"


def _sources():
    for path in sorted(SBUS_DIR.rglob("*.py")):
        yield path.relative_to(SBUS_DIR.parent).as_posix(), path.read_text()


def test_the_broker_defaults_are_the_ones_of_defaults_py():
    import inspect

    from sbus import defaults, server
    from sbus.broker import Broker
    from sbus.cli import build_parser
    from sbus.core import BrokerCore
    from sbus.flood import DEFAULT_POLICY
    from sbus.handover import ClientState

    for run in (server.run, Broker, BrokerCore):
        params = inspect.signature(run).parameters
        assert params["sep"].default == defaults.SEPARATOR, run
        assert params["max_message"].default == defaults.MAX_MESSAGE, run
        assert params["queue_limit"].default == defaults.QUEUE_LIMIT, run
    assert inspect.signature(server.run).parameters["mode"].default == defaults.SOCKET_MODE
    for run in (Broker, BrokerCore):
        assert inspect.signature(run).parameters["defaults"].default == DEFAULT_POLICY
    assert tuple(p.value for p in DEFAULT_POLICY) == (
        defaults.DEFAULT_SOFT, defaults.DEFAULT_HARD, defaults.DEFAULT_ORDER)
    state = ClientState(1)
    assert (state.soft, state.hard, state.order) == tuple(p.value for p in DEFAULT_POLICY)
    parser, _ = build_parser(["serve"])
    args = parser.parse_args(["serve"])
    assert (args.mode, args.separator.encode(), args.max_message, args.queue_limit) == (
        defaults.SOCKET_MODE, defaults.SEPARATOR, defaults.MAX_MESSAGE, defaults.QUEUE_LIMIT)
    assert tuple(x.encode() for x in (args.soft, args.hard, args.order)) == (
        defaults.DEFAULT_SOFT, defaults.DEFAULT_HARD, defaults.DEFAULT_ORDER)


def test_each_default_and_the_secret_prefix_are_written_once():
    for name, text in _sources():
        if name != "sbus/defaults.py":
            assert '"/run/sbus.socket"' not in text, name
            assert "= 0o666" not in text and "default=0o666" not in text, name  # SOCKET_MODE
        if name != "sbus/keys.py":
            assert 'b"!" + ' not in text, name  # keys.secret_prefix


def test_one_refused_and_every_error_in_the_sbus_error_tree():
    import re

    from sbus.errors import Refused, SbusError, ServeError, UsageError

    defined = [name for name, text in _sources() if re.search(r"^class Refused\b", text, re.M)]
    assert defined == ["sbus/errors.py"]
    assert issubclass(Refused, SbusError) and issubclass(ServeError, SbusError)
    assert issubclass(UsageError, SbusError)
    assert str(Refused("sub", "no")) == "the broker refused the SUB: no"
    assert str(Refused("a frame refused")) == "a frame refused"
    assert Refused("not a key", errno=2).errno == 2


def test_commands_live_in_cmd():
    from sbus.cli import COMMANDS

    outside = {name for name, (module, _) in COMMANDS.items()
               if not module.startswith("sbus.cmd.")}
    # the components whose command lines other work moves (issue 24) at most
    assert outside <= {"mount", "record", "journal", "analyze", "gateway", "bridge"}
    assert COMMANDS["top"][0] == "sbus.cmd.top"
    assert COMMANDS["install-units"][0] == "sbus.cmd.install_units"
