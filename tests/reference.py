"""A reference model of sbus written straight from the protocol text, for fuzzing.

Deliberately naive and independent of `sbus.routing` and `sbus.protocol`: the
matcher walks the pattern byte by byte as the prose describes it, the parser is
the protocol text's regular expressions, and `Bus` is a brute-force broker (every
publish is checked against every subscription).  Fuzzers and differential tests
compare the real code with this model; where they disagree, one of them is wrong.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable

from sbus.protocol import Control, Publish, Subscribe, Unsubscribe

__all__ = ["reference_match", "reference_parse", "Bus"]


def reference_match(pattern: bytes, key: bytes, sep: bytes = b"/") -> bool:
    """Does *pattern* match *key*, read literally from the protocol text?

    ``*`` matches until the next separator (or the end); a trailing separator
    matches a separator and any subsequent bytes; the empty pattern matches
    everything; and only a secret pattern (``!/…``) can ever match a secret key.
    """
    secret = b"!" + sep
    if key.startswith(secret) and not pattern.startswith(secret):
        return False
    if pattern == b"":
        return True
    s = sep[0]
    i = j = 0
    while i < len(pattern):
        c = pattern[i]
        if c == 0x2A:  # '*': swallow the rest of the key's segment
            while j < len(key) and key[j] != s:
                j += 1
            i += 1
        elif c == s and i == len(pattern) - 1:
            return j < len(key) and key[j] == s
        elif j < len(key) and key[j] == c:
            i += 1
            j += 1
        else:
            return False
    return j == len(key)


_SUB = re.compile(rb"SUB ([^\x00]*)(\x00.*)?", re.S)
_UNSUB = re.compile(rb"UNSUB ([^\x00]*)(\x00.*)?", re.S)
_MSG = re.compile(rb"MSG ([^\x00]*)\x00(.*)", re.S)
_CMSG = re.compile(rb"CMSG ([^\x00]*)(\x00(.*))?", re.S)  # \2 optional from clients


def reference_parse(packet: bytes):
    """The event the protocol text's regular expressions give *packet*, or None."""
    if m := _SUB.fullmatch(packet):
        return Subscribe(m[1])
    if m := _UNSUB.fullmatch(packet):
        return Unsubscribe(m[1])
    if m := _MSG.fullmatch(packet):
        return Publish(m[1], m[2])
    if m := _CMSG.fullmatch(packet):
        return Control(m[1], m[3])
    return None


class Bus:
    """Brute-force subscriptions: client -> multiset of patterns."""

    def __init__(self, sep: bytes = b"/") -> None:
        self.sep = sep
        self.subs: dict[Hashable, Counter[bytes]] = {}

    def subscribe(self, client: Hashable, pattern: bytes) -> None:
        self.subs.setdefault(client, Counter())[pattern] += 1

    def unsubscribe(self, client: Hashable, pattern: bytes) -> bool:
        mine = self.subs.get(client)
        if not mine or not mine[pattern]:
            return False
        mine[pattern] -= 1
        if not mine[pattern]:
            del mine[pattern]
            if not mine:
                del self.subs[client]
        return True

    def remove_client(self, client: Hashable) -> int:
        return sum(self.subs.pop(client, Counter()).values())

    def patterns(self, client: Hashable) -> Counter[bytes]:
        return +self.subs.get(client, Counter())

    def match(self, key: bytes) -> set:
        return {c for c, pats in self.subs.items()
                if any(reference_match(p, key, self.sep) for p in pats)}

    def __len__(self) -> int:
        return sum(sum(c.values()) for c in self.subs.values())
