#!/usr/bin/env bash
# Install everything the tests need (tools/setup.sh test) and run the whole suite.
# It passes detached too: setsid ./tools/test.sh </dev/null (tests/test_detached.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh test
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
