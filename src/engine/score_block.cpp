// InfoNCE on a block of precomputed scores (engine/score_block.h, with the
// derivation of the column term's backward).
#include "engine/score_block.h"

#include <torch/csrc/autograd/custom_function.h>

#include "comm/comm_capsule.h"

namespace contrax::detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Every column's log-sum-exp over every rank's rows, from this rank's block.
struct GatheredColumnLse : torch::autograd::Function<GatheredColumnLse> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& s, const CommunicatorPtr& comm,
                               int64_t world) {
    auto partial = torch::logsumexp(s, 0).unsqueeze(0);  // [1, N]; -inf on an empty rank
    auto lse = partial;
    if (world > 1) {
      lse = comm->all_gather_rows(partial.contiguous(), std::vector<int64_t>(world, 1), "all_gather");  // [W, N]
    }
    lse = torch::logsumexp(lse, 0);  // [N]
    ctx->save_for_backward({s, lse});
    ctx->saved_data["comm"] = comm_capsule(comm);  // alive until the backward runs
    ctx->saved_data["world"] = world;
    return lse;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    NoAutocast no_autocast;
    const auto saved = ctx->get_saved_variables();
    auto g = grads[0].contiguous().clone();  // [N]: this rank's dL_r / d lse_col
    if (ctx->saved_data["world"].toInt() > 1) {
      capsule_comm(ctx->saved_data["comm"])->all_reduce_sum(g, "all_reduce");
    }
    return {(saved[0] - saved[1]).exp() * g, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor score_block_loss(const torch::Tensor& scores, const Prologue& p, const BlockSpec& spec) {
  TORCH_INTERNAL_ASSERT(!spec.row_labels.defined(), "score_block_loss: labels are not supported");
  const auto& l = p.layout;
  const int64_t b = scores.size(0), g = spec.group;
  auto rows = torch::arange(b, scores.options().dtype(torch::kLong));
  auto designated = scores.gather(1, ((rows + l.offset) * g).unsqueeze(1)).squeeze(1);  // [b]
  auto per_row = torch::logsumexp(scores, 1) - designated;                             // [b]
  if (spec.symmetric) {
    TORCH_INTERNAL_ASSERT(g == 1, "score_block_loss: the symmetric form needs one key per row");
    auto lse_col = GatheredColumnLse::apply(scores, l.comm, l.world);  // [N]
    per_row = (per_row + lse_col.narrow(0, l.offset, b) - designated) * 0.5;
  }
  return reduce_rows(per_row, l, spec.reduction);
}

}  // namespace contrax::detail
