#!/usr/bin/env bash
# Build (once) the Debian bookworm root filesystem that tests/test_systemd_container.py
# boots with systemd-nspawn, and cache it: later runs only check the stamp file.
# The tests never write into it (they boot it with --volatile=overlay).
#
#   tools/make-test-rootfs.sh [DIR]     (default /var/cache/sbus-test/rootfs-vVERSION; root)
#
# SBUS_TEST_MIRROR overrides the Debian mirror.  Bump VERSION whenever the contents
# below change, so cached copies are rebuilt.
set -euo pipefail

VERSION=4
PACKAGES=systemd,systemd-sysv,dbus,python3,python3-venv,python3-systemd,python3-msgpack,python3-numpy
# What the .deb (tools/build-deb.sh) depends on, so that the test installs it offline.
PACKAGES+=,fuse3,python3-rich,python3-h11,python3-idna,python3-sortedcontainers,python3-outcome
dest=${1:-/var/cache/sbus-test/rootfs-v$VERSION}  # one per version: no rebuilding another's
mirror=${SBUS_TEST_MIRROR:-http://deb.debian.org/debian}
stamp="$dest/.sbus-test-rootfs"
want="version=$VERSION packages=$PACKAGES"

mkdir -p "$(dirname "$dest")"
exec 9>"$dest.lock"
flock 9  # one build at a time; a second caller waits and then finds it done

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

tmp="$dest.new"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$tmp" "$mirror" >"$tmp.log" 2>&1 ||
    { tail -n 30 "$tmp.log" >&2; echo "make-test-rootfs: debootstrap failed (log: $tmp.log)" >&2; exit 1; }
chroot "$tmp" apt-get clean
echo "$want" >"$tmp/.sbus-test-rootfs"
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
rm -f "$tmp.log"
echo "make-test-rootfs: built $dest in $(( $(date +%s) - start )) s"
