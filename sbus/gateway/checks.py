"""What remote clients may subscribe and publish to (pure): the broker's key rules, with
its separator, plus the gateway's own refusals (NUL, secret keys both ways)."""

from __future__ import annotations

from ..display import brief
from ..errors import InvalidRequest
from ..keys import Credentials, KeyRefused, KeyRules
from . import notices

__all__ = ["FrameRefused", "SharesFull", "check_key", "check_pattern"]

_NOBODY = Credentials(0, 0, 0)  # check_pattern needs some; secret patterns never get there


class FrameRefused(InvalidRequest):
    """A remote client's frame refused; the connection stays (the message says why,
    quoting briefly)."""


class SharesFull(FrameRefused):
    """A subscription refused because a share that other clients draw on is full (its
    address's, the unauthenticated clients', the gateway's): a state that changes, so
    the client is told the only way the protocol has, a disconnect after the refusal
    delay, and its library subscribes again when it reconnects."""


def _check_common(rules: KeyRules, topic: bytes, what: str) -> None:
    if b"\0" in topic:
        raise FrameRefused(f"{what} {brief(topic)} refused: it contains NUL, which sbus "
                           "keys cannot")
    if topic.startswith(notices.TOPIC):
        raise FrameRefused(f"{what} {brief(topic)} refused: the gateway's notices are its "
                           "own (subscribe to the topic itself to get them)")
    if rules.is_secret(topic):
        raise FrameRefused(f"{what} {brief(topic)} refused: it is a secret "
                           f"({rules.secret_prefix.decode('latin-1')}) key, which remote "
                           "clients may not use")


def check_pattern(rules: KeyRules, topic: bytes) -> None:
    """Raise `FrameRefused` unless remote clients may subscribe to *topic*."""
    _check_common(rules, topic, "subscription to")
    try:
        rules.check_pattern(topic, _NOBODY)
    except KeyRefused as exc:
        raise FrameRefused(f"subscription refused: {exc}") from None


def check_key(rules: KeyRules, topic: bytes) -> None:
    """Raise `FrameRefused` unless remote clients may publish to *topic*."""
    _check_common(rules, topic, "publish to")
    try:
        rules.check_key(topic)
    except KeyRefused as exc:
        raise FrameRefused(f"publish refused: {exc}") from None
