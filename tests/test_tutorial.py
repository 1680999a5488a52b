"""docs/tutorial.md cannot rot: its shell blocks run in order in one shell, as a reader
pastes them, and what the page says they print is checked."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIAL = Path(__file__).resolve().parent.parent / "docs" / "tutorial.md"
SKIP = "<!-- tutorial-test: skip"
NEEDS = ["fusermount3", "mountpoint", "mosquitto"]


def shell_blocks(text: str) -> list[str]:
    """The ```sh blocks of *text*, in order, but those right after a skip comment."""
    out = []
    for m in re.finditer(r"(?ms)^(<!--[^\n]*-->\n)?```sh\n(.*?)^```$", text):
        if not (m.group(1) or "").startswith(SKIP):
            out.append(m.group(2))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_steps(tmp_path: Path, trace: Path) -> str:
    """The end of the command trace and of every log the tutorial wrote."""
    parts = ["--- last commands:", *trace.read_text(errors="replace").splitlines()[-25:]]
    for log in sorted(tmp_path.glob("sbus-tutorial-*/*.log")):
        parts += [f"--- {log.name}:", *log.read_text(errors="replace").splitlines()[-10:]]
    return "\n".join(parts)


def test_the_blocks_are_found():
    blocks = shell_blocks(TUTORIAL.read_text())
    assert len(blocks) >= 10 and blocks[0].startswith("export WORK=")
    assert not any("pip install" in b for b in blocks)  # the install block is skipped


@pytest.mark.skipif(not all(map(shutil.which, NEEDS)), reason=f"needs {', '.join(NEEDS)}")
def test_tutorial_runs_end_to_end(tmp_path: Path):
    trace = tmp_path / "trace"  # each command as it runs: a hang or a failure names its step
    script = (f"exec 9>>{trace}; BASH_XTRACEFD=9; set -x; set -euo pipefail\n"
              + "\n".join(shell_blocks(TUTORIAL.read_text())))
    env = dict(os.environ, TMPDIR=str(tmp_path), GATEWAY_PORT=str(free_port()),
               MQTT_PORT=str(free_port()),
               PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    env.pop("SBUS_ADDRESS", None)
    # The output goes to a file and the test waits for the shell, not for the end of its
    # output: a step that fails leaves the background servers holding that output open.
    printed = tmp_path / "printed"
    with printed.open("wb") as sink:
        proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        rc = "none: still running after 240 s"
    finally:  # whatever the script left behind: its process group, a mount
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for work in tmp_path.glob("sbus-tutorial-*"):  # no stat of a dead mount
            subprocess.run(["fusermount3", "-u", "-z", str(work / "mnt")], capture_output=True)
    out = printed.read_text(errors="replace")
    assert rc == 0, f"{out}\n--- exit status {rc}\n{last_steps(tmp_path, trace)}"
    for said in ["greetings/world hello", "HELLO", "sensors/kitchen/temp 21.5",
                 "19.5\n19.6\n", "ticks/a", "sensors/garden/temp 12.0",
                 "sensors/roof/wind 7"]:
        assert said in out, f"the tutorial says {said!r}; the run printed:\n{out}"
    assert not list(tmp_path.glob("sbus-tutorial-*")), "the clean-up step left files"
