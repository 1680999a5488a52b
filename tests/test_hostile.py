"""The hostile-client soak in CI size: every broker attack at once, honest users unharmed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Seconds of load: CI size.  Shorter runs weigh the attacks' start (every role ramping
#: up at once) enough in the p99 to cross 50 ms: at 12 s two of three loaded runs, at 20 s
#: one of two quiet ones; 30 s passed every run.  The long soak is the tool itself
#: (``tools/hostile.py``, docs/security.md); ``SBUS_SOAK_SECONDS=300`` runs it longer here.
SECONDS = float(os.environ.get("SBUS_SOAK_SECONDS", 30))

HOSTILE = Path(__file__).resolve().parent.parent / "tools" / "hostile.py"

pytestmark = pytest.mark.alone  # honest p99 under 50 ms: no other test beside it


def test_hostile_soak_bounds_memory_and_stalls_and_loses_nothing() -> None:
    proc = subprocess.run([sys.executable, str(HOSTILE), "--duration", str(SECONDS), "--json"],
                          capture_output=True, text=True, timeout=3 * SECONDS + 180)
    print(proc.stdout[-5000:], proc.stderr[-3000:])
    line = next((x for x in proc.stdout.splitlines() if x.startswith("JSON ")), None)
    assert line is not None, proc.stderr[-2000:]
    result = json.loads(line[5:])
    figures = result["figures"]
    assert result["problems"] == [] and proc.returncode == 0
    # the checks were not vacuous: the attacks ran and the honest users were busy
    assert figures["attacks"] >= 16
    assert figures["whoami_probes"] > 500
    assert figures["reliable_sent"] > 1000
    assert figures["reliable_received_in_order"] == figures["reliable_sent"]
    assert figures["cross_user_received"] == figures["cross_user_sent"] > 1000
    assert figures["secrets_received"] > 0 and figures["secret_leaks"] == 0
    assert "broker_lacks_flags" not in figures
