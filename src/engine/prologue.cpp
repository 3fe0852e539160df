// The prologue every loss front end shares (see engine/prologue.h).
#include "engine/prologue.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "contrax/comm/collectives.h"

namespace contrax::detail {

EngineLayout make_layout(const char* caller, const CommunicatorPtr& comm, std::vector<int64_t> counts) {
  EngineLayout l;
  l.caller = caller;
  l.world = comm ? comm->world_size() : 1;
  l.rank = comm ? comm->rank() : 0;
  l.comm = l.world > 1 ? comm : nullptr;
  l.counts = std::move(counts);
  for (size_t s = 0; s < l.counts.size(); ++s) {
    if (static_cast<int64_t>(s) < l.rank) l.offset += l.counts[s];
    l.total += l.counts[s];
  }
  return l;
}

void check_no_double_backward(const EngineLayout& layout) {
  TORCH_CHECK(!torch::GradMode::is_enabled(), layout.caller,
              "(): double backward (create_graph=true) is not supported");
}

std::vector<int64_t> agree_on_rows(const char* caller, const torch::Tensor& counted, const char* arg,
                                   const CommunicatorPtr& comm, const std::string& local_error, const char* rows,
                                   int64_t extra, std::vector<int64_t>* extras) {
  auto counts = exchange_row_counts(counted, comm, caller, arg, local_error, extra, extras);
  int64_t total = 0;
  for (auto c : counts) total += c;
  TORCH_CHECK(total > 0, caller, "(): the global batch is empty (every rank passed 0 ", rows, ")");
  return counts;
}

bool route_tiled(MemoryPath path, int64_t tile_size, bool ring, int64_t logits_bytes, int64_t max_logits_bytes) {
  if (path == MemoryPath::kTiled || ring) return true;
  if (path == MemoryPath::kMaterialised) return false;
  return tile_size > 0 || logits_bytes > max_logits_bytes;
}

int64_t logits_blocks(const std::string& loss) {
  if (loss == "nt_xent") return 4;
  if (loss == "moco_v3") return 2;
  return 1;
}

Prologue make_prologue(const char* caller, const CommunicatorPtr& comm, std::vector<int64_t> counts,
                       const torch::Tensor& features, const MemoryPathOptions& memory, int64_t blocks) {
  Prologue p;
  p.dtype = compute_dtype(features.scalar_type());
  p.operand = operand_dtype(features.scalar_type(), features.device());
  const int64_t e = static_cast<int64_t>(c10::elementSize(p.dtype));
  int64_t B = 0, bmax = 0;
  for (auto c : counts) {
    B += c;
    bmax = std::max(bmax, c);
  }
  p.tiled = route_tiled(memory.path(), memory.tile_size(), memory.ring(), bmax * B * e * blocks,
                        memory.max_logits_bytes());
  p.layout = make_layout(caller, comm, std::move(counts));
  p.ring = p.tiled && memory.ring() && p.layout.world > 1;
  p.walk = make_walk(features, std::max<int64_t>(memory.tile_size(), 0), memory.tile_bytes());
  return p;
}

torch::Tensor safe_normalize(const torch::Tensor& x) {
  // x / max(|x|, eps) is unchanged by scaling x by any m > 0 together with eps,
  // so dividing by the row's largest magnitude first (a constant for autograd:
  // the function does not depend on it) changes nothing but the overflow.
  // max |x_ij| as one reduction (the inf-norm), not a pass of abs and another of amax.
  auto m = torch::linalg_vector_norm(x.detach(), std::numeric_limits<double>::infinity(), {1}, /*keepdim=*/true)
               .clamp_min(std::numeric_limits<float>::min());  // [n, 1]
  auto y = x / m;
  return y / torch::maximum(y.norm(2, 1, /*keepdim=*/true), 1e-12 / m);
}

torch::Tensor prepare(const torch::Tensor& x, const Prologue& p, bool normalize) {
  return normalize ? safe_normalize(x.to(p.dtype)).to(p.operand) : x.to(p.operand);
}

torch::Tensor clamped_scale(const torch::Tensor& logit_scale, double max_scale) {
  // exp never sees more than log(max_scale), so its backward multiplies by a
  // finite number; at and above the clamp the constant branch is taken (zero
  // gradient, as min(exp(x), max) has wherever exp(x) >= max). Both tests are
  // `x >= log_max`, and the cap is a `where`, not clamp_max: a NaN fails the
  // test and must reach the loss and its own gradient through the exp branch
  // (NaN in, NaN out), where `x < log_max` replaced it by the maximum and
  // clamp_max's backward gave it a zero gradient. A reduced-precision scale
  // (fp16/bf16, as autocast users hold it) is computed in fp32: exp(log 100)
  // needs no more, and CPU kernels for half clamps are not everywhere.
  const auto x = c10::isReducedFloatingType(logit_scale.scalar_type()) ? logit_scale.to(torch::kFloat) : logit_scale;
  const double log_max = std::log(max_scale);
  // The constants are Scalars (no tensor filled for them: two launches fewer).
  const auto over = x >= log_max;
  auto capped = torch::where(over, c10::Scalar(log_max), x).exp();
  return torch::where(over, c10::Scalar(max_scale), capped);
}

void warn_if_scale_not_log(const torch::Tensor& logit_scale, double max_logit_scale) {
  // open_clip and Inf-CL pass the scale itself (1/0.07 = 14.3, or 100) where
  // Contrax takes its log. Reading the value needs a host sync, so parameters
  // off the CPU are looked at only in the first calls of a process (the
  // mistake is made once, at construction, and shows at once).
  static std::atomic<int64_t> device_checks{0};
  if (!logit_scale.defined() || logit_scale.dim() != 0 || !c10::isFloatingType(logit_scale.scalar_type())) return;
  if (!logit_scale.device().is_cpu() && device_checks.fetch_add(1) >= 16) return;
  const double v = logit_scale.detach().item<double>();
  if (!(v > std::log(max_logit_scale) + 1.0)) return;
  TORCH_WARN_ONCE("logit_scale=", v, " is the log of the scale (Contrax clamps exp(logit_scale) at ", max_logit_scale,
                  "): pass log(1/0.07)=2.66, not 1/0.07=14.3 as open_clip/Inf-CL do");
}

void check_labels(ArgChecker& check, const torch::Tensor& labels, const char* arg, int64_t rows,
                  const torch::Device& device) {
  if (!labels.defined()) return;
  check.require(labels.scalar_type() == torch::kLong, "argument '", arg, "' must be an int64 tensor, but got dtype ",
                labels.scalar_type());
  check.require(labels.dim() == 1 && labels.size(0) == rows, "argument '", arg, "' must have shape [", rows,
                "] (one label per row on this rank), but got ", labels.sizes());
  check.require(labels.device() == device, "argument '", arg, "' must be on the features' device (", device,
                "), but got ", labels.device());
}

torch::Tensor gather_rows(const torch::Tensor& local, const CommunicatorPtr& comm, const std::vector<int64_t>& counts,
                          bool with_grad) {
  // The counts are agreed (agree_on_rows): no second metadata round trip.
  if (!comm || comm->world_size() == 1) return with_grad ? local : local.detach();
  if (with_grad) return gather_rows_with_grad(local, comm, counts);
  torch::NoGradGuard no_grad;
  return comm->all_gather_rows(local.detach(), counts, "all_gather_no_grad");
}

torch::Tensor gather_labels(const torch::Tensor& local, const CommunicatorPtr& comm,
                            const std::vector<int64_t>& counts) {
  if (!local.defined() || !comm || comm->world_size() == 1) return local;
  return comm->all_gather_rows(local.contiguous(), counts, "labels_all_gather");
}

}  // namespace contrax::detail
