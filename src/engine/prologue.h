// The one prologue every loss front end shares (CLIP, grouped, NT-Xent, MoCo
// v3, SigLIP, the tiled entry points): the row-count agreement that turns one
// rank's bad argument into an error on every rank, the layout of the global
// batch, the memory path's routing (decided from the exchanged counts, so the
// same on every rank), the compute dtype, the feature normalisation, the
// clamped scale, the label checks and the gathers. Internal to the engine
// (src/engine/), not installed.
#pragma once

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "contrax/comm/communicator.h"
#include "contrax/util/vocabulary.h"
#include "engine/panels.h"
#include "engine/precision.h"
#include "util/check.h"

namespace contrax::detail {

/// Autocast off for the scope: a loss computes one function whether or not
/// its caller is inside torch.autocast, in its forward and in its backward
/// (the engine follows its own precision policy, engine/precision.h: fp32
/// log-sum-exps for fp16/bf16 features; autocast would lower its GEMMs to bf16 on the CPU and
/// make the loss depend on where backward() was called). One at every front
/// end's entry and at the top of every engine backward.
class NoAutocast {
  c10::impl::ExcludeDispatchKeyGuard guard_{c10::autocast_dispatch_keyset};
};

/// Who called and where this rank's rows sit in the global batch; identical
/// on every rank except `rank` and `offset`.
struct EngineLayout {
  const char* caller = "";      // the public function called, for error messages
  CommunicatorPtr comm;         // null when W == 1
  std::vector<int64_t> counts;  // b_s for every rank
  int64_t rank = 0;
  int64_t world = 1;
  int64_t offset = 0;  // off_r
  int64_t total = 0;   // B

  /// Every rank's key rows when each row has `group` candidates: b_s g.
  std::vector<int64_t> key_counts(int64_t group) const {
    auto keys = counts;
    for (auto& c : keys) c *= group;
    return keys;
  }
};

/// "<caller>(): double backward (create_graph=true) is not supported" unless
/// grad mode is off (every engine backward computes without a graph).
void check_no_double_backward(const EngineLayout& layout);

/// The state (with a `layout`) a forward kept in ctx->saved_data["state"],
/// once check_no_double_backward has passed.
template <class State>
c10::intrusive_ptr<State> backward_state(torch::autograd::AutogradContext* ctx) {
  auto state = c10::static_intrusive_pointer_cast<State>(ctx->saved_data["state"].toCapsule());
  check_no_double_backward(state->layout);
  return state;
}

/// Builds the layout from exchanged counts.
EngineLayout make_layout(const char* caller, const CommunicatorPtr& comm, std::vector<int64_t> counts);

/// exchange_row_counts (contrax/comm/collectives.h) of `counted` (the argument
/// named `arg`), sharing this rank's `local_error` first, and an error on every
/// rank when the global batch is empty ("every rank passed 0 <rows>").
/// `extra`/`extras` ride along as there.
std::vector<int64_t> agree_on_rows(const char* caller, const torch::Tensor& counted, const char* arg,
                                   const CommunicatorPtr& comm, const std::string& local_error,
                                   const char* rows = "rows", int64_t extra = 0,
                                   std::vector<int64_t>* extras = nullptr);

// ---- the memory path

/// The routing every loss and `plan_loss` share (MemoryPath in
/// contrax/util/vocabulary.h): tiled for path kTiled or `ring`; materialised for
/// kMaterialised; tiled for a positive tile_size; otherwise tiled when the
/// largest rank's materialised logits (`logits_bytes`) would exceed
/// `max_logits_bytes`.
bool route_tiled(MemoryPath path, int64_t tile_size, bool ring, int64_t logits_bytes, int64_t max_logits_bytes);

/// How many [b x B] logits blocks the materialised path of `loss` holds per
/// rank ("clip"/"infonce": 1, "nt_xent": 4 (one [2b x 2B]), "moco_v3": 2): the
/// automatic routing and `plan_loss` compare this with `max_logits_bytes`.
int64_t logits_blocks(const std::string& loss);

/// What the ranks decided from the agreed counts, identically on every rank.
struct Prologue {
  EngineLayout layout;
  c10::ScalarType dtype = c10::kFloat;    // the compute dtype (compute_dtype)
  c10::ScalarType operand = c10::kFloat;  // the features' dtype in the gathers and GEMMs (operand_dtype)
  bool tiled = false;                   // the tiled path
  bool ring = false;                    // tiled, ring and W > 1: key blocks travel instead of being gathered
  TileWalk walk;                        // how the tiled path walks a logits block (tiles or panels)
};

/// The prologue of a loss over features like `features` (their dtype and
/// device): `blocks` is how many [b x B] logits blocks its materialised path
/// holds (the routing's measure, see logits_blocks).
Prologue make_prologue(const char* caller, const CommunicatorPtr& comm, std::vector<int64_t> counts,
                       const torch::Tensor& features, const MemoryPathOptions& memory, int64_t blocks);

// ---- the features

/// L2 normalisation of rows that cannot overflow: rows are divided by their
/// largest magnitude before the norm is taken, so 1e20-sized fp32 inputs give
/// unit rows instead of zeros. Same value and gradient as
/// F::normalize(x, dim 1, eps 1e-12) wherever that one does not overflow.
torch::Tensor safe_normalize(const torch::Tensor& x /* [n, d] */);

/// `x` L2-normalised in the compute dtype (safe_normalize) when `normalize`,
/// then in the operand dtype: the features as the gathers and GEMMs take them.
torch::Tensor prepare(const torch::Tensor& x, const Prologue& p, bool normalize);

/// The logit scale min(exp(logit_scale), max_scale) with the clamp taken on the
/// log side: exp never sees a value above log(max_scale), so a huge
/// logit_scale gives the clamped scale and a zero (not NaN) gradient.
torch::Tensor clamped_scale(const torch::Tensor& logit_scale, double max_scale);

/// Warns once when `logit_scale` looks like the scale itself rather than its
/// log (the commonest porting mistake from open_clip and Inf-CL).
void warn_if_scale_not_log(const torch::Tensor& logit_scale, double max_logit_scale);

/// `labels` (undefined: nothing to check) must be an int64 vector of `rows`
/// entries on `device`; `arg` names it.
void check_labels(ArgChecker& check, const torch::Tensor& labels, const char* arg, int64_t rows,
                  const torch::Device& device);

// ---- the gathers, once the counts are agreed

/// Every rank's `local` rows in rank order ([sum(counts), ...]): with
/// gradient (backward: reduce-scatter) or without; `local` itself for W = 1.
torch::Tensor gather_rows(const torch::Tensor& local, const CommunicatorPtr& comm,
                          const std::vector<int64_t>& counts, bool with_grad);

/// Every rank's labels in rank order (`counts` rows each); undefined `local`:
/// undefined.
torch::Tensor gather_labels(const torch::Tensor& local, const CommunicatorPtr& comm,
                            const std::vector<int64_t>& counts);

}  // namespace contrax::detail
