"""``CMSG broker/status``: what each user may see of the broker, through real sockets of
real users (forked children that setuid), and that the answer stays one bounded packet."""

from __future__ import annotations

import json
import os

import pytest
from conftest import raw, sync
from faultkit import NOBODY, as_user

from sbus.introspect import ANSWER_BYTES, ENTRY_BYTES, _text, entry_bytes

STATUS = b"CMSG broker/status"


def ask(sock, payload: bytes | None = None) -> dict:
    sock.send(STATUS if payload is None else STATUS + b"\0" + payload)
    while True:
        p = sock.recv(1 << 20)
        if p.startswith(STATUS + b"\0"):
            assert len(p) <= len(STATUS) + 1 + ANSWER_BYTES + 2048
            return json.loads(p[len(STATUS) + 1:])


def a_user_asks(pipe, address: str) -> None:
    s = raw(address)
    s.send(b"SUB mine/\x1b[2J")
    sync(s)
    pipe.send(ask(s))
    pipe.recv()  # hold the connection until the test is done


def test_a_user_sees_its_own_clients_root_sees_everyone(broker, short_tmp):
    os.chmod(short_tmp, 0o755)  # let the other user reach the socket
    root = raw(broker.address)
    root.send(b"SUB roots/secret/plans")
    root.send(b"CMSG blocking/soft/discard")
    sync(root)
    proc, pipe = as_user(NOBODY, a_user_asks, broker.address)
    try:
        assert pipe.poll(10)
        seen = pipe.recv()
        assert seen["broker"]["clients"] == 2 and seen["broker"]["visible"] == f"uid {NOBODY}"
        assert [c["uid"] for c in seen["clients"]] == [NOBODY]  # not root's client
        assert seen["clients"][0]["patterns"] == ["mine/\x1b[2J"]  # JSON escapes it
        everything = ask(root)
        assert {c["uid"] for c in everything["clients"]} == {0, NOBODY}
        me = next(c for c in everything["clients"] if c["id"] == everything["broker"]["you"])
        assert me["patterns"] == ["roots/secret/plans"] and me["soft"] == "discard"
        assert me["pid"] == os.getpid() and everything["broker"]["subscriptions"] == 2
    finally:
        pipe.send("done")
        proc.join(10)


def test_a_long_answer_is_cut_and_goes_on_where_it_stopped(broker):
    clients = [raw(broker.address) for _ in range(60)]
    for i, c in enumerate(clients):
        for j in range(50):
            c.send(b"SUB many/%d/%d/" % (i, j) + b"p" * 40)
        sync(c)
    seen, request, pages = set(), None, 0
    while True:
        answer = ask(clients[0], request)
        pages += 1
        seen.update(c["id"] for c in answer["clients"])
        if not answer["more"]:
            break
        request = json.dumps(answer["next"]).encode()
    assert pages > 1 and len(seen) == answer["broker"]["clients"] == 60


def test_sbus_status_and_ping_from_the_shell(broker):
    import subprocess

    from conftest import SBUS

    holder = raw(broker.address)
    holder.send(b"SUB shown/\x1b]0;pwned\x07")
    sync(holder)
    out = subprocess.run([*SBUS, "status", "--address", broker.address], capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "broker: 2 clients, 1 subscriptions" in out.stdout
    assert "shown/\\x1b]0;pwned\\x07" in out.stdout and "\x1b" not in out.stdout
    head = next(line for line in out.stdout.splitlines() if line.strip().startswith("id"))
    assert head.split() == ["id", "pid", "uid", "subs", "queued", "bytes", "drops", "paused",
                            "flood", "patterns"]
    js = subprocess.run([*SBUS, "status", "--json", "--address", broker.address],
                        capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert json.loads(js.stdout)["broker"]["subscriptions"] == 1
    ping = subprocess.run([*SBUS, "ping", "-c", "3", "-i", "0", "--address", broker.address],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert ping.returncode == 0 and "3 round trips: min" in ping.stdout
    gone = subprocess.run([*SBUS, "ping", "--address", "/nonexistent/bus.sock"],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert gone.returncode == 1 and len(gone.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("data", [b"plain/key", b"a\\xff", b"a\xff", b"a\\\xff\\", b"\x1b[2J\\n",
                                  "caf\u00e9/\\x41".encode(), b"'q'\x00\x80'", b"x" * 300])
def test_an_entry_gives_back_the_bytes_it_shows(data):
    text = _text(data)
    json.loads(json.dumps(text))  # always JSON text
    back = entry_bytes(text)
    if len(data) <= ENTRY_BYTES:
        assert back == data
    else:
        assert back.startswith(data[:ENTRY_BYTES]) and back.endswith(b"(+100 bytes)")


def test_sbus_status_tells_a_byte_from_its_escape(broker):
    """A raw 0xFF and the four characters backslash-x-f-f were shown alike."""
    import subprocess

    from conftest import SBUS

    holder = raw(broker.address)
    holder.send(b"SUB odd/\xff")
    holder.send(b"SUB odd/\\xff")
    sync(holder)
    shown = [json.dumps(p) for c in ask(holder)["clients"] for p in c["patterns"]]
    assert len(set(shown)) == 2
    out = subprocess.run([*SBUS, "status", "--address", broker.address], capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "odd/\\xff, odd/\\\\xff" in out.stdout, out.stdout


def test_a_client_of_control_byte_patterns_cannot_end_the_listing(broker):
    """Control bytes take 6 JSON characters each: 50 patterns of 200 of them made one
    entry larger than a page, and the answer stopped there ("more" without "next"),
    hiding every later client from root.  Now such an entry shows fewer patterns."""
    big = raw(broker.address)
    for i in range(60):
        big.send(b"SUB " + b"\x01" * 200 + b"%04d" % i + b"x" * 800)  # cut: a suffix
    big.send(b"CMSG client/status\0" + b"\x01" * 200)
    sync(big)
    later = raw(broker.address)
    sync(later)
    seen, request = [], None
    while True:
        answer = ask(later, request)
        seen += [c["id"] for c in answer["clients"]]
        if not answer["more"]:
            break
        request = json.dumps(answer["next"]).encode()
    assert len(seen) == answer["broker"]["clients"] == 2  # the asker too
    mine = next(c for c in ask(big)["clients"] if c["subscriptions"] == 60)
    assert 0 < len(mine["patterns"]) < 50


def test_a_page_fits_a_broker_of_small_packets(make_broker):
    """With ``--max-message 16k`` a 60 KiB page was dropped by the broker itself
    ("too large for its socket"), and ``sbus status`` said the broker did not answer."""
    import subprocess

    from conftest import SBUS

    small = make_broker("--max-message", "16k")
    clients = [raw(small.address) for _ in range(300)]
    for c in clients[:3]:
        c.send(b"SUB many/" + b"p" * 150)
    sync(clients[0])
    out = subprocess.run([*SBUS, "status", "--address", small.address], capture_output=True,
                         text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert "broker: 301 clients" in out.stdout  # and the asker
    assert out.stdout.count("many/") == 3  # every page listed
