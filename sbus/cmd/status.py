"""sbus status: what the broker says about itself and the clients this user may see."""

from __future__ import annotations

import argparse
import json
import sys

from .. import protocol
from ..client import Client, SbusError
from ..defaults import ANSWER_TIMEOUT, duration_arg
from ..display import printable
from ..introspect import entry_bytes
from ..protocol import Control


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the broker's answer as one JSON object (all pages joined)")
    p.add_argument("--timeout", type=duration_arg, default=ANSWER_TIMEOUT, metavar="SECONDS",
                   help=f"how long to wait for each answer (default {ANSWER_TIMEOUT:g})")


def fetch(bus: Client, timeout: float) -> dict:
    """Every page of the broker's answer, joined into one."""
    request, result = None, None
    while True:
        bus.control(protocol.STATUS, request)
        while True:
            event = bus.receive(timeout=timeout)
            if isinstance(event, Control) and event.key == protocol.STATUS:
                break
        page = json.loads(event.payload or b"{}")
        if result is None:
            result = page
        else:
            result["clients"].extend(page["clients"])
        if not page.get("more") or "next" not in page:
            result.pop("next", None)
            result["more"] = False
            return result
        request = json.dumps(page["next"]).encode()


def run(args: argparse.Namespace) -> int:
    with Client(args.address) as bus:
        try:
            state = fetch(bus, args.timeout)
        except TimeoutError:
            bus.sync(args.timeout)  # no answer at all: its TimeoutError says so
            raise SbusError(f"the broker at {bus.address} answers, but not with its status "
                            "(is it older than this client?)") from None
    if args.json:
        json.dump(state, sys.stdout, indent=1)
        print()
        return 0
    b = state["broker"]
    print(f"broker: {b['clients']:,} clients, {b['subscriptions']:,} subscriptions, "
          f"{b['published']:,} published, {b['delivered']:,} delivered, "
          f"{b['dropped']:,} dropped, up {b['uptime']:,.0f} s")
    print(f"clients visible to you ({b['visible']}):")
    print(f"{'id':>6} {'pid':>7} {'uid':>6} {'subs':>5} {'queued':>8} {'bytes':>10} "
          f"{'drops':>7} {'paused':>6} {'flood':<22} patterns")
    for c in state["clients"]:
        me = "*" if c["id"] == b["you"] else " "
        flood = f"{c['soft']}/{c['hard']}/{c['order']}" + (" nowait" if c["nowait"] else "")
        if c.get("publishing_for") is not None:  # a carrier naming whose messages go
            flood += f" for {c['publishing_for']}"
        patterns = ", ".join(printable(entry_bytes(p), 60) for p in c["patterns"][:5])
        more = c["subscriptions"] - min(len(c["patterns"]), 5)
        if more > 0:
            patterns += f" (+{more})"
        drops = c.get("dropped", c.get("dropped_unreported", 0))
        print(f"{c['id']:>5}{me} {c['pid']:>7} {c['uid']:>6} {c['subscriptions']:>5} "
              f"{c['queued']:>8} {c['queued_bytes']:>10} {drops:>7} "
              f"{c.get('publishers_paused', 0):>6} {flood:<22} {patterns}")
        if c.get("status"):  # the client's own words: escaped, on a line of their own
            print(f"{'':>7} status: {printable(entry_bytes(c['status']), 200)}")
    return 0
