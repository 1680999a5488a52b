"""``sbus record PATTERN... --dir DIR``: options to typed arguments for
`sbus.journal.record.record`."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from .. import rlimits
from ..defaults import parse_duration, parse_size
from ..errors import SbusError
from ..extras import install_command
from ..journal.store import EXPORT_SUBDIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("patterns", nargs="+", metavar="PATTERN",
                   help="routing key pattern to record ('' for everything not secret)")
    p.add_argument("--dir", "-d", required=True, help="journal directory (created if missing)")
    p.add_argument("--segment-size", default="64M", metavar="SIZE",
                   help="seal a segment once it is this big (default 64M)")
    p.add_argument("--segment-time", default="1h", metavar="DURATION",
                   help="seal a segment once it is this old (default 1h)")
    p.add_argument("--flush", type=float, default=0.1, metavar="SECONDS",
                   help="write buffered records at least this often (default 0.1): the most "
                        "a kill -9 can lose")
    p.add_argument("--keep", default=None, metavar="DURATION",
                   help="delete sealed segments older than this (e.g. 7d)")
    p.add_argument("--keep-bytes", default=None, metavar="SIZE",
                   help="delete the oldest sealed segments beyond this total size (e.g. 10G)")
    p.add_argument("--block", action="store_true",
                   help="when the broker's queue for the recorder is full, pause the "
                        "publishers (hard 'block' policy) instead of dropping messages for it")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write each sealed segment as zstd Parquet into DIR as it is sealed "
                        "(default: DIR/parquet of the journal; in a thread of its own; what "
                        "sbus.spark.read_journal reads)")
    p.add_argument("--no-export", action="store_true",
                   help="do not write Parquet files beside the journal")
    p.add_argument("--no-fsync", action="store_true",
                   help="do not fsync sealed segments (faster, not crash-safe against power loss)")


def _export_dir(args: argparse.Namespace) -> str | None:
    """Where sealed segments go as Parquet: ``--export DIR``, by default ``parquet/`` in
    the journal; None with ``--no-export``, or (with one line) without pyarrow unless
    ``--export`` asked for it explicitly."""
    if args.no_export:
        if args.export is not None:
            raise SbusError("--export and --no-export contradict each other")
        return None
    if importlib.util.find_spec("pyarrow") is None:
        if args.export is not None:
            raise SbusError(f"--export needs pyarrow: {install_command('spark')}")
        print("sbus record: no Parquet export (pyarrow is not installed: "
              f"{install_command('spark')}; --no-export says this is meant)",
              file=sys.stderr, flush=True)
        return None
    return args.export if args.export is not None else os.path.join(args.dir, EXPORT_SUBDIR)


def _writer_options(args: argparse.Namespace) -> dict:
    export_dir = _export_dir(args)
    try:
        return dict(
            segment_bytes=parse_size(args.segment_size),
            segment_seconds=parse_duration(args.segment_time),
            keep_seconds=None if args.keep is None else parse_duration(args.keep),
            keep_bytes=None if args.keep_bytes is None else parse_size(args.keep_bytes),
            fsync=not args.no_fsync,
            export_dir=export_dir,
        )
    except ValueError as exc:
        raise SbusError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    rlimits.raise_descriptor_limit()  # a long-running command: all the descriptors it may have
    from ..journal.record import record

    options = _writer_options(args)
    return record(args.address, [os.fsencode(p) for p in args.patterns], args.dir,
                  flush=args.flush, block=args.block, **options)
