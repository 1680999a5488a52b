#!/usr/bin/env bash
# Install everything the tests need (tools/setup.sh test) and run the whole suite.
# It passes detached too: setsid ./tools/test.sh </dev/null (tests/test_detached.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh test
export PATH="$PWD/.venv/bin:$PATH"
# Four workers, a file each at a time (pytest-xdist): the suite mostly waits on the
# processes it starts (with two workers it kept two cores 48 % busy: 11:13 against 8:55
# with four), and a file stays in one worker, so its module fixtures (one Spark session,
# one container) are made once.  Tests that bound latency by the wall clock still run
# alone (the `alone` marker, tests/conftest.py).  SBUS_TEST_WORKERS=0 runs it in this
# process.
exec .venv/bin/python -m pytest -n "${SBUS_TEST_WORKERS:-4}" --dist loadfile "$@"
