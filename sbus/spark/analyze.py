"""``sbus analyze``: traffic statistics of a journal, with Spark.

Batch (default): per-key and per-prefix statistics (messages, payload bytes, first/last
time, mean rate, payload size percentiles) and traffic per time window, written as
Parquet under ``--out`` together with ``report.md`` and a plot ``traffic.png``.

Streaming (``--stream``): per-minute (``--window``) rollups per prefix, published onto the
bus as ``stats/<prefix>`` with a JSON payload once each window is complete (event time
plus ``--late``), through the ``sbus`` sink, so restarts do not publish a window twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sbus.client import SbusError
from sbus.display import printable
from sbus.extras import install_command

STATS_PREFIX = "stats/"


# -- transformations (pure DataFrame -> DataFrame) -----------------------------------------


def with_prefix(df, depth: int):
    """A key's first *depth* segments as ``prefix``; when the key is not UTF-8 and those
    segments are not either, their exact bytes as ``prefix_bytes`` (null otherwise), as
    the source gives ``key_bytes`` beside ``key``.  `substring_index` works on the bytes."""
    from pyspark.sql import functions as F

    prefix = F.substring_index("key", "/", depth)
    df = df.withColumn("prefix", prefix)
    if "key_bytes" not in df.columns:  # (a schema without it: every key exact)
        return df.withColumn("prefix_bytes", F.lit(None).cast("binary"))
    exact = F.substring_index(F.col("key_bytes").cast("string"), "/", depth).cast("binary")
    return df.withColumn("prefix_bytes", F.when(exact != F.encode(prefix, "UTF-8"), exact))


def group_stats(df, *by: str):
    """messages, bytes, first/last ts, mean msg/s and payload size percentiles per group."""
    from pyspark.sql import functions as F

    size = F.length("payload")
    stats = df.groupBy(*by).agg(
        F.count("*").alias("messages"),
        F.sum(size).alias("bytes"),
        F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"),
        F.percentile_approx(size, [0.5, 0.9, 0.99], 10000).alias("pct"),
        F.max(size).alias("max_size"),
    )
    span = F.greatest(F.unix_micros("last_ts") - F.unix_micros("first_ts"), F.lit(1_000_000))
    return stats.select(
        *by, "messages", "bytes", "first_ts", "last_ts",
        (F.col("messages") / (span / 1e6)).alias("msg_per_s"),
        F.col("pct")[0].alias("p50_size"), F.col("pct")[1].alias("p90_size"),
        F.col("pct")[2].alias("p99_size"), "max_size",
    )


def window_stats(df, window: str):
    """Traffic per time window and prefix."""
    from pyspark.sql import functions as F

    return (df.groupBy(F.window("ts", window).alias("w"), "prefix", "prefix_bytes")
            .agg(F.count("*").alias("messages"), F.sum(F.length("payload")).alias("bytes"))
            .select(F.col("w.start").alias("window_start"), F.col("w.end").alias("window_end"),
                    "prefix", "prefix_bytes", "messages", "bytes"))


def rollups(df, window: str, late: str):
    """Streaming rollups as sink rows: key ``stats/<prefix>``, JSON payload."""
    from pyspark.sql import functions as F

    agg = (df.withWatermark("ts", late)
           .groupBy(F.window("ts", window).alias("w"), "prefix")
           .agg(F.count("*").alias("messages"), F.sum(F.length("payload")).alias("bytes")))
    body = F.struct(
        F.col("prefix"),
        F.date_format("w.start", "yyyy-MM-dd'T'HH:mm:ss'Z'").alias("window_start"),
        F.date_format("w.end", "yyyy-MM-dd'T'HH:mm:ss'Z'").alias("window_end"),
        "messages", "bytes")
    return agg.select(F.concat(F.lit(STATS_PREFIX), "prefix").alias("key"),
                      F.encode(F.to_json(body), "UTF-8").alias("payload"))


# -- batch -----------------------------------------------------------------------------------

#: Window lengths `sbus analyze` picks from (seconds), for about `WINDOWS` windows per span.
NICE_WINDOWS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
                86400, 604800)
WINDOWS = 60
OUTPUTS = ("keys.parquet", "prefixes.parquet", "windows.parquet", "report.md", "traffic.png")


def pick_window(span_s: float) -> int:
    """A round window length giving about `WINDOWS` windows over *span_s* seconds."""
    want = span_s / WINDOWS
    return next((w for w in NICE_WINDOWS if w >= want), NICE_WINDOWS[-1])


def window_text(seconds: int) -> str:
    for unit, n in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds % n == 0:
            k = seconds // n
            return f"{k} {unit}{'s' if k != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


class Progress:
    """One line per step on stderr, with the time since the start."""

    def __init__(self, quiet: bool = False) -> None:
        self.started = time.monotonic()
        self.quiet = quiet

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(f"sbus analyze: {time.monotonic() - self.started:5.1f}s  {text}",
                  file=sys.stderr, flush=True)


def journal_facts(journal: str) -> dict:
    """From the segment index, without Spark: first and last receive time (ns), rows,
    sequence gaps (rows removed by retention in the middle, or moved aside as damaged), and
    where the recorder missed messages (``gaps.jsonl``: a list of `Gap`, or the one line
    saying why it cannot be read)."""
    from sbus.journal.read import read_gaps
    from sbus.journal.store import JournalError
    from sbus.spark.offsets import START, gaps
    from sbus.spark.source import journal_view

    view = journal_view(journal)
    blocks = [b for _, bs in view for b in bs]
    try:
        missed: list | str = [g for g in read_gaps(journal)
                              if blocks and g.before > blocks[0].first_seq]
    except JournalError as exc:
        missed = str(exc)
    if not blocks:
        return {"first_ns": None, "last_ns": None, "rows": 0, "gaps": [], "missed": missed}
    end = blocks[-1].next_seq
    return {"first_ns": min(b.min_ts for b in blocks), "last_ns": max(b.max_ts for b in blocks),
            "rows": sum(b.count for b in blocks), "gaps": gaps(view, START.seq, end),
            "missed": missed}


def _partition_gaps(batches):
    """mapInArrow: per Spark partition, its first and last row and the longest pause
    between consecutive rows inside it (rows of a partition in ``seq`` order)."""
    import numpy as np
    import pyarrow as pa

    seqs, times = [], []
    for b in batches:
        seqs.append(b.column("seq").to_numpy(zero_copy_only=False))
        times.append(b.column("ts").cast(pa.int64()).to_numpy(zero_copy_only=False))
    if not seqs or not sum(map(len, seqs)):
        return
    seq = np.concatenate(seqs)
    ts = np.concatenate(times)
    order = np.argsort(seq, kind="stable")
    seq, ts = seq[order], ts[order]
    gap, at = 0, 0
    if len(ts) > 1:
        d = np.diff(ts)
        at = int(np.argmax(d))
        gap = int(d[at])
    yield pa.RecordBatch.from_pydict({
        "first_seq": [int(seq[0])], "first_us": [int(ts[0])], "last_seq": [int(seq[-1])],
        "last_us": [int(ts[-1])], "gap_us": [gap], "gap_from_us": [int(ts[at])],
        "gap_to_us": [int(ts[at + 1]) if len(ts) > 1 else int(ts[0])]})


def longest_gap(df) -> tuple[float, int, int] | None:
    """The longest pause between consecutive messages of *df* (by sequence number):
    ``(seconds, from_us, to_us)``, exact, in one pass over the partitions (each gives its
    own longest pause and its first and last row; the driver joins their edges).  None
    for fewer than two messages."""
    parts = sorted(df.select("seq", "ts").mapInArrow(
        _partition_gaps, "first_seq long, first_us long, last_seq long, last_us long, "
        "gap_us long, gap_from_us long, gap_to_us long").collect(), key=lambda r: r.first_seq)
    if not parts or (len(parts) == 1 and parts[0].first_seq == parts[0].last_seq):
        return None
    best = max((r.gap_us, r.gap_from_us, r.gap_to_us) for r in parts)
    for a, b in zip(parts, parts[1:], strict=False):
        best = max(best, (b.first_us - a.last_us, a.last_us, b.first_us))
    return best[0] / 1e6, best[1], best[2]


def analyze(spark, journal: str, out: str | os.PathLike, *, pattern: str | None = None,
            window: str | None = None, depth: int = 1, progress: Progress | None = None,
            skip_lost: bool = False) -> dict:
    """Run the batch analysis into *out*; returns a summary (also written into the report).

    Everything is written into a temporary directory next to *out* and moved into place
    at the end, so an interrupted run leaves no half report (and the previous one intact)."""
    from pyspark.sql import functions as F

    say = progress or Progress(quiet=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        say("reading the journal's index")
        facts = journal_facts(journal)
        span_s = ((facts["last_ns"] - facts["first_ns"]) / 1e9) if facts["rows"] else 0.0
        seconds = pick_window(span_s) if window is None else _window_seconds(window)
        wtext = window_text(seconds)
        reader = spark.read.format("sbus").option("failOnDataLoss", str(not skip_lost))
        if pattern is not None:
            reader = reader.option("pattern", pattern)
        df = with_prefix(reader.load(journal), depth).cache()
        try:
            say(f"per-key statistics of {facts['rows']:,} messages")
            group_stats(df, "key", "key_bytes").write.parquet(str(work / "keys.parquet"))
            say("per-prefix statistics")
            group_stats(df, "prefix", "prefix_bytes").write.parquet(
                str(work / "prefixes.parquet"))
            say(f"traffic per {wtext}")
            window_stats(df, f"{seconds} seconds").write.parquet(str(work / "windows.parquet"))
            say("the longest pause between messages")
            gap = longest_gap(df)
        finally:
            df.unpersist()
        say("writing the report")
        read = spark.read.parquet
        keys = read(str(work / "keys.parquet"))
        prefixes = read(str(work / "prefixes.parquet"))
        top_keys = keys.orderBy("messages", ascending=False).limit(20).collect()
        top_prefixes = prefixes.orderBy("messages", ascending=False).limit(20).collect()
        traffic = read(str(work / "windows.parquet")).orderBy("window_start").collect()
        totals = prefixes.agg(F.sum("messages"), F.sum("bytes"), F.count("*"),
                              F.min("first_ts"), F.max("last_ts")).first()
        stale_after = max(3 * seconds, span_s / 10)
        last = totals[4]
        stale = [] if last is None else keys.where(
            F.col("last_ts") < F.lit(last) - F.expr(f"make_interval(0,0,0,0,0,0,{stale_after})")
        ).orderBy("last_ts").limit(20).collect()
        summary = {
            "journal": str(journal),
            "messages": int(totals[0] or 0),
            "bytes": int(totals[1] or 0),
            "keys": keys.count(),
            "prefixes": int(totals[2]),
            "first": totals[3],
            "last": last,
            "window": wtext,
            "longest_gap_s": None if gap is None else round(gap[0], 6),
        }
        first_last = (facts["first_ns"], facts["last_ns"])
        series = window_series(traffic, seconds, first_last)
        plot = plot_traffic(series, work / "traffic.png", wtext, gap)
        silent = silent_periods(series["total"], series["starts"], seconds)
        (work / "report.md").write_text(render_report(
            summary, top_keys, top_prefixes, wtext, plot, stale=stale,
            stale_after=stale_after, gaps=facts["gaps"], silent=silent, longest=gap,
            missed=facts["missed"]))
        for name in OUTPUTS:  # into place; the previous report's files go only now
            target = out / name
            if (work / name).exists():
                out.mkdir(exist_ok=True)
                if target.is_dir():
                    shutil.rmtree(target)
                os.replace(work / name, target)
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)


_UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}


def _window_seconds(text: str) -> int:
    """``--window``: Spark's words (``1 minute``, ``10 seconds``) or an sbus duration
    (``10s``, ``5min``, ``1h``)."""
    from sbus.defaults import parse_duration

    m = re.fullmatch(r"\s*(\d+)\s*(second|minute|hour|day|week)s?\s*", text.lower())
    if m:
        return int(m[1]) * _UNITS[m[2]]
    try:
        return max(1, round(parse_duration(text)))
    except ValueError:
        raise SbusError(f"--window: {text!r} is not a duration (e.g. 10s, 5min, "
                        "'1 minute')") from None


def window_series(traffic: list, seconds: int, first_last: tuple) -> dict:
    """Messages per second in every window of the span (zero where nothing came), total and
    per prefix; windows only partly inside the journal's span are marked ``partial`` and
    their rate is over the part inside, so an edge does not look like a drop."""
    from datetime import datetime

    if not traffic or first_last[0] is None:
        return {"starts": [], "total": [], "bytes": [], "prefixes": {}, "partial": []}
    step = seconds
    t0 = min(r["window_start"] for r in traffic)
    t1 = max(r["window_start"] for r in traffic)
    n = int((t1 - t0).total_seconds() // step) + 1
    starts = [t0 + _td(i * step) for i in range(n)]
    # Naive local times, as PySpark's collect() gives timestamps.
    first = datetime.fromtimestamp(first_last[0] / 1e9)
    last = datetime.fromtimestamp(first_last[1] / 1e9)
    covered = []
    for s in starts:
        e = s + _td(step)
        inside = (min(e, last) - max(s, first)).total_seconds()
        covered.append(max(inside, 1e-3) if s < first or e > last else float(step))
    counts: dict[str, list[float]] = {}
    nbytes = [0.0] * n
    for r in traffic:
        i = int((r["window_start"] - t0).total_seconds() // step)
        counts.setdefault(exact(r, "prefix"), [0.0] * n)[i] += r["messages"]
        try:
            nbytes[i] += r["bytes"] or 0
        except (KeyError, ValueError):  # a traffic row without bytes
            pass
    rates = {p: [c / covered[i] for i, c in enumerate(v)] for p, v in counts.items()}
    total = [sum(v[i] for v in counts.values()) / covered[i] for i in range(n)]
    partial = [c < step for c in covered]
    return {"starts": starts, "total": total, "bytes": [b / c for b, c in zip(nbytes, covered,
                                                                               strict=True)],
            "prefixes": rates, "partial": partial}


def _td(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


def silent_periods(total: list[float], starts: list, seconds: int) -> list[tuple]:
    """Runs of whole windows with no message at all: ``(start, end, windows)``."""
    out = []
    run = None
    for i, rate in enumerate(total):
        if rate == 0 and run is None:
            run = i
        elif rate != 0 and run is not None:
            out.append((starts[run], starts[i], i - run))
            run = None
    return out


#: Prefixes drawn as small multiples, busiest first; beyond them one panel of the rest.
PANELS = 12


def traffic_figure(series: dict, window: str, gap: tuple | None = None):
    """The plot as a matplotlib figure: messages and payload bytes per second over time
    for all keys on top (the longest pause between messages shaded), then the busiest
    prefixes as small multiples, each its own scale, so a quiet prefix is not flattened
    by a loud one (`PANELS`; more prefixes than that: the rest summed in the last).
    Legends sit above their panels, never over the data."""
    import matplotlib

    matplotlib.use("Agg")
    from datetime import datetime

    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    starts, partial = series["starts"], series["partial"]
    step = (starts[1] - starts[0]) if len(starts) > 1 else _td(1)
    xs = [*starts, starts[-1] + step]  # each window drawn as a step across its width
    by_size = sorted(series["prefixes"], key=lambda p: -sum(series["prefixes"][p]))
    panels = [(f"prefix {_label(p)}: msg/s", series["prefixes"][p]) for p in by_size]
    if len(panels) > PANELS:
        rest = by_size[PANELS - 1:]
        summed = [sum(series["prefixes"][p][i] for p in rest) for i in range(len(starts))]
        panels = [*panels[:PANELS - 1], (f"the other {len(rest):,} prefixes: msg/s", summed)]
    cols = 3 if len(panels) > 8 else 2
    rows = -(-len(panels) // cols)
    fig = plt.figure(figsize=(11 if cols == 2 else 14, 6.0 + 1.9 * rows))
    grid = fig.add_gridspec(2 + rows, cols, height_ratios=[1.6, 1.2] + [1] * rows)
    thousands = FuncFormatter(lambda v, _: "0" if v == 0 else
                              f"{v:,.0f}" if v >= 10 else f"{v:,.1f}")

    def draw(ax, ys, title, color):
        ax.plot(xs, [*ys, ys[-1]], color=color, linewidth=1.6, drawstyle="steps-post")
        edge = [i for i, p in enumerate(partial) if p]
        ax.plot([starts[i] + step / 2 for i in edge], [ys[i] for i in edge], linestyle="none",
                marker="o", markerfacecolor="white", markeredgecolor=color, markersize=6,
                label="partial window: rate over the part recorded")
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(thousands)
        locator = mdates.AutoDateLocator(maxticks=8)
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        ax.set_title(title, fontsize="medium", loc="left")
        ax.grid(alpha=0.3)

    top = fig.add_subplot(grid[0, :])
    draw(top, series["total"], f"all keys: messages per second (windows of {window})",
         "black")
    if gap is not None and gap[0] > 0:  # local naive times, as the series' starts
        top.axvspan(datetime.fromtimestamp(gap[1] / 1e6), datetime.fromtimestamp(gap[2] / 1e6),
                    color="red", alpha=0.25, label=f"longest pause: {_seconds(gap[0])}")
    # Above the panel, right of its title: a legend inside the axes covers a peak.
    top.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize="small", ncol=2,
               frameon=False, borderaxespad=0.2)
    volume = fig.add_subplot(grid[1, :], sharex=top)
    draw(volume, series["bytes"], "all keys: payload bytes per second", "C7")
    for i, (title, ys) in enumerate(panels):
        ax = fig.add_subplot(grid[2 + i // cols, i % cols], sharex=top)
        draw(ax, ys, title, f"C{i % 10}")
    fig.suptitle(f"sbus traffic ({time.strftime('%Z')})", fontsize="large")
    fig.tight_layout()
    return fig


def plot_traffic(series: dict, path: Path, window: str, gap: tuple | None = None) -> str | None:
    """`traffic_figure` as a PNG at *path*; its name (None: nothing to draw)."""
    if not series["starts"]:
        return None
    import matplotlib.pyplot as plt

    fig = traffic_figure(series, window, gap)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _seconds(value: float) -> str:
    return f"{value:,.3f} s" if value < 10 else f"{value:,.1f} s"


def exact(row, name: str) -> str | bytes:
    """A key's or prefix's exact bytes where it is not UTF-8 (``NAME_bytes``), else its
    text: a report shows ``\\xff``, not the U+FFFD that Spark's string holds."""
    try:
        raw = row[name + "_bytes"]
    except (KeyError, ValueError):  # a table without the column (a Row says ValueError)
        raw = None
    return bytes(raw) if raw is not None else row[name]


