"""``sbus bridge``: the local bus joined to an MQTT broker (docs/bridge.md).

    sbus bridge --mqtt URL[,URL…] [--export PATTERN…] [--import PATTERN…] …
    sbus bridge --config FILE

The command line gives one map per direction; ``--config`` a TOML file with several
(``[[export]]`` / ``[[import]]`` tables, each with its own patterns, map and QoS) and
the credentials as file names, so that nothing secret is in ``ps``.  Options given on the
command line win over the file's.  paho-mqtt (the ``bridge`` extra) is imported only to
run: ``--help``, man pages and completion work without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import ssl
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .. import rlimits
from ..bridge.core import BridgeCore, Rule
from ..bridge.topics import ConfigError, Mapping
from ..defaults import MAX_MESSAGE, parse_duration, parse_size
from ..display import brief, printable
from ..errors import SbusError
from ..files import SECRET_BYTES, must_be_regular, read_small
from ..linger import LINGER, check_linger

log = logging.getLogger("sbus.bridge")

PORTS = {"mqtt": 1883, "mqtts": 8883}
#: A configuration file larger than this is not one (a few kilobytes is usual).
CONFIG_BYTES = 1 << 20

#: Settings with their defaults: the command line's ``--NAME`` and the file's ``NAME``.
DEFAULTS: dict[str, Any] = {
    "mqtt": None, "client-id": None, "session-expiry": 3600.0, "max-queued": 10000,
    "max-queued-bytes": 64 << 20, "max-message": MAX_MESSAGE, "keepalive": 30,
    "backoff-max": 30.0, "username": None, "password-file": None, "cafile": None,
    "cert": None, "key": None, "state-dir": None, "export-qos": 1, "import-qos": 1,
    "linger": LINGER,
}
_DURATIONS = {"session-expiry", "backoff-max", "linger"}
_SIZES = {"max-queued-bytes", "max-message"}
_INTS = {"max-queued", "keepalive", "export-qos", "import-qos"}
_RULE_KEYS = {"patterns", "map", "qos"}
_FILES = {"password-file", "cafile", "cert", "key"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="a TOML file: the settings below by name, and [[export]] / "
                        "[[import]] tables (patterns, map, qos) for several maps per "
                        "direction (docs/bridge.md)")
    p.add_argument("--mqtt", metavar="URL[,URL…]",
                   help="the MQTT broker: mqtt://[USER@]HOST[:PORT] or mqtts://… (TLS); "
                        "several, comma-separated, are tried in order")
    p.add_argument("--export", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="local sbus patterns whose messages go to MQTT")
    p.add_argument("--import", dest="imports", nargs="+", action="extend", default=[],
                   metavar="PATTERN",
                   help="local sbus patterns (keys after --import-map) to take from MQTT; "
                        "each becomes the narrowest MQTT filter that covers it")
    p.add_argument("--export-map", metavar="LOCAL=REMOTE",
                   help="local keys under LOCAL go out as topics under REMOTE "
                        "(e.g. sensors/=site/a/sensors/; default: unchanged)")
    p.add_argument("--import-map", metavar="LOCAL=REMOTE",
                   help="topics under REMOTE come in as keys under LOCAL "
                        "(e.g. remote/=site/; default: unchanged)")
    p.add_argument("--export-qos", type=int, choices=(0, 1),
                   help="QoS of exported messages (default 1; docs/bridge.md says what "
                        "each loses)")
    p.add_argument("--import-qos", type=int, choices=(0, 1),
                   help="QoS of the MQTT subscriptions (default 1)")
    p.add_argument("--client-id", metavar="ID",
                   help="MQTT client id, also the loop marker (default sbus-bridge-HOSTNAME); "
                        "unique per bridge")
    p.add_argument("--session-expiry", metavar="DURATION",
                   help="how long the MQTT broker keeps the bridge's session (and QoS 1 "
                        "imports) while it is away (default 1h; 0: a clean session)")
    p.add_argument("--max-queued", metavar="N",
                   help="QoS 1 exports held until acknowledged, in the spool on disk "
                        "(default 10000); when full, new ones are dropped and counted")
    p.add_argument("--max-queued-bytes", metavar="BYTES",
                   help="and their bytes at most (default 64m)")
    p.add_argument("--max-message", metavar="BYTES",
                   help="largest message taken from MQTT (default 256k, as 'sbus serve')")
    p.add_argument("--keepalive", metavar="SECONDS", help="MQTT keep-alive (default 30)")
    p.add_argument("--backoff-max", metavar="DURATION",
                   help="longest wait between reconnect attempts, either side (default 30s)")
    p.add_argument("--linger", metavar="DURATION",
                   help="when messages come fast enough that waiting this long gathers "
                        "two or more, wait that long between reads: a run per wake-up, "
                        "each message at most this much later (default 1ms; 0: off; at "
                        "most 100ms)")
    p.add_argument("--password-file", metavar="FILE",
                   help="MQTT password, first line of FILE (rather than in the URL)")
    p.add_argument("--cafile", metavar="FILE", help="CA certificates for mqtts:// "
                   "(default: the system's)")
    p.add_argument("--cert", metavar="FILE", help="client certificate (PEM) for mqtts://")
    p.add_argument("--key", metavar="FILE", help="its private key (PEM)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="where the bridge keeps its spool of unacknowledged exports, its "
                        "counters and its session's filters across restarts (default "
                        "$STATE_DIRECTORY, else /var/lib/sbus/bridge/ID as root, "
                        "~/.local/state/sbus/bridge/ID otherwise)")


# -- the settings ---------------------------------------------------------------------

def _load_config(path: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(read_small(path, CONFIG_BYTES).decode("utf-8"))
    except OSError as exc:
        raise SbusError(f"cannot read the configuration {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SbusError(f"{path}: not valid TOML: not UTF-8 at byte {exc.start}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SbusError(f"{path}: not valid TOML: {printable(str(exc), 200)}") from None
    except RecursionError:
        raise SbusError(f"{path}: not valid TOML: arrays or tables nested too deep") from None
    unknown = set(data) - set(DEFAULTS) - {"export", "import"}
    if unknown:
        raise SbusError(f"{path}: unknown setting {brief(sorted(unknown)[0].encode())} "
                        f"(known: {', '.join(sorted(DEFAULTS))}, [[export]], [[import]])")
    return data


def _value(name: str, value: Any, where: str) -> Any:
    """A setting from the file or the command line, checked and converted."""
    try:
        if name in _DURATIONS:
            seconds = parse_duration(str(value))
            return check_linger(seconds) if name == "linger" else seconds
        if name in _SIZES:
            return parse_size(str(value))
        if name in _INTS:
            if isinstance(value, bool) or not re.fullmatch(r"\d+", str(value)):
                raise ValueError(f"{value!r} is not a whole number")
            number = int(value)
            if name.endswith("qos") and number not in (0, 1):
                raise ValueError("QoS is 0 or 1")
            return number
    except ValueError as exc:
        raise SbusError(f"{where}{name}: {exc}") from None
    if name == "mqtt" and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if not isinstance(value, str):
        raise SbusError(f"{where}{name}: a string, not {type(value).__name__}")
    return value


def _rules(data: dict[str, Any], direction: str, path: str) -> tuple[Rule, ...]:
    tables = data.get(direction, [])
    if not isinstance(tables, list):
        raise SbusError(f"{path}: [[{direction}]] is a list of tables")
    rules = []
    for i, table in enumerate(tables, 1):
        where = f"{path}: [[{direction}]] #{i}: "
        if not isinstance(table, dict) or set(table) - _RULE_KEYS:
            raise SbusError(f"{where}holds only patterns, map and qos")
        patterns = table.get("patterns")
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list) or not patterns or \
                not all(isinstance(p, str) for p in patterns):
            raise SbusError(f"{where}patterns is a list of sbus patterns")
        try:
            mapping = Mapping.parse(table["map"]) if "map" in table else Mapping()
        except (ConfigError, AttributeError) as exc:
            raise SbusError(f"{where}map: {exc}") from None
        qos = _value("export-qos", table.get("qos", 1), where)
        rules.append(Rule(tuple(p.encode() for p in patterns), mapping, qos))
    return tuple(rules)


def _brokers(text: str, who: str):
    """(hosts, tls, username, password) of a comma-separated list of MQTT URLs."""
    from ..bridge.shell import Broker

    brokers, schemes, users = [], set(), set()
    password = None
    for part in text.split(","):
        url = urlsplit(part.strip())
        if url.scheme not in PORTS or not url.hostname:
            raise SbusError(f"{who} must be mqtt://HOST[:PORT] or mqtts://HOST[:PORT], "
                            f"not {brief(part.encode())}")
        try:
            port = url.port or PORTS[url.scheme]
        except ValueError:
            raise SbusError(f"bad port in {who} {brief(part.encode())}") from None
        brokers.append(Broker(url.hostname, port))
        schemes.add(url.scheme)
        users.add(unquote(url.username) if url.username else None)
        if url.password:
            password = unquote(url.password)
    if len(schemes) > 1 or len(users) > 1:
        raise SbusError(f"the addresses of {who} must share the scheme and the user")
    return brokers, schemes.pop() == "mqtts", users.pop(), password


def _file_of_config(name: str, config: str) -> str:
    """A file named in the config: a relative name is a systemd credential
    (``LoadCredential=``, in ``$CREDENTIALS_DIRECTORY``) if there is one by that name,
    else relative to the config file's directory."""
    if os.path.isabs(name):
        return name
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds and os.path.exists(os.path.join(creds, name)):
        return os.path.join(creds, name)
    return os.path.join(os.path.dirname(os.path.abspath(config)), name)


