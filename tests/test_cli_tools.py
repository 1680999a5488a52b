"""The command line as a user types it: --version, -v anywhere, help and errors, and the
sub/pub/request/reply options, each against a real broker."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from importlib import metadata

import faultkit
import pytest
from conftest import SBUS
from faultkit import wait_subscribed

from sbus import Client, SbusError
from sbus.cli import build_parser


def sbus(*args: str, input: bytes | None = None, timeout: float = 20):
    return subprocess.run([*SBUS, *args], input=input, capture_output=True, timeout=timeout)


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*SBUS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# -- the command itself -----------------------------------------------------------------

def test_version_from_the_installed_package():
    import sbus as package

    expected = f"sbus {metadata.version('sbus')}\n"
    assert package.__version__ == metadata.version("sbus")
    for flag in ("--version", "-V"):
        r = sbus(flag)
        assert r.returncode == 0 and r.stdout.decode() == expected
    top = subprocess.run([sys.executable, "-m", "sbus.top", "--version"], capture_output=True,
                         text=True, timeout=20)
    assert top.returncode == 0 and top.stdout == expected.replace("sbus", "sbus-top", 1)


def test_verbose_goes_before_or_after_the_subcommand(broker):
    r = sbus("whoami", "-v", "--address", broker.address)
    assert r.returncode == 0 and r.stdout.startswith(b"!/cred/")
    parser, _ = build_parser(["serve"])
    args = parser.parse_args(["-v", "serve", "-v"])
    assert args.verbose + args.sub_verbose == 2


def test_every_option_of_every_command_says_what_it_does():
    parser, modules = build_parser([], everything=True)
    commands = subparsers(parser)
    assert set(modules) == set(commands)  # every module imported: nothing left out
    missing = [f"sbus {name} {a.option_strings or a.dest}"
               for name, p in [("", parser), *commands.items()] for a in p._actions
               if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []


def required(name: str) -> list[str]:
    """Enough of a command line for *name* that only the option under test is wrong."""
    return {"gateway": ["--listen", ":0", "--auth-key-file", "k"]}.get(name, [])


def test_bad_values_are_named_without_internal_names():
    """Every option that converts its value, given garbage: the error says which option
    and what was wrong, never a Python function's name (``invalid <lambda> value``)."""
    parser, _ = build_parser([], everything=True)
    seen = 0
    for name, p in subparsers(parser).items():
        for a in p._actions:
            if a.type is None or not a.option_strings:
                continue
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    parser.parse_args([name, a.option_strings[0], "@@bad", *required(name)])
                continue  # a user name, a path: anything goes
            except SystemExit:
                pass
            line = err.getvalue().splitlines()[-1]
            if "the following arguments are required" in line:
                continue  # the value was taken (a format string without %)
            seen += 1
            assert a.option_strings[-1] in line, line
            m = re.search(r"invalid (\S+) value", line)
            assert m is None or m.group(1) in ("int", "float"), line
            assert "<" not in line, line
    assert seen > 30
    for args in (["ping", "-c", "0"], ["pub", "-c", "-1", "k", "v"], ["ping", "-i", "-1"],
                 ["status", "--timeout", "-1"], ["sub", "--timeout", "soon", "k"]):
        r = sbus(*args)
        assert r.returncode == 2 and b"Traceback" not in r.stderr, args
        assert r.stderr.decode().splitlines()[-1].startswith(f"sbus {args[0]}: error: "
                                                            f"argument {args[1]}")
    r = sbus("serve", "--mode", "rw-r--r--")
    assert r.returncode == 2
    assert r.stderr.decode().splitlines() == [
        "sbus serve: error: argument --mode: not an octal file mode: 'rw-r--r--' (e.g. 0660)"
        " (see 'sbus serve --help')"]


# -- sbus sub ---------------------------------------------------------------------------

def test_sub_format_string_with_time_hex_json_and_length(broker):
    sub = start("sub", "--address", broker.address, "-n", "1",
                "-F", r"%t|%T|%k|%p|%x|%j|%K|%l|%%\tend", "f/*")
    wait_subscribed(broker.address, "f/*")
    before = time.time()
    with Client(broker.address) as bus:
        bus.publish(b"f/\x1b", b"a\nb\xff\"")
    out, err = sub.communicate(timeout=10)
    assert sub.returncode == 0, err
    iso, unix, key, payload, hexed, js, jskey, length, rest = out.decode().split("|")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", iso)  # RFC 3339, UTC
    assert before <= float(unix) <= time.time()
    assert key == "f/\\x1b" and payload == 'a\\nb\\xff"'
    assert bytes.fromhex(hexed) == b"a\nb\xff\""
    assert json.loads(js) == 'a\nb\\xff"' and json.loads(jskey) == "f/\x1b"
    assert length == "5" and rest == "%\tend\n"
    bad = sbus("sub", "-F", "%k %z", "x")
    assert bad.returncode == 2 and b"unknown directive %z" in bad.stderr
    for args in (["-F", "%k", "--timestamps"], ["--format", "raw", "--pretty"]):
        bad = sbus("sub", "--address", broker.address, *args, "x")
        assert bad.returncode == 1 and bad.stderr.startswith(b"sbus sub: --timestamps and "
                                                             b"--pretty do not go with")


