"""The systemd units for *this* installation of sbus: rendered from one template and
written (the command line is sbus/cmd/install_units.py).

This is the only source of the unit files (the Debian build renders them with
``--exec /usr/bin/sbus``): the ``ExecStart=`` path and two sandboxing choices depend on
where sbus is installed: a broker in a virtualenv under ``/root`` or ``/home`` cannot
run as a ``DynamicUser=`` (it could not read its own code) nor behind
``ProtectHome=yes``.

The user units deliberately avoid every option that needs a mount namespace
(``ProtectSystem=``, ``PrivateTmp=``, ...): an unprivileged user manager can only
provide those through ``PrivateUsers=``, which remaps the UIDs that
``SO_PEERCRED`` reports -- and the bus's secrets rest on those.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .defaults import DEFAULT_ADDRESS, SOCKET_MODE
from .errors import SbusError

SYSTEM_SOCKET = DEFAULT_ADDRESS
USER_SOCKET = f"%t/{os.path.basename(DEFAULT_ADDRESS)}"
SYSTEM_MOUNT_POINT = "/mnt/sbus"
USER_MOUNT_POINT = "%t/sbus-fs"
HOME_TREES = ("/home", "/root", "/run/user")


@dataclass(frozen=True)
class Installation:
    """What the units must know about the installed sbus."""

    exec_start: str  # the command line that runs ``sbus`` (without the subcommand)
    world_readable: bool  # every file it needs is readable by any user (DynamicUser= ok)
    under_home: bool  # some of it lives below /home, /root or /run/user


def _readable_by_others(path: Path) -> bool:
    """Whether a user with no relation to the owner can read *path* (checks every parent)."""
    try:
        st = path.stat()
    except OSError:
        return False
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    if st.st_mode & need != need:
        return False
    for parent in path.parents:
        try:
            if not parent.stat().st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


def _under_home(path: Path) -> bool:
    return any(path == Path(h) or Path(h) in path.parents for h in HOME_TREES)


def _interpreter(script: Path) -> Path | None:
    """The ``#!`` interpreter of *script*, if it has one we can read."""
    try:
        with script.open("rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!") or not first[2:].split():
        return None
    return Path(first[2:].split()[0].decode(errors="replace")).resolve()


def this_installation(exec_path: str | None = None) -> Installation:
    """Describe the running installation, or the one whose ``sbus`` is *exec_path*.

    For an *exec_path* that does not exist here (units for an image), nothing can be
    checked and a system-wide installation is assumed.
    """
    if exec_path is None:
        candidate = Path(sys.executable).parent / "sbus"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            exec_start = str(candidate)
        else:  # e.g. run from a source tree: ask this interpreter to run the CLI module
            exec_start = f"{sys.executable} -m sbus.cli"
        needed = [Path(sys.executable).resolve(), Path(__file__).resolve().parent,
                  Path(os.__file__).resolve().parent]
    else:
        if not os.path.isabs(exec_path) or any(c.isspace() for c in exec_path):
            raise SbusError(f"--exec must be an absolute path without spaces, not {exec_path!r}")
        exec_start = exec_path
        needed = []
    script = Path(exec_start.split()[0])
    if script.exists():
        needed.append(script.resolve())
        interpreter = _interpreter(script)
        if interpreter is not None:
            needed.append(interpreter)
    return Installation(
        exec_start=exec_start,
        world_readable=all(_readable_by_others(p) for p in needed),
        under_home=any(_under_home(p) for p in needed) or _under_home(script),
    )


# -- rendering (pure) ----------------------------------------------------------------------

def _escaped(command: str) -> str:
    """*command* with systemd's specifier character ``%`` escaped."""
    return command.replace("%", "%%")


def _socket_unit(user: bool) -> str:
    where = USER_SOCKET if user else SYSTEM_SOCKET
    mode = ("# Only this user may connect to a per-user bus.\nSocketMode=0600\n" if user else
            "# A multi-user bus: anyone may connect; the broker guards secret keys\n"
            "# with the credentials the kernel reports (SO_PEERCRED).\n"
            f"SocketMode={SOCKET_MODE:04o}\n")
    return (
        "[Unit]\n"
        "Description=sbus message bus socket\n"
        "\n"
        "[Socket]\n"
        "# systemd owns the listening socket: connections made while the broker\n"
        "# (re)starts wait in the backlog instead of being refused.\n"
        f"ListenSequentialPacket={where}\n"
        f"{mode}"
        "RemoveOnStop=yes\n"
        "\n"
        "[Install]\n"
        "WantedBy=sockets.target\n"
    )


