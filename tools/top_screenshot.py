#!/usr/bin/env python3
"""Make docs/top.svg: a real broker, a few publishers with made-up but plausible traffic
(rising and falling, text and binary), and ``sbus-top --once --svg`` watching it.

    .venv/bin/python tools/top_screenshot.py [--out docs/top.svg] [--seconds 20]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sbus.client import Client  # noqa: E402


def traffic(address: str, seconds: float, stop: threading.Event) -> None:
    """About 50 keys; the total rate swells and ebbs so the sparkline has a shape."""
    rooms = ["kitchen", "hall", "bedroom", "garage", "office", "attic"]
    with Client(address) as bus:
        start = time.monotonic()
        tick = 0
        while not stop.is_set() and time.monotonic() - start < seconds:
            t = time.monotonic() - start
            swell = 1 + math.sin(t / 2.5)
            tick += 1
            for i, room in enumerate(rooms):
                if tick % (i + 1) == 0:
                    bus.publish(f"sensors/{room}/temp", f"{19 + i * 0.7 + swell:.1f} °C")
                    bus.publish(f"sensors/{room}/humidity", f"{40 + i * 3}%")
            for n in range(int(4 * swell) + 1):
                bus.publish(f"orders/eu/{1000 + tick % 4}",
                            json.dumps({"id": tick * 10 + n, "qty": n + 1, "sku": "A-17"}))
            if tick % 2 == 0:
                bus.publish("metrics/cpu", struct.pack("<dI", 0.42 * swell, tick))
            if tick % 5 == 0:
                bus.publish("logs/web", f"GET /api/items/{tick} 200 {3 + tick % 9} ms")
            time.sleep(max(0.0, start + tick / 50 - time.monotonic()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "top.svg"))
    ap.add_argument("--seconds", type=float, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sbshot-", dir="/tmp"))
    address = str(tmp / "bus.sock")
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="100", LINES="30")
    broker = subprocess.Popen([sys.executable, "-m", "sbus.cli", "serve", "--address", address],
                              stderr=subprocess.DEVNULL, env=env)
    stop = threading.Event()
    try:
        for _ in range(200):
            if os.path.exists(address):
                break
            time.sleep(0.05)
        pub = threading.Thread(target=traffic, args=(address, args.seconds + 5, stop))
        pub.start()
        out = subprocess.run([sys.executable, "-m", "sbus.top", "--address", address, "--once",
                              "--seconds", str(args.seconds), "--svg", args.out],
                             env=env, check=True, capture_output=True, text=True).stdout
        print(out)
    finally:
        stop.set()
        broker.terminate()
        broker.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