def test_sub_timeout_ends_a_quiet_subscription(broker):
    began = time.monotonic()
    r = sbus("sub", "--address", broker.address, "--timeout", "0.5", "quiet")
    assert r.returncode == 0 and r.stdout == b"" and r.stderr == b""
    assert 0.5 <= time.monotonic() - began < 10
    r = sbus("sub", "--address", broker.address, "--timeout", "300ms", "-n", "2", "quiet")
    assert r.returncode == 1
    assert r.stderr.decode() == "sbus sub: 0 of 2 messages, then none for 0.3 s\n"


def test_sub_timeout_is_reset_by_each_message(broker):
    sub = start("sub", "--address", broker.address, "--timeout", "1", "tick")
    wait_subscribed(broker.address, "tick")
    with Client(broker.address) as bus:
        for i in range(6):  # 1.8 s in all, never 1 s apart
            bus.publish(b"tick", b"%d" % i)
            time.sleep(0.3)
    out, _ = sub.communicate(timeout=10)
    assert sub.returncode == 0 and out.decode().splitlines() == [f"tick {i}" for i in range(6)]


def test_sub_exclude_timestamps_and_pretty_json(broker):
    sub = start("sub", "--address", broker.address, "-n", "2", "--timestamps", "--pretty",
                "--exclude", "e/noise/", "-T", "e/*/x", "e/")
    wait_subscribed(broker.address, "e/")
    with Client(broker.address) as bus:
        bus.publish(b"e/noise/a", b"no")
        bus.publish(b"e/b/x", b"no")
        bus.publish(b"e/json", b'{"a": [1, "\xe2\x80\xae\\u001b"]}')
        bus.publish(b"e/text", b"plain")
    out, err = sub.communicate(timeout=10)
    assert sub.returncode == 0, err
    lines = out.decode().splitlines()
    assert re.fullmatch(r"\S+T\S+ e/json", lines[0])
    assert lines[1:6] == ['  {', '    "a": [', '      1,', '      "\\u202e\\u001b"', '    ]']
    assert lines[6] == "  }" and re.fullmatch(r"\S+T\S+ e/text plain", lines[7])
    assert json.loads("\n".join(lines[1:7])) == {"a": [1, "\u202e\x1b"]}
    js = start("sub", "--address", broker.address, "-n", "1", "--format", "json",
               "--timestamps", "j")
    wait_subscribed(broker.address, "j")
    with Client(broker.address) as bus:
        bus.publish(b"j", b"x")
    obj = json.loads(js.communicate(timeout=10)[0])
    assert set(obj) == {"time", "key", "payload"} and obj["payload"] == "x"


def test_sub_hints_at_other_tools_wildcards(broker):
    r = sbus("sub", "--address", broker.address, "--timeout", "0.1", "sensors/#",
             "a/+/temp", "logs.>", "ok/*")
    assert r.returncode == 0
    lines = r.stderr.decode().splitlines()
    assert len(lines) == 2  # 'logs.>' is one segment under '/': not a wildcard there
    assert lines[0].startswith("sbus sub: note: 'sensors/#': MQTT's '#' is a literal")
    assert "write 'sensors/'" in lines[0]
    assert "MQTT's '+'" in lines[1] and "write 'a/*/temp'" in lines[1]


# -- sbus pub ---------------------------------------------------------------------------

def test_pub_count_interval_and_template(broker):
    with Client(broker.address) as bus:
        bus.subscribe(b"p")
        bus.whoami()
        began = time.time()
        r = sbus("pub", "--address", broker.address, "-c", "4", "-i", "150ms", "p",
                 '{"n": {n}, "at": {time}, "raw": "{x}"}')
        assert r.returncode == 0, r.stderr
        got = [json.loads(bus.receive(timeout=5).payload.replace(b'"{x}"', b'"x"'))
               for _ in range(4)]
    assert [g["n"] for g in got] == [1, 2, 3, 4]
    ats = [g["at"] for g in got]
    assert began <= ats[0] and all(b - a >= 0.12 for a, b in zip(ats, ats[1:], strict=False))
    bad = sbus("pub", "-c", "0", "p", "x")
    assert bad.returncode == 2 and b"not a count of 1 or more: '0'" in bad.stderr
    for args, why in ((["-i", "1"], "--interval goes with --count"),
                      (["-c", "2", "--lines"], "--count and --lines do not go together")):
        bad = sbus("pub", "--address", broker.address, *args, "p", input=b"x\n")
        assert bad.returncode == 1 and bad.stderr.decode() == f"sbus pub: {why}\n"


