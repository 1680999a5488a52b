#!/usr/bin/env bash
# Install what sbus needs on a Debian bookworm machine (run as root), into .venv:
#
#   tools/setup.sh run     what running the bus needs: the core (broker, client, CLI)
#   tools/setup.sh test    (default) everything the tests need: every Debian package
#                          below, every extra and the dev tools
#
# Nothing is installed outside the checkout but Debian packages: the commands stay in
# .venv/bin (put it on PATH), so no global link can outlive the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=${1:-test}

RUN_APT_PACKAGES=(
    python3 python3-venv                    # the core needs nothing compiled (see below)
)
APT_PACKAGES=(
    fuse3 libfuse3-dev pkg-config           # pyfuse3 compiles against libfuse3
    libsystemd-dev                          # systemd-python compiles against it
    systemd systemd-container debootstrap   # socket activation, user manager, nspawn
    tmux                                    # sbus-top end-to-end tests
    zsh man-db groff-base                   # completion and man page tests
    mosquitto                               # benchmark reference broker
    openjdk-17-jre-headless                 # Spark
    gcc libc6-dev                           # the C reference broker and load generator, sbus/_sendeach.c
    # tools/build-deb.sh and tests/test_deb.py: the package's build tools, and Debian's
    # python3 with the packages the .deb depends on (debian/control Build-Depends)
    debhelper dh-python lintian dpkg-dev python3-pip python3-dev
    python3-h11 python3-idna python3-msgpack python3-numpy python3-outcome python3-rich
    python3-sortedcontainers
)
case $profile in
    run) wanted=("${RUN_APT_PACKAGES[@]}"); extras="" ;;
    test) wanted=("${RUN_APT_PACKAGES[@]}" "${APT_PACKAGES[@]}"); extras="[all,dev]" ;;
    *) echo "usage: tools/setup.sh [run|test]" >&2; exit 2 ;;
esac
missing=()
for p in "${wanted[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# mosquitto is for benchmarks only: never leave the packaged daemon running.
if [ "$profile" = test ]; then
    # user mounts (tests/test_fuse_files.py) need /dev/fuse open to everyone, as
    # Debian's udev rule leaves it; containers often create it 0600
    if [ -c /dev/fuse ]; then chmod 0666 /dev/fuse; fi
    systemctl disable --now mosquitto >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q -e ".$extras"
# The broker's one optional piece of C (sbus/_sendeach.c, loaded through ctypes): with
# it, S3 (many keys in turn) costs ~8 % less CPU per delivery; without it (no compiler)
# the broker does the same in Python.
if command -v gcc >/dev/null; then
    gcc -O2 -Wall -shared -fPIC -o sbus/_sendeach.so sbus/_sendeach.c
fi
# Earlier versions linked the commands into /usr/local/bin; drop such a link when it
# points into this checkout or nowhere (a deleted clone), so it cannot shadow PATH.
for cmd in sbus sbus-top; do
    link=/usr/local/bin/$cmd
    if [ -L "$link" ] && { [ ! -e "$link" ] || [ "$(readlink "$link")" = "$PWD/.venv/bin/$cmd" ]; }
    then
        rm -f "$link" 2>/dev/null || true
    fi
done
echo "sbus set up in $PWD/.venv ($profile); its commands: export PATH=$PWD/.venv/bin:\$PATH"
