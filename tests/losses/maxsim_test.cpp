// maxsim_loss beyond verify's fp64 cases at W = 1..4 (tests/check/
// loss_world_test.cpp: in-batch, hard negatives, symmetric, small panels, on
// every memory path): on the materialised, tiled and ring paths, ranks
// padding their documents to different lengths, ties broken at the first
// maximum as the reference's torch.max, per-row and summed reductions, fp32
// within tolerance; memory bounded by the panel budget, the tiled and ring
// paths' below the materialised one's; every error message.

#include <gtest/gtest.h>

#include <array>

#include "contrax/losses/maxsim.h"
#include "contrax/losses/reference.h"
#include "contrax/util/memory.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;
using contrax::testing::run_ranks_collect_errors;

namespace {

auto f64() { return torch::TensorOptions().dtype(torch::kDouble); }

// Every memory path: materialised, tiled (tiles of 2: several steps) and the ring.
std::vector<MemoryPathOptions> every_path() {
  const auto tiles = MemoryPathOptions().path(MemoryPath::kTiled).tile_size(2);
  return {MemoryPathOptions().path(MemoryPath::kMaterialised), tiles, MemoryPathOptions(tiles).ring(true)};
}
std::string name_of(const MemoryPathOptions& m) {
  return m.ring() ? "ring" : m.path() == MemoryPath::kTiled ? "tiled" : "materialised";
}

// Loss and gradients of the reference on the whole batch (documents padded
// to one length).
struct Reference {
  torch::Tensor loss, dq, dd;
};
Reference reference_of(const torch::Tensor& q0, const torch::Tensor& qm, const torch::Tensor& d0,
                       const torch::Tensor& dm, double temperature, bool symmetric, Reduction r = Reduction::kMean) {
  auto q = q0.clone().requires_grad_(true), d = d0.clone().requires_grad_(true);
  auto rows = reference::score_rows(reference::maxsim_scores(q, qm, d, dm) / temperature, symmetric);
  auto loss = r == Reduction::kSum ? rows.sum() : rows.mean();
  loss.backward();
  return {loss.detach(), q.grad(), d.grad()};
}

// Two ranks, rows [3, 2], rank 0's documents `lengths[0]` tokens long and
// rank 1's `lengths[1]` (cut from q and docs): loss and gradients under the
// gradient convention equal `want` on the concatenated batch.
void expect_two_ranks_match(const torch::Tensor& q, const torch::Tensor& docs, const torch::Tensor& dm,
                            std::array<int64_t, 2> lengths, const MaxSimLossOptions& options, const Reference& want) {
  run_ranks(2, [&](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank(), off = r == 0 ? 0 : 3, n = r == 0 ? 3 : 2, L = lengths[r];
    auto mine_q = q.narrow(0, off, n).clone().requires_grad_(true);
    auto mine_d = docs.narrow(0, off, n).narrow(1, 0, L).clone().requires_grad_(true);
    auto o = MaxSimLossOptions(options).comm(comm).document_mask(dm.narrow(0, off, n).narrow(1, 0, L));
    if (options.query_mask().defined()) o.query_mask(options.query_mask().narrow(0, off, n));
    auto loss = maxsim_loss(mine_q, mine_d, c10::nullopt, o);
    loss.backward();
    auto total = loss.detach().clone();
    comm->all_reduce_sum(total);
    const auto path = name_of(options.memory());
    EXPECT_NEAR(total.item<double>() / 2, want.loss.item<double>(), 1e-12) << path;
    EXPECT_LE((mine_q.grad() / 2 - want.dq.narrow(0, off, n)).abs().max().item<double>(), 1e-12) << path;
    EXPECT_LE((mine_d.grad() / 2 - want.dd.narrow(0, off, n).narrow(1, 0, L)).abs().max().item<double>(), 1e-12)
        << path;
  });
}

}  // namespace

// Rank 0 pads its documents to 5 tokens, rank 1 to 3: the loss pads to the
// longest; loss and gradients equal the reference on the concatenated batch,
// on every path (the ring's blocks carry their masks).
TEST(MaxSim, RanksPadTheirDocumentsToDifferentLengths) {
  auto gen = at::detail::createCPUGenerator(3);
  const int64_t d = 4;
  auto q = torch::randn({5, 2, d}, gen, f64()), docs = torch::randn({5, 5, d}, gen, f64());
  auto qm = torch::ones({5, 2}, torch::kBool), dm = torch::ones({5, 5}, torch::kBool);
  dm.narrow(0, 3, 2).narrow(1, 3, 2).fill_(false);  // rank 1's documents: 3 tokens
  dm[0][4] = false;
  const auto want = reference_of(q, qm, docs, dm, 0.3, /*symmetric=*/true);
  for (const auto& m : every_path()) {
    expect_two_ranks_match(q, docs, dm, {5, 3},
                           MaxSimLossOptions().temperature(0.3).symmetric(true).query_mask(qm).memory(m), want);
  }
}