_USER_SANDBOX = (
    "NoNewPrivileges=yes\n"
    "RestrictAddressFamilies=AF_UNIX\n"
    "RestrictNamespaces=yes\n"
    "RestrictRealtime=yes\n"
    "RestrictSUIDSGID=yes\n"
    "LockPersonality=yes\n"
    "SystemCallArchitectures=native\n"
    "SystemCallFilter=@system-service\n"
)


def _system_sandbox(inst: Installation) -> str:
    lines = []
    if inst.world_readable:
        lines.append("DynamicUser=yes")
    else:
        lines.append("# Runs as root: this installation is not readable by other users,\n"
                     "# so DynamicUser=yes is not possible.")
    lines += [
        "CapabilityBoundingSet=",
        "ProtectSystem=strict",
        "ProtectHome=read-only" if inst.under_home else "ProtectHome=yes",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "PrivateNetwork=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "UMask=0077",
    ]
    return "\n".join(lines) + "\n" + _USER_SANDBOX


#: A user's bus ends when no client has been connected for this long (sbus.socket
#: starts it again on the next connect); the system bus serves everyone and stays.
USER_EXIT_IDLE = "10min"
_USER_IDLE = ("# Exits once no client has been connected for a while; the socket starts it\n"
              "# again on the next connect.\n")
_SYSTEM_IDLE = ("# Runs until stopped; add --exit-idle-time DURATION to ExecStart= (a drop-in)\n"
                "# to end it when idle: sbus.socket starts it again on the next connect.\n")


def _service_unit(inst: Installation, user: bool) -> str:
    return (
        "[Unit]\n"
        "Description=sbus message bus broker\n"
        "Requires=sbus.socket\n"
        "After=sbus.socket\n"
        "\n"
        "[Service]\n"
        "# Started by sbus.socket on the first connection; 'sbus serve' takes the\n"
        "# listening socket from LISTEN_FDS, reports READY=1 and a live STATUS=.\n"
        "Type=notify\n"
        "NotifyAccess=main\n"
        + (_USER_IDLE if user else _SYSTEM_IDLE)
        + f"ExecStart={_escaped(inst.exec_start)} serve"
        + (f" --exit-idle-time {USER_EXIT_IDLE}\n" if user else "\n")
        + "# 'systemctl reload': the next broker starts and gets ready while this one\n"
        "# serves, then takes the clients over and becomes the main process (MAINPID=).\n"
        "ExecReload=/bin/sh -c 'kill -HUP $$MAINPID'\n"
        "Restart=on-failure\n"
        "WatchdogSec=30s\n"
        "# On stop the broker puts its clients' sockets (all inside one socket) and its\n"
        "# state into the fd store: after 'systemctl restart' the next broker serves the\n"
        "# same connections (a plain stop empties the store). Two entries are used.\n"
        "FileDescriptorStoreMax=16\n"
        "# Every client is a file descriptor.\n"
        "LimitNOFILE=65536\n"
        "# No PrivateUsers=: it would remap the UIDs that SO_PEERCRED reports.\n"
        + (_USER_SANDBOX if user else _system_sandbox(inst))
    )


def _mount_unit(inst: Installation, user: bool) -> str:
    where = USER_MOUNT_POINT if user else SYSTEM_MOUNT_POINT
    env = f"Environment=SBUS_ADDRESS={USER_SOCKET}\n" if user else ""
    return (
        "[Unit]\n"
        f"Description=sbus message bus as a filesystem at {where}\n"
        "Requires=sbus.socket\n"
        "After=sbus.socket\n"
        "\n"
        "[Service]\n"
        "# sbus mount says READY=1 once the filesystem serves, so units after it can use it\n"
        "Type=notify\n"
        "NotifyAccess=main\n"
        f"{env}"
        f"ExecStartPre=mkdir -p {where}\n"
        f"ExecStart={_escaped(inst.exec_start)} mount {where}\n"
        "# A mount left behind by a crashed daemon would block the next start.\n"
        f"ExecStopPost=-fusermount3 -u -z {where}\n"
        "Restart=on-failure\n"
        "\n"
        "[Install]\n"
        f"WantedBy={'default.target' if user else 'multi-user.target'}\n"
    )


