"""Clients that must not notice a broker restart, for the tests that restart a real
broker under a real systemd manager (tests/test_systemd_user.py,
tests/test_systemd_container.py).

An `Audience` holds four raw connections: a reliable reader (``block``, of the
publisher's own user, so it may hold the publisher back), an ordinary reader, a reader
of its own secret inbox (``!/cred/…``) and the publisher.  `Audience.across` publishes a
steady stream before, during and after a restart and checks that each reader got
everything meant for it, in order, without end-of-file.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from conftest import raw, sync

#: one secret message per this many published
SECRET_EVERY = 50


@dataclass
class Reader:
    sock: socket.socket
    end: bytes
    got: list[bytes] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    eof: bool = False
    error: str = ""

    def read(self) -> None:
        try:
            while True:
                p = self.sock.recv(1 << 20)
                if not p:
                    self.eof = True
                    return
                if p == self.end:
                    return
                if p.startswith(b"MSG "):
                    self.got.append(p)
                    self.times.append(time.monotonic())
        except OSError as exc:
            self.error = repr(exc)

    def longest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)),
                   default=0.0)


class Audience:
    def __init__(self, address: str) -> None:
        self.reliable = raw(address, timeout=60)
        self.reliable.send(b"CMSG blocking/hard/block")
        self.reliable.send(b"SUB seq/")
        self.plain = raw(address, timeout=60)
        self.plain.send(b"SUB seq/")
        self.secret = raw(address, timeout=60)
        self.secret.send(b"SUB !/cred////")
        self.pub = raw(address, timeout=60)
        self.inbox = b""
        for s in self.sockets:
            sync(s)
        self.secret.send(b"CMSG !/cred/whoami")
        while not (p := self.secret.recv(1 << 20)).startswith(b"CMSG !/cred/whoami\0"):
            pass
        self.inbox = p.split(b"\0", 1)[1] + b"/inbox"

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.reliable, self.plain, self.secret, self.pub]

    def close(self) -> None:
        for s in self.sockets:
            s.close()

    def across(self, restart: Callable[[], object], rate: float = 2000,
               lead: int = 1000, tail: int = 1000) -> dict[str, float]:
        """Publish *lead* messages, then keep publishing at *rate* while *restart* runs,
        then *tail* more; assert every reader got its share in order, no end-of-file.
        Returns how many were published during the restart and the longest gaps (s)."""
        sent: list[bytes] = []
        secrets: list[bytes] = []
        marks: dict[str, int] = {}
        stop = threading.Event()

        def publish() -> None:
            start = time.monotonic()
            while not stop.is_set() or len(sent) < marks.get("after", 1 << 62) + tail:
                i = len(sent)
                packet = b"MSG seq/%d\0%d" % (i % 7, i)
                self.pub.send(packet)
                sent.append(packet)
                if i % SECRET_EVERY == 0:
                    packet = b"MSG " + self.inbox + b"\0secret %d" % i
                    self.pub.send(packet)
                    secrets.append(packet)
                # a steady stream: at most *rate* per second
                ahead = (i + 1) / rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)

        end, secret_end = b"MSG seq/end\0", b"MSG " + self.inbox + b"\0end"
        readers = {"reliable": Reader(self.reliable, end), "plain": Reader(self.plain, end),
                   "secret": Reader(self.secret, secret_end)}
        threads = [threading.Thread(target=r.read, daemon=True) for r in readers.values()]
        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        for t in threads:
            t.start()
        while len(sent) < lead:
            assert publisher.is_alive()
            time.sleep(0.01)
        marks["before"] = len(sent)
        try:
            restart()
        finally:
            marks["after"] = len(sent)
            stop.set()
            publisher.join(60)
        assert not publisher.is_alive()
        self.pub.send(end)
        self.pub.send(secret_end)
        for t in threads:
            t.join(60)
        for name, r in readers.items():
            assert not r.eof, f"the {name} reader saw end-of-file after {len(r.got)} messages"
            assert not r.error, f"the {name} reader: {r.error}"
        assert readers["reliable"].got == sent
        assert readers["plain"].got == sent
        assert readers["secret"].got == secrets
        during = marks["after"] - marks["before"]
        assert during > 0, "nothing was published while the broker restarted"
        return {"during": during, **{name: r.longest_gap() for name, r in readers.items()}}

    def all_see_eof(self, timeout: float = 30) -> None:
        """Every connection ends (an ordinary restart: the clients reconnect)."""
        for s in self.sockets:
            s.settimeout(timeout)
            while True:
                p = s.recv(1 << 20)
                if not p:
                    break