// Equal token scores: the gradient goes to the first maximal document token,
// as torch.max (the reference) sends it; the panel size changes nothing.
TEST(MaxSim, TiesGoToTheFirstMaximumAndPanelsChangeNothing) {
  auto gen = at::detail::createCPUGenerator(4);
  auto q = torch::randn({4, 3, 5}, gen, f64()), d = torch::randn({4, 2, 5}, gen, f64());
  d = torch::cat({d, d}, 1);  // tokens 2, 3 repeat tokens 0, 1: every maximum is tied
  auto qm = torch::ones({4, 3}, torch::kBool), dm = torch::ones({4, 4}, torch::kBool);
  const auto want = reference_of(q, qm, d, dm, 1.0, false);
  EXPECT_EQ(want.dd.narrow(1, 2, 2).abs().max().item<double>(), 0.0);  // the control: ties go to tokens 0, 1
  for (const auto& m : every_path()) {
    for (int64_t budget : {int64_t{16} << 20, int64_t{100}, int64_t{1}}) {
      auto qq = q.clone().requires_grad_(true), dd = d.clone().requires_grad_(true);
      auto loss = maxsim_loss(qq, dd, c10::nullopt, MaxSimLossOptions().panel_bytes(budget).memory(m));
      loss.backward();
      EXPECT_NEAR(loss.item<double>(), want.loss.item<double>(), 1e-13) << budget << " " << name_of(m);
      EXPECT_LE((qq.grad() - want.dq).abs().max().item<double>(), 1e-13) << budget << " " << name_of(m);
      EXPECT_LE((dd.grad() - want.dd).abs().max().item<double>(), 1e-13) << budget << " " << name_of(m);
    }
  }
}

// padding_score 0: a document's own masked tokens score 0, as PyLate's and
// colpali-engine's masks (which multiply the token scores) make them; the
// tokens the ranks add to align their lengths never count. W = 2, rank 0's
// documents 6 tokens long, rank 1's 4: against the multiplied-mask einsum.
TEST(MaxSim, PaddingScoreZeroIsTheMultipliedMask) {
  auto gen = at::detail::createCPUGenerator(8);
  auto q = torch::randn({5, 3, 4}, gen, f64()), d = torch::randn({5, 6, 4}, gen, f64());
  auto qm = torch::ones({5, 3}, torch::kBool), dm = torch::rand({5, 6}, gen, f64()) > 0.4;
  dm.narrow(0, 3, 2).narrow(1, 4, 2).fill_(false);  // rank 1's documents end at token 4
  dm[1].fill_(false);                               // a document of padding alone scores 0
  auto ref_q = q.clone().requires_grad_(true), ref_d = d.clone().requires_grad_(true);
  // Each rank's documents as they are: rank 1's have 4 tokens, not 6.
  auto scores = [&](int64_t from, int64_t count, int64_t L) {
    auto t = torch::einsum("iqd,jsd->ijqs", {ref_q, ref_d.narrow(0, from, count).narrow(1, 0, L)}) *
             dm.narrow(0, from, count).narrow(1, 0, L).to(torch::kDouble).unsqueeze(0).unsqueeze(2);
    return std::get<0>(t.max(3)).sum(2);
  };
  auto want = reference::score_rows(torch::cat({scores(0, 3, 6), scores(3, 2, 4)}, 1) / 0.5, false).mean();
  want.backward();
  for (const auto& m : every_path()) {
    expect_two_ranks_match(q, d, dm, {6, 4},
                           MaxSimLossOptions().temperature(0.5).padding_score(0.0).panel_bytes(100).memory(m),
                           {want.detach(), ref_q.grad(), ref_d.grad()});
  }
}

