#!/usr/bin/env python3
"""Fuzz the protocol parser, the routing index and the secret-key rules for a while.

    tools/fuzz.py                      # 60 s per target, coverage-guided (atheris)
    tools/fuzz.py --seconds 600 parser # one target, longer
    tools/fuzz.py --hypothesis         # without atheris: hypothesis, many examples

Every target compares the real code with the reference model in
``tests/reference.py`` (written from the protocol text), so a "crash" is a
disagreement as well as an unexpected exception.  Prints how many inputs each
target ran; exit status 1 if any target found a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

TARGETS = ("parser", "routing", "keys")


# -- targets: one input of bytes each ----------------------------------------------------

def fuzz_parser(data: bytes) -> None:
    from reference import reference_parse

    from sbus.protocol import ProtocolError, encode, parse

    expected = reference_parse(data)
    try:
        got = parse(data)
    except ProtocolError:
        got = None
    if got != expected:
        raise AssertionError(f"parse({data!r}) = {got!r}, protocol text says {expected!r}")
    if got is not None and parse(encode(got)) != got:
        raise AssertionError(f"encode/parse round trip changed {got!r}")


def fuzz_routing(data: bytes) -> None:
    """Bytes decoded as a sequence of operations on a RoutingIndex and the reference Bus."""
    from reference import Bus

    from sbus.routing import RoutingIndex

    sep = b"/" if data[:1] != b"." else b"."
    alphabet = [b"a", b"b", b"*", sep, b"!", b"cred", b"1", b""]
    index: RoutingIndex[int] = RoutingIndex(sep)
    model = Bus(sep)
    i = 1
    while i + 2 <= len(data):
        op, client, n = data[i] % 5, data[i + 1] % 4, data[i + 1] // 64 + 1
        word = b"".join(alphabet[b % len(alphabet)] for b in data[i + 2:i + 2 + n])
        i += 2 + n
        if op == 0 or op == 1:
            index.subscribe(client, word)
            model.subscribe(client, word)
        elif op == 2:
            if index.unsubscribe(client, word) != model.unsubscribe(client, word):
                raise AssertionError(f"unsubscribe {client} {word!r} disagrees")
        elif op == 3:
            if index.remove_client(client) != model.remove_client(client):
                raise AssertionError(f"remove_client {client} disagrees")
        got = index.match(word)
        if len(got) != len(set(got)) or set(got) != model.match(word):
            raise AssertionError(f"match({word!r}) = {got}, model says {model.match(word)}")
    if len(index) != len(model):
        raise AssertionError("subscription counts disagree")


def fuzz_keys(data: bytes) -> None:
    """An accepted pattern must never match a secret key of other credentials."""
    from reference import reference_match

    from sbus.keys import Credentials, KeyRefused, KeyRules

    sep = b"/"
    me = Credentials(1, 2, 12)
    pattern, _, key = data.partition(b"\0")
    if data[:1] == b"\x01":  # steer half the inputs towards secret-looking patterns
        pattern = b"!/cred/" + pattern[1:]
    try:
        accepted = KeyRules(sep).check_pattern(pattern, me)
    except KeyRefused:
        return
    for k in (key, b"!/cred/" + key, b"!/cred/1/2/13/" + key, b"!/cred/1/2/12/" + key):
        if reference_match(accepted, k, sep) and k.startswith(b"!/") \
                and not k.startswith(b"!/cred/1/2/12/"):
            raise AssertionError(f"pattern {pattern!r} (as {accepted!r}) matches secret {k!r}")


FUNCS = {"parser": fuzz_parser, "routing": fuzz_routing, "keys": fuzz_keys}


# -- drivers -------------------------------------------------------------------------------

def run_atheris_child(target: str, libfuzzer_args: list[str]) -> None:
    """Inside the child: instrument sbus and hand control to libFuzzer (which exits)."""
    import atheris

    with atheris.instrument_imports(include=["sbus", "reference"]):
        import reference  # noqa: F401

        import sbus.keys  # noqa: F401
        import sbus.protocol  # noqa: F401
        import sbus.routing  # noqa: F401
    atheris.Setup([sys.argv[0], *libfuzzer_args], FUNCS[target])
    atheris.Fuzz()


def run_atheris(target: str, seconds: int, workdir: Path) -> tuple[int, bool, str]:
    corpus = workdir / target
    corpus.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, __file__, "--child", target, "--",
         f"-max_total_time={seconds}", "-max_len=512", f"-artifact_prefix={workdir}/",
         str(corpus)],
        capture_output=True, text=True)
    done = re.search(r"Done (\d+) runs", proc.stderr)
    progress = re.findall(r"^#(\d+)", proc.stderr, re.M)  # on a crash: the last progress line
    count = int(done.group(1)) if done else max(map(int, progress), default=0)
    ok = proc.returncode == 0
    tail = "" if ok else proc.stderr[-3000:]
    return count, ok, tail


def run_hypothesis(target: str, seconds: int) -> tuple[int, bool, str]:
    """Batches of 2,000 random examples until the time is up (no coverage guidance)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    count = 0
    func = FUNCS[target]

    @settings(max_examples=2000, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(max_size=512))
    def check(data: bytes) -> None:
        nonlocal count
        count += 1
        func(data)

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            check()
        except AssertionError as exc:
            return count, False, str(exc)[-3000:]
    return count, True, ""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_atheris_child(argv[1], argv[3:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("targets", nargs="*", metavar="TARGET",
                    help=f"some of {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    ap.add_argument("--hypothesis", action="store_true",
                    help="use hypothesis even if atheris is installed")
    ap.add_argument("--workdir", default="/tmp/sbus-fuzz", help="corpus and crash artifacts")
    args = ap.parse_args(argv)
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        ap.error(f"unknown target(s) {', '.join(sorted(unknown))}; choose from {TARGETS}")
    try:
        import atheris  # noqa: F401
        engine = "hypothesis" if args.hypothesis else "atheris"
    except ImportError:
        engine = "hypothesis"
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    failed = False
    total = 0
    print(f"{'target':<10} {'engine':<11} {'seconds':>7} {'inputs':>12} {'inputs/s':>10}  result")
    for target in args.targets or TARGETS:
        t0 = time.monotonic()
        if engine == "atheris":
            count, ok, tail = run_atheris(target, args.seconds, workdir)
        else:
            count, ok, tail = run_hypothesis(target, args.seconds)
        took = time.monotonic() - t0
        total += count
        failed |= not ok
        print(f"{target:<10} {engine:<11} {took:>7.0f} {count:>12,} {count / took:>10,.0f}  "
              f"{'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            print(tail)
    print(f"total inputs fuzzed: {total:,}" + ("" if not failed else
                                                f"  (failures: see {workdir}/crash-*)"))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
