#!/usr/bin/env bash
# Install everything the tests need (tools/setup.sh test) and run the whole suite.
# It passes detached too: setsid ./tools/test.sh </dev/null (tests/test_detached.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh test
export PATH="$PWD/.venv/bin:$PATH"
# Two workers, a file each at a time (pytest-xdist): the suite mostly waits on the processes
# it starts, so two halve its time on two cores; a file stays in one worker, so its
# module fixtures (one Spark session, one container) are made once.  SBUS_TEST_WORKERS=0
# runs it in this process.
exec .venv/bin/python -m pytest -n "${SBUS_TEST_WORKERS:-2}" --dist loadfile "$@"
