#!/usr/bin/env bash
# Builds the API reference: one HTML site of the public C++ headers (Doxygen
# comments, through Doxygen's XML and breathe) and the Python package (its
# docstrings, through autodoc), with every warning an error.
#
#   bash tools/docs.sh [BUILD_DIR]      # site in BUILD_DIR/docs/html/index.html
#
# BUILD_DIR (default $CONTRAX_BUILD_DIR, else build) is a finished CMake build:
# autodoc imports the package CMake builds into BUILD_DIR/python/contrax
# (PYTHONPATH=BUILD_DIR/python, as CTest's python_tests runs it). Steps:
#   1. Doxygen (docs/api/Doxyfile): XML into BUILD_DIR/docs/xml; a public
#      declaration without a comment is a warning, and a warning fails;
#   2. Sphinx (docs/api/conf.py, index.rst): HTML into BUILD_DIR/docs/html;
#   3. Sphinx's coverage builder: a public Python function, class or method
#      that the site leaves out (it has no docstring) is a warning, and fails.
#
# Needs doxygen (Debian package; tools/setup.sh installs it) and, in the
# interpreter of the build's torch ($CONTRAX_DOCS_PYTHON, default .venv's
# python), the pins of requirements/docs.txt (sphinx, breathe):
#   CONTRAX_EXTRA_REQUIREMENTS=requirements/docs.txt bash tools/setup.sh
# (tools/test.sh does that). Exits 77 when a tool is missing (CTest's
# docs_build then reports it skipped), 1 on any warning or error.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-${CONTRAX_BUILD_DIR:-build}}
PY=${CONTRAX_DOCS_PYTHON:-${CONTRAX_VENV:-.venv}/bin/python}

say() { echo "docs: $*"; }
missing() { echo "docs: $*" >&2; exit 77; }
fail() { echo "docs: $*" >&2; exit 1; }

command -v doxygen >/dev/null || missing "doxygen not found (apt-get install doxygen; tools/setup.sh installs it)"
[ -x "$PY" ] || command -v "$PY" >/dev/null ||
  missing "no interpreter $PY (run tools/setup.sh, or set CONTRAX_DOCS_PYTHON)"
"$PY" -c 'import sphinx, breathe' 2>/dev/null ||
  missing "$PY cannot import sphinx and breathe ($PY -m pip install -r requirements/docs.txt)"
[ -d "$BUILD" ] || fail "no build directory $BUILD (build first: bash tools/setup.sh, or name one: tools/docs.sh BUILD_DIR)"
BUILD=$(cd "$BUILD" && pwd)
PKG=$BUILD/python/contrax
[ -f "$PKG/__init__.py" ] ||
  fail "the Python package is not in $PKG (autodoc imports it): build it with cmake --build $BUILD --target contrax_python"
compgen -G "$PKG/_contrax*.so" >/dev/null ||
  fail "the extension $PKG/_contrax*.so is not built (autodoc imports it): cmake --build $BUILD --target contrax_python"
export PYTHONPATH=$BUILD/python${PYTHONPATH:+:$PYTHONPATH}
if ! err=$("$PY" -c 'import contrax, contrax.modules, contrax.grad_cache, contrax.integrations.open_clip, contrax.integrations.lightly, contrax.integrations.sentence_transformers' 2>&1); then
  fail "$PY cannot import the built package from $BUILD/python (autodoc would document nothing): ${err##*$'\n'}"
fi

OUT=$BUILD/docs
rm -rf "$OUT/xml" "$OUT/html" "$OUT/coverage"
mkdir -p "$OUT"
say "Doxygen over include/contrax -> $OUT/xml"
# The Doxyfile's paths are relative to docs/api; OUTPUT_DIRECTORY is this build's.
(cd docs/api && { cat Doxyfile; echo "OUTPUT_DIRECTORY = $OUT"; } | doxygen -) ||
  fail "Doxygen failed: every warning above is an error (a public declaration without a /// comment, or bad markup)"
export CONTRAX_DOXYGEN_XML=$OUT/xml
say "Sphinx -> $OUT/html"
"$PY" -m sphinx -q -W --keep-going -b html docs/api "$OUT/html" ||
  fail "Sphinx failed: every warning above is an error"
say "Sphinx coverage of the Python package"
"$PY" -m sphinx -q -W --keep-going -b coverage docs/api "$OUT/coverage" ||
  fail "public Python objects without a docstring (above; listed in $OUT/coverage/python.txt)"
say "the API reference is at $OUT/html/index.html"