def _state_dir(given: str | None, client_id: str) -> str:
    if given:
        return given
    managed = os.environ.get("STATE_DIRECTORY")
    if managed:
        return managed.split(":")[0]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", client_id) or "_"
    if os.geteuid() == 0:
        return f"/var/lib/sbus/bridge/{name}"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return f"{base}/sbus/bridge/{name}"


def _check_tls_files(cafile: str | None, cert: str | None, key: str | None) -> None:
    """One clear line for a CA or certificate file that cannot be used (paho would raise
    from deep inside ssl)."""
    try:
        must_be_regular(cafile, cert, key)
        context = ssl.create_default_context(cafile=cafile)
        if cert:
            context.load_cert_chain(cert, key)
    except FileNotFoundError as exc:
        raise SbusError(f"TLS file not found: {exc.filename or cafile or cert}") from None
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        which = "--cafile" if cafile and not cert else "--cert/--key"
        raise SbusError(f"cannot use {which} for TLS: {printable(str(exc), 200)}") from None


def resolve(args: argparse.Namespace):
    """The core and the shell's settings from the command line and the file."""
    from ..bridge.shell import MqttSettings

    data = _load_config(args.config) if args.config else {}
    where = f"{args.config}: " if args.config else "--"
    opts: dict[str, Any] = {}
    for name, default in DEFAULTS.items():
        given = getattr(args, name.replace("-", "_"), None)
        if given is not None:
            opts[name] = _value(name, given, "--")
        elif name in data:
            opts[name] = _value(name, data[name], where)
            if name in _FILES:
                opts[name] = _file_of_config(opts[name], args.config)
        else:
            opts[name] = default
    if not opts["mqtt"]:
        raise SbusError("give the MQTT broker: --mqtt URL (or mqtt = … in --config)")
    brokers, tls, username, password = _brokers(opts["mqtt"], "--mqtt")
    if password is not None:
        log.warning("a password in the URL shows in ps: use --password-file or --config")
    if opts["username"]:
        username = opts["username"]
    if opts["password-file"]:
        try:
            line = read_small(opts["password-file"], SECRET_BYTES).split(b"\n", 1)[0]
            password = line.decode("utf-8")
        except OSError as exc:
            raise SbusError(f"cannot read {opts['password-file']}: "
                            f"{exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise SbusError(f"{opts['password-file']}: the password is not UTF-8") from None
    if (opts["cert"] or opts["key"] or opts["cafile"]) and not tls:
        raise SbusError("--cafile, --cert and --key need an mqtts:// URL")
    if tls:
        _check_tls_files(opts["cafile"], opts["cert"], opts["key"])
    client_id = opts["client-id"] or f"sbus-bridge-{socket.gethostname()}"
    if any(c < " " or "\x7f" <= c <= "\x9f" for c in client_id) or \
            len(client_id.encode()) > 65535:
        # MQTT's strings: a broker hangs up on control characters (mosquitto: a protocol
        # error), and the bridge would retry for ever, blaming the port
        raise SbusError(f"--client-id {printable(client_id, 60)}: MQTT takes no control "
                        "characters in a client id, and at most 65,535 bytes")
    try:
        core = BridgeCore(
            [p.encode() for p in args.export], [p.encode() for p in args.imports],
            export_map=Mapping.parse(args.export_map) if args.export_map else Mapping(),
            import_map=Mapping.parse(args.import_map) if args.import_map else Mapping(),
            export_qos=opts["export-qos"], import_qos=opts["import-qos"],
            export_rules=_rules(data, "export", args.config),
            import_rules=_rules(data, "import", args.config), client_id=client_id)
    except ConfigError as exc:
        raise SbusError(str(exc)) from None
    if not core.exports and not core.filters:
        raise SbusError("nothing to bridge: give --export and/or --import patterns "
                        "(or [[export]] / [[import]] in --config)")
    settings = MqttSettings(
        brokers=brokers, tls=tls, username=username, password=password,
        cafile=opts["cafile"], certfile=opts["cert"], keyfile=opts["key"],
        keepalive=opts["keepalive"], session_expiry=int(opts["session-expiry"]),
        max_queued=opts["max-queued"], max_queued_bytes=opts["max-queued-bytes"],
        max_message=opts["max-message"], state_dir=_state_dir(opts["state-dir"], client_id),
        linger=opts["linger"])
    return core, settings, max(0.2, opts["backoff-max"])


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    try:
        if args.export_map:
            Mapping.parse(args.export_map)
        if args.import_map:
            Mapping.parse(args.import_map)
    except ConfigError as exc:
        raise SbusError(str(exc)) from None
    core, settings, backoff_max = resolve(args)
    logging.getLogger().setLevel(min(logging.getLogger().level, logging.INFO))
    for f in core.filters:
        log.info("import %s as MQTT filter %s%s", brief(f.pattern), brief(f.mqtt),
                 "" if f.exact else " (checked locally)")
    from ..bridge.shell import BridgeShell

    shell = BridgeShell(core, args.address, settings, backoff_max=backoff_max)
    signal.signal(signal.SIGTERM, shell.stop)
    signal.signal(signal.SIGINT, shell.stop)
    shell.run()
    log.info("stopped: %s", shell.status())
    return 0
