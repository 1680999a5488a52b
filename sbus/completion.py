"""Shell completion for ``sbus`` and ``sbus-top``, written from the argparse definitions.

`options` reads the parsers once into plain data (commands, their options, what kind of
value each takes); `bash` and `zsh` turn that into a script.  Keys and patterns are the
user's own, so they complete to nothing; files, directories and choices complete.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["Option", "Command", "commands", "bash", "zsh", "SHELLS"]

SHELLS = ("bash", "zsh")
_FILES = {"PATH", "FILE", "CERT", "KEYFILE"}
_DIRS = {"DIR", "MOUNTPOINT"}


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]  # empty for a positional
    help: str
    metavar: str
    takes: str  # "" (a flag), "text", "file", "dir", "choice", "command"
    choices: tuple[str, ...] = ()
    repeat: bool = False
    optional: bool = False  # a positional that may be left out


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    options: tuple[Option, ...]


def _kind(action: argparse.Action) -> tuple[str, tuple[str, ...]]:
    if action.nargs == 0:
        return "", ()
    if action.choices:
        return "choice", tuple(str(c) for c in action.choices)
    metavar = str(action.metavar or action.dest).upper()
    if metavar in _FILES or action.dest in ("address", "svg") or "file" in action.dest:
        return "file", ()
    if metavar in _DIRS or action.dest in ("dir", "mountpoint", "journal"):
        return "dir", ()
    if action.dest == "program":
        return "command", ()
    return "text", ()


def _options(parser: argparse.ArgumentParser) -> tuple[Option, ...]:
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            continue
        takes, choices = _kind(a)
        metavar = a.metavar if isinstance(a.metavar, str) else a.dest.upper()
        repeat = isinstance(a, argparse._AppendAction | argparse._CountAction) or \
            a.nargs in ("+", "*")
        out.append(Option(tuple(a.option_strings), a.help or "", metavar, takes, choices,
                          repeat, optional=a.nargs in ("?", "*")))
    return tuple(out)


def commands() -> tuple[tuple[Option, ...], list[Command], tuple[Option, ...]]:
    """(sbus's own options, its commands, sbus-top's options)."""
    from .cli import COMMANDS, build_parser
    from .cmd.top import build_parser as top_parser

    parser, _ = build_parser([], everything=True)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmds = [Command(name, COMMANDS[name][1], _options(p)) for name, p in sub.choices.items()]
    return _options(parser), cmds, _options(top_parser())


# -- bash ---------------------------------------------------------------------------------

def _bash_quote(words) -> str:
    return "'" + " ".join(words).replace("'", "'\\''") + "'"


def _value(o: Option) -> str:
    return "words:" + " ".join(o.choices) if o.takes == "choice" else o.takes


def _bash_case(name: str, opts: tuple[Option, ...]) -> list[str]:
    flags = [f for o in opts for f in o.flags]
    lines = [f"        {name}) opts={_bash_quote(flags)}"]
    kinds: dict[str, list[str]] = {}
    for o in opts:
        if o.flags and o.takes:
            kinds.setdefault(_value(o), []).extend(o.flags)
    if kinds:
        lines.append("            case $prev in")
        lines += [f"                {'|'.join(fl)}) value={_bash_quote([v])} ;;"
                  for v, fl in kinds.items()]
        lines.append("            esac")
    positional = next((o for o in opts if not o.flags), None)
    if positional is not None:
        lines.append(f"            first={_bash_quote([_value(positional)])}")
    lines.append("            ;;")
    return lines


def bash() -> str:
    """The bash script: ``source <(sbus completion bash)``, or install it as
    /usr/share/bash-completion/completions/sbus (and a link named sbus-top)."""
    top_opts, cmds, top = commands()
    names = [c.name for c in cmds]
    out = [
        "# bash completion for sbus and sbus-top (written by `sbus completion bash`)",
        "_sbus_complete() {",
        "    # $1: the command ('' before one is typed), $2: the word, $3: the one before",
        "    local cur=$2 prev=$3 opts='' value='' first=''",
        '    case "$1" in',
        *_bash_case('""', top_opts),
        *[line for c in cmds for line in _bash_case(c.name, c.options)],
        *_bash_case("_top", top),
        "    esac",
        '    [[ -z $value && $cur != -* && -n $1 ]] && value=$first',
        '    if [[ -n $value && $value != text && ( $prev == -* || $cur != -* ) ]]; then',
        '        case $value in',
        '            words:*) COMPREPLY=($(compgen -W "${value#words:}" -- "$cur")) ;;',
        '            file) COMPREPLY=($(compgen -f -- "$cur")) ;;',
        '            dir) COMPREPLY=($(compgen -d -- "$cur")) ;;',
        '            command) COMPREPLY=($(compgen -c -- "$cur")) ;;',
        "        esac",
        "        return",
        "    fi",
        '    [[ $value == text && $prev == -* ]] && return',
        '    if [[ $cur == -* || -n $1 ]]; then',
        '        COMPREPLY=($(compgen -W "$opts" -- "$cur"))',
        "    else",
        f'        COMPREPLY=($(compgen -W {_bash_quote(names)} -- "$cur"))',
        "    fi",
        "}",
        "_sbus() {",
        "    COMPREPLY=()",
        "    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd='' i",
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        case ${COMP_WORDS[i]} in',
        "            -*) ;;",
        "            *) cmd=${COMP_WORDS[i]}; break ;;",
        "        esac",
        "    done",
        "    # after `sbus reply KEY --` comes a command line of its own",
        '    if [[ $cmd == reply ]]; then',
        "        for ((i = 2; i < COMP_CWORD; i++)); do",
        '            [[ ${COMP_WORDS[i]} == -- ]] && { COMPREPLY=($(compgen -c -- "$cur")); '
        "return; }",
        "        done",
        "    fi",
        '    _sbus_complete "$cmd" "$cur" "$prev"',
        "}",
        "_sbus_top() {",
        "    COMPREPLY=()",
        '    _sbus_complete _top "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"',
        "}",
        "complete -o filenames -F _sbus sbus",
        "complete -o filenames -F _sbus_top sbus-top",
    ]
    return "\n".join(out) + "\n"


# -- zsh ----------------------------------------------------------------------------------

def _zq(text: str) -> str:
    """Text for inside a single-quoted _arguments spec."""
    return text.replace("'", "'\\''")


def _zdesc(text: str) -> str:
    """A description for ``[...]``: brackets escaped, one short line."""
    text = " ".join(text.split())
    text = text.split("; ")[0].split(" (")[0] if len(text) > 70 else text
    return text.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]")


def _zaction(o: Option) -> str:
    metavar = _zq(o.metavar.replace(":", " "))
    action = {"file": "_files", "dir": "_files -/", "command": "_command_names -e",
              "choice": "(" + " ".join(_zq(c).replace(" ", "\\ ") for c in o.choices) + ")",
              "text": " "}.get(o.takes, " ")
    return f":{metavar}:{action}"


def _zspecs(opts: tuple[Option, ...]) -> list[str]:
    specs = []
    for o in opts:
        if not o.flags:
            if o.takes == "command":
                specs.append("'*::command:_normal'")
            else:
                lead = "*" if o.repeat else ":" if o.optional else ""
                specs.append(f"'{lead}{_zaction(o)}'")
            continue
        tail = f"[{_zq(_zdesc(o.help))}]" + (_zaction(o) if o.takes else "")
        final = o.flags[0] in ("-h", "-V", "--help", "--version")
        if len(o.flags) > 1:
            lead = "'(- *)'" if final else "'*'" if o.repeat else f"'({' '.join(o.flags)})'"
            specs.append(f"{lead}{{{','.join(o.flags)}}}'{tail}'")
        else:
            lead = "(- *)" if final else "*" if o.repeat else ""
            specs.append(f"'{lead}{o.flags[0]}{tail}'")
    return specs


def _zfunction(name: str, opts: tuple[Option, ...]) -> list[str]:
    body = " \\\n    ".join(["_arguments -S", *_zspecs(opts)])
    return [f"{name}() {{", f"    {body}", "}"]


def zsh() -> str:
    """The zsh script: ``source <(sbus completion zsh)`` after compinit, or install it as
    _sbus in a directory of $fpath (/usr/share/zsh/vendor-completions)."""
    top_opts, cmds, top = commands()
    out = ["#compdef sbus sbus-top", "# zsh completion for sbus and sbus-top "
           "(written by `sbus completion zsh`)", ""]
    for c in cmds:
        out += _zfunction(f"_sbus_cmd_{c.name.replace('-', '_')}", c.options)
    out += _zfunction("_sbus_cmd__top", top)
    described = "\n".join(f"        '{c.name}:{_zq(_zdesc(c.help))}'" for c in cmds)
    cases = "\n".join(f"        {c.name}) _sbus_cmd_{c.name.replace('-', '_')} ;;"
                      for c in cmds)
    main_specs = " \\\n        ".join(_zspecs(top_opts))
    out += [
        "_sbus() {",
        "    local curcontext=$curcontext state line ret=1",
        '    if [[ $service == sbus-top ]]; then _sbus_cmd__top; return; fi',
        f"    _arguments -C \\\n        {main_specs} \\\n"
        "        '1:command:->command' '*::argument:->argument' && ret=0",
        "    case $state in",
        "    command)",
        "        local -a cmds",
        f"        cmds=(\n{described}\n        )",
        "        _describe -t commands 'sbus command' cmds && ret=0 ;;",
        "    argument)",
        "        case $line[1] in",
        cases,
        "        esac ;;",
        "    esac",
        "    return ret",
        "}",
        "",
        'if [[ $funcstack[1] == _sbus ]]; then',
        '    _sbus "$@"',
        "else",
        "    compdef _sbus sbus sbus-top",
        "fi",
    ]
    return "\n".join(out) + "\n"
