// The loss workspace: the materialised losses' logits buffer kept between
// calls.
//
// A materialised loss holds one logits buffer per rank ([b x B] for CLIP,
// [2b x 2B] for NT-Xent). On the CPU, a buffer of 32 MiB or more is kept by
// the calling thread after the loss that used it is gone, and the next loss
// whose buffer fits reuses it: glibc would otherwise map a fresh one and fault
// in every page on every call (docs/benchmarks.md measures what that costs).
// Training calls the loss every step with the same shapes, so this is paid
// once. The price is that the buffer stays resident between calls; release it
// when the losses are done, or turn keeping off (CONTRAX_KEEP_WORKSPACE=0 in
// the environment does the same). CUDA tensors are not affected (PyTorch's
// caching allocator already reuses them).
#pragma once

#include <cstdint>

namespace contrax {

/// Keep the workspace between calls (default: on, unless CONTRAX_KEEP_WORKSPACE=0).
/// Turning it off also releases this thread's buffer.
///
///   contrax::set_keep_loss_workspace(false);   // e.g. before a memory-hungry evaluation
void set_keep_loss_workspace(bool keep);
bool keep_loss_workspace();
/// Bytes of the buffer this thread keeps (0: none).
int64_t loss_workspace_bytes();
/// Frees this thread's kept buffer (a loss still using it keeps it alive until
/// its backward is done).
void release_loss_workspace();

}  // namespace contrax