# -- request / reply --------------------------------------------------------------------

def test_request_and_reply_from_the_shell(broker):
    replier = start("reply", "--address", broker.address, "-n", "3", "svc/*", "--",
                    "sh", "-c", 'printf "%s for %s" "$(tr a-z A-Z)" "$SBUS_KEY"; exit 3')
    wait_subscribed(broker.address, "svc/*")
    r = sbus("request", "--address", broker.address, "svc/up", "hello")
    assert r.returncode == 0 and r.stdout == b"HELLO for svc/up"
    r = sbus("request", "--address", broker.address, "svc/up", input=b"from stdin")
    assert r.stdout == b"FROM STDIN for svc/up"
    with Client(broker.address) as bus:
        bus.publish(b"svc/x", b"not a request")  # no reply key: ignored, said so
        bus.subscribe(b"mine")
        bus.publish(b"mine", b"kept")  # arrives while the request waits
        assert bus.request(b"svc/lib", b"abc", timeout=10) == b"ABC for svc/lib"
        assert bus.receive(timeout=5).payload == b"kept"
    assert replier.wait(10) == 0
    err = replier.stderr.read().decode().splitlines()
    assert err[0] == "sbus reply: answering requests on 'svc/*'"
    assert "sbus reply: ignored a message on 'svc/x': no reply key (no NUL) in " \
           "'not a request'" in err
    assert err.count("sbus reply: sh exited with status 3 (replied with its output all "
                     "the same)") == 3


def test_request_without_replier_is_one_line_at_once(broker):
    """Nobody subscribes: the broker says so (`broker/reach`), no waiting for the timeout;
    a subscriber that does not answer: the timeout."""
    began = time.monotonic()
    r = sbus("request", "--address", broker.address, "--timeout", "60", "nobody", "x")
    assert r.returncode == 1 and time.monotonic() - began < 30
    assert r.stderr.decode() == "sbus request: no responders for 'nobody'\n"
    with Client(broker.address) as silent:
        silent.subscribe(b"silent")
        assert silent.reach(b"silent") == 1 and silent.reach(b"nobody") == 0
        r = sbus("request", "--address", broker.address, "--timeout", "0.3", "silent", "x")
    assert r.returncode == 1
    assert r.stderr.decode() == "sbus request: no reply to the request on 'silent' " \
                                "within 0.3 s\n"


def test_reach_tells_nobody_about_a_strangers_secret_keys(broker, short_tmp):
    os.chmod(short_tmp, 0o755)  # the other user reaches the socket
    with Client(broker.address) as a:
        a_inbox = a.whoami() + b"/inbox/x"
        a.subscribe(a_inbox)
        assert a.reach(a_inbox) == 1  # its own secret: it may know
        proc, pipe = faultkit.as_user(65534, _reach_of, broker.address,
                                      [a_inbox, a.whoami() + b"/never", b"public"])
        assert pipe.poll(30)
        assert pipe.recv() == [None, None, 0]  # another process's secrets: not said
        proc.join(10)
        with pytest.raises(SbusError, match="reserved"):
            a.reach(b"a/!/b")


def _reach_of(pipe, address: str, keys: list[bytes]) -> None:
    code = 1
    try:
        with Client(address) as bus:
            pipe.send([bus.reach(key) for key in keys])
        code = 0
    finally:
        os._exit(code)


