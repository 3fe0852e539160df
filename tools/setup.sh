#!/usr/bin/env bash
# Installs what Contrax needs on Debian bookworm (as root) and configures a
# Release build in ./build. Safe to re-run: apt is skipped when all packages
# are already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential cmake pkg-config
  libtorch-dev libgloo-dev        # LibTorch 1.13 (CPU) and c10d's Gloo headers
  libopenblas0-openmp             # ~30x faster GEMMs than the reference BLAS
  libgtest-dev zlib1g-dev
  dataset-fashion-mnist           # the real data set of `contrax train`
  python3-torch pybind11-dev python3-dev python3-pytest  # the Python binding
  libcli11-dev                    # CLI11: flags, --help and --config of the `contrax` tool
  nlohmann-json3-dev              # nlohmann-json: metrics.jsonl, config.json, results.json, --json
  python3-matplotlib              # curves.png of a run (tools/plot_run.py, `contrax plot`)
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
