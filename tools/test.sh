#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suite through CTest, which
# also runs the Python package's pytest suite, the `pip install` check and
# the API reference's build (docs_build: tools/docs.sh).
# Set-up first (tools/setup.sh: packages, .venv with PyPI's torch, the test
# requirements), then the whole build. CONTRAX_BUILD_DIR picks the build
# folder (default build); CONTRAX_TORCH=system tests the system's LibTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
CONTRAX_TARGETS=all CONTRAX_EXTRA_REQUIREMENTS="requirements/test.txt requirements/test-no-deps.txt requirements/docs.txt" bash tools/setup.sh
BUILD=${CONTRAX_BUILD_DIR:-build}
ctest --test-dir "$BUILD" --output-on-failure -j2 --timeout 900
