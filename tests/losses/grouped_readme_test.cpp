// The README's grouped-loss snippet, as written there.

#include <gtest/gtest.h>

#include <cmath>

#include "contrax/losses/grouped.h"
#include "contrax/losses/losses.h"

using namespace contrax;

// The README's snippet, as written there (single device here; `comm` may be any
// communicator).
TEST(GroupedReadme, SnippetRuns) {
  auto comm = Communicator::single();
  const int64_t b = 4, g = 3, d = 8;
  auto q = torch::randn({b, d}, torch::requires_grad()), cands = torch::randn({b * g, d}, torch::requires_grad());
  auto logit_scale = torch::tensor(std::log(1 / 0.05), torch::requires_grad());
  auto doc_id = torch::tensor({10, 11, 12, 10}, torch::kLong);  // queries 0 and 3 share their answer
  auto cand_doc_id = torch::randint(0, 100, {b * g}, torch::kLong);
  cand_doc_id.view({b, g}).select(1, 0).copy_(doc_id);
  auto img = torch::randn({b, d}, torch::requires_grad()), txt = torch::randn({b, d}, torch::requires_grad());
  auto cls = torch::tensor({0, 1, 0, 2}, torch::kLong);
  auto weight = torch::rand({b});
  // --- README snippet begins
  // Retrieval with hard negatives: queries [b, d], candidates [b * g, d] (each
  // query's positive, then g-1 mined negatives); every rank's candidates are
  // negatives of every query. A candidate that is the same document as the
  // query's answer (elsewhere in the global batch) is masked, not a negative.
  auto loss = contrax::grouped_loss(
      q, cands, logit_scale, {},
      contrax::GroupedLossOptions().comm(comm).normalize(true).labels(doc_id).candidate_labels(cand_doc_id));
  loss.backward();
  // CLIP with class labels (supervised-contrastive positives), per-row losses
  // weighted by the caller.
  auto rows = contrax::clip_loss(img, txt, logit_scale, {},
                                 contrax::ClipLossOptions()
                                     .comm(comm)
                                     .normalize(true)
                                     .labels(cls)
                                     .label_mode(contrax::LabelMode::kMultiPositive)
                                     .reduction(contrax::Reduction::kNone));  // [b_r]
  (rows * weight).sum().backward();
  // --- README snippet ends
  EXPECT_EQ(rows.sizes(), torch::IntArrayRef({b}));
  EXPECT_TRUE(q.grad().defined() && cands.grad().defined() && img.grad().defined());
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
}
