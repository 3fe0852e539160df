#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suite through CTest (which
# also runs the Python binding's pytest suite and the `pip install` check when
# the binding is built). CONTRAX_BUILD_DIR picks the build folder (default build).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
BUILD=${CONTRAX_BUILD_DIR:-build}
ctest --test-dir "$BUILD" --output-on-failure -j2 --timeout 900
