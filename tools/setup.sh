#!/usr/bin/env bash
# Installs what Contrax needs and builds what the main job needs (the
# `contrax` tool), as root on Debian. Safe to re-run: what is installed is
# skipped, downloads are kept, and the build is incremental.
#
#   * Debian packages: compiler, CMake, the data sets, CLI11, JSON, GoogleTest,
#     and with CONTRAX_TARGETS=all (tools/test.sh) Doxygen (the API reference);
#   * a project virtual environment (.venv) with PyPI's torch, pinned in
#     requirements/torch.txt, and matplotlib (requirements/plot.txt); torch's
#     LibTorch (torch.utils.cmake_prefix_path) is what the C++ library, the
#     tool and the Python package build against, with CUDA and NCCL where the
#     CUDA toolkit is installed;
#   * Gloo's headers, which PyPI's wheels lack (tools/gloo_headers.sh).
#
# Every wheel is downloaded once into $CONTRAX_CACHE/wheels and installed from
# there: a second set-up on the same machine downloads nothing. (pip's own
# HTTP cache is turned off: it would keep a second copy of every wheel.)
#
#   CONTRAX_BUILD_DIR  build folder (default: build)
#   CONTRAX_VENV       the virtual environment (default: .venv)
#   CONTRAX_CACHE      downloads (default: ~/.cache/contrax)
#   CONTRAX_TARGETS    CMake targets to build (default: contrax_cli; "all" for everything)
#   CONTRAX_EXTRA_REQUIREMENTS  more requirement files for .venv, space-separated (tools/test.sh:
#                      requirements/test.txt, requirements/test-no-deps.txt (installed
#                      without dependencies) and requirements/docs.txt)
#   CONTRAX_TORCH      pypi (default) or system: the system's LibTorch and
#                      python3-torch from Debian instead (tools/trixie.sh uses
#                      it for Debian trixie's LibTorch 2.6); or python: the
#                      torch already installed in CONTRAX_PYTHON (default the
#                      python3 on PATH), with no venv and nothing from PyPI
#                      (a GPU machine's own PyTorch: tools/gpu_check.sh --quick)
#   CONTRAX_PYTHON     the interpreter of CONTRAX_TORCH=python
#   CONTRAX_BUNDLE     the offline bundle (default .bundle, made by
#                      tools/gpu_bundle.sh): where apt cannot reach a mirror,
#                      CLI11, JSON, GoogleTest, Gloo's headers and the data set
#                      come from it
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${CONTRAX_BUILD_DIR:-build}
VENV=${CONTRAX_VENV:-.venv}
CACHE=${CONTRAX_CACHE:-$HOME/.cache/contrax}
TARGETS=${CONTRAX_TARGETS:-contrax_cli}
TORCH_FROM=${CONTRAX_TORCH:-pypi}
BUNDLE=${CONTRAX_BUNDLE:-.bundle}
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
case "$TORCH_FROM" in pypi|system|python) ;; *) echo "setup: CONTRAX_TORCH must be pypi, system or python, but is '$TORCH_FROM'" >&2; exit 2 ;; esac
if [ "$TORCH_FROM" = python ]; then
  PY=${CONTRAX_PYTHON:-$(command -v python3 || echo python3)}
  "$PY" -c 'import torch' 2>/dev/null || {
    echo "setup: CONTRAX_TORCH=python builds against the torch of CONTRAX_PYTHON, but '$PY' cannot import torch;" \
      "set CONTRAX_PYTHON to the interpreter that has it" >&2
    exit 2
  }
fi
t0=$(date +%s)
phase() { echo "setup: $* ($(($(date +%s) - t0)) s so far)"; }

# Free gigabytes on the file system that holds $1 (or would: its nearest
# existing parent).
free_gb() {
  local d=$1
  while [ ! -e "$d" ]; do d=$(dirname "$d"); done
  df -Pk "$d" | awk 'NR == 2 { print int($4 / 1048576) }'
}
# A first install of PyPI's torch needs room: its wheels in $CACHE (2.8 GB)
# and them unpacked for $VENV (4.5 GB; uv links the venv's files to its cache
# where both share a file system), with the test suite's packages about
# 10 GB. Said before anything is written, rather than as a traceback from
# the middle of a download.
need_space() {
  local gb=$1 d
  shift
  for d in "$@"; do
    local have
    have=$(free_gb "$d")
    if [ "$have" -lt "$gb" ]; then
      echo "setup: a first install of PyPI's torch needs about $gb GB free (wheels in $CACHE, unpacked in $VENV)," \
        "but the file system of $d has $have GB free; free some space, or set CONTRAX_CACHE and CONTRAX_VENV" \
        "to folders on a larger one" >&2
      exit 1
    fi
  done
}

