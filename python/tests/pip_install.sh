#!/usr/bin/env bash
# `pip install ./python` into a fresh virtual environment that sees the
# build's torch (no build isolation, no index: offline), then the API and
# loss tests against the installed package from outside the source tree;
# then, where the build's torch is PyPI's, `import contrax` under another
# torch release in a second environment must fail with the clear ImportError.
#   bash python/tests/pip_install.sh PYTHON
# CONTRAX_CMAKE_BUILD_DIR (set by CTest) lets setup.py reuse the existing
# CMake build instead of compiling the library once more.
# CONTRAX_OTHER_TORCH: the other release (default 2.14.1; its wheel is
# downloaded once into $CONTRAX_CACHE/wheels, ~540 MB, unpacked once into
# $CONTRAX_CACHE/site, and reused).
set -euo pipefail
PY=${1:-python3}
PKG=$(cd "$(dirname "$0")/.." && pwd)
OTHER=${CONTRAX_OTHER_TORCH:-2.14.1}
CACHE=${CONTRAX_CACHE:-$HOME/.cache/contrax}
work=$(mktemp -d /tmp/contrax_pip.XXXXXX)
trap 'rm -rf "$work"' EXIT
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

if "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  # The build's python is a virtual environment (PyPI's torch): a new one
  # without pip of its own, whose .pth file adds the build's site-packages
  # (torch, pip, setuptools) after its own.
  "$PY" -m venv --without-pip "$work/venv"
  site_of "$PY" >"$(site_of "$work/venv/bin/python")/build_env.pth"
  venv_torch=1
else
  "$PY" -m venv --system-site-packages "$work/venv"
  venv_torch=0
fi
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
# The installed package's surface and its losses, run from outside the source
# tree: what an install can get wrong (a missing module or file, the extension
# not loading). The whole suite runs against the build tree in CTest's
# python_tests, the peer libraries' in python_integration_tests.
OMP_NUM_THREADS=1 "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$PKG/tests/test_api.py" "$PKG/tests/test_losses.py"

if [ "$venv_torch" = 0 ]; then
  echo "pip_install: the build's torch is the system's; the other-torch import check needs PyPI's (skipped)"
  exit 0
fi
# A second environment with torch $OTHER of its own (its wheel only: the CUDA
# libraries and torch's other dependencies come from the build's environment
# through the .pth file), and the contrax just installed.
mkdir -p "$CACHE/wheels"
if ! ls "$CACHE"/wheels/torch-"$OTHER"-*.whl >/dev/null 2>&1; then
  echo "pip_install: downloading torch $OTHER's wheel into $CACHE/wheels (once)"
  "$PY" -m pip download -q --no-deps -d "$CACHE/wheels" "torch==$OTHER"
fi
# The wheel is unpacked once into $CACHE/site/torch-$OTHER (1.2 GB; 17 s of
# the test each time before) and found first through the .pth file.
unpacked=$CACHE/site/torch-$OTHER
if [ ! -f "$unpacked/.complete" ]; then
  rm -rf "$unpacked"
  "$PY" -m pip install -q --no-deps --no-index --find-links "$CACHE/wheels" --target "$unpacked" "torch==$OTHER"
  touch "$unpacked/.complete"
fi
"$PY" -m venv --without-pip "$work/other"
other_site=$(site_of "$work/other/bin/python")
printf '%s\n%s\n%s\n' "$unpacked" "$(site_of "$work/venv/bin/python")" "$(site_of "$PY")" >"$other_site/build_env.pth"
"$work/other/bin/python" - "$OTHER" <<'PYEOF'
import sys
import torch
assert torch.__version__.startswith(sys.argv[1]), torch.__version__
try:
    import contrax  # noqa: F401
except ImportError as e:
    msg = str(e)
    print("pip_install: under torch %s: ImportError: %s" % (torch.__version__, msg))
    import importlib.util, os  # the package's own record, read without importing the package
    where = importlib.util.find_spec("contrax").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("build_info", os.path.join(where, "_build_info.py"))
    _build_info = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_build_info)
    for part in ("contrax was built against torch %s" % _build_info.TORCH_VERSION,
                 "this interpreter imports torch %s" % torch.__version__,
                 "python -m pip install --no-build-isolation --force-reinstall"):
        assert part in msg, (part, msg)
else:
    raise SystemExit("pip_install: import contrax under torch %s did not fail" % torch.__version__)
PYEOF
