#!/usr/bin/env bash
# Installs what Contrax needs on Debian (bookworm: LibTorch 1.13; trixie:
# LibTorch 2.6), as root, and configures and builds a Release build. Safe to
# re-run: apt is skipped when all packages are already there, and the build is
# incremental.
#   CONTRAX_BUILD_DIR  build folder (default: build)
#   CONTRAX_CUDA=1     trixie only: contrib's CUDA/NCCL LibTorch instead of the CPU one
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${CONTRAX_BUILD_DIR:-build}
CUDA=${CONTRAX_CUDA:-0}
. /etc/os-release
CODENAME=${VERSION_CODENAME:-unknown}
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"

PACKAGES=(
  build-essential cmake pkg-config
  libopenblas0-openmp             # ~30x faster GEMMs than the reference BLAS
  libgtest-dev zlib1g-dev         # tests; gzip-compressed IDX data files
  libcli11-dev                    # command-line flags, config files (CLI11)
  nlohmann-json3-dev              # every JSON file Contrax writes or reads
  dataset-fashion-mnist           # the real data set of `contrax train`
  wordnet-base                    # WordNet 3.0, the corpus of `contrax train --recipe retrieval`
  pybind11-dev python3-dev python3-pytest  # the Python binding and its tests
  python3-venv python3-setuptools python3-wheel python3-pip  # `pip install ./python`, offline
  python3-matplotlib              # curves.png of a run
  iproute2 util-linux             # ip netns/veth for the two-node test; flock, mount for the fault tests
)
if [ "$CUDA" = 1 ]; then
  [ "$CODENAME" = trixie ] || { echo "setup: CONTRAX_CUDA=1 needs Debian trixie's contrib (this is $CODENAME); see tools/trixie.sh --cuda" >&2; exit 2; }
  # LibTorch 2.6 with CUDA 12.4 and NCCL 2.22 (contrib), its Gloo build, CUDA compiler and headers (non-free)
  PACKAGES+=(libtorch-cuda-dev libgloo-cuda-dev libnccl-dev python3-torch-cuda nvidia-cuda-toolkit)
else
  # LibTorch (CPU), c10d's Gloo headers, and the torch of the Python binding
  PACKAGES+=(libtorch-dev libgloo-dev python3-torch)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    # CUDA LibTorch depends on nvidia-cudnn, an installer that downloads cuDNN
    # from NVIDIA; where that host cannot be reached, keep everything else.
    if [ "$CUDA" = 1 ] && ! dpkg -s nvidia-cudnn 2>/dev/null | grep -q 'ok installed'; then
      echo "setup: nvidia-cudnn could not download cuDNN from NVIDIA; keeping the other CUDA packages without it"
      $SUDO dpkg --remove --force-depends nvidia-cudnn >/dev/null 2>&1 || true
      $SUDO dpkg --configure --force-depends -a >/dev/null
      # apt refuses to install anything more while that dependency is unmet:
      # fetch what is still missing and install it with dpkg.
      still=()
      for p in "${missing[@]}"; do dpkg -s "$p" 2>/dev/null | grep -q 'ok installed' || still+=("$p"); done
      if ((${#still[@]})); then
        debs=$(mktemp -d)
        (cd "$debs" && apt-get download -qq "${still[@]}" >/dev/null)
        $SUDO dpkg -i --force-depends "$debs"/*.deb >/dev/null
        rm -rf "$debs"
      fi
    else
      exit 1
    fi
  fi
fi

if [ "$CUDA" = 1 ] && ! ldconfig -p | grep -q 'libcudnn\.so\.9'; then
  # libtorch_cuda.so needs libcudnn.so.9 to link and load, and Debian has no
  # cuDNN binary (nvidia-cudnn downloads it from NVIDIA). Before configuring:
  # the Python binding is configured only if `import torch` works.
  if ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
    echo "setup: libcudnn.so.9 is missing: install cuDNN (nvidia-cudnn downloads it from NVIDIA); compiling the library only"
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build "$BUILD" --target contrax -j"$(nproc)"
    exit 0
  fi
  echo "setup: libcudnn.so.9 is missing and there is no GPU: a stub that aborts if called stands in for cuDNN"
  $SUDO bash tools/cudnn_stub.sh
fi
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
