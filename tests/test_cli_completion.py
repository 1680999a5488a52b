"""Man pages and shell completion, as a user meets them: pages rendered by man(1) without
a warning, bash completion sourced into a real bash, zsh completion typed in a real zsh
(in tmux)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import SBUS

from sbus.cli import COMMANDS
from sbus.manpages import write_manpages

VENV_BIN = str(Path(sys.executable).parent)


def render(page: Path) -> tuple[str, str]:
    """What man shows for *page* (whitespace folded: lines wrap), and what it warned
    about."""
    r = subprocess.run(["man", "--warnings", "-l", str(page)], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, LC_ALL="C.UTF-8", MANWIDTH="80"))
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split()), r.stderr


def test_one_man_page_per_command_rendered_without_warnings(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764028800")  # 25 November 2025
    written = {p.name for p in write_manpages(tmp_path / "man1")}
    assert written == {"sbus.1", "sbus-top.1", *(f"sbus-{c}.1" for c in COMMANDS)}
    for name in sorted(written):
        text, warnings = render(tmp_path / "man1" / name)
        assert warnings == "", f"{name}: {warnings}"
        assert "November 2025" in text and "OPTIONS" in text and "EXIT STATUS" in text
        if name != "sbus.1":  # every command tells its story and shows an example
            assert "DESCRIPTION" in text and "EXAMPLES" in text, name
    sub, _ = render(tmp_path / "man1" / "sbus-sub.1")
    assert "sbus-sub - subscribe and print messages" in sub
    assert "--format-string FORMAT" in sub and "%t receive time" in sub
    assert "\\x1b" in sub  # a backslash in the help text survives roff
    main, _ = render(tmp_path / "man1" / "sbus.1")
    assert "sbus-request(1)" in main and "sbus-top(1)" in main
    top, _ = render(tmp_path / "man1" / "sbus-top.1")
    assert "--version" in top and "? help" in top


def test_manpages_from_the_shell(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sbus.manpages", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and (tmp_path / "sbus-serve.1").exists()
    assert len(r.stdout.splitlines()) == len(COMMANDS) + 1  # sbus-top is one page for both


BASH_PROBE = r"""
source <(sbus completion bash)
t() {
    COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMPREPLY=()
    if [[ $1 == sbus-top ]]; then _sbus_top; else _sbus; fi
    printf '%s\n' "$*=${COMPREPLY[*]}"
}
t sbus se
t sbus -
t sbus -v st
t sbus serve --sep
t sbus serve --separator ''
t sbus serve --max-message ''
t sbus completion ''
t sbus sub --format ''
t sbus sub --ti
t sbus reply key -- printen
t sbus record --dir su
t sbus-top --so
t sbus-top --sort ''
"""


def test_bash_completion_sourced_into_bash(short_tmp):
    (short_tmp / "subdir").mkdir()
    (short_tmp / "subfile").write_text("")
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ["PATH"])
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", BASH_PROBE], cwd=short_tmp,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    got = {line.split("=", 1)[0]: " ".join(sorted(set(line.split("=", 1)[1].split())))
           for line in r.stdout.splitlines()}
    assert got == {
        "sbus se": "serve",
        "sbus -": "--help --verbose --version -V -h -v",
        "sbus -v st": "status",
        "sbus serve --sep": "--separator",
        "sbus serve --separator ": ". /",
        "sbus serve --max-message ": "",  # a size: nothing to offer
        "sbus completion ": "bash zsh",
        "sbus sub --format ": "json lines raw",
        "sbus sub --ti": "--timeout --timestamps",
        "sbus reply key -- printen": "printenv",
        "sbus record --dir su": "subdir",  # directories only
        "sbus-top --so": "--sort",
        "sbus-top --sort ": "byte-rate key last rate total",
    }


def test_zsh_completion_typed_into_zsh(short_tmp):
    assert shutil.which("zsh"), "zsh is missing: tools/setup.sh installs it"
    script = short_tmp / "_sbus"
    script.write_bytes(subprocess.run([*SBUS, "completion", "zsh"], capture_output=True,
                                      check=True, timeout=30).stdout)
    base = ["tmux", "-S", str(short_tmp / "tmux.sock")]  # nothing left in /tmp
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ["PATH"], HOME=str(short_tmp),
               TERM="xterm-256color")
    env.pop("TMUX", None)
    subprocess.run([*base, "-f", "/dev/null", "new-session", "-d", "-s", "z", "-x", "120",
                    "-y", "30", "zsh -f"], check=True, env=env, cwd=short_tmp)

    def pane() -> str:
        return subprocess.run([*base, "capture-pane", "-t", "z", "-p"], capture_output=True,
                              text=True, check=True).stdout

    def send(*keys: str, literal: bool = False) -> None:
        flags = ["-l"] if literal else []
        subprocess.run([*base, "send-keys", "-t", "z", *flags, "--", *keys], check=True)

    def ends(screen: str, typed: str) -> bool:
        """The command line (its first line: the prompt, then what is typed) reads so."""
        return screen.splitlines()[0].rstrip().endswith(typed)

    def wait(ok, what: str) -> str:
        deadline = time.monotonic() + 15
        while not ok(text := pane()):
            assert time.monotonic() < deadline, f"zsh never showed {what}:\n{text}"
            time.sleep(0.1)
        return text

    try:
        send(f"autoload -Uz compinit && compinit -u -D && source {script} && echo load-ok",
             "Enter")
        wait(lambda s: "\nload-ok" in s, "the script loaded")
        send("clear", "Enter")
        # Typed ahead of the cleared prompt, the keys are echoed by the tty and then
        # redrawn: wait until the screen holds the bare prompt alone.
        wait(lambda s: "load-ok" not in s and len([ln for ln in s.splitlines() if ln.strip()]) == 1,
             "the cleared prompt")
        send("sbus se", "Tab")
        wait(lambda s: ends(s, "sbus serve"), "'serve' completed")
        send("--sep", literal=True)
        send("Tab")
        wait(lambda s: ends(s, "sbus serve --separator"), "'--separator' completed")
        send("Tab")
        wait(lambda s: s.splitlines()[1].split() == [".", "/"], "the separators listed")
        send("C-u", "sbus completion ", "Tab")
        wait(lambda s: any(line.split() == ["bash", "zsh"] for line in s.splitlines()),
             "the shells listed")
        send("C-u", "sbus-top --sort ", "Tab")
        wait(lambda s: "byte-rate" in s and "total" in s, "sbus-top's sort columns")
        assert "command not found" not in pane() and "_arguments:" not in pane()
    finally:
        subprocess.run([*base, "kill-server"], capture_output=True)


def test_manpages_and_completion_need_no_optional_part(tmp_path):
    """A package build may lack FUSE and Spark: the pages and scripts come from the
    argparse definitions alone (importing pyfuse3 or pyspark here fails)."""
    code = ("import sys; sys.modules.update(pyfuse3=None, pyspark=None, pyarrow=None, paho=None)\n"
            "from sbus.manpages import write_manpages\n"
            "from sbus import completion\n"
            f"print(len(write_manpages({str(tmp_path)!r})), len(completion.bash()) > 0, "
            "len(completion.zsh()) > 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(len(COMMANDS) + 1), "True", "True"]
