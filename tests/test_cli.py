"""The sbus command line against a real broker."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from conftest import SBUS

from sbus import Client


def sbus(*args: str, input: bytes | None = None, timeout: float = 20):
    return subprocess.run([*SBUS, *args], input=input, capture_output=True, timeout=timeout)


def test_pub_sub_lines_and_count(broker):
    sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "--count", "3", "t/*"],
                           stdout=subprocess.PIPE)
    # publish until the subscriber has seen three messages (it may start late)
    with Client(broker.address) as pub:
        for i in range(200):
            pub.publish(b"t/%d" % i, b"payload %d\n" % i)
            try:
                out, _ = sub.communicate(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                continue
    lines = out.decode().splitlines()
    assert len(lines) == 3 and sub.returncode == 0
    first = int(lines[0].split()[0].split("/")[1])
    assert lines == [f"t/{i} payload {i}" for i in range(first, first + 3)]


def test_sub_lines_escape_what_would_drive_the_terminal(broker):
    """Keys and payloads are the publisher's bytes: in `lines` format an ESC, a newline or
    invalid UTF-8 is shown escaped, so another user cannot clear or retitle the reader's
    terminal, or forge lines."""
    sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "--count", "1", "x/"],
                           stdout=subprocess.PIPE)
    with Client(broker.address) as pub:
        for _ in range(400):
            pub.publish(b"x/\x1b]0;owned\x07", b"\x1b[2J\x1b[31mred\nforged line\xff\\")
            try:
                out, _ = sub.communicate(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                continue
    assert out == b"x/\\x1b]0;owned\\x07 \\x1b[2J\\x1b[31mred\\nforged line\\xff\\\\\n"
    assert b"\x1b" not in out and out.count(b"\n") == 1


def test_pub_from_stdin_and_lines(broker):
    with Client(broker.address) as c:
        c.subscribe(b"in")
        c.whoami()
        assert sbus("pub", "--address", broker.address, "in", input=b"all\nof it").returncode == 0
        assert c.receive(timeout=5).payload == b"all\nof it"
        sbus("pub", "--address", broker.address, "--lines", "in", input=b"one\ntwo\n")
        assert [c.receive(timeout=5).payload for _ in range(2)] == [b"one", b"two"]
        sbus("pub", "--address", broker.address, "in", "argument")
        assert c.receive(timeout=5).payload == b"argument"


def test_sub_json_and_raw(broker):
    for fmt, check in [
        ("json", lambda out: [json.loads(line) for line in out.splitlines()] == [
            {"key": "j", "payload": "text"}, {"key": "j", "payload_base64": "/wA="}]),
        ("raw", lambda out: out == b"text\xff\0"),
    ]:
        sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "--count", "2",
                                "--format", fmt, "j", "--ready-fd", "2"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert sub.stderr.readline() == b"ready\n"  # subscribed
        with Client(broker.address) as pub:
            pub.publish(b"j", b"text")
            pub.publish(b"j", b"\xff\0")
        out, _ = sub.communicate(timeout=20)
        assert check(out), out


def test_whoami(broker):
    r = sbus("whoami", "--address", broker.address)
    assert r.returncode == 0
    assert r.stdout.startswith(b"!/cred/0/0/")


def test_no_broker_one_clear_line(short_tmp):
    missing = str(short_tmp / "none.sock")
    for args in (["pub", "k", "v"], ["sub", "k"], ["whoami"]):
        r = sbus(*args, "--address", missing)
        err = r.stderr.decode()
        assert r.returncode == 1
        assert err.count("\n") == 1 and "Traceback" not in err
        assert missing in err and "sbus serve" in err


def one_line(r: subprocess.CompletedProcess, status: int) -> str:
    """The failure *r* said: exactly one line on stderr, no traceback, *status*."""
    err = r.stderr.decode()
    assert r.returncode == status, (r.returncode, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_broker_that_does_not_answer_is_one_line_for_every_command(broker):
    """A stopped broker (SIGSTOP: connected, never answering) is a timeout: one line
    naming the broker and the wait, exit status 1, for the commands that wait on it;
    `sbus pub` and `sbus sub` keep to their --timeout."""
    assert broker.proc is not None
    broker.proc.send_signal(signal.SIGSTOP)
    try:
        a = broker.address
        for args in (["ping", "-c", "1", "--timeout", "0.5"], ["status", "--timeout", "0.5"],
                     ["sub", "-n", "1", "--timeout", "0.5", "k"],
                     ["pub", "--timeout", "0.5", "k", "v"]):
            started = time.monotonic()
            err = one_line(sbus(*args, "--address", a), 1)
            assert time.monotonic() - started < 4, args  # its own timeout, not 5 s
            assert a in err and ("0.5 s" in err or "did not answer" in err), (args, err)
    finally:
        broker.proc.send_signal(signal.SIGCONT)
    assert sbus("pub", "--timeout", "5", "k", "v", "--address", broker.address).returncode == 0


def test_output_that_cannot_be_written_is_one_line(broker):
    """Standard output on a full disk (/dev/full): one line and status 1, for a
    command's output and for --help and --version (argparse would exit 0 silently)."""
    with open("/dev/full", "wb") as full:
        for args in (["whoami", "--address", broker.address], ["--help"], ["sub", "--help"],
                     ["--version"], ["completion", "bash"]):
            r = subprocess.run([*SBUS, *args], stdout=full, stderr=subprocess.PIPE,
                               timeout=20)
            err = one_line(r, 1)
            assert "No space left on device" in err, (args, err)


def test_a_wrong_command_line_is_one_line(short_tmp):
    for args in (["gateway"], ["sub", "--count", "x", "k"], ["bogus"], ["pub", "--bogus"],
                 ["pub", "k", "v", "z\x1b[2J"]):
        err = one_line(sbus(*args), 2)
        assert "--help" in err and "usage:" not in err, (args, err)
        assert "\x1b" not in err, err  # echoed arguments are escaped
    # a descriptor that is not open: said before anything else (a waiter would wait)
    assert "--ready-fd 99: Bad file descriptor" in one_line(
        sbus("sub", "--ready-fd", "99", "k", "--address", str(short_tmp / "none")), 2)


def test_an_address_that_is_not_a_socket_says_so(short_tmp):
    """No advice to start a broker where `sbus serve` would refuse to (a file of
    another kind in the way)."""
    (short_tmp / "file").write_bytes(b"")
    (short_tmp / "dir").mkdir()
    for name, kind in (("file", "a regular file"), ("dir", "a directory")):
        err = one_line(sbus("pub", "k", "v", "--address", str(short_tmp / name)), 1)
        assert f"it is {kind}, not a socket" in err and "sbus serve" not in err, err


def test_address_from_environment(broker, monkeypatch):
    monkeypatch.setenv("SBUS_ADDRESS", broker.address)
    assert sbus("whoami").returncode == 0
