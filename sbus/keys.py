"""Rules for routing keys and patterns: the reserved ``!`` and secret ``!/cred/`` keys.

Pure functions of bytes and credentials, shared by the broker (which enforces them)
and the client library (which checks early to give a clear error).

Decisions where the protocol text leaves room:

* ``!`` is reserved when it stands as a whole segment (both neighbours are the
  separator or an end).  Such a segment is only allowed at the start of a key, or
  directly after a complete ``!/cred/G/U/P/`` prefix (the nesting the protocol
  describes for credentials forwarded through other servers).
* A key that starts with ``!/`` is *secret*.  It must have the form
  ``!/cred/GID/UID/PID/REST`` (decimal fields, possibly empty).  Only patterns
  that themselves start with ``!/cred/`` can match secret keys.
* Credential fields of a pattern are compared as decimal text with the
  subscriber's own: ``0100`` is not ``100``.  Nested credentials after the first
  prefix belong to other machines and are not checked here.
* A pattern has at most `MAX_SEGMENTS` segments, and the prefix before a ``*`` at
  most `MAX_WILDCARD_PREFIX` bytes: these bound what one lookup and one subscription
  can cost the broker (sbus/routing.py).  Keys have no such limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .display import brief
from .errors import InvalidRequest

__all__ = ["Credentials", "KeyRefused", "KeyRules", "MAX_SEGMENTS", "MAX_WILDCARD_PREFIX"]

#: Segments a subscription pattern may have at most.
MAX_SEGMENTS = 256
#: Bytes before the ``*`` of a wildcard segment (``prefix*``) at most.
MAX_WILDCARD_PREFIX = 255


class KeyRefused(InvalidRequest):
    """A key or pattern that misuses the reserved ``!`` or names someone else's secrets."""


def secret_prefix(sep: bytes = b"/") -> bytes:
    """``!/``: how every secret key starts, and every pattern that may match one (the
    one place it is spelled; `sbus.routing` keeps secrets apart by it)."""
    return b"!" + sep


@dataclass(frozen=True, slots=True)
class Credentials:
    """A peer's kernel-verified identity (from ``SO_PEERCRED`` at connect time)."""

    gid: int
    uid: int
    pid: int

    def path(self, sep: bytes = b"/") -> bytes:
        """``!/cred/GID/UID/PID``: the whoami answer and the prefix of this peer's secrets."""
        return sep.join([b"!", b"cred", b"%d" % self.gid, b"%d" % self.uid, b"%d" % self.pid])

    @classmethod
    def parse(cls, path: bytes, sep: bytes = b"/") -> Credentials:
        """Inverse of `path` (the first prefix only, for nested answers)."""
        parts = path.split(sep)
        if len(parts) < 5 or parts[:2] != [b"!", b"cred"]:
            raise ValueError(f"not a credentials path: {path!r}")
        return cls(int(parts[2]), int(parts[3]), int(parts[4]))


class KeyRules:
    """The ``!`` rules for one separator (``/``, or ``.`` for the early-draft dialect)."""

    def __init__(self, sep: bytes = b"/") -> None:
        if len(sep) != 1 or sep in b"*!\0":
            raise ValueError(f"separator must be one byte other than * ! NUL: {sep!r}")
        self.sep = sep
        self.secret_prefix = secret_prefix(sep)
        s = re.escape(sep)
        self._cred_key = re.compile(rb"!%scred%s([0-9]*)%s([0-9]*)%s([0-9]*)%s" % (s, s, s, s, s))
        self._cred_pattern = re.compile(rb"!%scred%s([^%s]*)%s([^%s]*)%s([^%s]*)%s" % (
            s, s, s, s, s, s, s, s))

    def is_secret(self, key: bytes) -> bool:
        return key.startswith(self.secret_prefix)

    def check_key(self, key: bytes) -> None:
        """Raise `KeyRefused` unless *key* may be published to (anyone may publish secrets)."""
        rest = key
        while rest.startswith(self.secret_prefix):
            m = self._cred_key.match(rest)
            if m is None:
                raise KeyRefused(
                    f"secret key {brief(key)} must have the form !/cred/GID/UID/PID/... "
                    "with decimal fields".replace("/", self.sep.decode("latin-1"))
                )
            rest = rest[m.end():]
        self._check_bang(key, rest)

    def check_shape(self, pattern: bytes) -> None:
        """Raise `KeyRefused` if *pattern* has too many segments or too long a wildcard prefix."""
        segments = pattern.count(self.sep) + 1
        if segments > MAX_SEGMENTS:
            raise KeyRefused(f"pattern {brief(pattern)} has {segments} segments "
                             f"(at most {MAX_SEGMENTS})")
        star = pattern.find(b"*")
        while star >= 0:
            start = pattern.rfind(self.sep, 0, star) + 1
            if star - start > MAX_WILDCARD_PREFIX:
                raise KeyRefused(f"the prefix before '*' in pattern {brief(pattern)} is "
                                 f"{star - start} bytes (at most {MAX_WILDCARD_PREFIX})")
            end = pattern.find(self.sep, star)
            star = -1 if end < 0 else pattern.find(b"*", end)

    def check_pattern(self, pattern: bytes, cred: Credentials | None) -> bytes:
        """Check a SUB pattern for a subscriber; return it with empty credential fields filled.

        Without *cred* (a client that has not asked whoami yet) the fields are checked for
        form only, and the pattern is returned as it is."""
        self.check_shape(pattern)
        if not self.is_secret(pattern):
            self._check_bang(pattern, pattern)
            return pattern
        m = self._cred_pattern.match(pattern)
        if m is None:
            raise KeyRefused(
                f"truncated secret pattern {brief(pattern)}: needs !/cred/GID/UID/PID/")
        own = (None,) * 3 if cred is None else (b"%d" % cred.gid, b"%d" % cred.uid,
                                                 b"%d" % cred.pid)
        fields = []
        for name, given, mine in zip(("GID", "UID", "PID"), m.groups(), own, strict=True):
            if b"*" in given:
                raise KeyRefused(f"wildcard in the {name} field of secret pattern {brief(pattern)}")
            if given and not given.isdigit():
                raise KeyRefused(f"{name} field of secret pattern {brief(pattern)} is not decimal")
            if given and mine is not None and given != mine:
                raise KeyRefused(
                    f"secret pattern {brief(pattern)} names {name} {given.decode()}, "
                    f"subscriber has {mine.decode()}"
                )
            fields.append(mine)
        sep = self.sep
        rest = pattern[m.end():]
        self._check_bang(pattern, self._strip_nested(rest))
        if cred is None:
            return pattern
        return sep.join([b"!", b"cred", *fields]) + sep + rest

    def _strip_nested(self, rest: bytes) -> bytes:
        while rest.startswith(self.secret_prefix):
            m = self._cred_pattern.match(rest)
            if m is None:
                return rest
            rest = rest[m.end():]
        return rest

    def _check_bang(self, whole: bytes, rest: bytes) -> None:
        if b"!" in rest and b"!" in rest.split(self.sep):
            raise KeyRefused(f"'!' is reserved and cannot stand as a segment of {brief(whole)}")
