"""The suite runs detached from any terminal (``setsid ./tools/test.sh </dev/null``, as CI,
nohup and cron run it), and its tests of job control hold there too; and it runs from a
fresh clone, where only what git records exists."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# In a new session (as under setsid) the session leader's group has no parent in another
# group of the session: it is orphaned, and the kernel discards SIGTSTP sent to it.  A
# child in a group of its own (as a shell runs a job) is not orphaned and does stop.
_PROBE = """
import os, signal, subprocess, time
def state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
same = subprocess.Popen(["sleep", "30"])
job = subprocess.Popen(["sleep", "30"], process_group=0)
for p in (same, job):
    p.send_signal(signal.SIGTSTP)
deadline = time.monotonic() + 5
while state(job.pid) != "T" and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.1)
print(os.getsid(0) == os.getpid(), state(same.pid), state(job.pid))
for p in (same, job):
    p.kill()
    p.wait()
"""


def test_sigtstp_stops_a_job_of_its_own_group_even_in_a_new_session():
    done = subprocess.run([sys.executable, "-c", _PROBE], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=30, start_new_session=True)
    assert done.returncode == 0, done.stderr
    leader, same, job = done.stdout.split()
    assert leader == "True"
    assert same != "T", "the orphaned group's child stopped: the kernel rule changed?"
    assert job == "T", "a child in its own process group did not stop on SIGTSTP"


def test_the_job_control_test_passes_detached():
    """The one test that depends on job control, run with no terminal, no stdin, in a
    session of its own: it must pass there as well as in a developer's terminal.  A run
    that hangs ends in pytest-timeout's watchdog thread, which prints every thread's
    stack (a thread in a FUSE call may not take a signal) and the failure shows it."""
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "90",
         "--timeout-method", "thread", "tests/test_fuse.py", "-k", "ctrl_z"],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    try:
        out, err = run.communicate(timeout=150)
    except subprocess.TimeoutExpired:  # (the watchdog did not end it either)
        _end_session(run.pid)
        out, err = run.communicate()
        raise AssertionError(f"no end in 150 s: {out[-3000:]} {err[-2000:]}") from None
    if run.returncode:
        _end_session(run.pid)  # a run the watchdog ended leaves its mount, broker and cat
    assert run.returncode == 0, out[-3000:] + err[-2000:]
    assert "1 passed" in out


def _end_session(sid: int) -> None:
    """Kill every process left in the session *sid*: the run's children outlive it when
    it ends by the watchdog's exit, and a job (``cat``) is in a group of its own.  (While
    any is left, the kernel gives no new process the number *sid*.)"""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == sid:
                    os.kill(int(entry), signal.SIGKILL)


def test_the_scripts_people_and_ci_run_are_executable_in_a_clone():
    """A clone has the modes git records, not the ones in this working tree."""
    listed = subprocess.run(["git", "ls-files", "-s", "tools", ".ci", "debian"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    modes = {line.split("\t")[1]: line.split()[0] for line in listed.splitlines()}
    scripts = [p for p in modes if p.endswith(".sh") or p in (".ci/run", "debian/rules")
               or p.startswith("debian/bin/")]
    assert "tools/build-deb.sh" in scripts and "debian/rules" in scripts
    assert {p: modes[p] for p in scripts if modes[p] != "100755"} == {}
