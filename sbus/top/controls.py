"""Keyboard handling for ``sbus-top``, sans-IO: key strings in, view changes and actions out.

The terminal side (`sbus.top.terminal`) only turns bytes from stdin into key strings;
what a key *means* lives here, so it can be tested without a terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .model import CLIENTS_PANE, KEYS_PANE, ViewOptions

__all__ = ["Action", "Controls", "split_keys", "FOOTER_KEYS", "HELP", "MAX_DEPTH"]

MAX_DEPTH = 16
ESC = "\x1b"
ENTER = ("\r", "\n")
BACKSPACE = ("\x7f", "\x08")

#: (key, what it does) as the footer shows them.
FOOTER_KEYS = [("q", "quit"), ("p", "pause"), ("s", "sort"), ("/", "filter"),
               ("g", "group"), ("+/-", "depth"), ("c", "clear"), ("?", "help")]

#: The help screen (`?`): every key, what it does.
HELP = [("q, Ctrl-C", "quit"),
        ("p", "pause the screen (counting goes on); p again resumes"),
        ("s", "next sort column: msg/s, bytes/s, total, last seen, key"),
        ("r", "reverse the sort"),
        ("/", "filter keys: text matches anywhere, '*' or a trailing '/' makes a pattern;"
              " Enter keeps it, Esc puts the old one back"),
        ("g", "group keys by their first segment, or stop grouping"),
        ("+ / -", "group by more / fewer segments"),
        ("c", "clear the counters, the history and the recent messages"),
        ("Tab", "switch between the keys and the clients the broker lets you see"
                " (* marks this sbus-top)"),
        ("↑ ↓ j k", "scroll one row"),
        ("PgUp PgDn", "scroll one page"),
        ("Home End", "go to the first / last row"),
        ("?", "this help; any key closes it")]

UP, DOWN = ("\x1b[A", "\x1bOA", "k"), ("\x1b[B", "\x1bOB", "j")
PAGE_UP, PAGE_DOWN = ("\x1b[5~",), ("\x1b[6~", " ")
HOME, END = ("\x1b[H", "\x1b[1~", "\x1bOH"), ("\x1b[F", "\x1b[4~", "\x1bOF")
#: Scrolling to the end: the model moves this back to the last full page.
BOTTOM = 1 << 30


class Action(Enum):
    NONE = 0  # nothing visible changed
    REDRAW = 1  # the view changed: draw now rather than at the next tick
    CLEAR = 2  # forget all counters
    QUIT = 3


def split_keys(data: str) -> list[str]:
    """Split what one ``read`` returned into keys; an escape sequence (arrows, function
    keys: ``ESC [ ... final``) is one key, a lone ESC is the Escape key."""
    keys: list[str] = []
    i, n = 0, len(data)
    while i < n:
        ch = data[i]
        if ch == ESC and i + 1 < n and data[i + 1] in "[O":
            j = i + 2
            while j < n and not ("@" <= data[j] <= "~"):
                j += 1
            keys.append(data[i : j + 1])
            i = j + 1
            continue
        keys.append(ch)
        i += 1
    return keys


@dataclass
class Controls:
    """The interactive state: view options, pause, and a filter being typed."""

    options: ViewOptions = field(default_factory=ViewOptions)
    paused: bool = False
    editing: bool = False  # typing a filter after '/'
    helping: bool = False  # the help screen is up
    page: int = 10  # table rows on the screen: what PgUp/PgDn move (the screen sets it)
    _saved_filter: str = ""

    def press(self, key: str) -> Action:
        if self.editing:
            return self._edit(key)
        if self.helping:
            self.helping = False
            return Action.QUIT if key in ("q", "Q") else Action.REDRAW
        if key in ("q", "Q"):
            return Action.QUIT
        if key == "?":
            self.helping = True
            return Action.REDRAW
        if self._scroll(key):
            return Action.REDRAW
        if key == "r":
            self.options.reverse = not self.options.reverse
            self.options.scroll = 0
            return Action.REDRAW
        if key == "\t":
            self.options.pane = CLIENTS_PANE if self.options.pane == KEYS_PANE else KEYS_PANE
            self.options.scroll = 0
            return Action.REDRAW
        if key == "p":
            self.paused = not self.paused
            return Action.REDRAW
        if key == "s":
            self.options.sort = self.options.sort.next()
            self.options.scroll = 0
        elif key == "/":
            self.editing = True
            self._saved_filter = self.options.filter
        elif key == "g":
            self.options.depth = 0 if self.options.depth else 1
        elif key in ("+", "="):
            self.options.depth = min(self.options.depth + 1, MAX_DEPTH)
        elif key in ("-", "_"):
            self.options.depth = max(self.options.depth - 1, 0)
        elif key == "c":
            return Action.CLEAR
        else:
            return Action.NONE
        return Action.REDRAW

    def _scroll(self, key: str) -> bool:
        opts = self.options
        step = {**dict.fromkeys(UP, -1), **dict.fromkeys(DOWN, 1),
                **dict.fromkeys(PAGE_UP, -self.page), **dict.fromkeys(PAGE_DOWN, self.page)}
        if key in step:
            opts.scroll = max(0, opts.scroll + step[key])
        elif key in HOME:
            opts.scroll = 0
        elif key in END:
            opts.scroll = BOTTOM
        else:
            return False
        return True

    def _edit(self, key: str) -> Action:
        """The filter applies as it is typed; Enter keeps it, Escape puts the old one back."""
        if key in ENTER:
            self.editing = False
        elif key == ESC:
            self.editing = False
            self.options.filter = self._saved_filter
        elif key in BACKSPACE:
            self.options.filter = self.options.filter[:-1]
        elif len(key) == 1 and key.isprintable():
            self.options.filter += key
        else:
            return Action.NONE
        return Action.REDRAW
