"""End to end: the real ``sbus-top`` in a real terminal (tmux), a real broker, real traffic;
keys pressed with ``send-keys``, the screen read with ``capture-pane``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sbus.client import Client

#: key -> (messages per second, payload): alpha is busiest, beta/two moves the most bytes
PLAN = {b"alpha/one": (40, b"hello alpha"), b"beta/two": (8, b"B" * 200),
        b"beta/three": (4, b"three")}


class Tmux:
    """One private tmux server (its socket in *cwd*, so nothing is left in /tmp)
    running one shell in a 100×30 pane."""

    def __init__(self, cwd: Path) -> None:
        self.base = ["tmux", "-S", str(cwd / "tmux.sock")]
        env = dict(os.environ, TERM="xterm-256color")
        for name in ("TMUX", "COLUMNS", "LINES"):  # a size in the environment would
            env.pop(name, None)  # fix sbus-top's (rich's), whatever the pane's size
        subprocess.run([*self.base, "-f", "/dev/null", "new-session", "-d", "-s", "top",
                        "-x", "100", "-y", "30", "bash --norc --noprofile"],
                       check=True, env=env, cwd=cwd)

    def send(self, *keys: str, literal: bool = False) -> None:
        subprocess.run([*self.base, "send-keys", "-t", "top", *(["-l"] if literal else []),
                        *keys], check=True)

    def type_line(self, text: str) -> None:
        self.send(text, literal=True)
        self.send("Enter")

    def pane(self) -> str:
        return subprocess.run([*self.base, "capture-pane", "-t", "top", "-p"], check=True,
                              capture_output=True, text=True).stdout

    def wait(self, ok: Callable[[str], bool], what: str, timeout: float = 10) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.pane()
            if ok(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"screen never showed {what}:\n{text}")
            time.sleep(0.1)

    def kill(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


@pytest.fixture
def tmux(short_tmp: Path) -> Iterator[Tmux]:
    t = Tmux(short_tmp)  # one server each
    yield t
    t.kill()


@pytest.fixture
def traffic(broker) -> Iterator[None]:
    stop = threading.Event()

    def run():
        with Client(broker.address) as bus:
            start, tick = time.monotonic(), 0
            while not stop.is_set():
                tick += 1
                for key, (rate, payload) in PLAN.items():
                    if tick % (40 // rate) == 0:
                        bus.publish(key, payload)
                time.sleep(max(0.0, start + tick / 40 - time.monotonic()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    yield
    stop.set()
    t.join()


def table(text: str) -> list[str]:
    """The table's lines: after the header line, up to the first blank one."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith(("key", "prefix")))
    out = []
    for line in lines[head + 1:]:
        if not line.strip() or line.startswith("recent messages"):
            break
        out.append(line)
    return out


def total(text: str) -> int:
    m = re.search(r"total ([\d,]+) msgs", text)
    assert m, text
    return int(m.group(1).replace(",", ""))


def shell_ready(tmux: Tmux, short_tmp: Path, name: str) -> str:
    """Dump ``stty -a`` to a file through the shell (proves the shell reads and runs a
    typed line) and return it."""
    out = short_tmp / name
    tmux.type_line(f"stty -a > {out}; echo done-$((6*7))-{name}")
    tmux.wait(lambda s: f"\ndone-42-{name}" in s, f"the shell running stty ({name})")
    return out.read_text()


