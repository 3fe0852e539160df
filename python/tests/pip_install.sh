#!/usr/bin/env bash
# `pip install ./python` into a fresh virtual environment (system site
# packages for torch, no build isolation, no index: offline), then the whole
# Python suite against the installed package from outside the source tree.
#   bash python/tests/pip_install.sh PYTHON
# CONTRAX_CMAKE_BUILD_DIR (set by CTest) lets setup.py reuse the existing
# CMake build instead of compiling the library once more.
set -euo pipefail
PY=${1:-python3}
PKG=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/contrax_pip.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$PY" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install --no-build-isolation --no-index --no-deps -q "$PKG"
cd "$work"
unset PYTHONPATH
"$work/venv/bin/python" - "$work" <<'PYEOF'
import os, sys
import contrax
where = os.path.realpath(contrax.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), "contrax imported from %s, not the venv" % where
print("pip_install: contrax %s imported from %s" % (contrax.__version__, os.path.dirname(where)))
PYEOF
OMP_NUM_THREADS=1 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$PKG/tests"
