"""The ``sbus`` command.  Each subcommand lives in the module named in `COMMANDS`,
which provides ``add_arguments(parser)`` and ``run(args) -> int``; a module is only
imported when its subcommand is used (or for ``--help``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .cmd import OneLineParser, parse_command_line, run_command
from .defaults import DEFAULT_ADDRESS
from .extras import missing_extra, missing_extra_message

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("sbus.cmd.serve", "run the broker"),
    "pub": ("sbus.cmd.pub", "publish a message"),
    "sub": ("sbus.cmd.sub", "subscribe and print messages"),
    "whoami": ("sbus.cmd.whoami", "print this client's credentials path"),
    "status": ("sbus.cmd.status", "show the broker's state and the clients you may see"),
    "ping": ("sbus.cmd.ping", "measure round trips to the broker"),
    "bench": ("sbus.cmd.bench", "measure publish/subscribe throughput and latency"),
    "install-units": ("sbus.cmd.install_units", "install the systemd units for this installation"),
    "mount": ("sbus.cmd.mount", "mount the bus as a filesystem (FUSE)"),
    "top": ("sbus.cmd.top", "live traffic monitor"),
    "record": ("sbus.cmd.record", "record traffic into a journal"),
    "journal": ("sbus.cmd.journal", "read a recorded journal (cat, tail), say where it misses "
                "messages (gaps), export it as Parquet, show a query's lag"),
    "analyze": ("sbus.cmd.analyze", "analyse a journal with Spark"),
    "gateway": ("sbus.cmd.gateway", "TCP/TLS gateway for remote clients"),
    "request": ("sbus.cmd.request", "send a request and print the reply"),
    "reply": ("sbus.cmd.reply", "answer requests by running a command for each"),
    "completion": ("sbus.cmd.completion", "print a shell completion script (bash or zsh)"),
    "bridge": ("sbus.cmd.bridge", "join the bus to an MQTT broker"),
}


VERBOSE_HELP = "more log output (repeat for debug)"


class _Version(argparse.Action):
    """``--version``, looking the version up only when asked: reading the package
    metadata costs ~20 ms of start-up, which a restarting broker's clients would wait."""

    def __call__(self, parser, namespace, values, option_string=None):
        from .version import version

        print(f"sbus {version()}")
        parser.exit()


def _manual(name: str) -> str:
    """What the man page says beyond the options, for ``sbus COMMAND --help`` (pip
    installs no man pages)."""
    import textwrap

    from .manual import MANUAL

    text, examples, doc = MANUAL.get(name, ("", [], ""))
    out = textwrap.fill(text, 78) if text else ""
    if examples:
        out += "\n\nexamples:\n" + "\n".join(f"  {line}\n      {what}" for line, what in examples)
    if doc:
        out += f"\n\nmore: docs/{doc} in the sbus sources"
    return out.strip()


def build_parser(argv: list[str], *, everything: bool = False
                 ) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser, with the options of the subcommand named in *argv* (of every one for
    ``--help`` or *everything*: man pages and completion)."""
    parser = OneLineParser(prog="sbus", description="sbus: a small, fast message bus")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    parser.add_argument("-V", "--version", action=_Version, nargs=0,
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="what to do; each command has its own --help")
    modules: dict[str, object] = {}
    wanted = None if everything else next((a for a in argv if not a.startswith("-")), None)
    asked = not everything and any(a in ("-h", "--help") for a in argv)
    for name, (modname, helptext) in COMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext,
                           epilog=_manual(name) if asked and wanted == name else None,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--address", default=None, metavar="PATH",
                       help=f"broker socket (default $SBUS_ADDRESS, else {DEFAULT_ADDRESS})")
        # `sbus serve -v` as well as `sbus -v serve`: counted separately, added up in main
        p.add_argument("-v", "--verbose", dest="sub_verbose", action="count", default=0,
                       help=VERBOSE_HELP)
        if wanted in (name, None, "--help", "-h"):
            try:
                module = importlib.import_module(modname)
            except ImportError as exc:
                # man pages and completion leave out the options of a command whose
                # extra is not installed; anything else is a bug to show
                if wanted == name or (everything and missing_extra(exc) is None):
                    raise SystemExit(missing_extra_message(f"sbus {name}", exc) or
                                     f"sbus {name}: not available in this installation: "
                                     f"{exc}") from None
                continue
            module.add_arguments(p)
            modules[name] = module
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, modules = build_parser(argv)
    args = parse_command_line(parser, argv, "sbus")
    args.verbose += args.sub_verbose
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(name)s: %(message)s",
    )
    if args.command == "serve" and args.verbose == 0:
        logging.getLogger().setLevel(logging.INFO)
    return run_command(f"sbus {args.command}", modules[args.command].run, args)


if __name__ == "__main__":
    sys.exit(main())