def _row(cols: list) -> str:
    return "| " + " | ".join(str(c) for c in cols) + " |"


def _code(text: str | bytes, limit: int = 120) -> str:
    """Client text as a code span that stays inside its table cell: control bytes and
    newlines escaped (`printable`), pipes escaped, and a fence longer than any run of
    backticks in it, so a key cannot end the span, split the row or leave the table."""
    shown = printable(text, limit).replace("|", "\\|")
    runs = [len(r) for r in re.findall("`+", shown)]
    fence = "`" * (max(runs, default=0) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def _label(text: str | bytes) -> str:
    """A legend label: escaped, short, and with ``$`` taken literally (not mathtext)."""
    return printable(text, 40).replace("$", r"\$") or "(empty)"


def _n(value) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _rate(value: float) -> str:
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def render_report(summary: dict, keys: list, prefixes: list, window: str,
                  plot: str | None, *, stale: list = (), stale_after: float = 0,
                  gaps: list = (), silent: list = (), longest: tuple | None = None,
                  missed: list | str = ()) -> str:
    lines = [
        "# sbus traffic report", "",
        f"Journal: {_code(str(summary['journal']), 300)}  ",
        f"Messages: {_n(summary['messages'])}, payload bytes: {_n(summary['bytes'])}, "
        f"distinct keys: {_n(summary['keys'])}, prefixes: {_n(summary['prefixes'])}  ",
        f"From {summary['first']} to {summary['last']} (UTC)", "",
    ]
    if plot:
        lines += [f"![messages per second, windows of {window}]({plot})", "",
                  "Hollow markers: windows only partly inside the recording (their rate is "
                  "over the part recorded).", ""]
    head = ["messages", "msg/s", "bytes", "p50 B", "p90 B", "p99 B", "max B"]

    def stats(r) -> list:
        return [_n(r["messages"]), _rate(r["msg_per_s"]), _n(r["bytes"]), _n(r["p50_size"]),
                _n(r["p90_size"]), _n(r["p99_size"]), _n(r["max_size"])]

    lines += ["## Busiest prefixes", "", _row(["prefix", *head]), _row(["---"] * 8)]
    lines += [_row([_code(exact(r, "prefix")), *stats(r)]) for r in prefixes]
    lines += ["", "## Busiest keys", "", _row(["key", *head]), _row(["---"] * 8)]
    lines += [_row([_code(exact(r, "key")), *stats(r)]) for r in keys]
    lines += ["", "## Stale keys", ""]
    if stale:
        lines += [f"Keys with no message in the last {window_text(round(stale_after))} of "
                  "the recording (oldest first):", "",
                  _row(["key", "last message (UTC)", "messages"]), _row(["---"] * 3)]
        lines += [_row([_code(exact(r, "key")), r["last_ts"], _n(r["messages"])])
                  for r in stale]
    else:
        lines += ["None: every key sent a message near the end of the recording."]
    lines += ["", "## Drops and gaps", ""]
    if gaps:
        lines += ["Sequence numbers missing from the journal (removed by retention between "
                  "other segments, or set aside as damaged):", ""]
        lines += [f"* seq {lo:,}..{hi - 1:,}: {hi - lo:,} messages" for lo, hi in gaps[:20]]
        lines += [""]
    else:
        lines += ["No sequence gaps: every message from the first to the last recorded one "
                  "is in the journal.", ""]
    if longest is not None:
        from datetime import UTC, datetime

        def when(us: int) -> str:
            return datetime.fromtimestamp(us / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")

        lines += [f"Longest pause between two consecutive messages: **{_seconds(longest[0])}**, "
                  f"from {when(longest[1])} to {when(longest[2])} UTC (shaded red in the "
                  "plot).", ""]
    if silent:
        lines += [f"Silent periods (whole windows of {window} with no message at all):", ""]
        lines += [f"* {a} to {b} UTC ({_n(n)} windows)" for a, b, n in silent[:20]]
    else:
        lines += [f"No whole window of {window} without a message (a shorter pause shows "
                  "above, as the longest pause)."]
    lines += ["", *_missed_lines(missed), "",
              "Full tables: `keys.parquet`, `prefixes.parquet`, `windows.parquet`.", ""]
    return "\n".join(lines)


def _missed_lines(missed: list | str) -> list[str]:
    """What the recorder noted it missed (`sbus.journal.gaps`): the first 20, and totals."""
    from sbus.journal.gaps import said
    from sbus.journal.read import describe_gap

    if isinstance(missed, str):
        return [f"Where the recorder missed messages is not known: {_code(missed, 300)}"]
    if not missed:
        return ["The recorder noted no message missed (none dropped for it, none too large, "
                "the broker and the recorder there throughout)."]
    lines = [f"Where the recorder missed messages ({said(missed)}; `sbus journal gaps`):",
             ""]
    lines += [f"* {describe_gap(g)}" for g in missed[:20]]
    if len(missed) > 20:
        lines += [f"* … and {_n(len(missed) - 20)} more"]
    return lines


# -- streaming -------------------------------------------------------------------------------


def start_stream(spark, journal: str, checkpoint: str, address: str | None, *,
                 window: str = "1 minute", late: str = "10 seconds", depth: int = 1,
                 trigger: str = "10 seconds", max_rows: int | None = None,
                 pattern: str | None = None, skip_lost: bool = False):
    """Start the rollup query; returns the StreamingQuery."""
    from pyspark.sql import functions as F

    reader = spark.readStream.format("sbus").option("path", journal) \
        .option("failOnDataLoss", str(not skip_lost))
    if pattern is not None:
        reader = reader.option("pattern", pattern)
    if max_rows is not None:
        reader = reader.option("maxRowsPerTrigger", str(max_rows))
    df = reader.load().where(~F.col("key").startswith(STATS_PREFIX))  # not our own output
    writer = (rollups(with_prefix(df, depth), window, late).writeStream.format("sbus")
              .outputMode("append").option("checkpointLocation", checkpoint))
    if address is not None:
        writer = writer.option("address", address)
    if trigger == "available-now":
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=trigger)
    return writer.start()


def run(journal: str, *, out: str | None = None, pattern: str | None = None,
        window: str | None = None, depth: int = 1, master: str | None = None,
        stream: bool = False, checkpoint: str | None = None, address: str | None = None,
        late: str = "10 seconds", trigger: str = "10 seconds", max_rows: int | None = None,
        verbose: int = 0, skip_lost: bool = False) -> int:
    """``sbus analyze`` (`sbus.cmd.analyze` parses its options): the batch report into
    *out*, or with *stream* the rollups onto the bus; the exit status."""
    if depth < 1:
        raise SbusError("--prefix-depth must be at least 1")
    if not Path(journal).is_dir():
        raise SbusError(f"no journal directory at {journal}")
    if stream:
        if not checkpoint:
            raise SbusError("--stream needs --checkpoint DIR")
    elif not out:
        raise SbusError("batch analysis needs --out DIR (or use --stream)")
    if window is not None:
        _window_seconds(window)  # a bad --window fails before Spark starts
    try:
        import pyarrow  # noqa: F401
        import pyspark  # noqa: F401
    except ImportError as exc:
        raise SbusError(f"needs the spark extra ({exc.name} is not installed): "
                        f"{install_command('spark')}, and a Java 17 runtime") from None
    import logging
    import warnings

    from sbus.spark.session import get_session

    if not verbose:  # py4j logs every broken connection of an interrupted job, on root
        if not logging.getLogger().handlers:
            logging.basicConfig(format="%(name)s: %(message)s")
        for handler in logging.getLogger().handlers:
            handler.addFilter(lambda r: "py4j" not in r.pathname)
        logging.getLogger("py4j").setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", module="pyspark")
    from pyspark.errors import PySparkException, PythonException

    progress = Progress()
    spark = None
    try:
        progress("starting Spark")
        spark = get_session(master, "sbus analyze", quiet=not verbose)
        if stream:
            every = "1 minute" if window is None else f"{_window_seconds(window)} seconds"
            query = start_stream(spark, journal, checkpoint, address, window=every,
                                 late=late, depth=depth, trigger=trigger, max_rows=max_rows,
                                 pattern=pattern, skip_lost=skip_lost)
            progress("streaming rollups onto the bus (Ctrl-C stops)")
            try:
                query.awaitTermination()
            finally:
                query.stop()
            return 0
        summary = analyze(spark, journal, out, pattern=pattern, window=window, depth=depth,
                          progress=progress, skip_lost=skip_lost)
        progress(f"done: {summary['messages']:,} messages, {summary['keys']:,} keys; "
                 f"report in {Path(out) / 'report.md'}")
        print(json.dumps({**summary, "first": str(summary["first"]),
                          "last": str(summary["last"]),
                          "seconds": round(time.monotonic() - progress.started, 1)}))
        return 0
    except PythonException as exc:  # a worker's error, e.g. a damaged journal block
        raise SbusError(f"reading {journal} failed: {_worker_error(exc)}") from None
    except PySparkException as exc:  # the planner's: rows lost (`DataLoss`), say
        line = _worker_error(exc)
        if "rows lost" not in line:
            raise
        raise SbusError(f"reading {journal} failed: {line.split('; set option')[0]} "
                        f"(sbus journal gaps {printable(journal, 200)} says why; "
                        "--skip-lost reads past them)") from None
    except KeyboardInterrupt:
        _quiet_stop(spark)
        print("sbus analyze: interrupted; no report written" if not stream else
              "sbus analyze: interrupted", file=sys.stderr)
        return 130


def _worker_error(exc: Exception) -> str:
    """The line of a Python worker's traceback that says what failed (ours: an
    `SbusError` such as a damaged block), briefly and printable; else its last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    ours = [line for line in lines
            if re.match(r"[\w.]*(JournalError|SbusError|DataLoss): ", line)]
    line = (ours or lines or [type(exc).__name__])[-1]
    return printable(line.split(": ", 1)[1] if ours else line, 300)


def _quiet_stop(spark) -> None:
    """Stop Spark after Ctrl-C without its noise: a second Ctrl-C is ignored meanwhile, and
    what the stopping JVM and py4j print goes nowhere."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    os.dup2(devnull, 2)
    try:
        if spark is not None:
            spark.sparkContext.cancelAllJobs()
            spark.stop()
    except Exception:  # noqa: BLE001 - the JVM may already be going; nothing to report
        pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