// kSum is B times kMean (one rank); kNone gives each query's loss; fp32
// within 1e-5 of fp64, bf16 within its rounding.
TEST(MaxSim, ReductionsAndReducedPrecision) {
  auto gen = at::detail::createCPUGenerator(5);
  auto q = torch::randn({6, 4, 8}, gen, f64()), d = torch::randn({12, 7, 8}, gen, f64());  // g = 2
  auto qm = torch::rand({6, 4}, gen, f64()) > 0.3, dm = torch::rand({12, 7}, gen, f64()) > 0.3;
  qm.select(1, 0).fill_(true);
  dm.select(1, 0).fill_(true);
  const auto o = MaxSimLossOptions().temperature(0.7).query_mask(qm).document_mask(dm);
  const auto rows =
      reference::score_rows(reference::maxsim_scores(q, qm, d, dm) / 0.7, false);  // [6]
  for (const auto& m : every_path()) {
    EXPECT_LE((maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions(o).reduction(Reduction::kNone).memory(m)) - rows)
                  .abs().max().item<double>(), 1e-12) << name_of(m);
    EXPECT_NEAR(
        maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions(o).reduction(Reduction::kSum).memory(m)).item<double>(),
        rows.sum().item<double>(), 1e-11) << name_of(m);
  }
  auto q32 = q.to(torch::kFloat).requires_grad_(true);
  auto l32 = maxsim_loss(q32, d.to(torch::kFloat), c10::nullopt, o);
  l32.backward();
  const auto want = reference_of(q, qm, d, dm, 0.7, false);
  EXPECT_NEAR(l32.item<double>(), want.loss.item<double>(), 1e-5 * want.loss.abs().item<double>());
  EXPECT_LE((q32.grad().to(torch::kDouble) - want.dq).abs().max().item<double>(),
            1e-5 * want.dq.abs().max().item<double>());
  // bf16 features (computed in fp32, the engine's rule): within the inputs' rounding.
  auto q16 = q.to(torch::kBFloat16).requires_grad_(true);
  auto l16 = maxsim_loss(q16, d.to(torch::kBFloat16), c10::nullopt, o);
  l16.backward();
  EXPECT_EQ(l16.scalar_type(), torch::kFloat);
  EXPECT_NEAR(l16.item<double>(), want.loss.item<double>(), 3e-2 * want.loss.abs().item<double>());
  EXPECT_LE((q16.grad().to(torch::kDouble) - want.dq).abs().max().item<double>(),
            5e-2 * want.dq.abs().max().item<double>());
}

// The token scores of a pair exist only inside a panel: at n = m = 64, Lq =
// 8, Ld = 32, d = 16 (fp64) every pair's [Lq x Ld] scores take 8 MiB at once
// (what an einsum over the batch holds); with 64 KiB panels the call holds
// under a quarter of that, the [64 x 64] scores and the features included.
TEST(MaxSim, TokenScoresStayWithinThePanelBudget) {
  auto gen = at::detail::createCPUGenerator(6);
  auto q = torch::randn({64, 8, 16}, gen, f64()).requires_grad_(true);
  auto d = torch::randn({64, 32, 16}, gen, f64()).requires_grad_(true);
  const int64_t all_pairs = 64 * 64 * 8 * 32 * 8;
  MemoryTracker::install();
  PeakScope scope;
  maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions().panel_bytes(64 << 10)).backward();
  EXPECT_LT(scope.peak_above_start(), all_pairs / 4) << scope.peak_above_start();
}

// Tiled and ring: the [b x B g] scores are never held whole. One rank, 512
// queries and as many documents (Lq = Ld = 2, d = 4, fp64): the scores take
// 2 MiB, the features 32 KiB a tower; the tiled path's steps (tiles of 32)
// hold under a quarter of the scores, the materialised path at least them.
// Four and eight ranks, the documents much larger than the scores (16 a
// rank, Ld = 64, d = 32: 256 KiB a rank's block): on the tiled path every
// rank gathers every block and their gradient, so its peak grows with W; on
// the ring it holds a constant number of blocks and gradient partials in
// flight, whatever W.
TEST(MaxSim, TiledAndRingHoldNeitherTheScoresNorEveryDocument) {
  auto gen = at::detail::createCPUGenerator(9);
  auto q = torch::randn({512, 2, 4}, gen, f64()), d = torch::randn({512, 2, 4}, gen, f64());
  const int64_t scores = 512 * 512 * 8;
  MemoryTracker::install();
  const auto peak = [&](const MemoryPathOptions& m) {
    auto qq = q.clone().requires_grad_(true), dd = d.clone().requires_grad_(true);
    PeakScope scope;
    maxsim_loss(qq, dd, c10::nullopt, MaxSimLossOptions().memory(m)).backward();
    return scope.peak_above_start();
  };
  const auto tiles = MemoryPathOptions().path(MemoryPath::kTiled).tile_size(32);
  EXPECT_GE(peak(MemoryPathOptions().path(MemoryPath::kMaterialised)), scores);
  EXPECT_LT(peak(tiles), scores / 4) << peak(tiles);
  // A rank's peak, the mean over W thread ranks of their summed peak.
  const auto world_peak = [&](const MemoryPathOptions& m, int64_t W) {
    std::vector<torch::Tensor> qs, ds;
    for (int64_t r = 0; r < W; ++r) {
      qs.push_back(torch::randn({16, 4, 32}, gen, f64()).requires_grad_(true));
      ds.push_back(torch::randn({16, 64, 32}, gen, f64()).requires_grad_(true));
    }
    PeakScope scope;
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      maxsim_loss(qs[comm->rank()], ds[comm->rank()], c10::nullopt, MaxSimLossOptions().memory(m).comm(comm))
          .backward();
    });
    return scope.peak_above_start() / W;
  };
  // Steps of 2 x 2 pairs: their token work (and the copy of their documents) stays small beside a block.
  const auto small = MemoryPathOptions(tiles).tile_size(2), ring = MemoryPathOptions(small).ring(true);
  const int64_t gathered4 = world_peak(small, 4), gathered8 = world_peak(small, 8);
  const int64_t ring4 = world_peak(ring, 4), ring8 = world_peak(ring, 8);
  EXPECT_GE(gathered8, 2 * (int64_t{2} << 20)) << gathered8;  // every document and its gradient
  EXPECT_GE(gathered8, gathered4 * 3 / 2) << gathered4 << " " << gathered8;
  EXPECT_LE(ring8, ring4 * 5 / 4) << ring4 << " " << ring8;
  EXPECT_LT(ring8, gathered8 * 3 / 4) << ring8 << " " << gathered8;
}

