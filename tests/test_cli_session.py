"""Failures, drops, reconnects and readiness, as a user meets them: the CLI as typed, the
library in a program, against real brokers."""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import threading
import time

import pytest
import trio
from conftest import SBUS, stop_process
from faultkit import PipeLines

import sbus
from sbus import AsyncClient, Client, InvalidRequest, Publish, Refused


def run(*args: str, input: bytes | None = None, timeout: float = 20, **kw):
    return subprocess.run([*SBUS, *args], input=input, capture_output=True, timeout=timeout,
                          **kw)


def one_line(err: bytes) -> str:
    lines = err.decode().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# -- failures a user can see ------------------------------------------------------------

def test_pub_to_a_misused_bang_exits_1_with_one_line(broker):
    p = run("pub", "--address", broker.address, "a/!/b", "x")
    assert p.returncode == 1
    assert one_line(p.stderr) == ("sbus pub: '!' is reserved and cannot stand as a segment "
                                  "of 'a/!/b'")


def test_pub_over_the_size_limit_exits_1(broker):
    p = run("pub", "--address", broker.address, "big", input=b"x" * 300_000)
    assert p.returncode == 1
    assert "300008 bytes with its header, over the broker's limit of 262144" in one_line(
        p.stderr)


def test_pub_refused_by_the_broker_exits_1(make_broker):
    """Only the broker knows its --max-message: its refusal reaches the publisher."""
    b = make_broker("--max-message", "1k")
    p = run("pub", "--address", b.address, "k", "x" * 2000)
    assert p.returncode == 1
    assert one_line(p.stderr).startswith("sbus pub: the broker refused the PACKET: ")
    ok = run("pub", "--address", b.address, "k", "x" * 500)
    assert ok.returncode == 0 and ok.stderr == b""


def test_sub_of_someone_elses_secrets_is_refused_by_the_broker(broker):
    p = run("sub", "--address", broker.address, "!/cred/0/0/1/")
    assert p.returncode == 1
    line = one_line(p.stderr)
    assert line.startswith("sbus sub: the broker refused the SUB: ")
    assert "names PID 1" in line


def test_sub_of_a_malformed_pattern_is_refused_before_sending(broker):
    p = run("sub", "--address", broker.address, "!/cred/a/0/1/")
    assert p.returncode == 1
    assert one_line(p.stderr) == ("sbus sub: GID field of secret pattern '!/cred/a/0/1/' is "
                                  "not decimal")
    assert "refused" not in broker.log()  # never reached the broker


@pytest.mark.parametrize("command", [["record", "--dir", "journal"], ["top", "--once",
                                                                     "--seconds", "1"]])
def test_recorder_and_top_say_a_refused_pattern_and_exit_1(broker, short_tmp, command):
    p = run(command[0], "--address", broker.address, "!/cred/0/0/1/", *command[1:],
            cwd=short_tmp)
    assert p.returncode == 1
    assert one_line(p.stderr).startswith(f"sbus {command[0]}: the broker refused the SUB: ")


def test_library_raises_for_each_failure(broker):
    with Client(broker.address) as bus:
        with pytest.raises(InvalidRequest, match="'bogus' is not one of"):
            bus.set_flood(soft="bogus")
        with pytest.raises(Refused, match="names PID 1"):
            bus.subscribe(b"!/cred/0/0/1/x")
        bus.subscribe(b"ok")  # the connection goes on
        bus.publish(b"ok", b"still here")
        assert bus.receive(timeout=5) == Publish(b"ok", b"still here")
        bus.publish(b"k", b"")
        bus.send_packet(b"HELLO")  # a raw packet the broker refuses: raised on receive
        with pytest.raises(Refused, match="the broker refused the PACKET"):
            bus.receive(timeout=5)


# -- drops ----------------------------------------------------------------------------

def _drain(proc: subprocess.Popen, until: bytes, timeout: float = 20) -> list[bytes]:
    lines = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(until):
            return lines
    raise AssertionError(f"no {until!r} line in {len(lines)} lines")