if [ "$TORCH_FROM" = pypi ] && ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("torch")' 2>/dev/null; then
  need_space 10 "$CACHE" "$VENV"
fi

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config curl xz-utils
  libgtest-dev zlib1g-dev         # tests; gzip-compressed IDX data files
  libcli11-dev                    # command-line flags, config files (CLI11)
  nlohmann-json3-dev              # every JSON file Contrax writes or reads
  dataset-fashion-mnist           # the real data set of `contrax train`
  wordnet-base                    # WordNet 3.0, the corpus of `contrax train --recipe retrieval`
  iproute2 util-linux             # ip netns/veth for the two-node test; flock, mount for the fault tests
)
if [ "$TORCH_FROM" != python ]; then
  PACKAGES+=(python3-dev python3-venv)   # the Python package, the virtual environment
fi
# What the offline bundle (tools/gpu_bundle.sh) stands in for.
BUNDLED=" libgtest-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist "
if [ "$TORCH_FROM" = pypi ] && [ "$TARGETS" = all ]; then
  PACKAGES+=(doxygen)            # the API reference's C++ half, built by command 2 (tools/docs.sh; Sphinx is in requirements/docs.txt)
fi
if [ "$TORCH_FROM" = system ]; then
  # Debian's LibTorch (CPU), c10d's Gloo headers, the torch and pybind11 of the binding
  PACKAGES+=(libtorch-dev libgloo-dev python3-torch pybind11-dev python3-pytest python3-numpy
             python3-setuptools python3-wheel python3-pip libopenblas0-openmp
             python3-matplotlib)         # curves.png (with PyPI's torch: matplotlib in .venv, requirements/plot.txt)