def test_reply_survives_hostile_requests_from_another_user(broker, short_tmp):
    """Requests from uid 65534 with every kind of bad reply key, an oversized reply and a
    command that fails: each is one escaped line on stderr, counted, and the service
    goes on to answer an honest request."""
    os.chmod(short_tmp, 0o755)  # the other user reaches the socket
    replier = start("reply", "--address", broker.address, "--command-timeout", "1",
                    "--max-reply", "1m", "svc", "--", "sh", "-c",
                    'b=$(cat); case "$b" in big) head -c 300000 /dev/zero;; '
                    'long) head -c 99999 /dev/zero;; '
                    'slow) sleep 10;; *) printf "ok %s" "$b";; esac')
    wait_subscribed(broker.address, "svc")
    proc, pipe = faultkit.as_user(65534, _hostile_requests, broker.address)
    try:
        assert pipe.poll(30) and pipe.recv() == "sent"
        proc.join(10)
        with Client(broker.address) as bus:  # served after the hostile ones, in order
            assert bus.request(b"svc", b"honest", timeout=30) == b"ok honest"
        assert replier.poll() is None  # still serving
    finally:
        replier.terminate()
    err = replier.communicate(timeout=10)[1].decode()
    assert "Traceback" not in err and "\x1b" not in err  # escaped: no raw control bytes
    lines = err.splitlines()
    assert lines[0] == "sbus reply: answering requests on 'svc'"
    assert sum("ignored a message on 'svc'" in line for line in lines) == 2
    assert any("!/cred/x" in line and "no reply" in line for line in lines)
    assert any("\\x1b" in line and "no reply" in line for line in lines)
    assert any("sh took longer than 1 s" in line for line in lines)
    assert sum("over the broker's limit" in line for line in lines) == 2
    assert "(5 failed so far)" in err
    assert all(len(line) < 400 for line in lines)  # brief: long keys are cut


def _not_requests(pipe, address: str, n: int) -> None:
    code = 1
    try:
        with Client(address) as bus:
            for i in range(n):
                bus.publish(b"svc", b"no reply key %d" % i)
            bus.sync()
        pipe.send("sent")
        code = 0
    finally:
        os._exit(code)