def _flood(address: str, count: int, payload: bytes) -> None:
    with Client(address) as pub:
        for i in range(count):
            pub.publish(b"flood/x", b"%d " % i + payload)
        pub.sync(30)


def test_sub_says_how_many_messages_were_dropped(make_broker):
    """A reader that falls behind loses messages once the broker's queue for it is full;
    stderr says how many, and received + dropped is exactly what was published."""
    b = make_broker("--queue-limit", "64k")
    sub = subprocess.Popen([*SBUS, "sub", "--address", b.address, "flood/", "--ready-fd", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    report = re.compile(rb"sbus sub: dropped (\d+) messages")

    def dropped() -> list[int]:
        return [int(m[1]) for m in map(report.fullmatch, err.lines) if m]

    def wait_for(done) -> None:
        deadline = time.monotonic() + 20
        while not done() and time.monotonic() < deadline:
            select.select([out.fd, err.fd], [], [], 0.1)
            out.take()
            err.take()

    out, err = PipeLines(sub.stdout), PipeLines(sub.stderr)
    try:
        wait_for(lambda: out.lines)
        assert out.lines.pop() == b"ready"
        _flood(b.address, 20000, b"y" * 1000)  # nobody reads the pipe meanwhile
        wait_for(lambda: err.lines)  # once the broker's queue for the reader has drained
        with Client(b.address) as pub:
            pub.publish(b"flood/end", b"")
        # the drops since the last report are reported when the queue drains again, which
        # is after flood/end: wait for that report (a missing one fails below)
        wait_for(lambda: any(x.startswith(b"flood/end") for x in out.lines) and
                 len(out.lines) - 1 + sum(dropped()) >= 20000)
    finally:
        sub.terminate()
        sub.wait(10)
    out.take()
    err.take()
    assert all(map(report.fullmatch, err.lines)), err.lines  # stderr says nothing else
    assert out.lines[-1].startswith(b"flood/end")
    assert sum(dropped()) > 0
    assert len(out.lines) - 1 + sum(dropped()) == 20000, (len(out.lines), dropped())


def test_sub_block_loses_nothing(make_broker, short_tmp):
    b = make_broker("--queue-limit", "64k")
    sub = subprocess.Popen([*SBUS, "sub", "--address", b.address, "flood/", "--block",
                            "--ready-fd", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert sub.stdout.readline() == b"ready\n"
        data = short_tmp / "lines"
        data.write_bytes(b"".join(b"%d %s\n" % (i, b"y" * 500) for i in range(3000)))
        with open(data, "rb") as stdin:
            pub = subprocess.Popen([*SBUS, "pub", "--address", b.address, "--lines",
                                    "flood/x"], stdin=stdin)
        time.sleep(1)  # nobody reads: the publisher is paused meanwhile, not dropping
        lines = [sub.stdout.readline() for _ in range(3000)]
        assert pub.wait(20) == 0
    finally:
        sub.terminate()
    _, err = sub.communicate(timeout=10)
    assert [int(line.split()[1]) for line in lines] == list(range(3000))
    assert b"dropped" not in err


def test_pub_lines_says_how_many_a_killed_broker_may_have_taken_with_it(broker):
    """`sbus pub --lines`: 50 lines go into a stopped broker's socket, the broker is
    killed -9, and the next line finds it gone: the reconnect line says up to 50-51
    messages may be lost (before: nothing said of how many), the subscriber misses just
    those, and every line after arrives."""
    sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "p/", "--ready-fd",
                            "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pub = subprocess.Popen([*SBUS, "pub", "--address", broker.address, "--lines", "p/x"],
                           stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    got, said, sub_said = PipeLines(sub.stdout), PipeLines(pub.stderr), PipeLines(sub.stderr)
    try:
        assert sub_said.next(1) == [b"ready"]
        for i in range(4):  # a few a second: the broker confirms them as they go
            pub.stdin.write(b"%d\n" % i)
            pub.stdin.flush()
            time.sleep(0.3)
        assert got.next(4) == [b"p/x %d" % i for i in range(4)]
        broker.proc.send_signal(signal.SIGSTOP)
        pub.stdin.write(b"".join(b"%d\n" % i for i in range(4, 54)))
        pub.stdin.flush()
        time.sleep(0.5)  # all 50 in the stopped broker's socket
        broker.proc.kill()
        broker.proc.wait()
        broker.start()
        sub_said.next(2)  # the subscriber is back: "reconnecting", "reconnected ..."
        pub.stdin.write(b"54\n55\n")
        pub.stdin.close()
        assert pub.wait(20) == 0
        line = said.next(1)[0].decode()
        n = int(re.search(r"up to (\d+) message\(s\) sent since the broker last confirmed "
                          r"may be lost with the connection", line).group(1))
        assert 50 <= n <= 51, line
        assert got.next(2) == [b"p/x 54", b"p/x 55"]  # nothing of the 50 came
    finally:
        for proc in (sub, pub):
            stop_process(proc)


def test_library_counts_drops_and_calls_back(make_broker):
    b = make_broker("--queue-limit", "16k")
    reports = []
    with Client(b.address, on_drop=reports.append) as sub:
        sub.set_flood(soft="discard")
        sub.subscribe(b"flood/")
        _flood(b.address, 2000, b"z" * 200)  # this reader reads nothing meanwhile
        got = 0
        while not isinstance(event := sub.receive(timeout=10), sbus.Dropped):
            got += 1  # what fitted in the socket, then the report
        with Client(b.address) as pub:
            pub.publish(b"flood/end")
        for msg in sub:  # drop reports are skipped by iteration, but counted
            if msg.key == b"flood/end":
                break
            got += 1
    assert event.count == reports[0] and sum(reports) == sub.dropped > 0
    assert got + sub.dropped == 2000


# -- reconnect ------------------------------------------------------------------------

def test_sub_reconnects_after_a_broker_restart_and_says_so(broker):
    sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "r/", "-n", "2",
                            "--ready-fd", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert sub.stderr.readline() == b"ready\n"
        run("pub", "--address", broker.address, "r/1", "before")
        assert sub.stdout.readline() == b"r/1 before\n"
        broker.stop()
        assert sub.stderr.readline() == (f"sbus sub: the broker at {broker.address} closed the "
                                         "connection; reconnecting\n").encode()
        broker.start()
        assert sub.stderr.readline() == f"sbus sub: reconnected to the broker at " \
                                        f"{broker.address} (messages published while it " \
                                        "was away were not received)\n".encode()
        run("pub", "--address", broker.address, "r/2", "after")  # subscribed again by now
        out, _ = sub.communicate(timeout=10)
        assert sub.returncode == 0
        assert out.startswith(b"r/2 after\n")
    finally:
        stop_process(sub)  # never left running when an assertion fails


def test_sub_no_reconnect_exits_1(broker):
    sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "r/", "--no-reconnect",
                            "--ready-fd", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert sub.stdout.readline() == b"ready\n"
        broker.stop()
        _, err = sub.communicate(timeout=10)
        assert sub.returncode == 1
        assert one_line(err) == (f"sbus sub: the broker at {broker.address} closed the "
                                 "connection")
    finally:
        stop_process(sub)  # never left running when an assertion fails


def test_client_reconnect_restores_subscriptions_and_policy(broker):
    lines = []
    with Client(broker.address, reconnect=True,
                on_connection=lambda up, line: lines.append((up, line))) as bus:
        bus.set_flood(hard="block")
        bus.subscribe(b"a/")
        broker.stop()
        broker.start()
        bus.sync()  # reconnects: the subscription is in force again after this
        assert [up for up, _ in lines] == [False, True]
        with Client(broker.address) as other:
            other.publish(b"a/x", b"after the restart")
        assert bus.receive(timeout=5) == Publish(b"a/x", b"after the restart")
        bus.control(b"broker/status")
        st = bus.receive(timeout=5)
        assert b'"hard": "block"' in st.payload and b'"patterns": ["a/"]' in st.payload


async def _async_reconnect(broker) -> list[Publish]:
    async with AsyncClient(broker.address, reconnect=True) as bus:
        await bus.subscribe(b"a/")
        broker.stop()
        broker.start()
        await bus.sync()
        async with AsyncClient(broker.address) as pub:
            await pub.publish(b"a/1", b"one")
        got = []
        async for msg in bus:
            got.append(msg)
            break
        return got


def test_async_client_reconnects_under_trio(broker):
    assert trio.run(_async_reconnect, broker) == [Publish(b"a/1", b"one")]


def test_async_client_reconnects_under_asyncio(broker):
    assert asyncio.run(_async_reconnect(broker)) == [Publish(b"a/1", b"one")]


def test_async_client_raises_refusals(broker):
    async def main():
        async with AsyncClient(broker.address) as bus:
            with pytest.raises(Refused, match="names PID 1"):
                await bus.subscribe(b"!/cred/0/0/1/")
            with pytest.raises(InvalidRequest):
                await bus.subscribe(b"a/!/b")
    trio.run(main)
    asyncio.run(main())


# -- readiness and the README ---------------------------------------------------------

def test_ready_fd_lets_a_script_publish_without_a_race(broker, short_tmp):
    script = f"""
        set -e
        mkfifo ready
        {' '.join(SBUS)} sub 'x' -n1 --ready-fd 3 3>ready > out &
        read line < ready
        {' '.join(SBUS)} pub x hi
        wait
        echo "$line"
    """
    for _ in range(5):  # a race would show at once on a busy machine
        os.unlink(short_tmp / "ready") if (short_tmp / "ready").exists() else None
        p = subprocess.run(["bash", "-c", script], cwd=short_tmp, capture_output=True,
                           timeout=20, env={**os.environ, "SBUS_ADDRESS": broker.address})
        assert p.returncode == 0, p.stderr
        assert p.stdout == b"ready\n"
        assert (short_tmp / "out").read_bytes() == b"x hi\n"


def _readme_blocks(lang: str) -> list[str]:
    readme = open(os.path.join(os.path.dirname(sbus.__file__), "..", "README.md")).read()
    return re.findall(rf"^```{lang}\n(.*?)^```", readme, re.S | re.M)


def test_readme_shell_example_runs_as_written(broker, short_tmp):
    (block,) = _readme_blocks("sh")
    env = {**os.environ, "SBUS_ADDRESS": broker.address,
           "PATH": f"{short_tmp}:{os.environ['PATH']}"}
    (short_tmp / "sbus").write_text(f"#!/bin/sh\nexec {' '.join(SBUS)} \"$@\"\n")
    (short_tmp / "sbus").chmod(0o755)
    p = subprocess.run(["bash", "-e", "-c", block], cwd=short_tmp, capture_output=True,
                       timeout=30, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout == b"greetings/world hello\n"


@pytest.mark.parametrize("index", [0, 1])
def test_readme_python_examples_run_as_written(broker, short_tmp, index):
    blocks = _readme_blocks("python")
    assert len(blocks) == 2
    script = short_tmp / "example.py"
    script.write_text(blocks[index] + "\nprint(repr(msg))\n")
    p = subprocess.run([SBUS[0], str(script)], capture_output=True, timeout=30,
                       env={**os.environ, "SBUS_ADDRESS": broker.address})
    assert p.returncode == 0, p.stderr
    assert p.stdout == b"Publish(key=b'sensors/kitchen/temp', payload=b'21.5')\n"


def test_pub_count_reconnects_and_loses_nothing_once_back(broker):
    """`sbus pub -c` across a broker restart: it says so and goes on; a reconnecting `sbus
    sub` counts the sequence numbers: one gap (the restart), nothing lost or repeated
    before or after it."""
    sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "seq/n", "--ready-fd",
                            "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pub = None
    try:
        assert sub.stderr.readline() == b"ready\n"
        pub = subprocess.Popen([*SBUS, "pub", "--address", broker.address, "seq/n", "{n}",
                                "-c", "300", "-i", "10ms"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out = PipeLines(sub.stdout)
        got = out.until(b"seq/n 50")
        broker.stop()
        broker.start()
        got += out.until(b"seq/n 300")
        assert pub.wait(30) == 0
        err = pub.stderr.read().decode()
        assert f"sbus pub: the broker at {broker.address} " in err and "; reconnecting" in err
        assert f"sbus pub: reconnected to the broker at {broker.address}\n" in err
        seqs = [int(line.split()[1]) for line in got]
        assert seqs == sorted(set(seqs))  # nothing repeated, nothing out of order
        gaps = [(a, b) for a, b in zip(seqs, seqs[1:], strict=False) if b != a + 1]
        assert seqs[0] == 1 and len(gaps) <= 1, gaps  # lost: only while the broker was away
    finally:
        stop_process(sub)
        stop_process(pub)


@pytest.mark.parametrize("back", [False, True])
def test_pub_count_timeout_bounds_the_wait_for_a_lost_broker(broker, back):
    """`--timeout S` bounds each send, a send that waits for a lost broker too: a broker
    gone for S seconds is one line and exit status 1 (before, `-c` waited without end);
    one back within S is a reconnect, and the command goes on to its end."""
    watch = Client(broker.address)
    watch.subscribe("seq/")
    pub = subprocess.Popen([*SBUS, "pub", "--address", broker.address, "seq/n", "{n}",
                            "-c", "300", "-i", "10ms", "--timeout", "3"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        err = PipeLines(pub.stderr)
        watch.receive(timeout=20)  # it publishes (a start under load took over 0.5 s) ...
        watch.close()
        time.sleep(0.2)  # (... a few messages: then the broker goes)
        broker.stop()
        if back:
            broker.start()  # well within the 3 s
        gone = time.monotonic()
        code = pub.wait(20)
        err.take()
    finally:
        stop_process(pub)
    said = [line.decode() for line in err.lines]
    # (and how many of the messages sent it may not have taken: the line above)
    assert said[0].startswith(f"sbus pub: the broker at {broker.address} closed the "
                              "connection; reconnecting")
    if back:
        assert code == 0 and said[1:] == [f"sbus pub: reconnected to the broker at "
                                          f"{broker.address}"]
    else:
        assert code == 1 and said[1:] == [f"sbus pub: the broker at {broker.address} closed "
                                          "the connection, and did not come back in time"]
        # no later than its 3 s (sooner if the next try would come after them), not -c's
        assert 1.0 < time.monotonic() - gone < 10


def test_sub_timeout_bounds_the_wait_for_a_lost_broker(broker):
    """`sbus sub --timeout S` ends once nothing arrived for S seconds, a broker gone that
    long too: one line and exit status 1 (before, it waited for the broker without end)."""
    sub = subprocess.Popen([*SBUS, "sub", "--address", broker.address, "k/", "--timeout",
                            "3", "--ready-fd", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert sub.stdout.readline() == b"ready\n"
        broker.stop()
        gone = time.monotonic()
        code = sub.wait(20)
    finally:
        stop_process(sub)
    assert code == 1
    assert 1.0 < time.monotonic() - gone < 10
    assert sub.stderr.read().decode().splitlines() == [
        f"sbus sub: the broker at {broker.address} closed the connection; reconnecting",
        f"sbus sub: the broker at {broker.address} closed the connection, and did not come "
        "back in time"]


def test_reply_reconnects_after_a_broker_restart_and_says_so(broker):
    replier = subprocess.Popen([*SBUS, "reply", "--address", broker.address, "-n", "5",
                                "svc", "--", "cat"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert replier.stderr.readline() == b"sbus reply: answering requests on 'svc'\n"
        with Client(broker.address) as bus:
            assert bus.request(b"svc", b"1", timeout=10) == b"1"
        broker.stop()
        assert replier.stderr.readline() == (f"sbus reply: the broker at {broker.address} "
                                             "closed the connection; reconnecting\n").encode()
        broker.start()
        assert replier.stderr.readline() == (f"sbus reply: reconnected to the broker at "
                                             f"{broker.address} (messages published while "
                                             "it was away were not received)\n").encode()
        with Client(broker.address) as bus:  # subscribed again by now: nothing lost
            assert [bus.request(b"svc", b"%d" % n, timeout=10) for n in range(2, 6)] == \
                [b"2", b"3", b"4", b"5"]
        assert replier.wait(10) == 0
    finally:
        stop_process(replier)


def test_request_waits_for_a_restarted_broker_within_its_timeout(broker, short_tmp):
    """A lost broker during `sbus request` is waited for and the request sent again; a
    one-shot `sbus pub` fails with one line instead."""
    began = short_tmp / "began"
    replier = subprocess.Popen([*SBUS, "reply", "--address", broker.address, "svc", "--",
                                "sh", "-c", f"touch {began}; sleep 1; cat"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL)
    req = None
    try:
        assert replier.stderr.readline() == b"sbus reply: answering requests on 'svc'\n"
        req = subprocess.Popen([*SBUS, "request", "--address", broker.address, "--timeout",
                                "20", "svc", "again"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not began.exists():  # the request is with the replier's command (1 s)
            assert time.monotonic() < deadline and req.poll() is None
            time.sleep(0.02)
        broker.stop()
        broker.start()
        out, err = req.communicate(timeout=30)
        assert (req.returncode, out) == (0, b"again"), err
        assert b"; reconnecting\n" in err and b"reconnected to the broker" in err
        broker.stop()
        r = run("pub", "--address", broker.address, "k", "v")
        assert r.returncode == 1
        assert one_line(r.stderr).startswith("sbus pub: cannot connect to the sbus broker")
    finally:
        stop_process(replier)
        stop_process(req)


def test_a_request_resent_after_a_restart_waits_for_a_replier_to_come_back(broker, short_tmp):
    """The replier dies with the request, the broker restarts, and a new replier starts
    only after the requester is back: the request is sent again once someone subscribes
    to its key (before: at once, to nobody, and the requester waited out its timeout).
    Without any replier coming back, the timeout says so in one line."""
    first, began = _hanging_replier(broker, short_tmp)
    req = second = None
    try:
        req = subprocess.Popen([*SBUS, "request", "--address", broker.address, "--timeout",
                                "20", "svc", "again"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        _restart_without(first, began, broker)
        said = PipeLines(req.stderr)
        said.next(2)  # "... reconnecting", "reconnected to the broker ..."
        time.sleep(0.5)  # back, and asking whether anyone is there
        second = subprocess.Popen([*SBUS, "reply", "--address", broker.address, "svc", "--",
                                   "cat"], stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        assert req.wait(10) == 0 and req.stdout.read() == b"again"
        stop_process(second)
        r = run("request", "--address", broker.address, "--timeout", "1", "svc", "x")
        assert r.returncode == 1 and "no responders for 'svc'" in one_line(r.stderr)
    finally:
        for proc in (first, second, req):
            if proc is not None:
                stop_process(proc)


@pytest.mark.parametrize("run_async", [trio.run, lambda main: asyncio.run(main())],
                         ids=["trio", "asyncio"])
def test_an_async_request_resent_after_a_restart_waits_for_a_replier(broker, short_tmp,
                                                                     run_async):
    """`AsyncClient.request` as `Client.request` above: the request goes again once a
    replier is back, and the wait for it does not cut the reconnect short (before:
    never sent again; a wait cut every 0.1 s restarted the reconnect each time)."""
    first, began = _hanging_replier(broker, short_tmp)
    lines: list[str] = []
    second = None

    async def main() -> bytes:
        async with AsyncClient(broker.address, reconnect=True,
                               on_connection=lambda up, line: lines.append(line)) as bus:
            return await bus.request(b"svc", b"again", 20)

    def restart() -> None:
        nonlocal second
        _restart_without(first, began, broker)
        time.sleep(1)
        second = subprocess.Popen([*SBUS, "reply", "--address", broker.address, "svc", "--",
                                   "cat"], stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)

    try:
        helper = threading.Thread(target=restart)
        helper.start()
        assert run_async(main) == b"again"
        helper.join()
        assert len(lines) == 2 and "reconnecting" in lines[0], lines  # one reconnect, whole
    finally:
        for proc in (first, second):
            if proc is not None:
                stop_process(proc)


def _hanging_replier(broker, short_tmp) -> tuple[subprocess.Popen, object]:
    """`sbus reply svc` whose command never answers (it touches a file, then sleeps), in
    its own process group; and that file."""
    began = short_tmp / "began"
    replier = subprocess.Popen([*SBUS, "reply", "--address", broker.address, "svc", "--",
                                "sh", "-c", f"touch {began}; sleep 30"],
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                               process_group=0)
    assert replier.stderr.readline() == b"sbus reply: answering requests on 'svc'\n"
    return replier, began


def _restart_without(replier: subprocess.Popen, began, broker, timeout: float = 20) -> None:
    """Once the request is with *replier*'s command: kill both, restart the broker."""
    deadline = time.monotonic() + timeout
    while not began.exists():
        assert time.monotonic() < deadline and replier.poll() is None
        time.sleep(0.02)
    os.killpg(replier.pid, 9)
    replier.wait()
    broker.stop()
    broker.start()


def test_a_request_times_out_saying_no_replier_came_back(broker, short_tmp):
    """After a restart nobody subscribes to the key again: the request is never sent
    again, and the timeout says that, not that no reply came."""
    replier, began = _hanging_replier(broker, short_tmp)
    req = None
    try:
        req = subprocess.Popen([*SBUS, "request", "--address", broker.address, "--timeout",
                                "4", "svc", "x"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        _restart_without(replier, began, broker)
        out, err = req.communicate(timeout=20)
        assert req.returncode == 1 and out == b""
        assert err.decode().splitlines()[-1] == (
            "sbus request: nobody subscribed to 'svc' again within 4 s after the broker came "
            "back: the request was not sent again"), err
    finally:
        for proc in (replier, req):
            if proc is not None:
                stop_process(proc)


def test_a_broker_back_in_a_reconnects_last_step_is_found_before_the_timeout(short_tmp):
    """A client's reconnect tries once a second (a fixed backoff here) and a sync gives
    it 2.5 s.  The broker is back 2.05 s after the loss: the attempt the backoff would
    make next, at 3 s, is past the bound, so the reconnect gave up at 2 s; it now tries
    once more just before the bound, and the sync is answered."""
    from conftest import BrokerProcess

    from sbus.session import Backoff

    address = str(short_tmp / "bus.sock")
    first = BrokerProcess(address).start()
    second = BrokerProcess(address + ".next").start()  # put in place at 2.05 s
    client = Client(address, reconnect=True, backoff=Backoff(1.0, 1.0, rand=lambda lo, hi: hi))
    mover = threading.Timer(2.05, os.rename, (address + ".next", address))
    try:
        client.sync()
        first.stop()
        mover.start()
        began = time.monotonic()
        client.sync(timeout=2.5)
        assert 2.05 < time.monotonic() - began < 2.5
    finally:
        mover.cancel()
        if mover.is_alive():
            mover.join()
        client.close()
        second.stop()


def test_two_tasks_that_notice_a_lost_broker_reconnect_once(broker):
    """A sending task and a receiving task of one AsyncClient both meet the restart: one
    reconnect (the other task waits for it), then both go on."""
    lines: list[tuple[bool, str]] = []

    async def main() -> list[bytes]:
        async with AsyncClient(broker.address, reconnect=True,
                               on_connection=lambda up, line: lines.append((up, line))) as bus:
            await bus.subscribe(b"echo")
            got: list[bytes] = []

            async def send() -> None:
                n = 0
                while True:
                    n += 1
                    await bus.publish(b"echo", b"%d" % n)
                    await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                while len(got) < 5:
                    got.extend(ev.payload for ev in await bus.receive_batch())
                broker.stop()
                broker.start()
                target = len(got) + 20
                with trio.fail_after(20):
                    while len(got) < target:
                        got.extend(ev.payload for ev in await bus.receive_batch())
                nursery.cancel_scope.cancel()
            return got

    got = trio.run(main)
    assert [up for up, _ in lines] == [False, True], lines
    seqs = [int(p) for p in got]
    assert seqs == sorted(set(seqs))  # nothing twice, in order