def test_keys_change_the_screen_and_quitting_leaves_the_terminal_sane(
        broker, traffic, tmux, short_tmp):
    before = shell_ready(tmux, short_tmp, "before")
    tmux.type_line(f"{sys.executable} -m sbus.top --address {broker.address} --interval 0.2")
    screen = tmux.wait(lambda s: "● connected" in s and "beta/three" in s
                       and "msg/s▼" in s and table(s)[0].startswith("alpha/one"),
                       "traffic sorted by msg/s")
    footer = screen.rstrip().splitlines()[-1]
    assert footer.startswith("q quit p pause s sort:msg/s / filter g group +/- depth c clear")
    assert "hello alpha" in table(screen)[0]

    tmux.send("s")
    screen = tmux.wait(lambda s: "bytes/s▼" in s and table(s)[0].startswith("beta/two"),
                       "sorted by bytes/s, beta/two first")
    assert "sort:bytes/s" in screen
    tmux.send("s")
    tmux.wait(lambda s: "total▼" in s and table(s)[0].startswith("alpha/one"),
              "sorted by total")

    tmux.send("/")
    tmux.wait(lambda s: " filter: " in s and "Enter keep" in s, "the filter prompt")
    tmux.send("beta", literal=True)
    tmux.send("Enter")
    screen = tmux.wait(lambda s: "filter:beta" in s and "alpha/one" not in s
                       and "beta/two" in s and "beta/three" in s, "only beta keys")

    tmux.send("g")
    screen = tmux.wait(lambda s: "prefix (depth 1)" in s and "beta/ (2)" in s,
                       "beta keys grouped")

    tmux.send("p")
    tmux.wait(lambda s: "PAUSED" in s, "the pause badge")
    time.sleep(0.3)  # the frame with the badge may still have been arriving
    frozen = tmux.pane()
    time.sleep(1.3)
    assert tmux.pane() == frozen  # not redrawn: uptime, totals and ages stand still
    tmux.send("p")
    tmux.wait(lambda s: "PAUSED" not in s and total(s) > total(frozen), "counting resumed")

    counted = total(tmux.pane())
    tmux.send("c")
    tmux.wait(lambda s: total(s) < counted, "cleared counters")

    # a smaller terminal: the screen is laid out again for 80×24
    subprocess.run([*tmux.base, "resize-window", "-t", "top", "-x", "80", "-y", "24"],
                   check=True)

    def fits(text: str) -> bool:
        lines = text.splitlines()
        return (len(lines) == 24 and lines[0].startswith("sbus-top")
                and lines[-1].startswith("q quit") and "recent messages" in lines[-6])

    tmux.wait(fits, "the screen redrawn for 80×24")

    tmux.send("q")
    tmux.wait(lambda s: "sbus-top" not in s and s.rstrip().endswith(("$", "#")),
              "the shell prompt back")
    after = shell_ready(tmux, short_tmp, "after")
    # every setting as before; only the size line differs (we resized the window)
    assert after.splitlines()[1:] == before.splitlines()[1:]
    assert "rows 24; columns 80" in after.splitlines()[0]
    assert "stty -a >" in tmux.pane()  # what was typed is echoed again


def test_ctrl_c_also_restores_the_terminal(broker, tmux, short_tmp):
    before = shell_ready(tmux, short_tmp, "before")
    tmux.type_line(f"{sys.executable} -m sbus.top --address {broker.address}")
    tmux.wait(lambda s: "● connected" in s, "sbus-top connected")
    tmux.send("C-c")
    tmux.wait(lambda s: "sbus-top" not in s, "sbus-top gone")
    tmux.type_line("echo status-$?")
    tmux.wait(lambda s: "\nstatus-130" in s, "exit status 130, like the other commands")
    assert "Traceback" not in tmux.pane()
    assert shell_ready(tmux, short_tmp, "after") == before


def test_broker_gone_shows_retrying_then_reconnects(tmux, make_broker):
    broker = make_broker()
    tmux.type_line(f"{sys.executable} -m sbus.top --address {broker.address}")
    tmux.wait(lambda s: "● connected" in s, "sbus-top connected")
    broker.stop()
    tmux.wait(lambda s: "disconnected — retrying" in s, "the retrying state")
    broker.start()
    tmux.wait(lambda s: "● connected" in s, "connected again")
    with Client(broker.address) as bus:
        bus.publish(b"back/again", b"hello again")
    tmux.wait(lambda s: "back/again" in s and "hello again" in s, "new traffic counted")
    tmux.send("q")


def test_no_broker_says_why_instead_of_retrying(tmux, short_tmp):
    tmux.type_line(f"{sys.executable} -m sbus.top --address {short_tmp}/none.sock; "
                   "echo status-$?")
    screen = tmux.wait(lambda s: "\nstatus-" in s, "sbus-top ending")
    text = "".join(screen.splitlines())  # the terminal wraps the line
    assert f"sbus-top: cannot connect to the sbus broker at {short_tmp}/none.sock: No such " \
           "file or directory." in text
    assert "status-1" in text and "Traceback" not in text


