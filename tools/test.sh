#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suite through CTest (which
# also runs the Python binding's pytest suite when it is built).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
ctest --test-dir build --output-on-failure -j2 --timeout 900
