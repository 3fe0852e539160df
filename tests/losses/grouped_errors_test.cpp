// The grouped and labelled losses' error messages, on one device and across
// ranks, and the porting warning for a scale passed instead of its log.

#include <gtest/gtest.h>

#include <cmath>

#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"
#include "support/errors.h"
#include "support/ranks.h"
#include "support/strict_warnings.h"

using namespace contrax;
using contrax::testing::run_ranks_collect_errors;
using contrax::testing::WarningCapture;

TEST(GroupedErrors, LocalArgumentChecks) {
  auto q = torch::randn({3, 4}), k = torch::randn({6, 4}), s = torch::tensor(1.0);
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({7, 4}), s),
                       "grouped_loss(): argument 'candidates' must have g * queries.size(0) rows");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({2, 4}), s),
                       "grouped_loss(): argument 'candidates' must have g * queries.size(0) rows");
  CONTRAX_EXPECT_ERROR(grouped_loss(torch::randn({0, 4}), torch::randn({2, 4}), s),
                       "argument 'candidates' must be empty on a rank with no queries");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({6, 5}), s),
                       "arguments 'queries' and 'candidates' must have the same width");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, torch::randn({6, 4}, torch::kDouble), s),
                       "arguments 'queries' and 'candidates' must have the same dtype");
  CONTRAX_EXPECT_ERROR(grouped_loss(torch::randn({4}), k, s), "argument 'queries' must be a 2-D tensor");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, torch::ones({2})), "argument 'logit_scale' must be a 0-dim tensor");
  auto lab = torch::tensor({0, 1, 2}, torch::kLong), cand = torch::zeros({6}, torch::kLong);
  CONTRAX_EXPECT_ERROR(
      grouped_loss(q, k, s, {}, GroupedLossOptions().labels(lab.to(torch::kInt)).candidate_labels(cand)),
      "argument 'labels' must be an int64 tensor");
  CONTRAX_EXPECT_ERROR(
      grouped_loss(q, k, s, {}, GroupedLossOptions().labels(torch::zeros({4}, torch::kLong)).candidate_labels(cand)),
      "argument 'labels' must have shape [3]");
  CONTRAX_EXPECT_ERROR(
      grouped_loss(q, k, s, {}, GroupedLossOptions().labels(lab).candidate_labels(torch::zeros({3}, torch::kLong))),
      "argument 'candidate_labels' must have shape [6]");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().labels(lab)),
                       "argument 'labels' needs 'candidate_labels' when there are hard negatives (g = 2");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().candidate_labels(cand)),
                       "argument 'candidate_labels' needs 'labels'");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().label_mode(LabelMode::kMultiPositive)),
                       "argument 'label_mode' (kMultiPositive) needs 'labels'");
  CONTRAX_EXPECT_ERROR(grouped_loss(q, k, s, {}, GroupedLossOptions().tile_size(-2)),
                       "grouped_loss(): argument 'tile_size' must be >= 0 (the tile side");
  CONTRAX_EXPECT_ERROR(grouped_loss(torch::randn({0, 4}), torch::randn({0, 4}), s),
                       "grouped_loss(): the global batch is empty");
  // clip_loss
  auto a = torch::randn({3, 4}), b = torch::randn({3, 4});
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().labels(torch::zeros({3}))),
                       "clip_loss(): argument 'labels' must be an int64 tensor, but got dtype Float");
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().labels(torch::zeros({3, 1}, torch::kLong))),
                       "argument 'labels' must have shape [3]");
  CONTRAX_EXPECT_ERROR(clip_loss(a, b, s, {}, ClipLossOptions().label_mode(LabelMode::kMaskDuplicates)),
                       "argument 'label_mode' (kMaskDuplicates) needs 'labels'");
}