#: What sbus-record.service keeps by default (change with 'systemctl edit sbus-record').
RECORD_RETENTION = "--keep 7d --keep-bytes 2G"


def _record_unit(inst: Installation, user: bool) -> str:
    env = f"Environment=SBUS_ADDRESS={USER_SOCKET}\n" if user else ""
    return (
        "[Unit]\n"
        "Description=sbus recorder: a journal of the bus traffic in %S/sbus/journal\n"
        "Requires=sbus.socket\n"
        "After=sbus.socket\n"
        "\n"
        "[Service]\n"
        "# Records every key that is not secret (\"\" is the empty pattern); SIGTERM\n"
        "# flushes and seals the open segment. Patterns, retention, --block: with\n"
        "# 'systemctl edit sbus-record', an empty ExecStart= and a new one.\n"
        "Type=exec\n"
        f"{env}"
        "StateDirectory=sbus\n"
        f"ExecStart={_escaped(inst.exec_start)} record \"\" --dir %S/sbus/journal "
        f"{RECORD_RETENTION}\n"
        "Restart=on-failure\n"
        + (_USER_SANDBOX if user else _system_sandbox(inst))
        + "\n"
        "[Install]\n"
        f"WantedBy={'default.target' if user else 'multi-user.target'}\n"
    )


def _bridge_unit(inst: Installation, user: bool) -> str:
    env = f"Environment=SBUS_ADDRESS={USER_SOCKET}\n" if user else ""
    sandbox = _networked(_USER_SANDBOX if user else _system_sandbox(inst))
    return (
        "[Unit]\n"
        "Description=sbus bridge %i: the bus joined to an MQTT broker\n"
        "Requires=sbus.socket\n"
        "After=sbus.socket network-online.target\n"
        "Wants=network-online.target\n"
        "\n"
        "[Service]\n"
        "# One instance per MQTT broker: sbus-bridge@NAME reads %E/sbus/bridge-NAME.toml\n"
        "# (docs/bridge.md: brokers, [[export]] and [[import]] maps, credential files);\n"
        "# BRIDGE_ARGS in the optional %E/sbus/bridge-NAME.conf adds options.  Its spool\n"
        "# of unacknowledged exports and its counters live in the StateDirectory.\n"
        "# STATUS= shows the connections and the exported/imported/dropped/refused counts.\n"
        "# Its bus connection waits in the fd store across a restart or a crash, so the\n"
        "# broker queues what is published meanwhile for the next process.\n"
        "Type=notify\n"
        "NotifyAccess=main\n"
        "FileDescriptorStoreMax=1\n"
        f"{env}"
        "EnvironmentFile=-%E/sbus/bridge-%i.conf\n"
        "StateDirectory=sbus-bridge-%i\n"
        f"ExecStart={_escaped(inst.exec_start)} bridge --config %E/sbus/bridge-%i.toml"
        " $BRIDGE_ARGS\n"
        "Restart=on-failure\n"
        "RestartSec=5s\n"
        + sandbox
        + "\n"
        "[Install]\n"
        f"WantedBy={'default.target' if user else 'multi-user.target'}\n"
    )


