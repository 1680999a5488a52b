"""The soak tool in CI size: a short run must pass every one of its checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: Seconds of load: CI size.  The long soak is the tool itself (``tools/soak.py``,
#: docs/security.md); ``SBUS_SOAK_SECONDS=300`` runs this test at that size.
SECONDS = float(os.environ.get("SBUS_SOAK_SECONDS", 12))

SOAK = Path(__file__).resolve().parent.parent / "tools" / "soak.py"


def test_short_soak_loses_nothing_and_leaks_nothing() -> None:
    proc = subprocess.run([sys.executable, str(SOAK), "--duration", str(SECONDS), "--json"],
                          capture_output=True, text=True, timeout=3 * SECONDS + 180)
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    line = next((x for x in proc.stdout.splitlines() if x.startswith("JSON ")), None)
    assert line is not None, proc.stderr[-2000:]
    result = json.loads(line[5:])
    figures = result["figures"]
    assert result["problems"] == [] and proc.returncode == 0
    # the checks were not vacuous
    assert figures["reliable_sent"] > 0
    assert figures["reliable_received_in_order"] == figures["reliable_sent"]
    assert figures["secrets_received_by_owners"] > 0 and figures["secret_leaks"] == 0
    assert figures["idle_connections_held"] >= 500
    assert figures["broker_published"] > 1000
