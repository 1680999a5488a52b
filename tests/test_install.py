"""The README's quick path, for real: the wheel and sdist that ``python -m build`` makes
pass ``twine check``; the wheel installs into a new virtualenv with no compiler and no
pkg-config on PATH, from wheels only (``--no-index --only-binary=:all:``); the broker,
``sbus sub`` and ``sbus pub`` from it work; and each command whose extra is missing says
in one line which extra to install."""

from __future__ import annotations

import logging
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import stop_process, wait_for_socket

from sbus.extras import MODULE_EXTRA

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("sbus", "pyproject.toml", "README.md", "MANIFEST.in", "docs")
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "pkg-config")


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=kw.pop("timeout", 600), **kw)
    assert done.returncode == 0, f"{' '.join(map(str, argv))}:\n{done.stdout}{done.stderr}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """``python -m build`` of a copy of the tree (an in-tree build leaves build/ behind)."""
    base = tmp_path_factory.mktemp("build")
    src = base / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, src / name)
    _run([sys.executable, "-m", "build", "--outdir", str(base / "dist"), str(src)])
    return base / "dist"


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory) -> Iterator[tuple[Path, dict[str, str]]]:
    """A new virtualenv with the core installed from wheels alone, and the environment
    to run it in: PATH without any compiler, pip's own configuration ignored."""
    base = tmp_path_factory.mktemp("venv")
    wheel = next(dist.glob("sbus-*.whl"))
    wheelhouse = base / "wheelhouse"
    # Every dependency of the core must exist as a wheel: that is what "no compiler" means.
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
          "--dest", str(wheelhouse), str(wheel)])
    tools = base / "tools"  # what PATH offers besides the venv: a shell and no compiler
    tools.mkdir()
    for tool in ("sh", "cat", "sleep"):
        os.symlink(shutil.which(tool), tools / tool)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{base / 'venv' / 'bin'}:{tools}", PIP_CONFIG_FILE=os.devnull,
               SBUS_ADDRESS=str(base / "bus.socket"))
    for compiler in COMPILERS:
        assert shutil.which(compiler, path=env["PATH"]) is None
    _run([sys.executable, "-m", "venv", str(base / "venv")], env=env)
    _run(["pip", "install", "--quiet", "--no-index", "--only-binary=:all:",
          "--find-links", str(wheelhouse), "sbus"], env=env, cwd=base)
    yield base / "venv", env


