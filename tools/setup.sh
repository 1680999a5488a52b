#!/usr/bin/env bash
# Install everything sbus needs on a fresh Debian bookworm machine (run as root):
# the Debian packages its parts and tests use, then a virtualenv in .venv with
# sbus installed (editable) and every optional part.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(
    fuse3 libfuse3-dev pkg-config           # pyfuse3 compiles against libfuse3
    libsystemd-dev                          # systemd-python compiles against it
    systemd systemd-container debootstrap   # socket activation, user manager, nspawn
    tmux                                    # sbus-top end-to-end tests
    zsh man-db groff-base                   # completion and man page tests
    mosquitto                               # benchmark reference broker
    openjdk-17-jre-headless                 # Spark
    gcc libc6-dev                           # the C reference broker and load generator
)
missing=()
for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# mosquitto is for benchmarks only: never leave the packaged daemon running.
systemctl disable --now mosquitto >/dev/null 2>&1 || true

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e '.[fuse,spark,dev,bridge]'
# Put the commands on PATH for everyone when we may (root on a machine of our own).
if [ "$(id -u)" = 0 ] && [ -w /usr/local/bin ]; then
    for cmd in sbus sbus-top; do ln -sfn "$(pwd)/.venv/bin/$cmd" "/usr/local/bin/$cmd"; done
fi
echo "sbus set up in $(pwd)/.venv"
