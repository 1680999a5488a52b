"""The ``sbus`` source's read options, checked: names as Kafka's source spells them where
the idea is the same, and an unknown name is an error naming the nearest valid one (a
misspelt ``maxRowsPerTriger`` silently ignored reads everything at once)."""

from __future__ import annotations

import difflib
import json
import os
from datetime import UTC, datetime

from ..defaults import decimal, parse_size
from ..journal.arrow import pattern_bytes

__all__ = ["ReadOptions", "OPTIONS", "Position"]

#: Every read option, as documented (docs/spark.md); Spark passes names lower-cased.
OPTIONS = ("path", "pattern", "patternHex", "maxPartitionBytes", "minPartitions", "verify",
           "startingSeq", "endingSeq", "startingTimestamp", "endingTimestamp",
           "startingOffsets", "endingOffsets", "maxRowsPerTrigger", "maxOffsetsPerTrigger",
           "failOnDataLoss", "pushdown")
_CANONICAL = {name.lower(): name for name in OPTIONS}


class Position:
    """Where a read starts or ends: ``earliest``, ``latest``, a sequence number, or the
    first row received at or after a time (nanoseconds)."""

    def __init__(self, kind: str, value: int = 0) -> None:
        self.kind, self.value = kind, value

    def __repr__(self) -> str:
        return f"Position({self.kind!r}, {self.value})"


def _bool(name: str, value: str | None, default: bool) -> bool:
    if value is None:
        return default
    if value.lower() not in ("true", "false"):
        raise ValueError(f"option {name} must be true or false, got {value!r}")
    return value.lower() == "true"


def _positive(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"option {name} must be a whole number, got {value!r}") from None
    if n <= 0:
        raise ValueError(f"option {name} must be positive, got {n}")
    return n


def _time_ns(name: str, value: str) -> int:
    """Milliseconds since the epoch (as Kafka's ``startingTimestamp``) or an ISO 8601 time
    (UTC unless it says otherwise)."""
    text = value.strip()
    if decimal(text.lstrip("-")):
        return int(text) * 1_000_000
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"option {name} must be milliseconds since the epoch or an ISO 8601 "
                         f"time such as 2026-05-01T12:00:00Z, got {value!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(t.timestamp()) * 1_000_000_000 + t.microsecond * 1000


def _offsets(name: str, value: str) -> Position:
    text = value.strip()
    if text.lower() in ("earliest", "latest"):
        return Position(text.lower())
    try:
        doc = json.loads(text)
        return Position("seq", int(doc["seq"]))
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"option {name} must be earliest, latest or an offset such as "
                         f'{{"seq": 1234}}, got {value!r}') from None


class ReadOptions:
    """The options of one read, parsed once on the driver (and pickled to the tasks)."""

    def __init__(self, options, streaming: bool) -> None:
        unknown = [k for k in options if k.lower() not in _CANONICAL]
        if unknown:
            hints = []
            for k in unknown:
                near = difflib.get_close_matches(k.lower(), _CANONICAL, 1, 0.6)
                hints.append(f"{k!r}" + (f" (did you mean {_CANONICAL[near[0]]}?)" if near
                                          else ""))
            raise ValueError(f"unknown option(s) of the sbus source: {', '.join(hints)}; "
                             f"valid: {', '.join(OPTIONS)}")
        self.path = options.get("path")
        if not self.path:
            raise ValueError("the sbus source needs a journal directory: "
                             "spark.read.format('sbus').load(DIR) or option('path', DIR)")
        self.pattern = pattern_bytes(options.get("pattern"))
        if options.get("patternHex") is not None:  # non-UTF-8 patterns (py4j carries text)
            try:
                self.pattern = bytes.fromhex(options["patternHex"])
            except ValueError:
                raise ValueError("patternHex must be hexadecimal bytes, e.g. 'fffe2f'") from None
        self.max_bytes = parse_size(options.get("maxPartitionBytes", "128M"))
        if self.max_bytes <= 0:
            raise ValueError("option maxPartitionBytes must be positive")
        self.min_partitions = _positive("minPartitions", options.get("minPartitions")) or \
            os.cpu_count() or 1
        verify = options.get("verify")
        self.verify = None if verify is None else _bool("verify", verify, True)
        self.fail_on_data_loss = _bool("failOnDataLoss", options.get("failOnDataLoss"), True)
        # Off by default: PySpark <= 4.3 keeps the read planned with pushed filters on the
        # DataFrame's data source object, and every other scan of that DataFrame that pushes
        # nothing (a later query, or a sibling in a union or self-join) reads it, getting
        # the pushing query's rows; no source can tell (docs/spark.md, "Filter pushdown").
        self.pushdown = _bool("pushdown", options.get("pushdown"), False)
        rows = [n for n in ("maxRowsPerTrigger", "maxOffsetsPerTrigger") if n in options]
        if len(rows) > 1:
            raise ValueError("maxOffsetsPerTrigger is another name for maxRowsPerTrigger: "
                             "give one")
        self.max_rows = _positive(rows[0], options.get(rows[0])) if rows else None
        self.starting = self._position(options, "starting")
        self.ending = self._position(options, "ending")
        if not streaming and self.starting.kind == "latest":
            raise ValueError("startingOffsets=latest is for streaming; a batch read from "
                             "latest reads nothing")
        if self.ending.kind == "earliest":
            raise ValueError("endingOffsets=earliest reads nothing; give latest, a seq or "
                             "a time")

    @staticmethod
    def _position(options, which: str) -> Position:
        given = {n: options[n] for n in (f"{which}Seq", f"{which}Timestamp", f"{which}Offsets")
                 if options.get(n) is not None}
        if len(given) > 1:
            raise ValueError(f"give one of {', '.join(given)}: they all say where the read "
                             f"{'starts' if which == 'starting' else 'ends'}")
        if not given:
            return Position("earliest" if which == "starting" else "latest")
        name, value = next(iter(given.items()))
        if name.endswith("Seq"):
            try:
                return Position("seq", int(value))
            except ValueError:
                raise ValueError(f"option {name} must be a sequence number, got "
                                 f"{value!r}") from None
        if name.endswith("Timestamp"):
            return Position("time", _time_ns(name, value))
        return _offsets(name, value)
