// Bad input to the losses: each message, on one device and across ranks
// (one rank's bad input is an error on all ranks, and no hang).

#include <gtest/gtest.h>

#include "contrax/losses/losses.h"
#include "support/errors.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::error_of;
using contrax::testing::run_ranks_collect_errors;

namespace {

// Every rank's message (run_ranks_collect_errors) contains `text`.
void expect_each_rank_says(const std::vector<std::string>& errors, const std::string& text) {
  for (const auto& e : errors) EXPECT_NE(e.find(text), std::string::npos) << e;
}

}  // namespace

TEST(LossErrors, LocalArgumentChecks) {
  auto x = torch::randn({4, 3}), s = torch::tensor(1.0);
  CONTRAX_EXPECT_ERROR(clip_loss(torch::randn({4}), x, s),
                       "clip_loss(): argument 'a' must be a 2-D tensor [rows, width], but got shape [4]");
  CONTRAX_EXPECT_ERROR(clip_loss(x, torch::randn({3, 3}), s),
                       "clip_loss(): arguments 'a' and 'b' must have the same number of rows on each rank, but got 4 "
                       "and 3");
  CONTRAX_EXPECT_ERROR(clip_loss(x, torch::randn({4, 2}), s),
                       "clip_loss(): arguments 'a' and 'b' must have the same width, but got 3 and 2");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x.to(torch::kDouble), s),
                       "clip_loss(): arguments 'a' and 'b' must have the same dtype, but got Float and Double");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, torch::ones({3})),
                       "clip_loss(): argument 'logit_scale' must be a 0-dim tensor, but got shape [3]");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, s, torch::ones({1})),
                       "clip_loss(): argument 'logit_bias' must be a 0-dim tensor, but got shape [1]");
  CONTRAX_EXPECT_ERROR(clip_loss(x, x, s, c10::nullopt, ClipLossOptions().max_logit_scale(0)),
                       "clip_loss(): argument 'max_logit_scale' must be a positive finite number, but got 0");
  CONTRAX_EXPECT_ERROR(clip_loss(x.to(torch::kLong), x, s),
                       "clip_loss(): argument 'a' must be a floating-point tensor, but got dtype Long");
  CONTRAX_EXPECT_ERROR(nt_xent_loss(x, x, NTXentLossOptions().temperature(0)),
                       "nt_xent_loss(): argument 'temperature' must be a positive finite number, but got 0");
  CONTRAX_EXPECT_ERROR(nt_xent_loss(x, torch::randn({5, 3})),
                       "nt_xent_loss(): argument 'z2' must have the same shape as 'z1' ([4, 3]), but got [5, 3]");
  CONTRAX_EXPECT_ERROR(nt_xent_loss(torch::randn({2, 2, 2}), x),
                       "nt_xent_loss(): argument 'z1' must be a 2-D tensor");
  CONTRAX_EXPECT_ERROR(moco_v3_loss(x, x, x, x, MocoV3LossOptions().temperature(-1)),
                       "moco_v3_loss(): argument 'temperature' must be a positive finite number, but got -1");
  CONTRAX_EXPECT_ERROR(moco_v3_loss(x, x, torch::randn({4, 2}), x),
                       "moco_v3_loss(): argument 'k1' must have the same shape as 'q1' ([4, 3]), but got [4, 2]");
  CONTRAX_EXPECT_ERROR(clip_loss(torch::randn({0, 3}), torch::randn({0, 3}), s),
                       "clip_loss(): the global batch is empty");
  CONTRAX_EXPECT_ERROR(ClipLoss(ClipLossOptions(), -1.0), "ClipLoss(): argument 'init_scale' must be positive");
}

TEST(LossErrors, BadInputOnOneRankIsAnErrorOnAllRanks) {
  auto errors = run_ranks_collect_errors(3, [](const CommunicatorPtr& comm) {
    auto a = torch::randn({3, 4});
    auto b = comm->rank() == 1 ? torch::randn({2, 4}) : torch::randn({3, 4});
    clip_loss(a, b, torch::tensor(1.0), c10::nullopt, ClipLossOptions().comm(comm));
  });
  EXPECT_NE(errors[1].find("arguments 'a' and 'b' must have the same number of rows on each rank"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[0].find("clip_loss(): rank 1 passed an invalid argument"), std::string::npos) << errors[0];
  EXPECT_NE(errors[2].find("clip_loss(): rank 1 passed an invalid argument"), std::string::npos) << errors[2];
}

// Under static shapes nobody is told of another rank's bad argument: the rank
// that passed it says so and why the others may wait; they end in their next
// collective's timeout or a closed connection, not a hang.
TEST(LossErrors, BadInputUnderStaticShapesIsThisRanksErrorAndNoHang) {
  auto errors = run_ranks_collect_errors(
      3,
      [](const CommunicatorPtr& comm) {
        auto a = torch::randn({3, 4});
        auto b = comm->rank() == 1 ? torch::randn({2, 4}) : torch::randn({3, 4});
        clip_loss(a, b, torch::tensor(1.0), c10::nullopt, ClipLossOptions().comm(comm));
      },
      std::chrono::seconds(3), [](int64_t, CommunicatorOptions& o) { o.static_shapes(true); });
  EXPECT_NE(errors[1].find("arguments 'a' and 'b' must have the same number of rows on each rank"), std::string::npos)
      << errors[1];
  EXPECT_NE(errors[1].find("(static shapes: no other rank was told; they wait in their next collective until the "
                           "communicator's timeout)"),
            std::string::npos)
      << errors[1];
  EXPECT_FALSE(errors[0].empty());
  EXPECT_FALSE(errors[2].empty());
}

TEST(LossErrors, WidthOrDtypeMismatchBetweenRanks) {
  auto errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto z = torch::randn({3, comm->rank() == 0 ? 4 : 6});
    nt_xent_loss(z, z, NTXentLossOptions().comm(comm));
  });
  expect_each_rank_says(errors, "nt_xent_loss(): argument 'z1' must have the same trailing shape on every rank, but it "
                                "is [b, 6] on rank 1 and [b, 4] on rank 0");
  errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto q = torch::randn({3, 4}, comm->rank() == 0 ? torch::kFloat : torch::kDouble);
    moco_v3_loss(q, q, q, q, MocoV3LossOptions().comm(comm));
  });
  expect_each_rank_says(errors, "moco_v3_loss(): argument 'k1' must have the same dtype on every rank, but it is "
                                "Double on rank 1 and Float on rank 0");
}

// Issue 29, item 7: [b, 0] features reached ATen's amax() inside the
// normalisation; every loss refuses a width of 0 by the argument's name.
TEST(LossErrors, ZeroWidthFeaturesAreRefusedByName) {
  auto e = torch::randn({4, 0}), s = torch::tensor(1.0);
  const std::string want = "must have a width of at least 1";
  auto has = [&](const std::string& msg, const char* what) {
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  };
  has(error_of([&] { nt_xent_loss(e, e); }), "nt_xent_loss(): argument 'z1'");
  has(error_of([&] { nt_xent_loss(e, e, NTXentLossOptions().memory(MemoryPathOptions().path(MemoryPath::kTiled))); }),
      "nt_xent_loss(): argument 'z1'");
  has(error_of([&] { moco_v3_loss(e, e, e, e); }), "moco_v3_loss(): argument 'q1'");
  has(error_of([&] { clip_loss(e, e, s); }), "clip_loss(): argument 'a'");
}
