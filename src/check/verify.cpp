// Exactness verification of the distributed losses and of the gradient-cache
// training step (see contrax/check/verify.h).
#include "contrax/check/verify.h"

#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

#include "contrax/comm/collectives.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"
#include "contrax/parallel/data_parallel.h"
#include "contrax/parallel/grad_cache.h"
#include "contrax/util/memory.h"
#include "check/verify_cases.h"
#include "util/cuda_side.h"

namespace contrax {

using detail::labels_of;

namespace {

// Below this magnitude a reference quantity is compared absolutely (scaled by
// the floor): a loss or gradient that is exactly 0 (one global row; width 1,
// where normalised rows are +-1 and their gradients vanish) otherwise turns
// round-off into a "relative error" of 1e285. Round-off there is not 1e-17:
// normalising a row of norm 1e-3 amplifies it to ~1e-14. With the default
// tolerance 1e-10, absolute differences under 1e-13 pass this way; every
// gradient of verify's default cases is above the floor (a mean over <= 30 rows).
constexpr double kAbsFloor = 1e-3;

// Compared on the CPU: the distributed side may live on a CUDA device.
double rel(const torch::Tensor& got, const torch::Tensor& want) {
  if (want.numel() == 0) return 0.0;
  auto g = got.detach().to(torch::kCPU, torch::kDouble), w = want.detach().to(torch::kCPU, torch::kDouble);
  const double scale = std::max(w.abs().max().item<double>(), kAbsFloor);
  return (g - w).abs().max().item<double>() / scale;
}

// ---- the gradient-cache step: one GradCache step on every rank against one
// ordinary full-batch step, every parameter gradient compared.

// Dropout with a mask that is a fixed function of the example and the
// feature, so that the full batch, every rank split and every chunking see the
// same masks (and thread ranks share no generator). The example is keyed by
// its first input value, a continuous random number: no id has to travel
// with the rows. The mask is computed in fp64 whatever h's dtype (the hash
// amplifies the last bit), so a reduced-precision run draws the reference's.
torch::Tensor keyed_dropout(const torch::Tensor& h /* [n, k] */, const torch::Tensor& key /* [n] */, double p,
                            double salt) {
  auto j = torch::arange(h.size(1), h.options().dtype(torch::kDouble));
  auto k = key.detach().to(torch::kDouble);
  auto u = torch::frac(torch::sin(k.unsqueeze(1) * 997.0 + j.unsqueeze(0) * 78.233 + salt) * 43758.5453).abs();
  return h * ((u >= p).to(h.scalar_type()) / (1.0 - p));
}

// One tower, an MLP with dropout: w = {w1 [k, d], b1 [k], w2 [e, k], b2 [e]}.
torch::Tensor mlp_tower(const torch::Tensor& x /* [n, d] */, const std::vector<torch::Tensor>& w, double salt) {
  auto h = keyed_dropout(torch::tanh(torch::addmm(w[1], x, w[0].t())), x.select(1, 0), 0.3, salt);
  return torch::addmm(w[3], h, w[2].t());  // [n, e]
}

// A module owning given tensors, for DataParallel (the parameters are the
// case's `s`, so their gradients land where verify reads them).
std::shared_ptr<torch::nn::Module> module_of(const std::vector<torch::Tensor>& params) {
  auto m = std::make_shared<torch::nn::Module>();
  for (size_t i = 0; i < params.size(); ++i) m->register_parameter(c10::str("p", i), params[i]);
  return m;
}

// Two towers a (salt 1) and b (salt 2) of width d -> 12 -> 8 and the CLIP
// logit scale, in that order in `s`.
constexpr int64_t kTowerParams = 4;

}  // namespace

VerifyCase detail::grad_cache_case(std::string name, const detail::TowerLoss& loss,
                                   const detail::TowerLoss& reference) {
  using V = std::vector<torch::Tensor>;
  VerifyCase c;
  c.name = std::move(name);
  c.num_features = 2;              // the two towers' inputs
  c.feature_grad = {false, false};  // data, as in training
  c.parameters = [](int64_t width, at::Generator gen) {
    const int64_t hidden = 12, out = 8;
    auto f64 = torch::TensorOptions().dtype(torch::kDouble);
    torch::OrderedDict<std::string, torch::Tensor> p;
    for (const char* t : {"a", "b"}) {
      p.insert(c10::str(t, ".w1"), torch::randn({hidden, width}, gen, f64) / std::sqrt(static_cast<double>(width)));
      p.insert(c10::str(t, ".b1"), torch::randn({hidden}, gen, f64) * 0.1);
      p.insert(c10::str(t, ".w2"), torch::randn({out, hidden}, gen, f64) / std::sqrt(static_cast<double>(hidden)));
      p.insert(c10::str(t, ".b2"), torch::randn({out}, gen, f64) * 0.1);
    }
    p.insert("logit_scale", torch::tensor(std::log(1 / 0.07), f64));
    return p;
  };
  c.distributed = [loss](const V& x, const V& s, const CommunicatorPtr& comm) {
    const V wa(s.begin(), s.begin() + kTowerParams), wb(s.begin() + kTowerParams, s.begin() + 2 * kTowerParams);
    const torch::Tensor logit_scale = s[2 * kTowerParams];
    auto dp_a = std::make_shared<DataParallel>(module_of(wa), comm);
    auto dp_b = std::make_shared<DataParallel>(module_of(wb), comm);
    auto dp_loss = std::make_shared<DataParallel>(module_of({logit_scale}), comm);
    // Chunks of 4 and 5 rows: neither divides the default rows (6, 3, 0, 5).
    GradCacheEncoder a([wa](const BatchInput& in) -> c10::IValue { return mlp_tower(in.tensor(), wa, 1); }, 4);
    GradCacheEncoder b([wb](const BatchInput& in) -> c10::IValue { return mlp_tower(in.tensor(), wb, 2); }, 5);
    GradCache gc({a.data_parallel(dp_a), b.data_parallel(dp_b)},
                 [logit_scale, loss, comm](const V& r) { return loss(r, logit_scale, comm); },
                 GradCacheOptions().loss_data_parallel(dp_loss));
    return gc.step({x[0], x[1]});  // detached: the step ran its backward
  };
  c.reference = [reference](const V& x, const V& s) {
    const V wa(s.begin(), s.begin() + kTowerParams), wb(s.begin() + kTowerParams, s.begin() + 2 * kTowerParams);
    return reference({mlp_tower(x[0], wa, 1), mlp_tower(x[1], wb, 2)}, s[2 * kTowerParams], nullptr);
  };
  return c;
}

namespace {

// The CLIP loss over the towers' outputs (the comm added), and its reference.
VerifyCase grad_cache_case(std::string name, const ClipLossOptions& loss_options) {
  using V = std::vector<torch::Tensor>;
  return detail::grad_cache_case(
      std::move(name),
      [loss_options](const V& r, const torch::Tensor& scale, const CommunicatorPtr& comm) {
        return clip_loss(r[0], r[1], scale, c10::nullopt, ClipLossOptions(loss_options).comm(comm));
      },
      [normalize = loss_options.normalize(), m = loss_options.matryoshka()](const V& towers, const torch::Tensor& scale,
                                                                             const CommunicatorPtr&) {
        const auto loss = [&](const V& f) {
          return reference::clip_loss(f[0], f[1], scale, c10::nullopt, true, 100.0, normalize);
        };
        return m.dims().empty() ? loss(towers) : reference::matryoshka(m.dims(), m.weights(), towers, loss);
      });
}

// Grouped cases: feature 1 is [b_r, g * width] and holds each query's g
// candidates side by side, reshaped to the loss's [b_r g, width].
VerifyCase grouped_case(std::string name, int64_t g, bool labels, LabelMode mode, int64_t tile_size, bool ring) {
  using V = std::vector<torch::Tensor>;
  VerifyCase c;
  c.name = std::move(name);
  c.num_features = 2;
  c.scalars = {std::log(8.0), 0.2};
  c.feature_widths = {1, g};
  c.distributed = [=](const V& x, const V& s, const CommunicatorPtr& comm) {
    auto cands = x[1].reshape({-1, x[0].size(1)});
    auto o = GroupedLossOptions()
                 .normalize(true)
                 .comm(comm)
                 .path(tile_size < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
                 .tile_size(std::max<int64_t>(tile_size, 0))
                 .ring(ring);
    if (labels) o.labels(labels_of(x[0])).candidate_labels(labels_of(cands)).label_mode(mode);
    return grouped_loss(x[0], cands, s[0], s[1], o);
  };
  c.reference = [=](const V& x, const V& s) {
    auto cands = x[1].reshape({-1, x[0].size(1)});
    return reference::grouped_rows(x[0], cands, s[0], s[1], 100.0, true,
                                   labels ? labels_of(x[0]) : torch::Tensor(),
                                   labels ? labels_of(cands) : torch::Tensor(), mode)
        .mean();
  };
  return c;
}

VerifyCase clip_labels_case(std::string name, bool symmetric, LabelMode mode, int64_t tile_size, bool ring) {
  using V = std::vector<torch::Tensor>;
  VerifyCase c;
  c.name = std::move(name);
  c.num_features = 2;
  c.scalars = {std::log(1 / 0.07)};
  c.distributed = [=](const V& x, const V& s, const CommunicatorPtr& comm) {
    return clip_loss(x[0], x[1], s[0], c10::nullopt,
                     ClipLossOptions().symmetric(symmetric).normalize(true).comm(comm).labels(labels_of(x[0]))
                         .label_mode(mode).path(tile_size < 0 ? MemoryPath::kMaterialised : MemoryPath::kAuto)
                         .tile_size(std::max<int64_t>(tile_size, 0)).ring(ring));
  };
  c.reference = [=](const V& x, const V& s) {
    return reference::clip_rows(x[0], x[1], s[0], c10::nullopt, symmetric, 100.0, true, labels_of(x[0]), mode).mean();
  };
  return c;
}

// The InfoNCE family's memory-bounded paths: tiles that do not divide the
// batch, and the ring; then the tiled and ring forms with a bias and in one
// direction. `cases` holds the materialised ones (builtin_cases' order).
void add_memory_path_cases(std::vector<VerifyCase>& cases) {
  using V = std::vector<torch::Tensor>;
  // cases[from] (its inputs and reference) renamed `name`, computed by `distributed`.
  auto add = [&cases](size_t from, std::string name, decltype(VerifyCase::distributed) distributed) {
    VerifyCase c = cases[from];
    c.name = std::move(name);
    c.distributed = std::move(distributed);
    cases.push_back(std::move(c));
  };
  for (bool ring : {false, true}) {
    const std::string suffix = ring ? "_ring" : "_tiled";
    add(0, "clip" + suffix, [ring](const V& x, const V& s, const CommunicatorPtr& comm) {
      return clip_loss(x[0], x[1], s[0], c10::nullopt,
                       ClipLossOptions().normalize(true).comm(comm).tile_size(3).ring(ring));
    });
    add(4, "nt_xent" + suffix, [ring](const V& x, const V&, const CommunicatorPtr& comm) {
      return nt_xent_loss(x[0], x[1], NTXentLossOptions().temperature(0.2).comm(comm).tile_size(2).ring(ring));
    });
    add(5, "moco_v3" + suffix, [ring](const V& x, const V&, const CommunicatorPtr& comm) {
      return moco_v3_loss(x[0], x[1], x[2], x[3],
                          MocoV3LossOptions().temperature(0.2).comm(comm).tile_size(4).ring(ring));
    });
  }
  add(1, "clip_bias_tiled", [](const V& x, const V& s, const CommunicatorPtr& comm) {
    return clip_loss(x[0], x[1], s[0], s[1], ClipLossOptions().comm(comm).tile_size(3));
  });
  add(3, "infonce_ring", [](const V& x, const V& s, const CommunicatorPtr& comm) {
    return clip_loss(x[0], x[1], s[0], c10::nullopt,
                     ClipLossOptions().symmetric(false).comm(comm).tile_size(2).ring(true));
  });
}

std::vector<VerifyCase> builtin_cases() {
  using V = std::vector<torch::Tensor>;
  std::vector<VerifyCase> cases;
  auto clip_case = [&](std::string name, bool symmetric, bool bias, double log_scale, bool normalize) {
    VerifyCase c;
    c.name = std::move(name);
    c.num_features = 2;
    c.scalars = bias ? std::vector<double>{log_scale, -0.3} : std::vector<double>{log_scale};
    c.distributed = [=](const V& x, const V& s, const CommunicatorPtr& comm) {
      return clip_loss(x[0], x[1], s[0], bias ? std::make_optional(s[1]) : c10::nullopt,
                       ClipLossOptions().symmetric(symmetric).normalize(normalize).comm(comm));
    };
    c.reference = [=](const V& x, const V& s) {
      return reference::clip_loss(x[0], x[1], s[0], bias ? std::make_optional(s[1]) : c10::nullopt, symmetric, 100.0,
                                  normalize);
    };
    cases.push_back(std::move(c));
  };
  clip_case("clip", true, false, std::log(1 / 0.07), true);
  clip_case("clip_bias", true, true, std::log(10.0), false);
  clip_case("clip_clamped", true, false, std::log(200.0), true);
  clip_case("infonce", false, false, std::log(5.0), false);

  VerifyCase nt;
  nt.name = "nt_xent";
  nt.num_features = 2;
  nt.distributed = [](const V& x, const V&, const CommunicatorPtr& comm) {
    return nt_xent_loss(x[0], x[1], NTXentLossOptions().temperature(0.2).comm(comm));
  };
  nt.reference = [](const V& x, const V&) { return reference::nt_xent_loss(x[0], x[1], 0.2); };
  cases.push_back(nt);

  VerifyCase moco;
  moco.name = "moco_v3";
  moco.num_features = 4;
  moco.feature_grad = {true, true, false, false};
  moco.distributed = [](const V& x, const V&, const CommunicatorPtr& comm) {
    return moco_v3_loss(x[0], x[1], x[2], x[3], MocoV3LossOptions().temperature(0.2).comm(comm));
  };
  moco.reference = [](const V& x, const V&) { return reference::moco_v3_loss(x[0], x[1], x[2], x[3], 0.2); };
  cases.push_back(moco);

  add_memory_path_cases(cases);

  // SigLIP on each memory path: materialised, tiled with gathered keys, the ring.
  for (const auto path : {MemoryPath::kMaterialised, MemoryPath::kTiled}) {
    for (bool ring : {false, true}) {
      if (ring && path == MemoryPath::kMaterialised) continue;
      VerifyCase sig;
      sig.name = ring ? "siglip_ring" : path == MemoryPath::kTiled ? "siglip_tiled" : "siglip";
      sig.num_features = 2;
      sig.scalars = {std::log(10.0), -2.0};
      sig.distributed = [=](const V& x, const V& s, const CommunicatorPtr& comm) {
        return siglip_loss(x[0], x[1], s[0], s[1],
                           SigLipLossOptions().normalize(true).path(path).tile_size(2).ring(ring).comm(comm));
      };
      sig.reference = [](const V& x, const V& s) { return reference::siglip_loss(x[0], x[1], s[0], s[1], true); };
      cases.push_back(sig);
    }
  }

  // Grouped candidates (hard negatives) and labels.
  cases.push_back(grouped_case("grouped_hard_negatives", 3, false, LabelMode::kMaskDuplicates, -1, false));
  cases.push_back(grouped_case("grouped_hard_negatives_ring", 3, false, LabelMode::kMaskDuplicates, 4, true));
  cases.push_back(grouped_case("grouped_mask_duplicates", 2, true, LabelMode::kMaskDuplicates, -1, false));
  cases.push_back(grouped_case("grouped_multi_positive_tiled", 2, true, LabelMode::kMultiPositive, 3, false));
  cases.push_back(clip_labels_case("clip_multi_positive", true, LabelMode::kMultiPositive, -1, false));
  cases.push_back(clip_labels_case("clip_mask_duplicates_ring", true, LabelMode::kMaskDuplicates, 3, true));
  cases.push_back(clip_labels_case("infonce_multi_positive_tiled", false, LabelMode::kMultiPositive, 2, false));

  detail::add_scorer_cases(cases);  // Matryoshka prefixes and MaxSim (verify_scorer_cases.cpp)

  cases.push_back(grad_cache_case("grad_cache_clip", ClipLossOptions().normalize(true)));
  // The towers' 8 features over prefixes of 2 and 4.
  cases.push_back(grad_cache_case("grad_cache_matryoshka", ClipLossOptions().matryoshka_dims({4, 2})));
  // Tiles of 3 rows divide none of the default row counts.
  cases.push_back(grad_cache_case("grad_cache_tiled_ring", ClipLossOptions().normalize(true).tile_size(3).ring(true)));
  return cases;
}

// The global batch and this rank's share of it, after checking the options
// that shape them (rows, width, device, dtype).
struct Share {
  std::vector<int64_t> rows;
  int64_t total = 0, offset = 0;
};

Share checked_share(const VerifyOptions& o, int64_t W, int64_t r) {
  Share sh;
  sh.rows = o.rows().empty() ? default_row_counts(W) : o.rows();
  const auto& rows = sh.rows;
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == W, "verify(): option 'rows' must have one entry per rank (", W,
              "), but got ", rows.size());
  for (int64_t s = 0; s < W; ++s) {
    TORCH_CHECK(rows[s] >= 0, "verify(): option 'rows' must be non-negative, but got ", rows[s], " for rank ", s);
    if (s < r) sh.offset += rows[s];
    sh.total += rows[s];
  }
  TORCH_CHECK(sh.total > 0, "verify(): option 'rows' must sum to a positive batch");
  TORCH_CHECK(o.width() > 0, "verify(): option 'width' must be positive, but got ", o.width());
  const auto memory = verify_memory_problem(sh.total, o.width(), "verify(): option 'rows'", "option 'width'");
  TORCH_CHECK_VALUE(memory.empty(), memory);
  const torch::Device dev = o.device();
  const int64_t n_cuda = dev.is_cpu() ? 0 : detail::cuda_device_count();
  TORCH_CHECK(dev.is_cpu() || (dev.is_cuda() && dev.index() < n_cuda && n_cuda > 0),
              "verify(): option 'device' must be the CPU or an available CUDA device, but got ", dev.str(),
              " (this process sees ", n_cuda, " CUDA device", n_cuda == 1 ? "" : "s", ")");
  const auto dt = o.dtype();
  TORCH_CHECK(dt == torch::kDouble || dt == torch::kFloat || dt == torch::kBFloat16 || dt == torch::kHalf,
              "verify(): option 'dtype' must be fp64, fp32, bf16 or fp16, but got ", dt);
  return sh;
}

// Keeps the largest error and what it was of (NaN counts as infinite).
void note(VerifyResult& res, double e, const std::string& what) {
  if (std::isnan(e)) e = INFINITY;
  if (res.worst.empty() || e > res.max_rel_err) {
    res.max_rel_err = e;
    res.worst = what;
  }
}

torch::Tensor grad_of(const torch::Tensor& t) { return t.grad().defined() ? t.grad() : torch::zeros_like(t); }

// Model parameters: this rank's gradients (`got`) against the reference's
// (`want`); the worst rank counts (every rank learns every rank's errors, so
// all report the same).
void compare_parameters(VerifyResult& res, const std::vector<std::string>& names, const std::vector<torch::Tensor>& got,
                        const std::vector<torch::Tensor>& want, const CommunicatorPtr& comm, const torch::Device& dev) {
  if (names.empty()) return;
  std::vector<double> errs;
  for (size_t k = 0; k < names.size(); ++k) errs.push_back(rel(grad_of(got[k]), grad_of(want[k])));
  auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  auto worst_rank = std::get<0>(
      gather_no_grad(torch::tensor(errs, f64).reshape({1, -1}).to(dev), comm, "verify").all.cpu().max(0));  // [P]
  for (size_t k = 0; k < names.size(); ++k) note(res, worst_rank[k].item<double>(), "grad " + names[k]);
}

}  // namespace

namespace detail {

torch::Tensor labels_of(const torch::Tensor& x /* [n, d] */) {
  auto sign = [&](int64_t j) { return (x.select(1, std::min<int64_t>(j, x.size(1) - 1)).detach() > 0).to(torch::kLong); };
  return sign(0) + 2 * sign(1);
}

}  // namespace detail

std::vector<VerifyCase>& verify_cases() {
  static std::vector<VerifyCase> cases = builtin_cases();
  return cases;
}

std::vector<int64_t> default_row_counts(int64_t world_size) {
  static const int64_t pattern[] = {6, 3, 0, 5, 2, 7, 1, 4};
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < world_size; ++r) rows.push_back(world_size == 1 ? 7 : pattern[r % 8]);
  return rows;
}

