#!/usr/bin/env python3
"""The floor of a Python hop from the bus to MQTT: the least any Python bridge does per
export, for `tools/bench_bridge.py`'s ``floor-export`` path (not a bridge: nothing is
kept, nothing is mapped, no reconnect, no flow control).

It subscribes to *pattern* on the bus (through `sbus.client.Client`, with its whoami as
the barrier), connects to the MQTT broker at 127.0.0.1:*port* (MQTT 3.1.1, clean
session, ``TCP_NODELAY``), prints ``READY``, and then, blocking on the bus socket, sends
each message as one PUBLISH on the topic of its key, at QoS 0 or 1; acknowledgements
are read without waiting, after each send, and thrown away.  What the sbus bridge does
beyond this per message (the receive through the client, the key's mapping, the spool,
paho's record of the message; before its export lane, a turn of its event loop too) is
what its added latency holds over this path's (docs/performance.md, "The floor of a
Python hop").

``--loop c``: the per-message loop in C (`tools/bridge_floor_loop.c`, compiled with ``cc``
at start-up; ``floor-c-export``), so that no Python runs per message: what is left of the
added latency is the extra process's, not the language's.

``--acks thread``: a second thread blocks on the MQTT socket and reads each PUBACK as it
comes, as the bridge's import lane does (``floor-acked-export``): what waking for the
acknowledgements costs the next hop's latency on a machine of few CPUs.

Usage: tools/bridge_floor.py --address BUS --port PORT [--qos 0|1] [--pattern P]
                             [--acks after-send|thread] [--loop python|c]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sbus.bridge.buffered import remaining_length  # noqa: E402
from sbus.client import Client  # noqa: E402


def mqtt_connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client_id = b"floor%d" % os.getpid()
    # protocol name, level 4, clean session, keep-alive 600 s, the client identifier
    body = b"\0\4MQTT\4\2\2\x58" + len(client_id).to_bytes(2, "big") + client_id
    sock.sendall(b"\x10" + remaining_length(len(body)) + body)
    ack = sock.recv(4)
    if len(ack) < 4 or ack[0] != 0x20 or ack[3] != 0:
        raise SystemExit(f"bridge_floor: the MQTT broker refused the connection: {ack!r}")
    return sock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", required=True, help="the bus's socket")
    ap.add_argument("--port", type=int, required=True, help="the MQTT broker's port")
    ap.add_argument("--qos", type=int, choices=(0, 1), default=1)
    ap.add_argument("--pattern", default="k.000", help="what to carry (lg's key)")
    ap.add_argument("--acks", choices=("after-send", "thread"), default="after-send",
                    help="read PUBACKs after each send, or in a thread woken for each")
    ap.add_argument("--loop", choices=("python", "c"), default="python",
                    help="the per-message loop in Python, or in C (no Python per message)")
    args = ap.parse_args()
    c_loop = _c_loop() if args.loop == "c" else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    bus = Client(args.address)
    bus.subscribe(args.pattern)
    bus.whoami()
    sock = bus.sock
    sock.setblocking(True)
    mqtt = mqtt_connect(args.port)
    if args.acks == "thread":
        threading.Thread(target=_read_acks, args=(mqtt,), daemon=True).start()
    print("READY", flush=True)
    if c_loop is not None:
        while (rc := c_loop(sock.fileno(), mqtt.fileno(), args.qos)) == 1:
            pass  # a signal: its handler runs here
        if rc < 0:
            raise SystemExit(f"bridge_floor: {os.strerror(-rc)}")
        return 0
    command, mid = (0x32 if args.qos else 0x30), 0
    while True:
        packet = sock.recv(65536)
        if not packet:
            return 0
        nul = packet.find(b"\0", 4)
        if not packet.startswith(b"MSG ") or nul < 0:
            continue  # control messages: not this tool's business
        topic, payload = packet[4:nul], packet[nul + 1:]
        head = len(topic).to_bytes(2, "big") + topic
        if args.qos:
            mid = mid % 0xFFFF + 1
            head += mid.to_bytes(2, "big")
        mqtt.sendall(bytes([command]) + remaining_length(len(head) + len(payload)) + head
                  + payload)
        if args.acks == "after-send":
            try:
                mqtt.recv(65536, socket.MSG_DONTWAIT)  # PUBACKs, unread
            except BlockingIOError:
                pass


def _c_loop() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    """`floor_loop` of tools/bridge_floor_loop.c, built here for this run."""
    source = Path(__file__).with_name("bridge_floor_loop.c")
    with tempfile.TemporaryDirectory(prefix="bridge_floor.") as tmp:
        built = Path(tmp) / "floor_loop.so"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                       check=True)
        fn = ctypes.CDLL(str(built)).floor_loop  # (loaded: the file may go)
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int)  # (the GIL let go in the call)
    fn.restype = ctypes.c_int
    return fn


def _read_acks(mqtt: socket.socket) -> None:
    while mqtt.recv(65536):  # woken for every PUBACK, thrown away
        pass


if __name__ == "__main__":
    sys.exit(main())
