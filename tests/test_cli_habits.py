"""What people used to mosquitto and ping(8) reach for first (issue 29), each through the
real command: mosquitto's -t/-m, a payload awaited at a terminal, one time format,
ping's summary on Ctrl-C, a reply's last newline on a terminal, a backgrounded mount
with nowhere to log, a user's broker on the system bus's socket."""

from __future__ import annotations

import os
import pty
import re
import select
import shutil
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from conftest import SBUS
from test_cli_tools import sbus, start, wait_subscribed

from sbus import Client
from sbus.cmd.status import fetch

RFC3339_UTC = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"


def read_until(fd: int, needle: bytes, timeout: float = 10) -> bytes:
    """What a pty's leader reads until *needle* shows (or the time is up: assert)."""
    out, deadline = b"", time.monotonic() + timeout
    while needle not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {out!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            out += chunk
    return out


def wait_holders(address: str, pattern: str, n: int, timeout: float = 20) -> None:
    """Until *n* clients hold *pattern* in the broker's status."""
    deadline = time.monotonic() + timeout
    with Client(address) as bus:
        while sum(pattern in c["patterns"] for c in fetch(bus, 5)["clients"]) < n:
            assert time.monotonic() < deadline, f"fewer than {n} hold {pattern!r}"
            time.sleep(0.02)


# -- mosquitto's spellings --------------------------------------------------------------

def test_mosquitto_pub_and_sub_spellings_work(broker):
    sub = start("sub", "--address", broker.address, "-C", "2", "-t", "greetings/world",
                "-t", "other")
    wait_subscribed(broker.address, "other")
    r = sbus("pub", "--address", broker.address, "-t", "greetings/world", "-m", "hello")
    assert r.returncode == 0 and r.stderr == b""
    r = sbus("pub", "--address", broker.address, "-t", "other", "positional")
    assert r.returncode == 0 and r.stderr == b""
    out, err = sub.communicate(timeout=10)
    assert sub.returncode == 0, err
    assert out.decode().splitlines() == ["greetings/world hello", "other positional"]


@pytest.mark.parametrize("args,line", [
    ([], "sbus pub: which key? e.g. sbus pub greetings/world hello"),
    (["-m", "hello"], "sbus pub: which key? e.g. sbus pub greetings/world hello"),
    (["k", "p", "-m", "hello"], "sbus pub: one payload at most, not 2 (-m is the PAYLOAD): "
                                "e.g. sbus pub greetings/world hello"),
    (["-t", "k", "a", "b"], "sbus pub: one payload at most, not 2 (-m is the PAYLOAD): "
                            "e.g. sbus pub greetings/world hello"),
    (["--lines", "k", "p"], "sbus pub: --lines reads standard input: no PAYLOAD with it"),
])
def test_pub_without_a_key_or_with_two_payloads_says_the_sbus_spelling(broker, args, line):
    r = sbus("pub", "--address", broker.address, *args)
    assert (r.returncode, r.stdout, r.stderr.decode()) == (2, b"", line + "\n")


def test_sub_without_a_pattern_says_the_sbus_spelling(broker):
    r = sbus("sub", "--address", broker.address)
    assert r.returncode == 2 and r.stderr.decode() == (
        "sbus sub: which keys? e.g. sbus sub 'greetings/*' ('' for everything that is not "
        "secret)\n")


# -- a payload from the terminal ---------------------------------------------------------

def test_pub_at_a_terminal_says_what_it_waits_for(broker):
    sub = start("sub", "--address", broker.address, "-n", "1", "typed")
    wait_subscribed(broker.address, "typed")
    leader, follower = pty.openpty()
    pub = subprocess.Popen([*SBUS, "pub", "--address", broker.address, "typed"],
                           stdin=follower, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    try:
        said = read_until(leader, b"Ctrl-D")
        assert b"sbus pub: reading the payload from the terminal until Ctrl-D" in said
        os.write(leader, b"by hand\n\x04")
        assert pub.wait(10) == 0
    finally:
        os.close(leader)
        if pub.poll() is None:
            pub.kill()
            pub.wait()
    assert sub.communicate(timeout=10)[0] == b"typed by hand\n"
    # not at a terminal: not a word (a pipe's writer knows what it sends)
    r = sbus("pub", "--address", broker.address, "typed", input=b"piped")
    assert r.returncode == 0 and r.stderr == b""


@pytest.mark.parametrize("argv,said", [
    (["pub", "--lines", "typed"], b"sbus pub: reading one message per line from the "
                                  b"terminal until Ctrl-D"),
    (["request", "--timeout", "0.1", "typed"], b"sbus request: reading the request body "
                                               b"from the terminal until Ctrl-D (or give "
                                               b"it: sbus request KEY PAYLOAD)"),
])
def test_lines_and_request_at_a_terminal_say_what_they_wait_for(broker, argv, said):
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*SBUS, argv[0], "--address", broker.address, *argv[1:]],
                            stdin=follower, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    try:
        assert said in read_until(leader, said[-12:])
        os.write(leader, b"\x04")
        proc.wait(10)
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- one time format -----------------------------------------------------------------------

def test_one_time_format_for_sub_and_journal(broker, short_tmp):
    from sbus.display import timestamp

    assert timestamp(0) == "1970-01-01T00:00:00.000000Z"
    assert timestamp(1.5, local=True) == datetime.fromtimestamp(1.5).astimezone().isoformat(
        timespec="microseconds")
    local = start("sub", "--address", broker.address, "-n", "1", "--timestamps",
                  "--local-time", "t/")
    before = time.time()
    rec = subprocess.Popen([*SBUS, "record", "--address", broker.address, "t/", "--dir",
                            str(short_tmp / "j")], stderr=subprocess.PIPE)
    try:
        wait_holders(broker.address, "t/", 2)  # the recorder too
        with Client(broker.address) as bus:
            bus.publish(b"t/x", b"at")
        deadline = time.monotonic() + 20
        while True:  # the recorder flushes every 0.1 s
            journal = sbus("journal", "cat", str(short_tmp / "j"))
            if journal.returncode == 0 and journal.stdout:
                break
            assert time.monotonic() < deadline, journal.stderr
            time.sleep(0.05)
    finally:
        rec.terminate()
        rec.wait(20)
    line = local.communicate(timeout=10)[0].decode()
    offset = datetime.now().astimezone().isoformat()[-6:]
    assert re.fullmatch(r"\S+ t/x at\n", line) and line.split()[0].endswith(offset)
    assert datetime.fromisoformat(line.split()[0]).timestamp() >= before - 1
    stamp, rest = journal.stdout.decode().split(" ", 1)
    assert re.fullmatch(RFC3339_UTC, stamp) and rest.endswith("t/x at\n")
    assert datetime.fromisoformat(stamp).timestamp() >= before - 1
    utc = start("sub", "--address", broker.address, "-n", "1", "--timestamps", "u")
    fmt = start("sub", "--address", broker.address, "-n", "1", "-F", "%t %k", "u")
    wait_holders(broker.address, "u", 2)
    with Client(broker.address) as bus:
        bus.publish(b"u", b"1")
    stamp = utc.communicate(timeout=10)[0].decode().split()[0]
    assert re.fullmatch(RFC3339_UTC, stamp)
    assert abs(datetime.fromisoformat(stamp).timestamp() - datetime.now(UTC).timestamp()) < 60
    assert re.fullmatch(RFC3339_UTC + " u\n", fmt.communicate(timeout=10)[0].decode())


# -- ping and request ----------------------------------------------------------------------

def test_ping_prints_its_summary_on_ctrl_c(broker):
    ping = subprocess.Popen([*SBUS, "ping", "--address", broker.address, "-c", "1000", "-i",
                             "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL,
                            # a test run in the background inherits SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    read_until(ping.stdout.fileno(), b"round trip 2:")
    ping.send_signal(signal.SIGINT)
    out, err = ping.communicate(timeout=10)
    assert ping.returncode == 0, err
    assert err == b""
    summary = out.decode().splitlines()[-1]
    assert re.fullmatch(r"\d+ round trips: min \d+ µs, median \d+ µs, max \d+ µs", summary)
    assert int(summary.split()[0]) >= 2


def test_request_raw_on_a_terminal_ends_its_line(broker):
    replier = start("reply", "--address", broker.address, "-n", "2", "svc", "--", "printf",
                    "no newline")
    wait_subscribed(broker.address, "svc")
    for args in ([], ["--raw"]):
        leader, follower = pty.openpty()
        proc = subprocess.Popen([*SBUS, "request", "--address", broker.address, *args,
                                 "svc", "x"], stdout=follower, stdin=subprocess.DEVNULL)
        os.close(follower)
        out = read_until(leader, b"\r\n")
        assert proc.wait(20) == 0
        os.close(leader)
        assert out == b"no newline\r\n", args
    assert replier.wait(10) == 0
    # into a pipe, the bytes as they are
    replier = start("reply", "--address", broker.address, "-n", "1", "svc", "--", "printf",
                    "no newline")
    wait_subscribed(broker.address, "svc")
    assert sbus("request", "--address", broker.address, "svc", "x").stdout == b"no newline"
    assert replier.wait(10) == 0


# -- serve as a user -----------------------------------------------------------------------

def test_serve_as_a_user_on_the_system_socket_says_where_to_go():
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root to run the command as another user")
    env = {k: v for k, v in os.environ.items() if k != "SBUS_ADDRESS"}
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        *SBUS, "serve", "--address", "/run/sbus-habits-test.socket"],
                       capture_output=True, text=True, timeout=30, env=env,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (
        "sbus serve: cannot listen on /run/sbus-habits-test.socket: Permission denied (a bus "
        "of your own goes where you may write: sbus serve --address "
        "$XDG_RUNTIME_DIR/sbus.socket, and export SBUS_ADDRESS=$XDG_RUNTIME_DIR/sbus.socket "
        "for the other sbus commands)\n")


# -- a backgrounded mount with nowhere to log ----------------------------------------------

def _fuse_usable() -> bool:
    try:
        import pyfuse3  # noqa: F401
    except ImportError:
        return False
    return os.geteuid() == 0 and os.path.exists("/dev/fuse") and bool(shutil.which("unshare"))


@pytest.mark.skipif(not _fuse_usable(), reason="needs root, /dev/fuse, pyfuse3 and unshare")
def test_mount_daemon_without_journald_or_syslog_says_where_it_logs(broker, short_tmp):
    """In a mount namespace where neither journald's socket nor /dev/log is a socket."""
    hide = "mount -t tmpfs none /run/systemd/journal 2>/dev/null || true; " \
           "[ ! -e /dev/log ] || mount --bind /dev/null /dev/log; "
    mountpoint, state = short_tmp / "m", short_tmp / "state"
    mountpoint.mkdir()
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        hide + 'exec "$@"', "sh", *SBUS, "mount", "--daemon", "--address",
                        broker.address, str(mountpoint)],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                       env={**os.environ, "XDG_STATE_HOME": str(state)})
    assert r.returncode == 0, r.stderr
    logfile = state / "sbus" / "mount.log"
    assert r.stderr == f"sbus mount: neither journald nor /dev/log here: logging to {logfile}\n"
    deadline = time.monotonic() + 10
    while "mounted (pid" not in (logfile.read_text() if logfile.exists() else ""):
        assert time.monotonic() < deadline, "the daemon logged nothing"
        time.sleep(0.05)
    pid = int(re.search(r"mounted \(pid (\d+)\)", logfile.read_text()).group(1))
    os.kill(pid, signal.SIGTERM)  # it unmounts (in its namespace) and says so
    while "unmounted" not in logfile.read_text():
        assert time.monotonic() < deadline + 10, logfile.read_text()
        time.sleep(0.05)