def test_wheel_and_sdist_pass_twine_check(dist: Path):
    files = sorted(p.name for p in dist.iterdir())
    with open(REPO / "pyproject.toml", "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert files == [f"sbus-{version}-py3-none-any.whl", f"sbus-{version}.tar.gz"]
    out = _run([sys.executable, "-m", "twine", "check", "--strict",
                *map(str, dist.iterdir())]).stdout
    assert out.count("PASSED") == 2, out
    with tarfile.open(dist / f"sbus-{version}.tar.gz") as sdist:
        names = set(sdist.getnames())
    for name in ("sbus/cli.py", "docs/systemd.md", "sbus/units.py", "README.md"):
        assert f"sbus-{version}/{name}" in names, name


def test_the_core_installs_without_heavy_dependencies(venv):
    path, env = venv
    listed = _run(["pip", "list", "--format=freeze"], env=env).stdout.lower()
    names = {line.split("==")[0] for line in listed.split()}
    assert "sbus" in names and "trio" in names
    for heavy in ("numpy", "rich", "systemd-python", "pyfuse3", "pyspark", "h11"):
        assert heavy not in names, f"{heavy} came with the core install"


QUICK_PATH = ("sbus serve &\n", "sbus sub 'greetings/*' &\n", "sbus pub greetings/world hello\n",
              "pip install .\n")


def test_the_readme_shows_the_quick_path_tested_here():
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## Set up a machine")]
    for line in QUICK_PATH:
        assert line in quick, line


def test_quick_path_serve_sub_pub(venv):
    """README: `sbus serve &`, `sbus sub 'greetings/*' &`, `sbus pub greetings/world hello`."""
    path, env = venv
    serve = subprocess.Popen(["sbus", "serve"], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sub = None
    try:
        wait_for_socket(env["SBUS_ADDRESS"], serve)
        sub = subprocess.Popen(["sbus", "sub", "greetings/*"], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        # sub's subscription is in place once the broker lists it as a client
        deadline = time.monotonic() + 10
        while "greetings/*" not in _run(["sbus", "status"], env=env).stdout:
            assert time.monotonic() < deadline, "sbus sub did not subscribe"
            time.sleep(0.05)
        _run(["sbus", "pub", "greetings/world", "hello"], env=env)
        assert select.select([sub.stdout], [], [], 10)[0], "sbus sub printed nothing"
        line = sub.stdout.readline()
        assert "greetings/world" in line and "hello" in line, line
    finally:
        stop_process(sub)
        stop_process(serve)


def test_completion_works_without_the_extras(venv):
    """Completion lists every command; one whose extra is missing just lacks options."""
    path, env = venv
    out = _run(["sbus", "completion", "bash"], env=env).stdout
    for command in ("serve", "pub", "sub", "mount", "record", "top"):
        assert command in out, command


@pytest.mark.parametrize("argv, extra", [
    (["sbus", "mount", "{tmp}"], "fuse"),
    (["sbus", "top", "--once"], "top"),
    (["sbus-top", "--once"], "top"),
    (["sbus", "record", "", "--dir", "{tmp}/journal"], "record"),
    (["sbus", "analyze", "{tmp}", "--out", "{tmp}/out"], "spark"),
    (["sbus", "gateway", "--listen", "127.0.0.1:0", "--auth-key-file", "{tmp}/key",
      "--tls-cert", "{tmp}/cert.pem", "--tls-key", "{tmp}/key.pem",
      "--https-listen", "127.0.0.1:0"], "gateway"),
])
def test_a_missing_extra_is_named_in_one_line(venv, tmp_path, argv, extra):
    path, env = venv
    if extra == "gateway":  # the core gateway runs; HTTPS needs h11
        import trustme

        cert = trustme.CA().issue_cert("127.0.0.1")
        cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
        cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
        (tmp_path / "key").write_text("secret\n")
        (tmp_path / "key").chmod(0o600)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    # the source tree it runs from (under PYTHONPATH), else the source tree's spelling (a
    # wheelhouse is no path pip records); never 'sbus[...]': another project on the index
    assert re.search(rf"pip install '(\.|/[^']+)\[{extra}\]'", done.stderr), done.stderr
    assert "'sbus[" not in done.stderr


def test_every_extra_named_to_users_is_declared():
    with open(REPO / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for module, extra in MODULE_EXTRA.items():
        assert extra in extras, f"{module}: extra {extra!r} is not in pyproject.toml"
    assert set(MODULE_EXTRA.values()) <= set(extras["all"][0][5:-1].split(","))


def test_without_the_systemd_extra_a_backgrounded_mount_logs_to_syslog(monkeypatch, tmp_path):
    """python-systemd (the 'systemd' extra) gives the journal handler when journald runs;
    without it the mount logs to syslog's socket (which journald reads), or, with neither,
    to a file it names (tests/test_cli_habits.py runs that through the command)."""
    from sbus.cmd.mount import _system_log_handler

    no_journal = str(tmp_path / "no-journal")
    try:
        from systemd.journal import JournalHandler
    except ImportError:
        pass
    else:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as journald:
            journald.bind(str(tmp_path / "journal"))
            handler = _system_log_handler(journal=str(tmp_path / "journal"))
            assert isinstance(handler, JournalHandler)
            handler.close()
    monkeypatch.setitem(sys.modules, "systemd.journal", None)  # as if not installed
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    handler = _system_log_handler(str(tmp_path / "none"), no_journal)
    assert isinstance(handler, logging.FileHandler)
    assert handler.baseFilename == str(tmp_path / "state" / "sbus" / "mount.log")
    handler.close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as syslog:
        syslog.bind(str(tmp_path / "log"))
        handler = _system_log_handler(str(tmp_path / "log"), no_journal)
        try:
            handler.handle(logging.makeLogRecord({"msg": "mounted", "levelno": logging.INFO,
                                                  "levelname": "INFO"}))
        finally:
            handler.close()
        syslog.settimeout(5)
        assert f"sbus-mount[{os.getpid()}]: mounted".encode() in syslog.recv(1000)
