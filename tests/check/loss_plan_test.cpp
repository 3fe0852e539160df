// plan_loss, the cost model, against real calls: the bytes it predicts are
// the communicator's counters; its routing and its errors.

#include <gtest/gtest.h>

#include "contrax/check/plan.h"
#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/maxsim.h"
#include "contrax/losses/siglip.h"
#include "engine/panels.h"
#include "engine/precision.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::run_ranks;

// ---- plan_loss: the cost model against real calls ----

// fp64, and bf16 with reduced operands (CUDA's policy, switched on here for
// the CPU): bf16 features and their gradients travel in bf16, the ring's
// gradient partials and the log-sum-exps in fp32.
TEST(LossPlan, BytesMatchTheCommunicatorsCounters) {
  const int64_t W = 2, b = 5, d = 8;
  const int64_t g = 3;  // grouped: the positive and two hard negatives per query
  for (bool reduced : {false, true}) {
    contrax::detail::set_reduced_operands_everywhere(reduced);
    const auto dt = reduced ? torch::kBFloat16 : torch::kDouble;
    for (const std::string loss : {"clip", "infonce", "grouped", "nt_xent", "moco_v3"}) {
      // Materialised, then the ring (blocks of rows travel instead of one gather).
      for (bool ring : {false, true}) {
        const int64_t tile = ring ? 2 : 0;
        auto plan = plan_loss(PlanOptions().loss(loss).group(loss == "grouped" ? g : 1).batch(W * b).width(d).world(W)
                                  .dtype(dt).tile_size(tile).ring(ring));
        EXPECT_EQ(plan.chosen, ring ? "ring" : "materialised");
        const auto& path = plan.paths[ring ? 2 : 0];
        const std::string what = loss + (ring ? " (ring)" : "") + (reduced ? ", bf16 operands" : "");
        run_ranks(W, [&](const CommunicatorPtr& comm) {
          auto x = torch::randn({b, d}).to(dt).requires_grad_(true);
          auto y = torch::randn({b, d}).to(dt).requires_grad_(true);
          auto ls = torch::tensor(0.3, torch::kDouble);
          comm->reset_stats();
          torch::Tensor l =
              loss == "clip"
                  ? clip_loss(x, y, ls, c10::nullopt, ClipLossOptions().comm(comm).tile_size(tile).ring(ring))
              : loss == "infonce"
                  ? clip_loss(x, y, ls, c10::nullopt,
                              ClipLossOptions().symmetric(false).comm(comm).tile_size(tile).ring(ring))
              : loss == "grouped"
                  ? grouped_loss(x, torch::randn({b * g, d}).to(dt).requires_grad_(true), ls, c10::nullopt,
                                 GroupedLossOptions().comm(comm).tile_size(tile).ring(ring))
              : loss == "nt_xent" ? nt_xent_loss(x, y, NTXentLossOptions().comm(comm).tile_size(tile).ring(ring))
                                  : moco_v3_loss(x, y, y, x, MocoV3LossOptions().comm(comm).tile_size(tile).ring(ring));
          auto s = comm->stats();
          EXPECT_EQ(s.total_bytes_sent() - s.op("metadata").bytes_sent, path.bytes_sent_forward) << what;
          comm->reset_stats();
          l.backward();
          EXPECT_EQ(comm->stats().total_bytes_sent(), path.bytes_sent_backward) << what;
        });
      }
    }
  }
  contrax::detail::set_reduced_operands_everywhere(false);
  // On CUDA the plan counts bf16 features at two bytes (the CPU at four): at
  // B = 64 over W = 2, the forward gather sends a rank's 32 rows of width 8 to
  // its one peer, 32 * 8 elements at 4 - 2 = 2 bytes fewer each; the column
  // log-sum-exps (fp32 on both) are the same.
  const auto on = [](torch::Device dev) {
    return plan_loss(PlanOptions().batch(64).width(8).world(2).dtype(torch::kBFloat16).device(dev))
        .paths[0]
        .bytes_sent_forward;
  };
  EXPECT_EQ(on(torch::Device(torch::kCPU)) - on(torch::Device(torch::kCUDA, 0)), 32 * 8 * 2);
}