# -- install hints ---------------------------------------------------------------------------

def test_a_missing_extra_names_the_install_of_this_sbus(short_tmp):
    """`sbus top` without 'rich': the command installs the extra from this source tree,
    not 'sbus[top]' (on the package index, another project)."""
    (short_tmp / "rich.py").write_text(
        'raise ModuleNotFoundError("No module named \'rich\'", name="rich")\n')
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(short_tmp), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([*SBUS, "top", "--once"], capture_output=True, text=True, timeout=30,
                       env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stdout == ""
    hint = r.stderr.split(": pip install ")[1]
    assert r.stderr == ("sbus top: needs the 'top' extra, which is not installed: pip install "
                        f"{hint}")
    assert hint in (f"'{repo}[top]' (no module named 'rich')\n",
                    f"-e '{repo}[top]' (no module named 'rich')\n")


def test_the_docs_spell_every_install_of_an_extra_one_way():
    repo = Path(__file__).resolve().parent.parent
    texts = [repo / "README.md", *sorted((repo / "docs").glob("*.md")),
             *sorted((repo / "sbus").rglob("*.py"))]
    for path in texts:
        for line in path.read_text().splitlines():
            assert not re.search(r"pip install[^\n]*'sbus\[|-e '\.\[", line), f"{path}: {line}"
