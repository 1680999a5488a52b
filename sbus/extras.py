"""Which optional part of sbus needs which third-party module, so that a command whose
extra is not installed says, in one line, what to install instead of ending in a
traceback.  The extras themselves are declared in pyproject.toml; a test keeps the two in
step.

The command named installs the extra into *this* sbus, from where it came: its source
tree (``pip install '/src/sbus[fuse]'``) or the wheel it was installed from.  Never
``sbus[fuse]`` from the package index: that name is another project there.
"""

from __future__ import annotations

import json
import os
import shlex
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

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


def _checkout(directory: Path) -> bool:
    """Whether *directory* is an sbus source tree (its pyproject.toml names sbus)."""
    try:
        text = (directory / "pyproject.toml").read_text()
    except OSError:
        return False
    return 'name = "sbus"' in text


def _installed_from() -> tuple[str, bool] | None:
    """(source tree or wheel, editable) this sbus was installed from, as pip recorded it
    (PEP 610 ``direct_url.json``), if that is still there."""
    try:
        text = metadata.distribution("sbus").read_text("direct_url.json")
        record = json.loads(text or "null")
    except (metadata.PackageNotFoundError, ValueError):
        return None
    if not isinstance(record, dict) or not str(record.get("url", "")).startswith("file:"):
        return None
    path = unquote(urlsplit(record["url"]).path)
    editable = bool((record.get("dir_info") or {}).get("editable"))
    return (path, editable) if os.path.exists(path) else None


def install_command(extra: str) -> str:
    """The one spelling of "add *extra* to this sbus": ``pip install '<source>[extra]'``
    with the source tree the running code is in, else the source tree or wheel pip
    installed it from, else ``'.[extra]'`` to be run in the sbus source tree."""
    here = Path(__file__).resolve().parent.parent
    recorded = _installed_from()
    if _checkout(here):
        editable = recorded is not None and recorded[1] and Path(recorded[0]) == here
        source: tuple[str, bool] | None = (str(here), editable)
    else:
        source = recorded
    if source is None:
        return f"pip install '.[{extra}]' in the sbus source tree"
    return f"pip install {'-e ' if source[1] else ''}{shlex.quote(f'{source[0]}[{extra}]')}"


def missing_extra_message(command: str, exc: ImportError) -> str | None:
    """One line for the user, or None if *exc* is not a missing extra (a real bug)."""
    extra = missing_extra(exc)
    if extra is None:
        return None
    return (f"{command}: needs the '{extra}' extra, which is not installed: "
            f"{install_command(extra)} (no module named {exc.name!r})")
