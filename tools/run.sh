#!/usr/bin/env bash
# Install only what running the bus needs (tools/setup.sh run) and run the broker in
# the foreground on $SBUS_ADDRESS (default /run/sbus.socket).  Other shells then use
# .venv/bin/sbus pub / sub.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh run
exec .venv/bin/sbus serve "$@"
