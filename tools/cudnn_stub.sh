#!/usr/bin/env bash
# For GPU-less test machines only: makes LibTorch's CUDA build loadable
# without cuDNN. Debian ships cuDNN only as `nvidia-cudnn`, an installer that
# downloads it from NVIDIA; where that host cannot be reached, libtorch_cuda.so
# (which NEEDs libcudnn.so.9) cannot even be loaded, so nothing that links
# LibTorch runs. This writes a libcudnn.so.9 whose every function, taken from
# the symbols the installed LibTorch libraries import from it, prints its own
# name and aborts. Without a GPU, LibTorch never calls cuDNN (Contrax never
# does), so the suite runs against the CUDA build; with one, install the real
# cuDNN instead. Called by tools/setup.sh (CONTRAX_CUDA=1) when no cuDNN is
# installed and no NVIDIA device is present.
#   bash tools/cudnn_stub.sh [LIBDIR]     (default /usr/local/lib/contrax-cudnn-stub)
set -euo pipefail
LIBDIR=${1:-/usr/local/lib/contrax-cudnn-stub}
if ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  echo "cudnn_stub: an NVIDIA device is present: install the real cuDNN instead of a stub" >&2
  exit 2
fi
ARCH=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo x86_64-linux-gnu)
mapfile -t symbols < <(for lib in /usr/lib/"$ARCH"/libtorch*.so.*.*; do
  nm -D --undefined-only --with-symbol-versions "$lib" 2>/dev/null
done | sed -n 's/.* \([A-Za-z_][A-Za-z0-9_]*\)@libcudnn\.so\.9.*/\1/p' | sort -u)
((${#symbols[@]})) || { echo "cudnn_stub: no LibTorch library imports cuDNN; nothing to do" >&2; exit 0; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
{
  echo '#include <stdio.h>'
  echo '#include <stdlib.h>'
  echo 'static void contrax_cudnn_stub(const char* name) {'
  echo '  fprintf(stderr, "%s: cuDNN is a stub on this GPU-less test machine (tools/cudnn_stub.sh)\\n", name);'
  echo '  abort();'
  echo '}'
  for s in "${symbols[@]}"; do echo "int $s(void) { contrax_cudnn_stub(\"$s\"); return 0; }"; done
} >"$work/stub.c"
# The importers ask for version node `libcudnn.so.9`.
printf 'libcudnn.so.9 { global: *; };\n' >"$work/stub.map"
mkdir -p "$LIBDIR"
cc -shared -fPIC -O1 -Wl,-soname,libcudnn.so.9 -Wl,--version-script="$work/stub.map" \
  "$work/stub.c" -o "$LIBDIR/libcudnn.so.9"
echo "$LIBDIR" >/etc/ld.so.conf.d/contrax-cudnn-stub.conf
ldconfig
echo "cudnn_stub: $LIBDIR/libcudnn.so.9 with ${#symbols[@]} aborting functions (GPU-less testing only)"