TEST(LossPlan, RoutingAndErrors) {
  // 8192^2 fp32 logits are exactly the default 256 MiB threshold.
  EXPECT_EQ(plan_loss(PlanOptions().batch(8192)).chosen, "materialised");
  EXPECT_EQ(plan_loss(PlanOptions().batch(8193)).chosen, "tiled");
  EXPECT_EQ(plan_loss(PlanOptions().batch(8192).loss("nt_xent")).chosen, "tiled");  // one [2B x 2B] buffer
  EXPECT_EQ(plan_loss(PlanOptions().batch(8192).dtype(torch::kHalf)).chosen, "materialised");  // fp32 inside
  EXPECT_EQ(plan_loss(PlanOptions().batch(100).world(2).tile_size(16).ring(true)).chosen, "ring");
  auto p = plan_loss(PlanOptions().batch(8192).world(4));
  EXPECT_EQ(p.paths[0].gemms * 2, p.old_gemms);
  EXPECT_EQ(p.paths[0].logits_bytes, int64_t{2048} * 8192 * 4);
  EXPECT_NE(to_string(p).find("materialised (chosen)"), std::string::npos) << to_string(p);
  EXPECT_NE(to_json(p).find("\"chosen\": \"materialised\""), std::string::npos);
  // grouped: one [b x B g] buffer, g blocks against the threshold.
  EXPECT_EQ(plan_loss(PlanOptions().loss("grouped").group(4).batch(4096)).chosen, "materialised");  // 256 MiB
  EXPECT_EQ(plan_loss(PlanOptions().loss("grouped").group(5).batch(4096)).chosen, "tiled");
  auto gp = plan_loss(PlanOptions().loss("grouped").group(4).batch(1024).world(2));
  EXPECT_EQ(gp.paths[0].gemms, 12);
  EXPECT_EQ(gp.paths[0].logits_bytes, int64_t{512} * 1024 * 4 * 4);
  EXPECT_NE(to_string(gp).find("plan: grouped (g = 4)"), std::string::npos) << to_string(gp);
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("triplet")),
                       "plan_loss(): argument 'loss' must be clip, infonce, grouped, nt_xent, moco_v3, siglip or maxsim, "
                       "but got 'triplet'");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("clip").group(2)),
                       "plan_loss(): argument 'group' applies to losses 'grouped' and 'maxsim' only, but loss is 'clip'");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("grouped").group(0)),
                       "plan_loss(): argument 'group' must be >= 1, but got 0");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().batch(0)), "plan_loss(): argument 'batch' must be positive, but got 0");
}

// maxsim: each path's bytes against the counters of real calls (fp64, W = 2,
// g = 2 documents per query, Lq = 3, Ld = 5, d = 6), and its steps against
// the steps walked (both ranks, forward and backward: 4 walks of the plan's).
TEST(LossPlan, MaxSimBytesAndStepsMatchRealCalls) {
  const int64_t W = 2, b = 4, g = 2, Lq = 3, Ld = 5, d = 6, budget = 2000;
  const std::vector<std::string> names{"materialised", "tiled", "ring"};
  for (size_t i = 0; i < names.size(); ++i) {
    const auto memory = i == 0 ? MemoryPathOptions().path(MemoryPath::kMaterialised)
                               : MemoryPathOptions().path(MemoryPath::kTiled).tile_size(3).ring(i == 2);
    auto plan = plan_loss(PlanOptions().loss("maxsim").group(g).batch(W * b).width(d).world(W).dtype(torch::kDouble)
                              .query_tokens(Lq).document_tokens(Ld).token_panel_bytes(budget).memory(memory));
    EXPECT_EQ(plan.chosen, names[i]);
    const auto& path = plan.paths[i];
    const int64_t steps = contrax::detail::steps_walked();
    run_ranks(W, [&](const CommunicatorPtr& comm) {
      auto q = torch::randn({b, Lq, d}, torch::kDouble).requires_grad_(true);
      auto docs = torch::randn({b * g, Ld, d}, torch::kDouble).requires_grad_(true);
      comm->reset_stats();
      auto l = maxsim_loss(q, docs, c10::nullopt, MaxSimLossOptions().memory(memory).panel_bytes(budget).comm(comm));
      auto st = comm->stats();
      EXPECT_EQ(st.total_bytes_sent() - st.op("metadata").bytes_sent, path.bytes_sent_forward) << names[i];
      comm->reset_stats();
      l.backward();
      EXPECT_EQ(comm->stats().total_bytes_sent(), path.bytes_sent_backward) << names[i];
    });
    if (i > 0) EXPECT_EQ(contrax::detail::steps_walked() - steps, 4 * path.panels) << names[i];
  }
  // The routing counts the [b x B g] scores; the plan's own errors.
  EXPECT_EQ(plan_loss(PlanOptions().loss("maxsim").batch(8192)).chosen, "materialised");  // 256 MiB
  EXPECT_EQ(plan_loss(PlanOptions().loss("maxsim").group(2).batch(8192)).chosen, "tiled");
  auto p = plan_loss(PlanOptions().loss("maxsim").group(2).batch(4096).world(8).width(128));
  EXPECT_NE(to_string(p).find("scorer: MaxSim, 32 query tokens x 256 document tokens"), std::string::npos)
      << to_string(p);
  EXPECT_NE(to_json(p).find("\"document_tokens\": 256"), std::string::npos) << to_json(p);
  // The tiled path holds a step's logits, not the [b x B g] scores; the ring
  // two messages of a block and a partial, a contribution and its own
  // gradient (6 blocks' bytes), not every rank's documents and their gradient
  // (2 W = 16).
  EXPECT_LT(p.paths[1].logits_bytes * 100, p.paths[0].logits_bytes);
  EXPECT_EQ(p.paths[2].feature_bytes * 16, p.paths[1].feature_bytes * 6);
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("maxsim").query_tokens(0)),
                       "plan_loss(): arguments 'query_tokens' and 'document_tokens' must be positive, but got 0 and 256");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("maxsim").token_panel_bytes(0)),
                       "plan_loss(): argument 'token_panel_bytes' must be positive, but got 0");
  CONTRAX_EXPECT_ERROR(plan_loss(PlanOptions().loss("maxsim").width(8).matryoshka_dims({4})),
                       "plan_loss(): argument 'matryoshka' applies to the dot-product losses, not to 'maxsim'");
}
