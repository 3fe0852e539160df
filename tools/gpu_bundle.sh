#!/usr/bin/env bash
# The offline bundle: what a GPU machine without network needs to build
# Contrax against its own PyTorch and run `tools/gpu_check.sh --quick`.
#
# GPU machines, clusters and containers often have a PyTorch of their own
# (with Python.h, zlib, nvcc and CMake) but no network, and lack the build's
# header-only and test dependencies. Run this on a machine that reaches
# Debian's mirror; carry the folder it writes (about 40 MB) to the GPU
# machine, into the checkout; there `tools/setup.sh` finds everything in it
# when apt cannot reach a mirror.
#
#   bash tools/gpu_bundle.sh          # writes .bundle/ (ignored by git)
#
# What it holds:
#   prefix/          Debian's libcli11-dev, nlohmann-json3-dev, libgtest-dev and
#                    libgmock-dev unpacked with dpkg-deb -x (headers, GoogleTest's
#                    static libraries and CMake packages): CMAKE_PREFIX_PATH=prefix/usr
#   gloo/include/    Gloo's headers (tools/gloo_headers.sh), which PyPI-style
#                    wheels do not ship
#   fashion-mnist/   the four IDX files of dataset-fashion-mnist (`contrax train`'s data)
#   peers/           ../shared/peers (the plain PyTorch DDP program of the default
#                    recipe), where this checkout has one, for the side-by-side run
#   pylib/           memeff and siglip-kernel (requirements/gpu_peers.txt), pure-Python
#                    wheels unpacked, for python/bench/gpu_losses.py
#   sanitizer.tar.xz NVIDIA's compute-sanitizer from PyPI's nvidia-cuda-sanitizer-api
#                    (requirements/gpu_sanitizer.txt): its executable and libraries
#                    without the HTML documentation (about 9 MB), which
#                    tools/gpu_check.sh --quick unpacks to run memcheck, racecheck
#                    and synccheck on the panel kernels' test
#   MANIFEST         every package with its version and SHA-256, and the sizes
#
# Environment: CONTRAX_BUNDLE (the folder, default .bundle), CONTRAX_PEERS (the
# peer programs' folder, default ../shared/peers), CONTRAX_CACHE (downloads:
# the wheels are kept in $CONTRAX_CACHE/bundle and the sanitizer's archive
# beside them, named by its wheel's SHA-256, so that a second bundle
# downloads and compresses only what changed; xz took 21 s of CPU of it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${CONTRAX_BUNDLE:-.bundle}
PEERS=${CONTRAX_PEERS:-../shared/peers}
PACKAGES=(libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev dataset-fashion-mnist)
# The bundle must travel with a checkout to a lent machine (64 MB in all).
LIMIT_MB=56
CACHE=${CONTRAX_CACHE:-$HOME/.cache/contrax}/bundle

