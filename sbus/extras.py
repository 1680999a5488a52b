"""Which optional part of sbus needs which third-party module, so that a command whose
extra is not installed says, in one line, what to install (``pip install 'sbus[fuse]'``)
instead of ending in a traceback.  The extras themselves are declared in pyproject.toml;
a test keeps the two in step."""

from __future__ import annotations

#: top-level module -> the extra that installs it
MODULE_EXTRA: dict[str, str] = {
    "pyfuse3": "fuse",
    "rich": "top",
    "numpy": "record",
    "h11": "gateway",
    "systemd": "systemd",
    "pyspark": "spark",
    "pyarrow": "spark",
    "matplotlib": "spark",
    "pandas": "spark",
    "paho": "bridge",
}


def missing_extra(exc: ImportError) -> str | None:
    """The extra whose absence caused *exc*, or None if it is not a missing extra."""
    name = getattr(exc, "name", None) or ""
    return MODULE_EXTRA.get(name.partition(".")[0])


def missing_extra_message(command: str, exc: ImportError) -> str | None:
    """One line for the user, or None if *exc* is not a missing extra (a real bug)."""
    extra = missing_extra(exc)
    if extra is None:
        return None
    return (f"{command}: needs the '{extra}' extra, which is not installed: "
            f"pip install 'sbus[{extra}]' (no module named {exc.name!r})")
