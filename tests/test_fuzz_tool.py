"""tools/fuzz.py runs on this machine, counts its inputs, and its oracles can fail."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent.parent / "tools" / "fuzz.py"


def _load():
    spec = importlib.util.spec_from_file_location("sbus_fuzz_tool", FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fuzz_tool_runs_briefly_and_counts_inputs(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(FUZZ), "--seconds", "1", "--workdir",
                           str(tmp_path), "parser", "keys"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    total = re.search(r"total inputs fuzzed: ([\d,]+)", proc.stdout)
    assert total and int(total.group(1).replace(",", "")) > 1000, proc.stdout


def test_fuzz_tool_refuses_unknown_targets() -> None:
    proc = subprocess.run([sys.executable, str(FUZZ), "bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown target" in proc.stderr


def test_keys_oracle_catches_a_rule_that_accepts_everything(monkeypatch) -> None:
    """Plant the bug the keys target hunts for; the oracle must object."""
    fuzz = _load()
    fuzz.fuzz_keys(b"\x01*/*/*/\0a")  # the real rules refuse wildcard credentials
    monkeypatch.setattr("sbus.keys.KeyRules.check_pattern", lambda self, p, cred: p)
    with pytest.raises(AssertionError, match="matches secret"):
        fuzz.fuzz_keys(b"\x01*/*/*/\0a")


def test_routing_oracle_catches_a_lost_tail_match(monkeypatch) -> None:
    fuzz = _load()
    ops = bytes([0, 64, 0, 3])  # op 0 (subscribe), client 0, 2 atoms: "a" + sep; then match it
    fuzz.fuzz_routing(b"/" + ops)
    from sbus.routing import RoutingIndex

    real = RoutingIndex.match
    monkeypatch.setattr(RoutingIndex, "match",
                        lambda self, key: () if key.endswith(b"/") else real(self, key))
    with pytest.raises(AssertionError, match="model says"):
        fuzz.fuzz_routing(b"/" + ops)