TEST(GroupedErrors, LabelsOnAnotherDevice) {
  // The meta device stands in for a GPU: any device but the features' is refused.
  auto a = torch::randn({3, 4}), s = torch::tensor(1.0);
  auto meta = torch::empty({3}, torch::TensorOptions().dtype(torch::kLong).device(torch::kMeta));
  CONTRAX_EXPECT_ERROR(clip_loss(a, a, s, {}, ClipLossOptions().labels(meta)),
                       "clip_loss(): argument 'labels' must be on the features' device (cpu), but got meta");
  auto cand = torch::empty({6}, torch::TensorOptions().dtype(torch::kLong).device(torch::kMeta));
  CONTRAX_EXPECT_ERROR(
      grouped_loss(a, torch::randn({6, 4}), s, {},
                   GroupedLossOptions().labels(torch::zeros({3}, torch::kLong)).candidate_labels(cand)),
      "grouped_loss(): argument 'candidate_labels' must be on the features' device (cpu)");
}

TEST(GroupedErrors, GroupSizeMustAgreeAcrossRanks) {
  auto errors = run_ranks_collect_errors(3, [](const CommunicatorPtr& comm) {
    const int64_t r = comm->rank();
    const int64_t g = r == 2 ? 3 : 2;
    const int64_t b = r == 1 ? 0 : 2;  // the empty rank knows no g and must not object
    grouped_loss(torch::randn({b, 4}), torch::randn({b * g, 4}), torch::tensor(1.0), {},
                 GroupedLossOptions().comm(comm));
  });
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("grouped_loss(): argument 'candidates' must hold the same number of candidates per query "
                             "(g) on every rank, but g is 3 on rank 2 and 2 on rank 0"),
              std::string::npos)
        << errors[r];
  }
  // An empty rank next to g = 3 ranks works (checked for value above in GroupedWorld).
  auto ok = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    const int64_t b = comm->rank() == 0 ? 0 : 2;
    grouped_loss(torch::randn({b, 4}), torch::randn({b * 3, 4}), torch::tensor(1.0), {},
                 GroupedLossOptions().comm(comm));
  });
  EXPECT_EQ(ok[0], "");
  EXPECT_EQ(ok[1], "");
}

TEST(GroupedErrors, BadLabelsOnOneRankIsAnErrorOnAllRanks) {
  auto errors = run_ranks_collect_errors(2, [](const CommunicatorPtr& comm) {
    auto labels = comm->rank() == 1 ? torch::zeros({2}, torch::kLong) : torch::zeros({3}, torch::kLong);
    clip_loss(torch::randn({3, 4}), torch::randn({3, 4}), torch::tensor(1.0), {},
              ClipLossOptions().comm(comm).labels(labels));
  });
  EXPECT_NE(errors[1].find("argument 'labels' must have shape [3]"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("clip_loss(): rank 1 passed an invalid argument"), std::string::npos) << errors[0];
}


TEST(GroupedWarnings, ScaleInsteadOfItsLogWarnsOnce) {
  auto a = torch::randn({3, 4}), b = torch::randn({3, 4});
  WarningCapture capture;
  // Normal values (the log of 1/0.07, and the clamp itself) say nothing.
  clip_loss(a, b, torch::tensor(std::log(1 / 0.07)));
  clip_loss(a, b, torch::tensor(std::log(100.0) + 0.5));
  grouped_loss(a, b, torch::tensor(2.0));
  EXPECT_TRUE(capture.messages.empty()) << capture.messages.front();
  // 1/0.07 = 14.3 passed as the log: one warning, however many calls.
  for (int i = 0; i < 3; ++i) clip_loss(a, b, torch::tensor(1 / 0.07));
  ASSERT_EQ(capture.messages.size(), 1u);
  EXPECT_NE(capture.messages[0].find("logit_scale=14.2857 is the log of the scale (Contrax clamps exp(logit_scale) at "
                                     "100): pass log(1/0.07)=2.66, not 1/0.07=14.3 as open_clip/Inf-CL do"),
            std::string::npos)
      << capture.messages[0];
  grouped_loss(a, b, torch::tensor(100.0));
  EXPECT_EQ(capture.messages.size(), 1u);  // once per process, whichever loss
}