def _networked(sandbox: str) -> str:
    """The sandbox of the local units, with the network a gateway or bridge exists for."""
    return sandbox.replace("PrivateNetwork=yes\n", "").replace(
        "RestrictAddressFamilies=AF_UNIX\n", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6\n")


#: Where sbus-gateway.service takes its certificate, key and secret from.
GATEWAY_SECRETS = "/etc/sbus/gateway"


def _gateway_unit(inst: Installation) -> str:
    return (
        "[Unit]\n"
        "Description=sbus gateway: remote publish/subscribe over TLS\n"
        "Requires=sbus.socket\n"
        "After=sbus.socket network-online.target\n"
        "Wants=network-online.target\n"
        "\n"
        "[Service]\n"
        "# Reports READY=1 once listening and a live STATUS= (clients, patterns,\n"
        "# published, delivered, discarded, bus up/down).\n"
        "Type=notify\n"
        "NotifyAccess=main\n"
        "# The certificate, key and shared secret stay root-only files under\n"
        f"# {GATEWAY_SECRETS}; systemd hands copies to the unprivileged service.\n"
        f"LoadCredential=cert.pem:{GATEWAY_SECRETS}/cert.pem\n"
        f"LoadCredential=key.pem:{GATEWAY_SECRETS}/key.pem\n"
        f"LoadCredential=auth-key:{GATEWAY_SECRETS}/auth-key\n"
        "# Change the port or add --https-listen with 'systemctl edit sbus-gateway'.\n"
        f"ExecStart={_escaped(inst.exec_start)} gateway --listen [::]:7443 \\\n"
        "    --tls-cert ${CREDENTIALS_DIRECTORY}/cert.pem \\\n"
        "    --tls-key ${CREDENTIALS_DIRECTORY}/key.pem \\\n"
        "    --auth-key-file ${CREDENTIALS_DIRECTORY}/auth-key\n"
        "Restart=on-failure\n"
        "RestartSec=1s\n"
        "# Every remote client is a file descriptor (10,000 idle clients fit in < 1 GB).\n"
        "LimitNOFILE=65536\n"
        "# One bus connection, charged to this user; the broker needs no privileges\n"
        "# from it: remote clients can never reach !/ secret keys anyway.\n"
        + _networked(_system_sandbox(inst))
        + "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def render(inst: Installation, *, user: bool) -> dict[str, str]:
    """Unit file name -> text, for the system manager or (``user=True``) a user manager
    (which gets no gateway: its secrets are root's files)."""
    rendered = {
        "sbus.socket": _socket_unit(user),
        "sbus.service": _service_unit(inst, user),
        "sbus-mount.service": _mount_unit(inst, user),
        "sbus-record.service": _record_unit(inst, user),
        "sbus-bridge@.service": _bridge_unit(inst, user),
    }
    if not user:
        rendered["sbus-gateway.service"] = _gateway_unit(inst)
    return rendered


# -- installing (I/O) ----------------------------------------------------------------------

def default_unit_dir(user: bool) -> Path:
    if not user:
        return Path("/etc/systemd/system")
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "systemd" / "user"


def write_units(directory: Path, units: dict[str, str]) -> list[tuple[Path, bool]]:
    """Write all units or none; return (path, changed) for each."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SbusError(f"cannot create {directory}: {exc.strerror}") from None
    staged: list[tuple[str, Path, bool]] = []
    try:
        for name, text in units.items():
            target = directory / name
            try:
                changed = target.read_text() != text
            except FileNotFoundError:
                changed = True
            except OSError as exc:
                raise SbusError(f"cannot read {target}: {exc.strerror}") from None
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
            staged.append((tmp, target, changed))
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
    except OSError as exc:
        for tmp, _, _ in staged:
            os.unlink(tmp)
        raise SbusError(f"cannot write units into {directory}: {exc.strerror}") from None
    except BaseException:
        for tmp, _, _ in staged:
            os.unlink(tmp)
        raise
    for tmp, target, _ in staged:
        os.replace(tmp, target)
    return [(target, changed) for _, target, changed in staged]


def manager_running(user: bool) -> bool:
    """Whether the system manager (or this user's) runs here, to be told of new units."""
    if not user:
        return os.path.isdir("/run/systemd/system")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return bool(runtime) and os.path.exists(os.path.join(runtime, "systemd", "private"))


def systemctl(user: bool) -> list[str]:
    return ["systemctl", "--user"] if user else ["systemctl"]


def daemon_reload(user: bool) -> str | None:
    """``systemctl daemon-reload``; None when it worked, else what it said."""
    done = subprocess.run([*systemctl(user), "daemon-reload"], capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr.strip()