def test_scrolling_reverse_sort_help_and_the_clients_pane(broker, tmux):
    with Client(broker.address) as bus:
        for i in range(1, 41):
            bus.publish(b"k/%02d" % i, b"v%d" % i)
    watcher = Client(broker.address)
    watcher.subscribe(b"watch/\x1b[2J")  # someone else's client, with a hostile pattern
    watcher.control(b"client/status", b"exported 3\x1b[31m")  # and a hostile status line
    watcher.whoami()
    tmux.type_line(f"{sys.executable} -m sbus.top --address {broker.address} --sort key "
                   "--interval 0.1")
    tmux.wait(lambda s: "● connected" in s, "sbus-top connected")
    for attempt in range(10):  # published again until sbus-top has counted them all
        with Client(broker.address) as bus:
            for i in range(1, 41):
                bus.publish(b"k/%02d" % i, b"v%d" % i)
        try:
            # (and the screen drawn to its last line: tmux may show it mid-redraw)
            screen = tmux.wait(lambda s: "keys 40" in s and table(s)[0].startswith("k/01")
                               and s.rstrip().endswith("/40"),
                               "40 keys sorted by name", timeout=2)
            break
        except AssertionError:
            if attempt == 9:
                raise
    page = len(table(screen))
    assert screen.rstrip().endswith(f" {page}/40") and "? help" in screen
    tmux.send("End")
    screen = tmux.wait(lambda s: table(s)[-1].startswith("k/40"), "the last page")
    assert table(screen)[0].startswith(f"k/{41 - page:02d}")
    assert screen.rstrip().endswith(f" {41 - page}-40/40")
    tmux.send("Up")
    tmux.wait(lambda s: table(s)[-1].startswith("k/39"), "one row up")
    tmux.send("Home")
    tmux.wait(lambda s: table(s)[0].startswith("k/01"), "the first page again")
    tmux.send("PageDown")
    tmux.wait(lambda s: table(s)[0].startswith(f"k/{page + 1:02d}"), "one page down")
    tmux.send("r")
    # the whole frame (a capture can catch one half redrawn): the table and the footer
    tmux.wait(lambda s: "key▲" in s and table(s)[0].startswith("k/40")
              and "sort:key rev" in s, "reversed, from the top, and said in the footer")
    tmux.send("Down")
    tmux.wait(lambda s: table(s)[0].startswith("k/39"), "scrolled one row")

    tmux.send("?")
    tmux.wait(lambda s: "keys (any key closes this help)" in s and "reverse the sort" in s
              and "PgUp PgDn" in s, "the whole help screen")
    tmux.send("x")
    tmux.wait(lambda s: "key▲" in s and "any key closes" not in s, "the table back")

    subprocess.run([*tmux.base, "resize-window", "-t", "top", "-x", "160", "-y", "30"],
                   check=True)  # room for the watcher's status line after its pattern
    tmux.send("Tab")
    screen = tmux.wait(lambda s: "patterns" in s and "watch/" in s, "the clients pane")
    lines = screen.splitlines()
    head = next(i for i, line in enumerate(lines) if "patterns" in line)
    rows = [line for line in lines[head + 1:head + 6] if line.strip()]
    assert len(rows) == 2  # sbus-top's connection and the watcher (the root user sees all)
    mine = next(r for r in rows if "*" in r.split()[0])
    other = next(r for r in rows if r is not mine)
    assert other.split()[1] == str(os.getpid())
    # its pattern, then its own status line: both escaped
    assert other.rstrip().endswith("watch/\\x1b[2J  [exported 3\\x1b[31m]")
    assert mine.rstrip().endswith("''")  # sbus-top's own pattern: everything
    assert "\x1b" not in screen
    tmux.send("Tab")
    tmux.wait(lambda s: "key▲" in s, "the keys again")
    tmux.send("q")
    tmux.wait(lambda s: s.rstrip().endswith(("$", "#")), "the shell prompt back")
    watcher.close()
