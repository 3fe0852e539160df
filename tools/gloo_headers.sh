#!/usr/bin/env bash
# Gloo's headers for building against PyPI's torch.
#
# c10d's ProcessGroupGloo.hpp, which the communicator includes to build a Gloo
# process group, includes Gloo's own headers (gloo/context.h, ...). PyPI's
# torch wheels compile Gloo into libtorch_cpu.so but do not ship its headers.
# They come from Debian's libgloo-dev package (Gloo's upstream headers plus
# the config.h of Debian's build), unpacked into .deps/gloo/include; nothing
# of Gloo is linked from it (the symbols are torch's). The version is pinned
# with its SHA-256; when Debian's archive no longer carries it (a newer upload
# replaced it in sid), the current sid version is taken from the archive's
# signed-by-apt Packages index instead, and the script says so.
#
#   bash tools/gloo_headers.sh        # idempotent; prints the include folder
#   CONTRAX_CACHE  download cache (default ~/.cache/contrax): the .deb is kept
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.deps/gloo
VERSION="0.0~git20250912.d97133a-2"   # pytorch/gloo at d97133a (2025-09-12)
SHA256=2ee01a68afe26991fbb7c5ead2815f113d37da20e2587cd339408030df7d2e2a
CACHE=${CONTRAX_CACHE:-$HOME/.cache/contrax}

if [ -f "$OUT/include/gloo/rendezvous/store.h" ] && [ -f "$OUT/VERSION" ]; then
  echo "$OUT/include"
  exit 0
fi

# The Debian mirror apt uses here (deb822 sources first, then the one-line format).
mirror=""
[ -f /etc/apt/sources.list.d/debian.sources ] && mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
[ -z "$mirror" ] && [ -f /etc/apt/sources.list ] && mirror=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list)
mirror=${mirror:-http://deb.debian.org/debian}
mirror=${mirror%/}

mkdir -p "$CACHE"
fetch() {  # fetch VERSION SHA256 -> path of the verified .deb, or nothing
  local deb="$CACHE/libgloo-dev_${1}_amd64.deb"
  if [ ! -f "$deb" ]; then
    curl -fsSL --retry 3 -o "$deb.part" "$mirror/pool/main/g/gloo/libgloo-dev_${1}_amd64.deb" 2>/dev/null || { rm -f "$deb.part"; return 0; }
    mv "$deb.part" "$deb"
  fi
  if [ "$(sha256sum "$deb" | cut -d' ' -f1)" != "$2" ]; then
    echo "tools/gloo_headers.sh: $deb does not have the expected SHA-256; deleted" >&2
    rm -f "$deb"
    return 0
  fi
  echo "$deb"
}

deb=$(fetch "$VERSION" "$SHA256")
if [ -z "$deb" ]; then
  echo "tools/gloo_headers.sh: libgloo-dev $VERSION is no longer in $mirror; looking up sid's current one" >&2
  index=$(mktemp)
  trap 'rm -f "$index"' EXIT
  curl -fsSL --retry 3 "$mirror/dists/sid/main/binary-amd64/Packages.xz" | xz -dc >"$index"
  read -r VERSION SHA256 < <(awk '/^Package: libgloo-dev$/ {p = 1} p && /^Version:/ {v = $2} p && /^SHA256:/ {s = $2}
                                   p && /^$/ {print v, s; exit}' "$index")
  [ -n "${VERSION:-}" ] || { echo "tools/gloo_headers.sh: no libgloo-dev in sid's index" >&2; exit 1; }
  deb=$(fetch "$VERSION" "$SHA256")
  [ -n "$deb" ] || { echo "tools/gloo_headers.sh: could not download libgloo-dev $VERSION from $mirror" >&2; exit 1; }
fi

rm -rf "$OUT"
tmp=$(mktemp -d)
dpkg-deb -x "$deb" "$tmp"
mkdir -p "$OUT/include"
cp -r "$tmp/usr/include/gloo" "$OUT/include/"
rm -rf "$tmp"
echo "Debian libgloo-dev $VERSION (sha256 $SHA256)" >"$OUT/VERSION"
echo "tools/gloo_headers.sh: Gloo headers of Debian's libgloo-dev $VERSION in $OUT/include" >&2
echo "$OUT/include"
