"""sbus serve: run the broker (socket-activated by systemd, or bound by hand)."""

from __future__ import annotations

import argparse
import logging
import os

from .. import server
from ..defaults import (
    DEFAULT_HARD,
    DEFAULT_ORDER,
    DEFAULT_SOFT,
    MAX_MESSAGE,
    QUEUE_LIMIT,
    SEPARATOR,
    SOCKET_MODE,
    duration_arg,
    size_arg,
)
from ..errors import ServeError
from ..flood import Hard, Order, Soft
from ..limits import Limits
from ..rlimits import (
    RESERVED_DESCRIPTORS,
    USER_SHARE,
    connections_per_user_for,
    raise_descriptor_limit,
)

log = logging.getLogger("sbus.serve")

#: Said when a user may not create the socket (the default is the system bus's place).
PLACE_HINT = ("a bus of your own goes where you may write: sbus serve --address "
              "$XDG_RUNTIME_DIR/sbus.socket, and export SBUS_ADDRESS=$XDG_RUNTIME_DIR/"
              "sbus.socket for the other sbus commands")


def _user(text: str) -> int | str:
    """A ``--trusted-user``: a UID, or a name looked up when its clients connect (a
    DynamicUser= service's user exists only while the service runs)."""
    return int(text) if text.isdigit() else text


def _octal_mode(text: str) -> int:
    """``--mode``: file permissions in octal, as chmod(1) takes them."""
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o7777:
        raise argparse.ArgumentTypeError(f"not an octal file mode: {text!r} (e.g. 0660)")
    return mode


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", type=_octal_mode, default=SOCKET_MODE, metavar="MODE",
                   help="permissions of the socket file it creates (octal, default "
                        f"{SOCKET_MODE:04o}: a multi-user bus; secrets are guarded by "
                        "credentials)")
    p.add_argument("--separator", default=SEPARATOR.decode(), choices=["/", "."],
                   help="routing key separator ('.' serves the early-draft dialect)")
    p.add_argument("--max-message", type=size_arg, default=MAX_MESSAGE, metavar="BYTES",
                   help="largest packet accepted and forwarded (default 256k)")
    p.add_argument("--queue-limit", type=size_arg, default=QUEUE_LIMIT, metavar="BYTES",
                   help="bytes queued per slow client before its hard policy applies "
                        "(default 4m)")
    p.add_argument("--soft", choices=[s.value.decode() for s in Soft],
                   default=DEFAULT_SOFT.decode(), help="flood policy of new clients when a "
                   f"message would block (default {DEFAULT_SOFT.decode()})")
    p.add_argument("--hard", choices=[h.value.decode() for h in Hard],
                   default=DEFAULT_HARD.decode(), help="flood policy of new clients whose "
                   f"queue is full (default {DEFAULT_HARD.decode()})")
    p.add_argument("--order", choices=[o.value.decode() for o in Order],
                   default=DEFAULT_ORDER.decode(), help="order in which queued messages "
                   f"leave (default {DEFAULT_ORDER.decode()})")
    p.add_argument("--max-connections-per-user", type=int, default=None, metavar="N",
                   help="connections one user may hold at once (default: 1/"
                        f"{USER_SHARE} of the descriptor limit less {RESERVED_DESCRIPTORS}, "
                        f"at most {Limits.connections_per_user}; root is exempt)")
    p.add_argument("--max-subscriptions-per-user", type=int, metavar="N",
                   default=Limits.subscriptions_per_user,
                   help="subscriptions one user may hold at once "
                        f"(default {Limits.subscriptions_per_user})")
    p.add_argument("--max-subscription-bytes-per-user", type=size_arg, metavar="BYTES",
                   default=Limits.subscription_bytes_per_user,
                   help="broker memory one user's subscriptions may cost (default 16m)")
    p.add_argument("--max-queued-bytes-per-user", type=size_arg,
                   default=Limits.queued_bytes_per_user, metavar="BYTES",
                   help="bytes queued in the broker for all of one user's connections, and "
                        "held for its paused publishers (default 64m; root is exempt)")
    p.add_argument("--max-cache-bytes", type=size_arg, default=Limits.cache_bytes,
                   metavar="BYTES", help="size of the route cache (default 16m)")
    p.add_argument("--max-cache-bytes-per-user", type=size_arg,
                   default=Limits.cache_bytes_per_user, metavar="BYTES",
                   help="share of the route cache one user's publishes may fill (default 2m)")
    p.add_argument("--exit-idle-time", type=duration_arg, default=None, metavar="DURATION",
                   help="exit once no client has been connected for this long (e.g. 5min; "
                        "default: never). Under socket activation the next client starts "
                        "the broker again")
    p.add_argument("--trusted-user", type=_user, action="append", default=[],
                   metavar="USER", help="a user (name or UID) whose subscribers may pause "
                                        "other users' publishers with 'block' (root always "
                                        "may); repeatable")


def _connections_per_user(asked: int | None) -> int:
    """The per-user connection limit, kept well below the descriptor limit (raised to
    the hard limit first): one user must never take the last descriptors."""
    descriptors = raise_descriptor_limit()
    if asked is None:
        asked = connections_per_user_for(descriptors)
        log.debug("descriptor limit %d: at most %d connections per user", descriptors, asked)
    elif asked > (descriptors - RESERVED_DESCRIPTORS) // 2:
        log.warning("--max-connections-per-user %d is not well below the descriptor limit "
                    "%d: two users could take every descriptor", asked, descriptors)
    return asked


def run(args: argparse.Namespace) -> int:
    limits = Limits(connections_per_user=_connections_per_user(args.max_connections_per_user),
                    subscriptions_per_user=args.max_subscriptions_per_user,
                    subscription_bytes_per_user=args.max_subscription_bytes_per_user,
                    queued_bytes_per_user=args.max_queued_bytes_per_user,
                    cache_bytes=args.max_cache_bytes,
                    cache_bytes_per_user=args.max_cache_bytes_per_user,
                    trusted=frozenset(args.trusted_user))
    try:
        server.run(args.address, mode=args.mode, sep=args.separator.encode(),
                   max_message=args.max_message, queue_limit=args.queue_limit,
                   limits=limits, exit_idle=args.exit_idle_time,
                   defaults=(Soft(args.soft.encode()), Hard(args.hard.encode()),
                             Order(args.order.encode())))
    except ServeError as exc:
        if isinstance(exc.__cause__, PermissionError) and os.geteuid() != 0:
            raise ServeError(f"{exc} ({PLACE_HINT})") from None
        raise
    return 0