fi
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
use_bundle=0
if ((${#missing[@]})); then
  phase "installing Debian packages: ${missing[*]} (about 1-2 min)"
  # Without a mirror (a GPU machine offline, a container), the bundle stands
  # in for what it holds; the rest must be there already (compiler, CMake).
  # Short timeouts: offline, apt must fail in seconds, not minutes.
  if ! { command -v apt-get >/dev/null &&
         timeout 60 $SUDO apt-get update -qq -o Acquire::http::Timeout=10 -o Acquire::Retries=0 >/dev/null 2>&1 &&
         DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
    if [ ! -f "$BUNDLE/MANIFEST" ]; then
      echo "setup: apt could not install ${missing[*]} (no mirror reachable?), and there is no offline bundle in" \
        "$BUNDLE; make one on a machine with network (bash tools/gpu_bundle.sh) and carry it here," \
        "or set CONTRAX_BUNDLE" >&2
      exit 1
    fi
    use_bundle=1
    rest=()
    for p in "${missing[@]}"; do [[ "$BUNDLED" == *" $p "* ]] || rest+=("$p"); done
    phase "apt cannot install packages here: CLI11, JSON, GoogleTest, Gloo's headers and Fashion-MNIST from the" \
      "offline bundle $BUNDLE${rest[*]:+; not installed, and assumed unneeded: ${rest[*]}}"
  fi
fi

# Installs requirement files into the venv from the wheel cache, downloading
# into the cache first only what is missing there. `pip wheel`, not `pip
# download`: a dependency published only as source (antlr4-python3-runtime,
# through lightly's hydra) is built into a wheel while the index is at hand,
# so the offline install never has to fetch its build requirements. The
# install itself is uv's (requirements/setup.txt): it unpacks several wheels
# at once, into its cache beside the wheels, and links them into the venv.
export UV_CACHE_DIR=$CACHE/uv
WHEELS=$CACHE/wheels
# uv itself, with the venv's pip (from the cache, downloaded the first time).
install_uv() {
  local py=$VENV/bin/python
  mkdir -p "$WHEELS"
  [ -x "$VENV/bin/uv" ] && return
  if ! "$py" -m pip install -q --no-index --find-links "$WHEELS" -r requirements/setup.txt 2>/dev/null; then
    "$py" -m pip download -q --no-cache-dir -d "$WHEELS" -r requirements/setup.txt
    "$py" -m pip install -q --no-index --find-links "$WHEELS" -r requirements/setup.txt
  fi
}
pip_cached() {
  local py=$VENV/bin/python wheels=$WHEELS
  local install=("$VENV/bin/uv" pip install -q --python "$py" --offline --no-index --find-links "$wheels")
  if ! "${install[@]}" "$@" 2>/dev/null; then
    phase "downloading $(grep -hv '^#' "${@: -1}" | tr '\n' ' ')and what they need into $wheels"
    "$py" -m pip wheel -q --no-cache-dir -w "$wheels" "$@"
    "${install[@]}" "$@"
  fi
}

# The venv's bytecode, compiled once for what is installed. uv writes none,
# and where PYTHONDONTWRITEBYTECODE=1 (set on this project's machines) Python
# never caches any: every process compiled what it imported again, 4.5 s of
# CPU for `import torch` instead of 2.5, 22.6 s for sentence-transformers
# instead of 9.0, in every test process and rank. Skipped while the installed
# set is the one compiled last (the stamp holds `uv pip freeze`).
compile_bytecode() {
  local stamp=$VENV/.contrax-bytecode frozen
  frozen=$("$VENV/bin/uv" pip freeze -q --python "$VENV/bin/python" 2>/dev/null | sha256sum | cut -d' ' -f1)
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$frozen" ] && return
  phase "compiling the bytecode of $VENV's packages (once per installed set)"
  "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    >/dev/null 2>&1 || true  # a few packages ship templates that are not Python
  echo "$frozen" >"$stamp"
}

cmake_args=()
# The CUDA wheels' CMake package needs the CUDA toolkit (nvcc), which may
# not be on PATH.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
if [ "$TORCH_FROM" = pypi ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    phase "creating the virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
  want=$(grep -E '^torch==' requirements/torch.txt | cut -d= -f3)
  have=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  if [ "${have%%+*}" != "$want" ]; then
    phase "installing PyPI's torch $want into $VENV (first time: ~4 GB of wheels with CUDA's libraries, 1-2 min)"
  fi
  install_uv
  pip_cached -r requirements/torch.txt
  pip_cached -c requirements/torch.txt -r requirements/plot.txt
  for r in ${CONTRAX_EXTRA_REQUIREMENTS:-}; do
    # A file named *-no-deps.txt: its packages alone (requirements/test-no-deps.txt says why).
    no_deps=()
    [[ "$r" == *-no-deps.txt ]] && no_deps=(--no-deps)
    pip_cached "${no_deps[@]}" -c requirements/torch.txt -r "$r"
  done
  PY=$VENV/bin/python
  compile_bytecode
  prefix=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
  cmake_args+=(-DCMAKE_PREFIX_PATH="$prefix" -DPython3_EXECUTABLE="$(cd "$VENV" && pwd)/bin/python3")
else
  [ "$TORCH_FROM" = system ] && PY=/usr/bin/python3
  if [ "$TORCH_FROM" = python ]; then
    prefix=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
    cmake_args+=(-DCMAKE_PREFIX_PATH="$prefix")
  fi
  cmake_args+=(-DPython3_EXECUTABLE="$(command -v "$PY")")
fi
if [ "$TORCH_FROM" != system ]; then
  # Gloo's headers, which PyPI-style wheels do not ship: the bundle's copy
  # where apt (and so the network) is out of reach.
  if [ "$use_bundle" = 1 ] && [ ! -f .deps/gloo/include/gloo/rendezvous/store.h ]; then
    mkdir -p .deps/gloo
    cp -r "$BUNDLE/gloo/include" "$BUNDLE/gloo/VERSION" .deps/gloo/
  fi
  bash tools/gloo_headers.sh >/dev/null
fi
if [ "$use_bundle" = 1 ]; then
  bundle_prefix="$(cd "$BUNDLE" && pwd)/prefix/usr"
  for i in "${!cmake_args[@]}"; do
    [[ "${cmake_args[$i]}" == -DCMAKE_PREFIX_PATH=* ]] && cmake_args[$i]="${cmake_args[$i]};$bundle_prefix"
  done
fi
# Ninja and ccache where installed (a GPU machine may have neither).
generator=(-G Ninja)
command -v ninja >/dev/null || generator=(-G "Unix Makefiles")
command -v ccache >/dev/null && cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  phase "configuring $BUILD"
  mkdir -p "$BUILD"
  cmake -S . -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    "${cmake_args[@]}" >"$BUILD/configure.log" 2>&1 || {
    echo "setup: configuring failed; the last lines of $BUILD/configure.log:" >&2
    tail -n 30 "$BUILD/configure.log" >&2
    exit 1
  }
fi
# ccache reuses compilations across builds and clean clones; these settings
# let it reuse the ones that include the precompiled LibTorch header.
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_BASEDIR=$PWD
[ "$TARGETS" = all ] && targets=() || read -r -a targets <<<"$TARGETS"
phase "building ${TARGETS} in $BUILD (first time on 2 cores: the tool about 5 min, everything about 20)"
cmake --build "$BUILD" --parallel "$(nproc)" ${targets[@]:+--target "${targets[@]}"}
phase "done: $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)"
