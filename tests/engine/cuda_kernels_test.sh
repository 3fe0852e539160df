#!/usr/bin/env bash
# The CUDA panel kernels compile for sm_80 and sm_90 with the build's spill
# flags (src/engine/kernels/CMakeLists.txt) and ptxas reports no spill and no
# stack frame for any of them; and the same flags fail the compile of a kernel
# made to spill, so the check can fail.
#
#   cuda_kernels_test.sh NVCC SRC_DIR KERNEL.cu... -- FLAGS...
set -uo pipefail
nvcc=$1 src=$2
shift 2
kernels=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do kernels+=("$1"); shift; done
shift
flags=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
arch=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
status=0
for k in "${kernels[@]}"; do
  name=$(basename "$k" .cu)
  if ! "$nvcc" -std=c++17 -O3 -I"$src" "${arch[@]}" "${flags[@]}" -Xptxas=-v -c "$k" -o "$tmp/$name.o" \
      >"$tmp/$name.log" 2>&1; then
    echo "FAIL: $name does not compile with the spill flags:"; cat "$tmp/$name.log"; status=1; continue
  fi
  entries=$(grep -c "Compiling entry function" "$tmp/$name.log")
  clean=$(grep -c "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" "$tmp/$name.log")
  if [ "$entries" -eq 0 ] || [ "$entries" -ne "$clean" ]; then
    echo "FAIL: $name: $entries kernels compiled, $clean without stack frame or spills:"; cat "$tmp/$name.log"; status=1
  else
    echo "ok: $name: $entries kernels (sm_80, sm_90), no spills, no stack frame"
  fi
done
# The control: a kernel whose 64 live floats cannot fit the 32 registers that
# __launch_bounds__(1024, 2) leaves a thread must spill, and the flags must
# fail its compile.
cat >"$tmp/control.cu" <<'CU'
__global__ void __launch_bounds__(1024, 2) spill(float* out, const float* in, int n) {
  float acc[64];
#pragma unroll
  for (int k = 0; k < 64; ++k) acc[k] = in[k * n + threadIdx.x];
#pragma unroll
  for (int it = 0; it < 4; ++it) {
#pragma unroll
    for (int k = 0; k < 64; ++k) acc[k] = acc[k] * acc[(k + 7) % 64] + in[it];
  }
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 64; ++k) s += acc[k] * in[n + k];
  out[threadIdx.x] = s;
}
CU
if "$nvcc" -O3 -gencode arch=compute_80,code=sm_80 "${flags[@]}" -c "$tmp/control.cu" -o "$tmp/control.o" \
    >"$tmp/control.log" 2>&1; then
  echo "FAIL: a kernel that must spill passed the spill flags (the check cannot fail)"; status=1
elif ! grep -q -i "spill\|local memory" "$tmp/control.log"; then
  echo "FAIL: the spilling control failed, but not on a spill:"; cat "$tmp/control.log"; status=1
else
  echo "ok: a kernel forced to spill fails with the spill flags"
fi
exit $status
