"""`sbus install-units`: what it writes, `systemd-analyze verify`, and bad input."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sbus import units
from sbus.units import Installation

REPO = Path(__file__).resolve().parent.parent
SBUS_EXE = Path(sys.executable).parent / "sbus"
NAMES = ["sbus.socket", "sbus.service", "sbus-mount.service", "sbus-record.service"]
ANALYZE = shutil.which("systemd-analyze")


def install(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(SBUS_EXE), "install-units", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=60)


def test_the_units_have_one_source():
    """sbus/units.py is the template; no rendered copy is kept in the tree to drift (the
    Debian build writes them: debian/rules runs install-units --exec /usr/bin/sbus)."""
    assert not (REPO / "units").exists()
    assert "install-units --exec /usr/bin/sbus" in (REPO / "debian" / "rules").read_text()


@pytest.mark.parametrize("scope", ["system", "user"])
def test_installed_units_verify_clean(short_tmp: Path, scope: str) -> None:
    unit_dir = short_tmp / scope
    flags = ["--user"] if scope == "user" else []
    done = install(*flags, "--unit-dir", str(unit_dir))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:4] == [f"wrote {unit_dir / n}" for n in NAMES]
    assert "daemon-reload" not in done.stdout  # not the manager's own directory
    service = (unit_dir / "sbus.service").read_text()
    idle = " --exit-idle-time 10min" if scope == "user" else ""
    assert f"ExecStart={SBUS_EXE} serve{idle}\n" in service
    runtime = short_tmp / "xdg"
    runtime.mkdir(mode=0o700)
    names = NAMES + ([] if flags else ["sbus-gateway.service"])
    verify = subprocess.run([ANALYZE, *flags, "verify", *(str(unit_dir / n) for n in names)],
                            capture_output=True, text=True, cwd=unit_dir, timeout=60,
                            env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert (verify.returncode, verify.stderr, verify.stdout) == (0, "", "")


def test_unit_contents() -> None:
    inst = Installation("/opt/sbus/bin/sbus", world_readable=True, under_home=False)
    system = units.render(inst, user=False)
    user = units.render(inst, user=True)
    assert "ListenSequentialPacket=/run/sbus.socket\n" in system["sbus.socket"]
    assert "SocketMode=0666\n" in system["sbus.socket"]
    assert "ListenSequentialPacket=%t/sbus.socket\n" in user["sbus.socket"]
    assert "SocketMode=0600\n" in user["sbus.socket"]
    assert "\nExecStart=/opt/sbus/bin/sbus serve\n" in system["sbus.service"]  # stays up
    assert "\nExecStart=/opt/sbus/bin/sbus serve --exit-idle-time 10min\n" in user["sbus.service"]
    for text in (system["sbus.service"], user["sbus.service"]):
        for line in ("Type=notify", "NotifyAccess=main", "Restart=on-failure",
                     "NoNewPrivileges=yes", "After=sbus.socket"):
            assert f"\n{line}\n" in text
        assert "\nPrivateUsers=" not in text  # it would remap what SO_PEERCRED reports
    for line in ("DynamicUser=yes", "ProtectSystem=strict", "PrivateTmp=yes", "ProtectHome=yes"):
        assert f"\n{line}\n" in system["sbus.service"]
    # In a user manager these would need a user namespace (PrivateUsers=): none of them.
    for option in ("ProtectSystem=", "PrivateTmp=", "ProtectHome=", "PrivateDevices=",
                   "DynamicUser="):
        assert f"\n{option}" not in user["sbus.service"]
    assert "ExecStart=/opt/sbus/bin/sbus mount /mnt/sbus\n" in system["sbus-mount.service"]
    assert "After=sbus.socket\n" in system["sbus-mount.service"]
    assert "Environment=SBUS_ADDRESS=%t/sbus.socket\n" in user["sbus-mount.service"]
    for scope, text in (("system", system), ("user", user)):
        record = text["sbus-record.service"]
        assert ('\nExecStart=/opt/sbus/bin/sbus record "" --dir %S/sbus/journal '
                f"{units.RECORD_RETENTION}\n") in record, scope
        assert "\nStateDirectory=sbus\n" in record and "\nAfter=sbus.socket\n" in record
    assert "Environment=SBUS_ADDRESS=%t/sbus.socket\n" in user["sbus-record.service"]
    assert "\nDynamicUser=yes\n" in system["sbus-record.service"]
    gateway = system["sbus-gateway.service"]
    assert "\nExecStart=/opt/sbus/bin/sbus gateway --listen [::]:7443 \\\n" in gateway
    assert "\nLoadCredential=auth-key:/etc/sbus/gateway/auth-key\n" in gateway
    assert "\nRestrictAddressFamilies=AF_UNIX AF_INET AF_INET6\n" in gateway
    assert "\nPrivateNetwork=" not in gateway and "\nDynamicUser=yes\n" in gateway
    assert "sbus-gateway.service" not in user  # its secrets are root's files
    # '%' in a path is not taken for a systemd specifier
    odd = units.render(Installation("/opt/50%/bin/sbus", True, False), user=False)
    assert "\nExecStart=/opt/50%%/bin/sbus serve\n" in odd["sbus.service"]


def test_installation_not_readable_by_others_runs_as_root(short_tmp: Path) -> None:
    exe = short_tmp / "bin" / "sbus"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    short_tmp.chmod(0o755)
    assert units.this_installation(str(exe)).world_readable
    short_tmp.chmod(0o700)  # like a virtualenv in /root
    private = units.this_installation(str(exe))
    assert not private.world_readable
    service = units.render(private, user=False)["sbus.service"]
    assert "\nDynamicUser=" not in service
    short_tmp.chmod(0o755)
    # Anything below a home directory keeps ProtectHome= from hiding it.
    home = Installation("/root/venv/bin/sbus", world_readable=False, under_home=True)
    assert "\nProtectHome=read-only\n" in units.render(home, user=False)["sbus.service"]
    assert units.this_installation("/home/ann/venv/bin/sbus").under_home


def test_root_option_installs_below_a_tree(short_tmp: Path) -> None:
    done = install("--root", str(short_tmp / "img"), "--exec", "/usr/bin/sbus")
    assert done.returncode == 0, done.stderr
    target = short_tmp / "img" / "etc" / "systemd" / "system"
    assert sorted(p.name for p in target.iterdir()) == sorted([*NAMES, "sbus-bridge@.service",
                                                              "sbus-gateway.service"])
    assert "ExecStart=/usr/bin/sbus serve\n" in (target / "sbus.service").read_text()
    for p in target.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
    user = install("--user", "--root", str(short_tmp / "img"),
                   env={"XDG_CONFIG_HOME": "/home/ann/.config"})
    assert user.returncode == 0, user.stderr
    assert (short_tmp / "img/home/ann/.config/systemd/user/sbus.socket").is_file()


def test_bad_input_is_a_clear_error_and_writes_nothing(short_tmp: Path) -> None:
    # --exec must be absolute
    done = install("--unit-dir", str(short_tmp / "a"), "--exec", "bin/sbus")
    assert done.returncode == 1
    assert done.stderr == "sbus install-units: --exec must be an absolute path without " \
        "spaces, not 'bin/sbus'\n"
    assert not (short_tmp / "a").exists()
    # the unit directory is a file
    (short_tmp / "file").write_text("x")
    done = install("--unit-dir", str(short_tmp / "file"))
    assert done.returncode == 1
    assert done.stderr.startswith(f"sbus install-units: cannot create {short_tmp / 'file'}: ")
    assert "Traceback" not in done.stderr
    # one target is in the way: nothing at all is written, no temporary file left
    d = short_tmp / "units"
    (d / "sbus.service").mkdir(parents=True)
    done = install("--unit-dir", str(d))
    assert done.returncode == 1
    assert done.stderr.startswith(f"sbus install-units: cannot read {d / 'sbus.service'}: ")
    assert sorted(p.name for p in d.iterdir()) == ["sbus.service"]
