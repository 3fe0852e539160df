// The loss workspace: the materialised losses' logits buffer kept between
// calls, and the budget of the panels a loss walks its logits in on a GPU.
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

/// On CUDA every memory path (tiled, ring, the materialised path's panels,
/// SigLIP) walks the logits in row panels of all the columns of a block,
/// sized so that what a panel holds at once (its logits, their temporaries
/// and the gradient panel in the operand dtype) stays within this budget
/// (docs/losses.md). 0 (the default) is automatic: 1 GiB, or 1.5 GiB on a GPU
/// of 40 GB or more. The environment variable CONTRAX_PANEL_BYTES sets it at
/// start. The CPU keeps its cache-sized tiles (`tile_bytes`) whatever this is.
///
///   contrax::set_loss_panel_bytes(int64_t{512} << 20);   // smaller panels, less memory
void set_loss_panel_bytes(int64_t bytes);
/// The budget set (0: automatic).
int64_t loss_panel_bytes();

}  // namespace contrax
