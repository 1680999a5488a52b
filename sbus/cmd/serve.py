"""sbus serve: run the broker (socket-activated by systemd, or bound by hand)."""

from __future__ import annotations

import argparse
import sys

import trio

from .. import server
from ..flood import Hard, Order, Soft
from ..limits import Limits


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    text = text.strip().lower().rstrip("ib")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", type=lambda s: int(s, 8), default=0o666,
                   help="permissions of the socket file it creates (octal, default 0666: "
                        "a multi-user bus; secrets are guarded by credentials)")
    p.add_argument("--separator", default="/", choices=["/", "."],
                   help="routing key separator ('.' serves the early-draft dialect)")
    p.add_argument("--max-message", type=_size, default=256 * 1024, metavar="BYTES",
                   help="largest packet accepted and forwarded (default 256k)")
    p.add_argument("--queue-limit", type=_size, default=4 * 1024 * 1024, metavar="BYTES",
                   help="bytes queued per slow client before its hard policy applies "
                        "(default 4m)")
    p.add_argument("--soft", choices=[s.value.decode() for s in Soft], default="queue",
                   help="flood policy of new clients when a message would block (default queue)")
    p.add_argument("--hard", choices=[h.value.decode() for h in Hard], default="discard",
                   help="flood policy of new clients whose queue is full (default discard)")
    p.add_argument("--order", choices=[o.value.decode() for o in Order], default="queue",
                   help="order in which queued messages leave (default queue)")
    p.add_argument("--max-connections-per-user", type=int, default=Limits.connections_per_user)
    p.add_argument("--max-subscriptions-per-user", type=int,
                   default=Limits.subscriptions_per_user)
    p.add_argument("--max-queued-bytes-per-user", type=_size,
                   default=Limits.queued_bytes_per_user, metavar="BYTES",
                   help="bytes queued in the broker for all of one user's connections "
                        "(default 64m; root is exempt)")


def run(args: argparse.Namespace) -> int:
    limits = Limits(connections_per_user=args.max_connections_per_user,
                    subscriptions_per_user=args.max_subscriptions_per_user,
                    queued_bytes_per_user=args.max_queued_bytes_per_user)
    try:
        trio.run(lambda: server.run(args.address, mode=args.mode, sep=args.separator.encode(),
                             max_message=args.max_message, queue_limit=args.queue_limit,
                             limits=limits,
                             defaults=(Soft(args.soft.encode()), Hard(args.hard.encode()),
                                       Order(args.order.encode()))))
    except server.ServeError as exc:
        print(f"sbus serve: {exc}", file=sys.stderr)
        return 1
    return 0

