"""The terminal side of ``sbus-top``: cbreak mode that is always undone, and key reading.

Kept apart from the model and the view so that everything that touches a tty is in
one small place; `sbus.top.controls` decides what the keys mean.
"""

from __future__ import annotations

import os
import termios
import tty
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from .controls import split_keys

__all__ = ["cbreak", "read_keys"]


@contextmanager
def cbreak(fd: int) -> Iterator[None]:
    """Keys arrive one by one, unechoed, while inside; the terminal's settings are put back
    exactly as they were on the way out, whatever the way out is (``q``, Ctrl-C, a crash).
    Ctrl-C still interrupts: cbreak keeps signal characters."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def read_keys(fd: int) -> list[str]:
    """The keys typed since the last call (waits for at least one); ``[]`` at end of input."""
    await trio.lowlevel.wait_readable(fd)
    data = os.read(fd, 1024)
    if not data:
        return []
    return split_keys(data.decode("utf-8", "replace"))
