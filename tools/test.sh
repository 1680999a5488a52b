#!/usr/bin/env bash
# Set everything up (tools/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
