"""Man pages, one per command, written from the argparse definitions (so they never
disagree with ``--help``): sbus(1), sbus-COMMAND(1) for each subcommand, sbus-top(1).

``python -m sbus.manpages DIR`` (or `write_manpages`) writes them; the Debian package
installs them.  What a page says beyond the options is in `MANUAL`, written for users.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, date, datetime
from pathlib import Path

from .defaults import DEFAULT_ADDRESS
from .manual import MANUAL

__all__ = ["write_manpages", "manpage", "escape"]

_EXIT = [("0", "success"),
         ("1", "an error, said in one line on standard error (no broker, refused, timed out)"),
         ("2", "a wrong command line (argparse's usage message)"),
         ("130", "interrupted with Ctrl-C")]


def escape(text: str) -> str:
    """Text for a roff line: backslashes and hyphens escaped, no line starting with a
    control character (``.`` or ``'``)."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    lines = [("\\&" + line if line.startswith((".", "'")) else line)
             for line in text.splitlines()]
    return "\n".join(lines)


def _built() -> date:
    """The date on the pages: $SOURCE_DATE_EPOCH when a package build sets it
    (reproducible builds), else today."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "")
    if epoch.isdigit():
        return datetime.fromtimestamp(int(epoch), UTC).date()
    return date.today()


def _flags(action: argparse.Action) -> str:
    value = ""
    if action.nargs != 0:
        metavar = action.metavar or action.dest.upper()
        if action.choices and not action.metavar:
            metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
        value = " \\fI" + escape(str(metavar)) + "\\fR"
    if not action.option_strings:
        return "\\fI" + escape(str(action.metavar or action.dest)) + "\\fR"
    return ", ".join("\\fB" + escape(f) + "\\fR" + value for f in action.option_strings)


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%" in text:
        fmt = parser._get_formatter()
        text = fmt._expand_help(action)
    return text


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage lines as ``--help`` shows them, wrapped at 78 columns whatever the
    terminal of the build."""
    fmt = argparse.HelpFormatter(parser.prog, width=78)
    fmt.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return fmt.format_help().strip("\n")


def manpage(name: str, parser: argparse.ArgumentParser, summary: str,
            description: str = "", see_also: list[str] | None = None,
            commands: list[tuple[str, str]] | None = None,
            examples: list[tuple[str, str]] | None = None, doc: str = "") -> str:
    """One man page in roff (man macros) for *parser*, named *name* (``sbus-sub``)."""
    from .version import version

    out = [f'.TH {escape(name.upper())} 1 "{_built():%B %Y}" '
           f'"sbus {escape(version())}" "sbus manual"',
           ".SH NAME", f"{escape(name)} \\- {escape(summary)}",
           ".SH SYNOPSIS", ".nf", escape(_usage(parser)), ".fi"]
    if description:
        out += [".SH DESCRIPTION", *(escape(p) + "\n.PP" for p in description.split("\n\n"))]
        out[-1] = out[-1].removesuffix("\n.PP")
    if commands:
        out.append(".SH COMMANDS")
        for cmd, what in commands:
            out += [".TP", f"\\fB{escape(cmd)}\\fR", escape(what)
                    + f" (see \\fBsbus\\-{escape(cmd)}\\fR(1))"]
    positionals = [a for a in parser._actions
                   if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    if positionals:
        out.append(".SH ARGUMENTS")
        for a in positionals:
            out += [".TP", _flags(a), escape(_help(a, parser))]
    options = [a for a in parser._actions if a.option_strings]
    if options:
        out.append(".SH OPTIONS")
        for a in options:
            out += [".TP", _flags(a), escape(_help(a, parser))]
    if examples:
        out.append(".SH EXAMPLES")
        for line, what in examples:
            out += [".TP", f"\\fB{escape(line)}\\fR", escape(what)]
    out += [".SH ENVIRONMENT", ".TP", "\\fBSBUS_ADDRESS\\fR",
            "the broker's socket when \\fB\\-\\-address\\fR is not given "
            f"(else {DEFAULT_ADDRESS})", ".SH EXIT STATUS"]
    for code, what in _EXIT:
        out += [".TP", code, escape(what)]
    if see_also:
        out += [".SH SEE ALSO", ", ".join(f"\\fB{escape(s)}\\fR(1)" for s in see_also)
                + (f"; docs/{escape(doc)} in the sbus sources" if doc else "")]
    return "\n".join(out) + "\n"


def pages() -> dict[str, str]:
    """File name -> man page text, for every command."""
    from .cli import COMMANDS, build_parser
    from .cmd.top import build_parser as top_parser

    parser, _ = build_parser([], everything=True)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = [f"sbus-{name}" for name in COMMANDS]
    out = {"sbus.1": manpage(
        "sbus", parser, "a small, fast publish/subscribe message bus",
        "sbus is a publish/subscribe message bus for Linux: a broker on a unix-domain "
        "SOCK_SEQPACKET socket, and clients that subscribe to routing-key patterns and "
        "publish messages the broker forwards, in order, to every matching subscriber. "
        "Each command has its own page.",
        see_also=[*names, "sbus-top"], commands=[(n, h) for n, (_, h) in COMMANDS.items()])}
    for name, (_, helptext) in COMMANDS.items():
        text, examples, doc = MANUAL.get(name, ("", [], ""))
        if name == "top":
            page, summary = top_parser(), "live traffic monitor for the bus"
        else:
            page, summary = sub.choices[name], helptext
            page.prog = f"sbus {name}"
        out[f"sbus-{name}.1"] = manpage(f"sbus-{name}", page, summary, text, ["sbus"],
                                        examples=examples, doc=doc)
    return out


def write_manpages(directory: str | Path) -> list[Path]:
    """Write every page into *directory* (created if missing); returns the files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, text in pages().items():
        path = directory / filename
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m sbus.manpages DIRECTORY", file=sys.stderr)
        return 2
    for path in write_manpages(argv[0]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
