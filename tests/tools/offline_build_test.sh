#!/usr/bin/env bash
# The offline build (CTest offline_build; issue 38, item 5): what a GPU
# machine without network does. tools/gpu_bundle.sh writes the bundle (here,
# where a mirror is reachable); then, inside a root with no network and none
# of the bundled packages, `CONTRAX_TORCH=python tools/setup.sh` builds the
# tool against a torch that is already installed (PYTHON, standing for the
# machine's own), taking CLI11, JSON, GoogleTest, Gloo's headers and the data
# set from the bundle, and builds offline_build_probe: one translation unit
# against each bundled dependency (c10d's Gloo process group, CLI11, JSON,
# GoogleTest), run. The rest of the tool is not compiled a second time: it
# compiles against the same headers in the normal build, and the bundle must
# hold exactly the package versions installed here (checked below), so a
# second compilation would prove nothing more (and took 10-25 minutes of the
# suite on 2 cores). The root is this machine seen through two namespaces:
# a network namespace with no interface up (no apt, no PyPI), and a mount
# namespace in which dpkg's database lacks the bundled packages, their
# folders (headers, CMake packages, the data set) are empty, and so is .deps/.
# Without the bundle the same set-up must stop at once naming
# tools/gpu_bundle.sh. Skipped (77) where the namespaces cannot be made or no
# mirror is reachable to make the bundle.
# Usage: offline_build_test.sh PYTHON BUILD_DIR (the bundle goes into BUILD_DIR-bundle)
set -u
py=$1 build=$2 work=$2-bundle
repo="$(cd "$(dirname "$0")/../.." && pwd)"
fail() { echo "FAIL: $*"; exit 1; }
# The machines this is for carry a PyPI-style torch (no Gloo headers, no
# system LibTorch); Debian's python3-torch (the PyTorch 2.6 part of CI) is the
# system LibTorch that CONTRAX_TORCH=system already builds against.
case "$("$py" -c 'import torch; print(torch.__file__)' 2>/dev/null)" in
  /usr/lib/python3/*) echo "skipped: $py's torch is Debian's (the system LibTorch); the offline build is checked with a PyPI-style torch"; exit 77 ;;
esac
if ! unshare -n -m true 2>/dev/null; then
  echo "skipped: network and mount namespaces cannot be made here (unshare -n -m needs root)"
  exit 77
fi
rm -rf "$work" "$build"
mkdir -p "$work"
if ! CONTRAX_BUNDLE="$work/bundle" bash "$repo/tools/gpu_bundle.sh" >"$work/bundle.log" 2>&1; then
  cat "$work/bundle.log"
  echo "skipped: the bundle could not be made (no Debian mirror or PyPI reachable?)"
  exit 77
fi
# The bundle holds the versions this machine's packages have: what the normal
# build compiled the whole tool against is what the offline build finds.
while read -r pkg version _; do
  case "$pkg" in '#'*|gloo-headers|peers|*.whl) continue ;; esac
  here=$(dpkg-query -W -f='${Version}' "$pkg" 2>/dev/null) || fail "the bundle's $pkg is not installed here"
  [ "$here" = "$version" ] || fail "the bundle holds $pkg $version, this machine has $here"
done <"$work/bundle/MANIFEST"
[ "$(cat "$work/bundle/gloo/VERSION")" = "$(cat "$repo/.deps/gloo/VERSION")" ] ||
  fail "the bundle's Gloo headers are not those of .deps/gloo"

# What the root lacks: the bundled packages (tools/setup.sh's BUNDLED), and
# every folder of theirs that sits in a shared root of headers, CMake
# packages, data sets or sources.
packages="libcli11-dev nlohmann-json3-dev libgtest-dev libgmock-dev dataset-fashion-mnist"
awk -v drop=" $packages " '
  /^Package: / { skip = index(drop, " " $2 " ") > 0 }
  { if (!skip) print }
  /^$/ { skip = 0 }' /var/lib/dpkg/status >"$work/dpkg-status"
hide=()
for p in $packages; do
  while read -r f; do
    [ -d "$f" ] || continue
    case "$(dirname "$f")" in
      /usr/include|/usr/share/cmake|/usr/lib/cmake|/usr/lib/*-linux-gnu/cmake|/usr/share/datasets|/usr/src) hide+=("$f") ;;
    esac
  done < <(dpkg -L "$p" 2>/dev/null)
done
hide+=("$repo/.deps")
[ ${#hide[@]} -ge 5 ] || fail "found only ${#hide[@]} folders to hide: ${hide[*]}"

# offline CONTRAX_BUNDLE: the set-up in the root without network or packages.
offline() {
  unshare -n -m bash -c '
    set -e
    mount --bind "$1" /var/lib/dpkg/status
    shift
    for d in "$@"; do [ -e "$d" ] && mount -t tmpfs tmpfs "$d"; done
    cd "'"$repo"'"
    env CONTRAX_TORCH=python CONTRAX_PYTHON="'"$py"'" CONTRAX_BUNDLE="'"$BUNDLE_DIR"'" \
      CONTRAX_BUILD_DIR="'"$build"'" CONTRAX_TARGETS=offline_build_probe bash tools/setup.sh
  ' offline "$work/dpkg-status" "${hide[@]}"
}

BUNDLE_DIR=$work/none
log=$(offline 2>&1)
st=$?
echo "$log" | tail -n 5
[ $st -eq 1 ] || fail "without a bundle: exit status $st, expected 1"
grep -q "there is no offline bundle in $work/none; make one on a machine with network (bash tools/gpu_bundle.sh)" <<<"$log" ||
  fail "without a bundle: no message naming tools/gpu_bundle.sh"

BUNDLE_DIR=$work/bundle
log=$(offline 2>&1)
st=$?
echo "$log" | tail -n 15
[ $st -eq 0 ] || fail "the offline build failed (exit status $st)"
grep -q "from the offline bundle $work/bundle" <<<"$log" || fail "it did not say that it used the bundle"
for pkg in CLI11 nlohmann_json GTest; do
  dir=$(grep -E "^${pkg}_DIR:" "$build/CMakeCache.txt" | cut -d= -f2)
  [[ "$dir" == "$work/bundle/"* ]] || fail "$pkg was found in '$dir', not in the bundle"
done
probe=$("$build/tests/offline_build_probe" 2>&1) || { echo "$probe"; fail "the probe built offline failed"; }
echo "$probe" | head -n 1
grep -q "PASSED.* 3 tests" <<<"$probe" || { echo "$probe"; fail "the probe built offline did not pass its 3 tests"; }
rm -rf "$work" "$build"
echo "ok"
