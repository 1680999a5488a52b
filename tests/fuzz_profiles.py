"""Hypothesis budgets for the fuzz tests: brief in CI, longer by hand.

Profiles are applied per test (``@fuzz_settings``) rather than loaded globally,
so other areas' hypothesis tests keep their own settings.  The profile is
``$SBUS_FUZZ_PROFILE`` if set, else ``ci`` when ``$CI`` is true, else ``dev``;
``tools/fuzz.py --hypothesis`` uses ``long``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=150, derandomize=False, **_common)
settings.register_profile("dev", max_examples=400, **_common)
settings.register_profile("long", max_examples=20_000, **_common)


def profile_name() -> str:
    name = os.environ.get("SBUS_FUZZ_PROFILE")
    if name:
        return name
    return "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"


def fuzz_settings(**overrides) -> settings:
    """Settings for one fuzz test (usable as a decorator), from the chosen profile."""
    return settings(settings.get_profile(profile_name()), **overrides)
