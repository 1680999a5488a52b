"""The version of the installed package, in one place: its metadata (pyproject.toml)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["version"]


def version() -> str:
    """``0.1.0`` as installed; a source tree that was never installed says so."""
    try:
        return metadata.version("sbus")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"
