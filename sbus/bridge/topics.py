"""sbus keys and patterns <-> MQTT topics and filters, pure (docs/bridge.md, "Keys").

The two syntaxes nearly agree: ``/`` separates levels in both, MQTT's ``+`` is sbus's
whole-segment ``*`` and ``#`` is a trailing ``/``.  Where they differ the rule is:

* A pattern becomes the narrowest MQTT filter that covers it; `Filter.exact` says whether
  MQTT selects exactly the same topics.  ``foo*`` becomes ``+`` and ``a/`` becomes ``a/#``
  (which also matches ``a``), so what arrives is always checked against the sbus pattern.
* A key MQTT cannot carry is **refused, never escaped**: ``+``/``#`` (wildcards in MQTT,
  ordinary bytes in sbus), invalid UTF-8, control characters and non-characters (brokers
  may reject them), an empty or over-long topic, one deeper than brokers take
  (`MAX_LEVELS`), a leading ``$`` (reserved by brokers).
  An escape would give two keys one topic or make a topic that means something else.
* Secret keys (``!/…``) never leave the host: no export pattern may name them and an
  exported key that is secret is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..display import brief
from ..keys import KeyRefused, KeyRules
from ..routing import matches

__all__ = ["Mapping", "Filter", "ConfigError", "to_filter", "topic_problem",
           "MAX_LEVELS", "MAX_TOPIC", "SECRET"]

SEP = b"/"
SECRET = b"!/"
#: An MQTT topic is a UTF-8 string with a 16-bit length.
MAX_TOPIC = 65535
#: Levels of a topic the bridge sends at most.  MQTT sets no limit, but brokers do and
#: close the connection on a deeper one: mosquitto 2.0 at more than 201 levels, EMQX
#: (``max_topic_levels``) at more than 128.  Sent again at each reconnect, such a message
#: would stop every export behind it, so it is refused instead.
MAX_LEVELS = 128
RULES = KeyRules(SEP)

# C0 and C1 controls, DEL, and Unicode non-characters: the MQTT spec lets a broker close
# the connection on them (mosquitto does), so they are refused rather than sent.
_NONCHARACTERS = "".join(chr(plane << 16 | low) for plane in range(17) for low in (0xFFFE, 0xFFFF))
_UNSENDABLE = re.compile(f"[\x00-\x1f\x7f-\x9f\ufdd0-\ufdef{_NONCHARACTERS}+#]")


class ConfigError(ValueError):
    """A pattern or prefix the bridge cannot use: one line saying which and why."""


def topic_problem(topic: bytes) -> str | None:
    """Why MQTT cannot carry *topic* as a topic name, or None if it can."""
    if not topic:
        return "empty topic"
    if len(topic) > MAX_TOPIC:
        return f"topic of {len(topic)} bytes (MQTT allows {MAX_TOPIC})"
    if topic.count(SEP) >= MAX_LEVELS:
        return f"topic of {topic.count(SEP) + 1} levels (brokers take {MAX_LEVELS} at most)"
    try:
        text = topic.decode("utf-8")
    except UnicodeDecodeError:
        return "not valid UTF-8"
    bad = _UNSENDABLE.search(text)
    if bad is not None:
        return f"{bad.group()!r} cannot be sent in an MQTT topic"
    if text.startswith("$"):
        return "topics starting with '$' are reserved by MQTT brokers"
    return None


@dataclass(frozen=True)
class Mapping:
    """One direction's prefix mapping: local keys under *local* are remote topics under
    *remote* (``sensors/`` <-> ``site/a/sensors/``).  Each prefix is empty or ends with
    ``/``, so a mapping moves whole segments."""

    local: bytes = b""
    remote: bytes = b""

    @classmethod
    def parse(cls, text: str) -> Mapping:
        """``LOCAL=REMOTE`` (split at the first ``=``)."""
        local, eq, remote = text.partition("=")
        if not eq:
            raise ConfigError(f"a prefix mapping is LOCAL=REMOTE, not {text!r}")
        m = cls(local.encode(), remote.encode())
        for name, prefix in (("local", m.local), ("remote", m.remote)):
            if prefix and not prefix.endswith(SEP):
                raise ConfigError(f"{name} prefix {brief(prefix)} must be empty or end with '/'")
            if b"*" in prefix:
                raise ConfigError(f"{name} prefix {brief(prefix)} cannot hold '*'")
        if m.local.startswith(SECRET):
            raise ConfigError("secret keys (!/…) never leave the host: not as a prefix either")
        problem = m.remote and topic_problem(m.remote)
        if problem:
            raise ConfigError(f"remote prefix {brief(m.remote)}: {problem}")
        return m

    def to_remote(self, key: bytes) -> bytes | None:
        return self.remote + key[len(self.local):] if key.startswith(self.local) else None

    def to_local(self, topic: bytes) -> bytes | None:
        return self.local + topic[len(self.remote):] if topic.startswith(self.remote) else None


@dataclass(frozen=True)
class Filter:
    """An import pattern (local) and the MQTT filter that covers it (remote)."""

    pattern: bytes
    mqtt: str
    exact: bool

    def matches(self, key: bytes) -> bool:
        return matches(self.pattern, key, SEP)


def check_export(pattern: bytes, mapping: Mapping) -> bytes:
    """An export pattern, checked: a shape the broker takes, not secret, under the prefix."""
    _check_shape(pattern)
    if pattern.startswith(SECRET):
        raise ConfigError(f"export pattern {brief(pattern)}: secret keys never leave the host")
    if not pattern.startswith(mapping.local):
        raise ConfigError(f"export pattern {brief(pattern)} is not under the local prefix "
                          f"{brief(mapping.local)} of --export-map")
    return pattern


def to_filter(pattern: bytes, mapping: Mapping) -> Filter:
    """The MQTT filter for an import *pattern* (local, under ``mapping.local``)."""
    _check_shape(pattern)
    if pattern.startswith(SECRET):
        raise ConfigError(f"import pattern {brief(pattern)}: the bridge does not publish "
                          "to secret keys (remote peers have no local credentials)")
    remote = mapping.to_remote(pattern)
    if remote is None:
        raise ConfigError(f"import pattern {brief(pattern)} is not under the local prefix "
                          f"{brief(mapping.local)} of --import-map")
    if not remote:
        return Filter(pattern, "#", True)
    tail = remote.endswith(SEP)
    levels: list[str] = []
    exact = not tail  # MQTT's a/# also matches a itself
    for seg in (remote[:-1] if tail else remote).split(SEP):
        star = seg.find(b"*")
        if star >= 0:
            if seg[star:].strip(b"*"):
                raise ConfigError(f"import pattern {brief(pattern)} can never match: bytes "
                                  "after '*' in a segment")
            exact = exact and star == 0
            levels.append("+")
            continue
        try:
            level = seg.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"import pattern {brief(pattern)} is not valid UTF-8: "
                              "no MQTT topic could match it") from None
        if "+" in level or "#" in level:
            raise ConfigError(f"import pattern {brief(pattern)} holds '+' or '#', which no "
                              "MQTT topic can contain")
        levels.append(level)
    if tail:
        levels.append("#")
    return Filter(pattern, "/".join(levels), exact)


def local_problem(key: bytes) -> str | None:
    """Why the bridge will not publish an imported *key* on the local bus, or None."""
    if key.startswith(SECRET):
        return "secret keys are not imported"
    try:
        RULES.check_key(key)
    except KeyRefused as exc:
        return str(exc)
    return None


def _check_shape(pattern: bytes) -> None:
    try:
        RULES.check_shape(pattern)
        if not pattern.startswith(SECRET):
            RULES.check_key(pattern)  # the '!' rules of a public pattern are those of a key
    except KeyRefused as exc:
        raise ConfigError(str(exc)) from None
