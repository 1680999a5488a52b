"""sbus completion bash|zsh: print the shell completion script (sbus/completion.py)."""

from __future__ import annotations

import argparse
import sys

from .. import completion


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=completion.SHELLS,
                   help="bash: source <(sbus completion bash); zsh: source <(sbus completion "
                        "zsh) after compinit")


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(getattr(completion, args.shell)())
    return 0