double default_tolerance(c10::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat: return 1e-4;
    case torch::kHalf: return 1e-2;
    case torch::kBFloat16: return 1e-1;
    default: return 1e-10;
  }
}

int64_t verify_reference_bytes(int64_t total_rows, int64_t width) {
  const double B = static_cast<double>(total_rows);
  const double bytes = 6.0 * (2.0 * B) * (2.0 * B) * 8.0 + 256.0 * B * static_cast<double>(width);
  return bytes >= 9.0e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bytes);
}

std::string verify_memory_problem(int64_t total_rows, int64_t width, const std::string& rows_name,
                                  const std::string& width_name) {
  const int64_t need = verify_reference_bytes(total_rows, width), avail = available_memory_bytes();
  if (avail <= 0 || need <= avail) return {};
  return c10::str(rows_name, " (", total_rows, " rows in all, width ", width, ") needs about ",
                  format_bytes(static_cast<double>(need)),
                  " for the single-device fp64 reference ([2B x 2B] logits, their softmax and gradients), but this "
                  "machine (or its memory limit) allows ",
                  format_bytes(static_cast<double>(avail)), "; use fewer rows or a smaller ", width_name);
}

VerifyResult verify_case(const VerifyCase& c, const CommunicatorPtr& comm_in, const VerifyOptions& o) {
  auto comm = comm_in ? comm_in : Communicator::single();
  const int64_t W = comm->world_size(), r = comm->rank();
  const auto share = checked_share(o, W, r);
  const torch::Device dev = o.device();
  const auto dt = o.dtype();
  // Same global inputs on every rank, rounded to the dtype under test (the
  // reference computes in fp64 on the rounded values).
  auto gen = at::detail::createCPUGenerator(o.seed());
  auto f64 = torch::TensorOptions().dtype(torch::kDouble);
  auto rounded = [&](const torch::Tensor& x) { return x.to(dt).to(torch::kDouble); };
  std::vector<torch::Tensor> global;
  for (int64_t k = 0; k < c.num_features; ++k) {
    const int64_t times = c.feature_widths.empty() ? 1 : c.feature_widths.at(k);
    global.push_back(rounded(torch::randn({share.total, o.width() * times}, gen, f64)));
  }
  auto needs_grad = [&](int64_t k) { return c.feature_grad.empty() || c.feature_grad[k]; };
  torch::OrderedDict<std::string, torch::Tensor> params;
  if (c.parameters) params = c.parameters(o.width(), gen);
  for (auto& p : params) p.value() = rounded(p.value());
  const size_t n_scalars = c.scalars.size();

  std::vector<torch::Tensor> ref_x, ref_s;
  for (int64_t k = 0; k < c.num_features; ++k) ref_x.push_back(global[k].clone().requires_grad_(needs_grad(k)));
  for (double v : c.scalars) ref_s.push_back(torch::tensor(v, f64).requires_grad_(true));
  for (const auto& p : params) ref_s.push_back(p.value().clone().requires_grad_(true));
  auto ref_loss = c.reference(ref_x, ref_s);
  ref_loss.backward();

  // This rank's share, on the device under test (clone(): a fresh leaf also
  // where to() returns the CPU tensor itself).
  std::vector<torch::Tensor> loc_x, loc_s;
  for (int64_t k = 0; k < c.num_features; ++k) {
    loc_x.push_back(global[k].narrow(0, share.offset, share.rows[r]).to(dev, dt).clone().requires_grad_(needs_grad(k)));
  }
  // The 0-dim parameters (logit scales, biases) stay fp64, as mixed-precision
  // training keeps its parameters in fp32; the losses take them as they are.
  for (double v : c.scalars) loc_s.push_back(torch::tensor(v, f64).to(dev).requires_grad_(true));
  for (const auto& p : params) loc_s.push_back(p.value().to(dev, dt).clone().requires_grad_(true));
  auto loss = c.distributed(loc_x, loc_s, comm);
  if (loss.requires_grad()) loss.backward();

  VerifyResult res;
  res.loss = c.name;
  res.world_size = W;
  res.rows = share.rows;
  res.device = loss.device().str();
  // Scalars to average over ranks: the loss and every scalar gradient.
  std::vector<torch::Tensor> to_sum{loss.detach().reshape({1})};
  for (size_t k = 0; k < n_scalars; ++k) to_sum.push_back(grad_of(loc_s[k]).reshape({1}));
  auto packed = torch::cat(to_sum).contiguous();
  comm->all_reduce_sum(packed, "verify");
  packed = packed.cpu() / static_cast<double>(W);
  res.loss_rel_err = rel(packed[0], ref_loss);
  note(res, res.loss_rel_err, "loss");
  for (size_t k = 0; k < n_scalars; ++k) {
    auto want = grad_of(ref_s[k]);
    double e = rel(packed[k + 1], want);
    // Some scalar gradients are zero by structure: a clamped scale, or a bias
    // under a softmax (shift-invariant). The reference then holds round-off
    // (~1e-17) and a relative error means nothing, so compare absolutely.
    if (want.abs().item<double>() < 1e-12) e = (packed[k + 1] - want).abs().item<double>();
    note(res, e, "grad scalar " + std::to_string(k));
  }
  compare_parameters(res, params.keys(), {loc_s.begin() + n_scalars, loc_s.end()},
                     {ref_s.begin() + n_scalars, ref_s.end()}, comm, dev);
  for (int64_t k = 0; k < c.num_features; ++k) {
    auto all = gather_no_grad(grad_of(loc_x[k]), comm, "verify").all.cpu() / static_cast<double>(W);
    if (!needs_grad(k)) {
      note(res, all.abs().max().item<double>(), "grad of constant input " + std::to_string(k));
      continue;
    }
    note(res, rel(all, ref_x[k].grad()), "grad input " + std::to_string(k));
  }
  // A loss that left the device means the case did not test it.
  if (loss.device() != dev && !(dev.is_cuda() && loss.is_cuda() && dev.index() < 0)) {
    note(res, INFINITY, "loss on " + res.device + ", not " + dev.str());
  }
  res.passed = res.max_rel_err <= o.tolerance();
  return res;
}

