// The logits workspace (contrax/engine/workspace.h, engine/workspace.h). Why:
// glibc maps each fresh buffer this large and faults in its pages every call,
// ~180 ms for NT-Xent's 512 MiB at 4096 rows per rank (W = 2), a sixth of the
// call. A buffer still in use (two losses alive at once) is never handed out
// again: the second gets a fresh one, which is not kept.
#include "engine/workspace.h"

#include <atomic>

#include "contrax/engine/workspace.h"
#include "util/env.h"

namespace contrax {

namespace detail {

namespace {

constexpr int64_t kKeepBytes = int64_t{32} << 20;

struct Workspace {
  c10::Storage storage;
  c10::ScalarType dtype = c10::kFloat;
};

Workspace& thread_workspace() {
  thread_local Workspace ws;
  return ws;
}

std::atomic<bool>& keep_workspace_flag() {
  static std::atomic<bool> on{env_on("CONTRAX_KEEP_WORKSPACE")};
  return on;
}

}  // namespace

torch::Tensor logits_buffer(int64_t rows, int64_t cols, const torch::TensorOptions& opt) {
  const auto dtype = c10::typeMetaToScalarType(opt.dtype());
  const int64_t bytes = rows * cols * static_cast<int64_t>(c10::elementSize(dtype));
  if (!opt.device().is_cpu() || bytes < kKeepBytes || !keep_workspace_flag().load(std::memory_order_relaxed)) {
    return torch::empty({rows, cols}, opt);
  }
  auto& ws = thread_workspace();
  if (ws.storage && ws.storage.use_count() > 1) return torch::empty({rows, cols}, opt);  // in use
  if (!ws.storage || ws.dtype != dtype || static_cast<int64_t>(ws.storage.nbytes()) < bytes) {
    ws.storage = c10::Storage();  // the old one goes first: never two kept buffers at once
    auto t = torch::empty({rows, cols}, opt);
    ws.storage = t.storage();
    ws.dtype = dtype;
    return t;
  }
  return torch::empty({0}, opt).set_(ws.storage, 0, {rows, cols}, {cols, 1});
}

}  // namespace detail

void set_keep_loss_workspace(bool keep) {
  detail::keep_workspace_flag().store(keep);
  if (!keep) release_loss_workspace();
}

bool keep_loss_workspace() { return detail::keep_workspace_flag().load(); }

int64_t loss_workspace_bytes() {
  const auto& st = detail::thread_workspace().storage;
  return st ? static_cast<int64_t>(st.nbytes()) : 0;
}

void release_loss_workspace() { detail::thread_workspace().storage = c10::Storage(); }

}  // namespace contrax
