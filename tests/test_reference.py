"""The generated reference pages (docs/reference/) say what the code does now: a change of
an option, a default or a client docstring without `tools/gen_reference.py` fails here."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference",
                                                  ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_are_up_to_date():
    gen = _generator()
    environment = dict(os.environ)
    pages = gen.render_all()
    assert dict(os.environ) == environment, "the generator must leave the environment alone"
    assert set(pages) == {"cli.md", "client.md", "options.md"}
    for name, text in pages.items():
        written = (ROOT / "docs" / "reference" / name).read_text()
        assert written == text, f"docs/reference/{name} is stale: run tools/gen_reference.py"


def test_every_command_and_option_is_in_the_cli_page():
    gen = _generator()
    page = gen.render_all()["cli.md"]
    with gen._fixed_environment():
        parser = gen._parser()
    for name, sub in gen._subparsers(parser).items():
        assert f"\n## sbus {name}\n" in page
        for action in sub._actions:
            for option in action.option_strings:
                assert option in page, (name, option)