say() { echo "gpu_bundle: $*" >&2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$OUT.part"' EXIT
rm -rf "$OUT.part"
mkdir -p "$OUT.part/prefix" "$tmp/debs"

say "downloading ${PACKAGES[*]} from Debian's mirror"
download() { (cd "$tmp/debs" && apt-get download -q "${PACKAGES[@]}" >/dev/null 2>&1); }
if ! download; then
  apt-get update -qq >/dev/null 2>&1 || true
  download || { say "apt-get download failed: this script needs a machine that reaches Debian's mirror"; exit 1; }
fi

{
  echo "# Contrax offline bundle, $(date -u +%Y-%m-%dT%H:%MZ), from $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "# package version sha256"
} >"$OUT.part/MANIFEST"
for deb in "$tmp"/debs/*.deb; do
  pkg=$(dpkg-deb -f "$deb" Package)
  echo "$pkg $(dpkg-deb -f "$deb" Version) $(sha256sum "$deb" | cut -d' ' -f1)" >>"$OUT.part/MANIFEST"
  if [ "$pkg" = dataset-fashion-mnist ]; then
    dpkg-deb -x "$deb" "$tmp/data"
  else
    dpkg-deb -x "$deb" "$OUT.part/prefix"
  fi
done
# Documentation is not needed to build.
rm -rf "$OUT.part/prefix/usr/share/doc" "$OUT.part/prefix/usr/share/lintian"

mkdir -p "$OUT.part/fashion-mnist"
find "$tmp/data" -name '*-ubyte*' -exec cp {} "$OUT.part/fashion-mnist/" \;
[ "$(find "$OUT.part/fashion-mnist" -name '*-ubyte*' | wc -l)" -eq 4 ] ||
  { say "dataset-fashion-mnist did not hold the four IDX files"; exit 1; }

gloo=$(bash tools/gloo_headers.sh 2>/dev/null)
mkdir -p "$OUT.part/gloo"
cp -r "$gloo" "$OUT.part/gloo/"
cp .deps/gloo/VERSION "$OUT.part/gloo/VERSION"
echo "gloo-headers $(cut -d' ' -f3 .deps/gloo/VERSION) (tools/gloo_headers.sh)" >>"$OUT.part/MANIFEST"

if [ -f "$PEERS/simclr_torch_ddp.py" ]; then
  mkdir -p "$OUT.part/peers"
  cp "$PEERS"/*.py "$PEERS"/*.md "$OUT.part/peers/" 2>/dev/null || true
  echo "peers $(sha256sum "$PEERS/simclr_torch_ddp.py" | cut -d' ' -f1) (simclr_torch_ddp.py from $PEERS)" >>"$OUT.part/MANIFEST"
else
  say "no peer program in $PEERS: the GPU check will skip the side-by-side run"
fi

# fetch REQUIREMENTS: the wheels they resolve to (PyPI asked each time, a
# wheel already in $CACHE not downloaded again), one path per line.
fetch() {
  mkdir -p "$CACHE"
  python3 -m pip download --no-deps --no-cache-dir --progress-bar off -d "$CACHE" -r "$1" >"$tmp/pip.log" 2>&1 ||
    { cat "$tmp/pip.log" >&2; say "pip could not download $1 from PyPI"; exit 1; }
  sed -n -E 's/^ *(Saved|File was already downloaded) (.*\.whl)$/\2/p' "$tmp/pip.log"
}
mkdir -p "$OUT.part/pylib"
fetch requirements/gpu_peers.txt >"$tmp/peers"
[ -s "$tmp/peers" ] || { say "pip named no wheel for requirements/gpu_peers.txt"; exit 1; }
while read -r whl; do
  python3 -m zipfile -e "$whl" "$OUT.part/pylib"
  echo "$(basename "$whl") $(sha256sum "$whl" | cut -d' ' -f1)" >>"$OUT.part/MANIFEST"
done <"$tmp/peers"

whl=$(fetch requirements/gpu_sanitizer.txt | head -n 1)
[ -n "$whl" ] || { say "pip named no wheel for requirements/gpu_sanitizer.txt"; exit 1; }
sha=$(sha256sum "$whl" | cut -d' ' -f1)
archive=$CACHE/sanitizer-$sha.tar.xz
if [ ! -f "$archive" ]; then
  python3 -m zipfile -e "$whl" "$tmp/sanitizer"
  root=$(dirname "$(find "$tmp/sanitizer" -type f -path '*/compute-sanitizer/compute-sanitizer' | head -n 1)")
  [ -n "$root" ] && [ "$root" != . ] || { say "$(basename "$whl") holds no compute-sanitizer executable"; exit 1; }
  chmod +x "$root/compute-sanitizer" "$root"/TreeLauncher* 2>/dev/null || true
  tar -C "$(dirname "$root")" --exclude=compute-sanitizer/docs --exclude=compute-sanitizer/include \
    -cJf "$archive.part" compute-sanitizer
  mv "$archive.part" "$archive"
fi
cp "$archive" "$OUT.part/sanitizer.tar.xz"
echo "$(basename "$whl") $sha (compute-sanitizer, as sanitizer.tar.xz)" >>"$OUT.part/MANIFEST"

mb=$(du -sm "$OUT.part" | cut -f1)
echo "# size ${mb} MB" >>"$OUT.part/MANIFEST"
[ "$mb" -le "$LIMIT_MB" ] || { say "the bundle is ${mb} MB, over the ${LIMIT_MB} MB that may travel"; exit 1; }
rm -rf "$OUT"
mv "$OUT.part" "$OUT"
say "wrote $OUT (${mb} MB); carry it into the checkout of the GPU machine, then: bash tools/gpu_check.sh --quick"
echo "$OUT"