TEST(MaxSim, EveryBadArgumentIsNamed) {
  auto q = torch::randn({2, 3, 4}), d = torch::randn({2, 5, 4});
  CONTRAX_EXPECT_ERROR(maxsim_loss(torch::randn({2, 4}), d),
                       "maxsim_loss(): argument 'queries' must be a 3-D tensor [rows, tokens, width], but got shape "
                       "[2, 4]");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, torch::randn({2, 5, 3})),
                       "maxsim_loss(): arguments 'queries' and 'documents' must have the same width, but got 4 and 3");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, torch::randn({3, 5, 4})),
                       "maxsim_loss(): argument 'documents' must have g * queries.size(0) rows (g >= 1 per query: its "
                       "positive, then g-1 hard negatives), but got 3 rows for 2 queries");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d.to(torch::kDouble)),
                       "maxsim_loss(): arguments 'queries' and 'documents' must have the same dtype, but got Float "
                       "and Double");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions().query_mask(torch::ones({2, 3}))),
                       "maxsim_loss(): argument 'query_mask' must be a bool tensor [2, 3] (one entry per token of "
                       "'queries'), but got Float [2, 3]");
  auto dm = torch::ones({2, 5}, torch::kBool);
  dm[1].fill_(false);
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions().document_mask(dm)),
                       "maxsim_loss(): argument 'document_mask' must leave every row of 'documents' at least one "
                       "valid token, but row 1 has none");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d, torch::ones({1})),
                       "maxsim_loss(): argument 'logit_scale' must be a 0-dim tensor, but got shape [1]");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions().temperature(0)),
                       "maxsim_loss(): argument 'temperature' must be a positive finite number, but got 0");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions().padding_score(NAN)),
                       "maxsim_loss(): argument 'padding_score' must be -inf or a finite number, but got nan");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions().panel_bytes(0)),
                       "maxsim_loss(): argument 'panel_bytes' must be positive, but got 0");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, d, c10::nullopt, MaxSimLossOptions().tile_size(-1)),
                       "maxsim_loss(): argument 'tile_size' must be >= 0");
  CONTRAX_EXPECT_ERROR(maxsim_loss(q, torch::randn({4, 5, 4}), c10::nullopt, MaxSimLossOptions().symmetric(true)),
                       "maxsim_loss(): argument 'symmetric' needs one document per query, but got g = 2");
  CONTRAX_EXPECT_ERROR(maxsim_loss(torch::randn({2, 0, 4}), d),
                       "maxsim_loss(): argument 'queries' must have at least one token per row, but got [2, 0, 4]");
  // One rank's bad argument is an error on every rank; different g likewise.
  auto errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto qq = torch::randn({2, 3, 4});
    maxsim_loss(qq, torch::randn({comm->rank() == 0 ? 2 : 4, 5, 4}), c10::nullopt, MaxSimLossOptions().comm(comm));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("maxsim_loss(): argument 'documents' must hold the same number of documents per query (g) on "
                     "every rank, but g is 2 on rank 1 and 1 on an earlier rank"),
              std::string::npos)
        << e;
  }
}
