"""``sbus install-units``: write the systemd units for this installation (sbus/units.py)
into the manager's directory, or below an image's root, and tell the manager."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import units


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--user", action="store_true",
                   help="units for your user manager (systemctl --user) instead of the system")
    p.add_argument("--root", metavar="DIR", type=Path,
                   help="install below DIR, as if it were / (building an image)")
    p.add_argument("--unit-dir", metavar="DIR", type=Path,
                   help="write the units into exactly DIR (default /etc/systemd/system, "
                        "or $XDG_CONFIG_HOME/systemd/user with --user)")
    p.add_argument("--exec", dest="exec_path", metavar="PATH",
                   help="the sbus executable for ExecStart= (default: this installation's)")
    p.add_argument("--no-reload", action="store_true",
                   help="do not run 'systemctl daemon-reload' afterwards")


def run(args: argparse.Namespace) -> int:
    inst = units.this_installation(args.exec_path)
    directory = args.unit_dir or units.default_unit_dir(args.user)
    if args.root is not None:
        directory = args.root / directory.relative_to(directory.anchor)
    for path, changed in units.write_units(directory, units.render(inst, user=args.user)):
        print(f"{'wrote' if changed else 'unchanged'} {path}")
    if not inst.world_readable and not args.user:
        print("note: this installation is not readable by other users, so sbus.service "
              "runs as root instead of DynamicUser=yes")
    systemctl = " ".join(units.systemctl(args.user))
    default_place = args.root is None and args.unit_dir is None
    if default_place and not args.no_reload and units.manager_running(args.user):
        failed = units.daemon_reload(args.user)
        if failed is None:
            print(f"ran {systemctl} daemon-reload")
        else:
            print(f"warning: {systemctl} daemon-reload failed: {failed}", file=sys.stderr)
    print(f"start the bus with: {systemctl} enable --now sbus.socket")
    if args.user:
        print("clients find it with: export SBUS_ADDRESS=$XDG_RUNTIME_DIR/sbus.socket")
    return 0
