#!/usr/bin/env bash
# Set everything up (tools/setup.sh) and run the bus in the foreground on
# $SBUS_ADDRESS (default /run/sbus.socket). Other shells then use `sbus pub`/`sbus sub`.
set -euo pipefail
cd "$(dirname "$0")/.."
./tools/setup.sh
exec .venv/bin/sbus serve "$@"