def test_reply_rations_its_lines_about_single_requests(broker, short_tmp):
    """Another user's 500 messages that are no requests: a few lines, then one a second
    with the count of those not written (before: a line each, 7,084 in 15 s in the
    audit); the exit line counts them all; an honest request is still answered."""
    os.chmod(short_tmp, 0o755)
    replier = start("reply", "--address", broker.address, "svc", "--", "cat")
    wait_subscribed(broker.address, "svc")
    proc, pipe = faultkit.as_user(65534, _not_requests, broker.address, 500)
    try:
        assert pipe.poll(30) and pipe.recv() == "sent"
        proc.join(10)
        with Client(broker.address) as bus:
            assert bus.request(b"svc", b"honest", timeout=30) == b"honest"
            time.sleep(1.2)  # the allowance has a line again: it says what it held back
            bus.publish(b"svc", b"one more")
            assert bus.request(b"svc", b"honest", timeout=30) == b"honest"
    finally:
        replier.terminate()
    lines = replier.communicate(timeout=10)[1].decode().splitlines()
    ignored = [line for line in lines if "ignored a message on 'svc'" in line]
    assert 20 <= len(ignored) <= 25, len(ignored)
    assert "'one more' (4" in ignored[-1] and "such lines not written)" in ignored[-1], \
        ignored[-1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_reply_stopped_by_a_signal_says_its_counts(broker, sig):
    """A service is stopped with SIGTERM: it ends with its exit line, counting every
    request, also those whose lines were rationed away (before: killed, no line)."""
    replier = start("reply", "--address", broker.address, "svc", "--", "cat")
    wait_subscribed(broker.address, "svc")
    with Client(broker.address) as bus:
        for body in (b"one", b"two"):
            assert bus.request(b"svc", body, timeout=30) == body
        bus.publish(b"svc", b"no reply key")
        bus.sync()
    time.sleep(0.3)  # taken by the replier
    replier.send_signal(sig)
    assert replier.wait(10) == 0
    lines = replier.communicate(timeout=10)[1].decode().splitlines()
    assert lines[-1] == ("sbus reply: 2 requests, 0 without a reply, 1 other messages "
                         "ignored, stopped by a signal"), lines


def _hostile_requests(pipe, address: str) -> None:
    code = 1
    try:
        with Client(address) as bus:
            me = bus.whoami()
            for payload in (b"no reply key", b"public/key\0x",  # ignored: not requests
                            b"!/cred/x\0x",  # malformed secret key
                            b"!/cred/\x1b[2J\x1b]0;owned\x07/2/3/x\0x",  # control bytes
                            me + b"/" + b"k" * 200_000 + b"\0long",  # too long with the reply
                            me + b"/inbox/1\0big",  # a reply over the broker's limit
                            me + b"/inbox/2\0slow",  # the command fails (killed)
                            b"!/cred/0/0/1/" + b"/".join([b"s"] * 300) + b"\0x"):  # segments
                bus.publish(b"svc", payload)
            bus.sync()
        pipe.send("sent")
        code = 0
    finally:
        os._exit(code)


def test_reply_says_nothing_of_a_command_that_exits_without_reading(broker):
    """A command that exits before reading the request (sh -c 'exit 3') is its business:
    no BrokenPipeError, no traceback, and a reply all the same."""
    replier = start("reply", "--address", broker.address, "-n", "10", "early", "--",
                    "sh", "-c", "exit 3")
    wait_subscribed(broker.address, "early")
    with Client(broker.address) as bus:
        for n in range(10):  # small bodies wait in a buffer, large ones in the pipe
            assert bus.request(b"early", b"x" * (10 if n % 2 else 200_000), timeout=10) == b""
    assert replier.wait(10) == 0
    err = replier.stderr.read().decode()
    assert "Traceback" not in err and "Error" not in err, err
    assert err.count("sh exited with status 3") == 10


def test_reply_bounds_what_the_command_prints_and_how_long_it_runs(broker):
    replier = start("reply", "--address", broker.address, "-n", "2", "--max-reply", "1k",
                    "--command-timeout", "1.5", "big", "--",
                    "sh", "-c", 'if [ "$(cat)" = slow ]; then sleep 30; else yes; fi')
    wait_subscribed(broker.address, "big")
    for body in ("flood", "slow"):
        r = sbus("request", "--address", broker.address, "--timeout", "3", "big", body)
        assert r.returncode == 1 and b"no reply" in r.stderr
    assert replier.wait(10) == 0
    err = replier.stderr.read().decode()
    assert "no reply to the request on 'big': sh printed more than 1,024 bytes" in err
    assert "no reply to the request on 'big': sh took longer than 1.5 s" in err


def test_a_reply_key_must_be_a_secret_inbox(broker):
    """A replier never publishes to a public key named by whoever sent the request."""
    replier = start("reply", "--address", broker.address, "-n", "1", "svc", "--", "echo", "hi")
    wait_subscribed(broker.address, "svc")
    with Client(broker.address) as bus:
        bus.subscribe(b"public/victim")
        bus.publish(b"svc", b"public/victim\0body")
        with pytest.raises(TimeoutError):
            bus.receive(timeout=0.5)
        bus.publish(b"svc", bus.whoami() + b"/inbox/x\0body")  # not subscribed: nobody hears
    assert replier.wait(10) == 0
    assert "is not a secret !/cred/ key" in replier.stderr.read().decode()


def test_request_escapes_a_reply_for_a_terminal_not_for_a_pipe(broker):
    """A replier is another party: on a terminal its bytes cannot clear the screen or set
    the title (--raw if you mean it); into a pipe they go as they are."""
    replier = start("reply", "--address", broker.address, "-n", "3", "evil", "--",
                    "printf", "\\033[2J\\033]0;owned\\007two\\nlines\\377")
    wait_subscribed(broker.address, "evil")
    hostile = b"\x1b[2J\x1b]0;owned\x07two\nlines\xff"
    assert sbus("request", "--address", broker.address, "evil", "x").stdout == hostile
    for args, expected in (([], b"\\x1b[2J\\x1b]0;owned\\x07two\r\nlines\\xff\r\n"),
                           (["--raw"], hostile.replace(b"\n", b"\r\n") + b"\r\n")):
        leader, follower = pty.openpty()
        proc = subprocess.Popen([*SBUS, "request", "--address", broker.address, *args,
                                 "evil", "x"], stdout=follower, stdin=subprocess.DEVNULL)
        os.close(follower)
        assert proc.wait(20) == 0
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not chunk:
                break
            out += chunk
        os.close(leader)
        assert out == expected
    assert replier.wait(10) == 0


def test_async_client_request_under_trio(broker):
    import trio

    from sbus import AsyncClient
    from sbus.errors import NoResponders

    replier = start("reply", "--address", broker.address, "-n", "2", "async", "--", "rev")
    wait_subscribed(broker.address, "async")

    async def main() -> list:
        async with await AsyncClient.connect(broker.address) as bus:
            first = await bus.request(b"async", b"abc\n", timeout=10)
            await bus.subscribe(b"other")
            await bus.publish(b"other", b"kept")
            second = await bus.request("async", "xyz\n", timeout=10)
            kept = await bus.receive()
            with pytest.raises(NoResponders, match="no responders for 'nobody'"):
                await bus.request(b"nobody", b"", timeout=30)
            with pytest.raises(TimeoutError, match="no reply to the request on 'nobody'"):
                await bus.request(b"nobody", b"", timeout=0.3, no_responders=False)
            return [first, second, kept.payload]

    assert trio.run(main) == [b"cba\n", b"zyx\n", b"kept"]
    assert replier.wait(10) == 0
