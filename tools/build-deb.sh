#!/usr/bin/env bash
# Build the Debian package of this tree: dist/sbus_VERSION_ARCH.deb, checked by lintian.
#
#   tools/build-deb.sh [OUTDIR]    (default dist/; Debian bookworm; tools/setup.sh
#                                   installs what it needs)
#
# The only step that uses the network is the first: pip builds the wheel of sbus and
# fetches (or, for pyfuse3, compiles) the packages the .deb carries because bookworm's
# are too old (debian/carried.txt), with a pip cache of its own so that pyfuse3 is
# compiled for Debian's python3 and libfuse3 (never taken from another Python's cache).
# dpkg-buildpackage then works offline in a copy of the tree; the version is
# pyproject.toml's.
set -euo pipefail
outdir=$(realpath -m "${1:-$(dirname "$0")/../dist}")
cd "$(dirname "$0")/.."
repo=$PWD
cache=${XDG_CACHE_HOME:-$HOME/.cache}/sbus-deb/pip

version=$(python3 -c 'import tomllib
print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
arch=$(dpkg --print-architecture)
for tool in dpkg-buildpackage dh dh_python3 lintian /usr/bin/python3; do
    command -v "$tool" >/dev/null ||
        { echo "build-deb: $tool is missing (tools/setup.sh test installs it)" >&2; exit 1; }
done
/usr/bin/python3 -m pip --version >/dev/null 2>&1 ||
    { echo "build-deb: pip for /usr/bin/python3 is missing (apt install python3-pip)" >&2; exit 1; }
work=$(mktemp -d /tmp/sbus-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT

copy() {  # the source tree without caches and build leftovers
    mkdir -p "$1"
    tar -C "$repo" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' --exclude='*.so' \
        -cf - sbus pyproject.toml README.md MANIFEST.in docs debian | tar -C "$1" -xf -
}

copy "$work/wheel-src"
src="$work/sbus-$version"
copy "$src"
echo "build-deb: wheels (sbus, and what debian/carried.txt names)"
/usr/bin/python3 -m pip wheel --quiet --cache-dir "$cache" --no-deps --no-binary pyfuse3 \
    --use-feature=no-binary-enable-wheel-cache \
    --wheel-dir "$src/debian/wheels" "$work/wheel-src" -r debian/carried.txt

cat >"$src/debian/changelog" <<CHANGES
sbus ($version) unstable; urgency=medium

  * Built from the sbus source tree by tools/build-deb.sh.

 -- sbus developers <sbus@example.org>  $(date -R)
CHANGES

echo "build-deb: dpkg-buildpackage (with Debian's python3 and tools only)"
(cd "$src" && env PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    dpkg-buildpackage -b -us -uc >"$work/build.log" 2>&1) ||
    { tail -n 40 "$work/build.log" >&2; echo "build-deb: dpkg-buildpackage failed" >&2; exit 1; }
deb="sbus_${version}_${arch}.deb"
mkdir -p "$outdir"
mv "$work/$deb" "$outdir/$deb"
echo "build-deb: lintian"
lintian --fail-on error "$outdir/$deb"
echo "built $outdir/$deb"