std::vector<VerifyResult> verify(const CommunicatorPtr& comm, const VerifyOptions& o) {
  std::vector<VerifyResult> out;
  const auto& cases = verify_cases();
  for (const auto& name : o.cases()) {
    bool known = false;
    for (const auto& c : cases) known = known || c.name == name;
    std::string names;
    for (const auto& c : cases) names += (names.empty() ? "" : ", ") + c.name;
    TORCH_CHECK(known, "verify(): unknown case '", name, "'; known cases: ", names);
  }
  for (const auto& c : cases) {
    if (!o.cases().empty() && std::find(o.cases().begin(), o.cases().end(), c.name) == o.cases().end()) continue;
    out.push_back(verify_case(c, comm, o));
  }
  return out;
}

std::string to_json(const VerifyResult& r) {
  std::ostringstream os;
  os << std::setprecision(6) << "{\"loss\": \"" << r.loss << "\", \"world_size\": " << r.world_size << ", \"rows\": [";
  for (size_t i = 0; i < r.rows.size(); ++i) os << (i ? ", " : "") << r.rows[i];
  // JSON has no infinity; a non-finite error is reported as the largest double.
  auto num = [](double x) { return std::isfinite(x) ? x : 1.7976931348623157e308; };
  os << "], \"max_rel_err\": " << num(r.max_rel_err) << ", \"loss_rel_err\": " << num(r.loss_rel_err) << ", \"worst\": \""
     << r.worst << "\", \"device\": \"" << r.device << "\", \"passed\": " << (r.passed ? "true" : "false") << "}";
  return os.str();
}

}  // namespace contrax
