"""``sbus bridge --mqtt URL [--export PATTERN…] [--import PATTERN…]`` (docs/bridge.md).

paho-mqtt (the ``bridge`` extra) is imported only to run: ``--help``, man pages and
completion work without it."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from .. import rlimits
from ..client import SbusError
from ..defaults import MAX_MESSAGE, duration_arg, size_arg
from ..display import brief
from .core import BridgeCore
from .topics import ConfigError, Mapping

if TYPE_CHECKING:
    from .shell import MqttSettings

log = logging.getLogger("sbus.bridge")

PORTS = {"mqtt": 1883, "mqtts": 8883}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mqtt", required=True, metavar="URL",
                   help="the MQTT broker: mqtt://[USER@]HOST[:PORT] or mqtts://… (TLS)")
    p.add_argument("--export", nargs="+", action="extend", default=[], metavar="PATTERN",
                   help="local sbus patterns whose messages go to MQTT")
    p.add_argument("--import", dest="imports", nargs="+", action="extend", default=[],
                   metavar="PATTERN",
                   help="local sbus patterns (keys after --import-map) to take from MQTT; "
                        "each becomes the narrowest MQTT filter that covers it")
    p.add_argument("--export-map", type=_mapping, default=Mapping(), metavar="LOCAL=REMOTE",
                   help="local keys under LOCAL go out as topics under REMOTE "
                        "(e.g. sensors/=site/a/sensors/; default: unchanged)")
    p.add_argument("--import-map", type=_mapping, default=Mapping(), metavar="LOCAL=REMOTE",
                   help="topics under REMOTE come in as keys under LOCAL "
                        "(e.g. remote/=site/; default: unchanged)")
    p.add_argument("--export-qos", type=int, choices=(0, 1), default=1,
                   help="QoS of exported messages (default 1; docs/bridge.md says what "
                        "each loses)")
    p.add_argument("--import-qos", type=int, choices=(0, 1), default=1,
                   help="QoS of the MQTT subscriptions (default 1)")
    p.add_argument("--client-id", default=None, metavar="ID",
                   help="MQTT client id, also the loop marker (default sbus-bridge-HOSTNAME); "
                        "unique per bridge")
    p.add_argument("--session-expiry", type=duration_arg, default=3600.0, metavar="DURATION",
                   help="how long the MQTT broker keeps the bridge's session (and QoS 1 "
                        "imports) while it is away (default 1h; 0: a clean session)")
    p.add_argument("--max-queued", type=int, default=10000, metavar="N",
                   help="QoS 1 exports held until acknowledged, e.g. while the MQTT broker "
                        "is away (default 10000)")
    p.add_argument("--max-queued-bytes", type=size_arg, default=64 << 20, metavar="BYTES",
                   help="and their bytes at most (default 64m)")
    p.add_argument("--max-message", type=size_arg, default=MAX_MESSAGE, metavar="BYTES",
                   help="largest message taken from MQTT (default 256k, as 'sbus serve')")
    p.add_argument("--keepalive", type=int, default=30, metavar="SECONDS",
                   help="MQTT keep-alive (default 30)")
    p.add_argument("--backoff-max", type=duration_arg, default=30.0, metavar="DURATION",
                   help="longest wait between reconnect attempts, either side (default 30s)")
    p.add_argument("--password-file", metavar="FILE",
                   help="MQTT password, first line of FILE (rather than in the URL)")
    p.add_argument("--cafile", metavar="FILE", help="CA certificates for mqtts:// "
                   "(default: the system's)")
    p.add_argument("--cert", metavar="FILE", help="client certificate (PEM) for mqtts://")
    p.add_argument("--key", metavar="FILE", help="its private key (PEM)")


def _mapping(text: str) -> Mapping:
    try:
        return Mapping.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def settings(args: argparse.Namespace) -> MqttSettings:
    from .shell import MqttSettings  # paho-mqtt only when the bridge runs (not for --help)

    url = urlsplit(args.mqtt)
    if url.scheme not in PORTS or not url.hostname:
        raise SbusError(f"--mqtt must be mqtt://HOST[:PORT] or mqtts://HOST[:PORT], "
                        f"not {args.mqtt!r}")
    try:
        port = url.port or PORTS[url.scheme]
    except ValueError:
        raise SbusError(f"bad port in --mqtt {args.mqtt!r}") from None
    password = unquote(url.password) if url.password else None
    if args.password_file:
        try:
            with open(args.password_file) as f:
                password = f.readline().rstrip("\n")
        except OSError as exc:
            raise SbusError(f"cannot read {args.password_file}: {exc.strerror}") from None
    if (args.cert or args.key or args.cafile) and url.scheme != "mqtts":
        raise SbusError("--cafile, --cert and --key need an mqtts:// URL")
    return MqttSettings(
        host=url.hostname, port=port, tls=url.scheme == "mqtts",
        username=unquote(url.username) if url.username else None, password=password,
        cafile=args.cafile, certfile=args.cert, keyfile=args.key or None,
        keepalive=args.keepalive, export_qos=args.export_qos, import_qos=args.import_qos,
        session_expiry=int(args.session_expiry), max_queued=args.max_queued,
        max_queued_bytes=args.max_queued_bytes,
        max_message=args.max_message)


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    if not args.export and not args.imports:
        raise SbusError("nothing to bridge: give --export and/or --import patterns")
    try:
        core = BridgeCore([p.encode() for p in args.export], [p.encode() for p in args.imports],
                          export_map=args.export_map, import_map=args.import_map,
                          client_id=args.client_id or f"sbus-bridge-{socket.gethostname()}")
    except ConfigError as exc:
        raise SbusError(str(exc)) from None
    logging.getLogger().setLevel(min(logging.getLogger().level, logging.INFO))
    for f in core.filters:
        log.info("import %s as MQTT filter %s%s", brief(f.pattern), brief(f.mqtt),
                 "" if f.exact else " (checked locally)")
    from .shell import BridgeShell

    shell = BridgeShell(core, args.address, settings(args),
                        backoff_max=max(0.2, args.backoff_max))
    signal.signal(signal.SIGTERM, shell.stop)
    signal.signal(signal.SIGINT, shell.stop)
    shell.run()
    log.info("stopped: %s", shell.status())
    return 0
