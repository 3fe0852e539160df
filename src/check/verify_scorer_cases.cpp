// verify's cases of the scorers beyond one dot product (docs/scorers.md):
// Matryoshka prefixes on every loss and the gradient cache's loss side, and
// late interaction (maxsim_loss), each against a plain reference.
#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "check/verify_cases.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/maxsim.h"
#include "contrax/losses/reference.h"
#include "contrax/losses/siglip.h"

namespace contrax::detail {

namespace {

// Matryoshka prefixes (MatryoshkaOptions): a half and a third of the width
// (listed widest first, as sentence-transformers does) and the whole width,
// weighted unevenly, against the reference losses' plain loop over prefixes;
// each loss on one of its memory paths (tiles of 2 or 3 rows, the ring).
MatryoshkaOptions prefixes_of(int64_t width) {
  std::vector<int64_t> dims;
  for (int64_t m : {width / 2, width / 3}) {
    if (m >= 1 && m < width && (dims.empty() || dims.back() != m)) dims.push_back(m);
  }
  const std::vector<double> weights{0.5, 2.0};
  return MatryoshkaOptions().dims(dims).weights({weights.begin(), weights.begin() + dims.size()});
}

void add_matryoshka_cases(std::vector<VerifyCase>& cases) {
  using V = std::vector<torch::Tensor>;
  using Loss = std::function<torch::Tensor(const V& f, const V& s, const V& x)>;
  // A case of `features` features and `scalars` whose distributed side is
  // `distributed` (given the prefixes of the width) and whose reference is
  // `loss` over each prefix f of every feature (x: the whole features).
  auto add = [&cases](std::string name, int64_t features, std::vector<double> scalars,
                      std::function<torch::Tensor(const V&, const V&, const CommunicatorPtr&, const MatryoshkaOptions&)>
                          distributed,
                      Loss loss, std::vector<bool> grad = {}) {
    VerifyCase c;
    c.name = std::move(name);
    c.num_features = features;
    c.scalars = std::move(scalars);
    c.feature_grad = std::move(grad);
    c.distributed = [distributed](const V& x, const V& s, const CommunicatorPtr& comm) {
      return distributed(x, s, comm, prefixes_of(x[0].size(1)));
    };
    c.reference = [loss](const V& x, const V& s) {
      const auto m = prefixes_of(x[0].size(1));
      return reference::matryoshka(m.dims(), m.weights(), x, [&](const V& f) { return loss(f, s, x); });
    };
    cases.push_back(std::move(c));
  };
  const double clip_scale = std::log(1 / 0.07);
  add("clip_matryoshka", 2, {clip_scale},
      [](const V& x, const V& s, const CommunicatorPtr& comm, const MatryoshkaOptions& m) {
        return clip_loss(x[0], x[1], s[0], c10::nullopt, ClipLossOptions().comm(comm).matryoshka(m));
      },
      [](const V& f, const V& s, const V&) { return reference::clip_loss(f[0], f[1], s[0], c10::nullopt); });
  add("clip_matryoshka_bias_ring", 2, {std::log(10.0), -0.3},
      [](const V& x, const V& s, const CommunicatorPtr& comm, const MatryoshkaOptions& m) {
        return clip_loss(x[0], x[1], s[0], s[1], ClipLossOptions().comm(comm).tile_size(3).ring(true).matryoshka(m));
      },
      [](const V& f, const V& s, const V&) { return reference::clip_loss(f[0], f[1], s[0], s[1]); });
  add("infonce_matryoshka_multi_positive_tiled", 2, {clip_scale},
      [](const V& x, const V& s, const CommunicatorPtr& comm, const MatryoshkaOptions& m) {
        return clip_loss(x[0], x[1], s[0], c10::nullopt,
                         ClipLossOptions().symmetric(false).comm(comm).labels(labels_of(x[0])).tile_size(2)
                             .matryoshka(m));
      },
      // The labels come from the whole rows, as the distributed side's.
      [](const V& f, const V& s, const V& x) {
        return reference::clip_rows(f[0], f[1], s[0], c10::nullopt, false, 100.0, false, labels_of(x[0])).mean();
      });
  add("nt_xent_matryoshka_tiled", 2, {},
      [](const V& x, const V&, const CommunicatorPtr& comm, const MatryoshkaOptions& m) {
        return nt_xent_loss(x[0], x[1], NTXentLossOptions().temperature(0.2).comm(comm).tile_size(2).matryoshka(m));
      },
      [](const V& f, const V&, const V&) { return reference::nt_xent_loss(f[0], f[1], 0.2); });
  add("moco_v3_matryoshka", 4, {},
      [](const V& x, const V&, const CommunicatorPtr& comm, const MatryoshkaOptions& m) {
        return moco_v3_loss(x[0], x[1], x[2], x[3], MocoV3LossOptions().temperature(0.2).comm(comm).matryoshka(m));
      },
      [](const V& f, const V&, const V&) { return reference::moco_v3_loss(f[0], f[1], f[2], f[3], 0.2); },
      {true, true, false, false});
  add("siglip_matryoshka_tiled", 2, {std::log(10.0), -2.0},
      [](const V& x, const V& s, const CommunicatorPtr& comm, const MatryoshkaOptions& m) {
        return siglip_loss(x[0], x[1], s[0], s[1], SigLipLossOptions().comm(comm).tile_size(2).matryoshka(m));
      },
      [](const V& f, const V& s, const V&) { return reference::siglip_loss(f[0], f[1], s[0], s[1]); });
}

// Late interaction (maxsim_loss): feature 0 holds each query's 3 tokens side
// by side ([b, 3 width] -> [b, 3, width]), feature 1 each query's g
// documents of 4 tokens; a token is padding where its first entry is below
// -0.7 (its first token never), so ranks and the reference agree on the masks
// without sending them. `panel_bytes` small: several panels of token scores.
torch::Tensor token_mask(const torch::Tensor& tokens /* [n, L, d] */) {
  auto first = torch::arange(tokens.size(1), tokens.options().dtype(torch::kLong)) == 0;
  return (tokens.select(2, 0).detach() > -0.7).logical_or(first.unsqueeze(0));
}

// A maxsim_loss case: g documents per query, the loss's options as named,
// on the memory path `memory` (its tiles of 2 or 3 rows: several steps).
struct MaxSimCase {
  int64_t g = 1;
  bool symmetric = false, normalize_scores = false, learnt_scale = false;
  double padding_score = -std::numeric_limits<double>::infinity();
  int64_t panel_bytes = int64_t{16} << 20;
  MemoryPathOptions memory;
};

VerifyCase maxsim_case(std::string name, const MaxSimCase& m) {
  using V = std::vector<torch::Tensor>;
  constexpr int64_t Lq = 3, Ld = 4;
  VerifyCase c;
  c.name = std::move(name);
  c.num_features = 2;
  c.feature_widths = {Lq, m.g * Ld};
  if (m.learnt_scale) c.scalars = {std::log(2.0)};
  const auto split = [](const V& x) {
    const int64_t width = x[0].size(1) / Lq;
    return std::make_pair(x[0].view({-1, Lq, width}), x[1].reshape({-1, Ld, width}));
  };
  c.distributed = [=](const V& x, const V& s, const CommunicatorPtr& comm) {
    auto [q, d] = split(x);
    return maxsim_loss(q, d, m.learnt_scale ? std::make_optional(s[0]) : c10::nullopt,
                       MaxSimLossOptions().temperature(0.5).symmetric(m.symmetric).normalize_scores(m.normalize_scores)
                           .query_mask(token_mask(q)).document_mask(token_mask(d)).padding_score(m.padding_score)
                           .panel_bytes(m.panel_bytes).memory(m.memory).comm(comm));
  };
  c.reference = [=](const V& x, const V& s) {
    auto [q, d] = split(x);
    auto scores = reference::maxsim_scores(q, token_mask(q), d, token_mask(d), m.padding_score);
    if (m.normalize_scores) scores = scores / token_mask(q).sum(1, true).to(scores.scalar_type());
    auto logits = m.learnt_scale ? scores * torch::clamp_max(s[0].exp(), 100.0) : scores / 0.5;
    return reference::score_rows(logits, m.symmetric).mean();
  };
  return c;
}

// maxsim_loss on each memory path, hard negatives, the symmetric form, both
// kinds of padding_score and both scales among them.
void add_maxsim_cases(std::vector<VerifyCase>& cases) {
  const auto tiles = [](int64_t side) { return MemoryPathOptions().path(MemoryPath::kTiled).tile_size(side); };
  const double zero = 0.0;
  cases.push_back(maxsim_case("maxsim", {}));
  cases.push_back(maxsim_case("maxsim_hard_negatives_panels", {3, false, true, true, -INFINITY, 200}));
  cases.push_back(maxsim_case("maxsim_symmetric_panels", {1, true, false, true, -INFINITY, 300}));
  cases.push_back(maxsim_case("maxsim_tiled_hard_negatives", {3, false, true, true, -INFINITY, 200, tiles(2)}));
  cases.push_back(maxsim_case("maxsim_tiled_symmetric_padding_zero", {1, true, false, false, zero, 300, tiles(3)}));
  cases.push_back(
      maxsim_case("maxsim_ring_hard_negatives_padding_zero", {3, false, false, true, zero, 200, tiles(2).ring(true)}));
  cases.push_back(maxsim_case("maxsim_ring_symmetric", {1, true, true, true, -INFINITY, 16 << 20, tiles(3).ring(true)}));
}

}  // namespace

void add_scorer_cases(std::vector<VerifyCase>& cases) {
  using V = std::vector<torch::Tensor>;
  add_matryoshka_cases(cases);
  // Grouped candidates over prefixes: the candidates' rows cut like the queries'.
  // Feature 1 holds each query's 3 candidates side by side (as verify's grouped cases).
  VerifyCase grouped;
  grouped.name = "grouped_matryoshka";
  grouped.num_features = 2;
  grouped.scalars = {std::log(8.0), 0.2};
  grouped.feature_widths = {1, 3};
  grouped.distributed = [](const V& x, const V& s, const CommunicatorPtr& comm) {
    return grouped_loss(x[0], x[1].reshape({-1, x[0].size(1)}), s[0], s[1],
                        GroupedLossOptions().comm(comm).matryoshka(prefixes_of(x[0].size(1))));
  };
  grouped.reference = [](const V& x, const V& s) {
    const auto m = prefixes_of(x[0].size(1));
    return reference::matryoshka(m.dims(), m.weights(), {x[0], x[1].reshape({-1, x[0].size(1)})}, [&](const V& f) {
      return reference::grouped_rows(f[0], f[1], s[0], s[1], 100.0, false).mean();
    });
  };
  cases.push_back(grouped);

  add_maxsim_cases(cases);
  // The gradient cache over token towers: each tower's 8 outputs as 2 tokens
  // of 4 (masked as above), MaxSim under the learnt scale.
  const auto tokens = [](const torch::Tensor& r) { return r.view({r.size(0), 2, 4}); };
  cases.push_back(grad_cache_case(
      "grad_cache_maxsim",
      [tokens](const V& r, const torch::Tensor& s, const CommunicatorPtr& comm) {
        auto q = tokens(r[0]), d = tokens(r[1]);
        return maxsim_loss(q, d, s, MaxSimLossOptions().query_mask(token_mask(q)).document_mask(token_mask(d)).comm(comm));
      },
      [tokens](const V& r, const torch::Tensor& s, const CommunicatorPtr&) {
        auto q = tokens(r[0]), d = tokens(r[1]);
        const auto scores = reference::maxsim_scores(q, token_mask(q), d, token_mask(d));
        return reference::score_rows(scores * torch::clamp_max(s.exp(), 100.0), false).mean();
      }));
}

}  // namespace contrax::detail
