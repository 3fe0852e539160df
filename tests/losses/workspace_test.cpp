// The kept logits workspace (contrax/engine/workspace.h): a materialised
// loss's buffer reused by the next call on the same thread changes no value or
// gradient, two losses alive at once and another dtype stay exact, and the
// buffer is released on request.
#include <gtest/gtest.h>

#include <cmath>

#include "contrax/engine/workspace.h"
#include "contrax/losses/losses.h"
#include "contrax/losses/reference.h"
#include "contrax/util/memory.h"
#include "support/ranks.h"

using namespace contrax;
using contrax::testing::rel_err;

namespace {
// One materialised CLIP call, one process: its loss and both feature gradients.
std::vector<torch::Tensor> clip_once(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.clone().requires_grad_(true), y = b.clone().requires_grad_(true);
  auto l = clip_loss(x, y, torch::tensor(std::log(10.0), a.options()), c10::nullopt,
                     ClipLossOptions().path(MemoryPath::kMaterialised));
  l.backward();
  return {l.detach(), x.grad(), y.grad()};
}
}  // namespace

TEST(LossWorkspace, KeptBufferIsReusedAndChangesNothing) {
  release_loss_workspace();
  set_keep_loss_workspace(true);
  auto gen = at::detail::createCPUGenerator(5);
  const int64_t B = 3000;  // [3000 x 3000] fp32 = 34.3 MB, above the 32 MiB threshold
  auto a = torch::randn({B, 8}, gen), b = torch::randn({B, 8}, gen);
  const int64_t buffer = B * B * 4;
  auto first = clip_once(a, b);
  EXPECT_EQ(loss_workspace_bytes(), buffer);
  {
    PeakScope scope;
    auto second = clip_once(a, b);
    EXPECT_LT(scope.peak_above_start(), buffer / 2) << "the second call allocated its own logits buffer";
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(first[i], second[i])) << i;
  }
  {
    // A training loop that still holds the last step's loss while it computes
    // the next one (Python's `loss = f(...)`): the buffer left that graph in
    // its backward, so the next step reuses it.
    const auto o = ClipLossOptions().path(MemoryPath::kMaterialised);
    auto ls = torch::tensor(std::log(10.0));
    auto x = a.clone().requires_grad_(true), y = b.clone().requires_grad_(true);
    auto prev = clip_loss(x, y, ls, c10::nullopt, o);
    prev.backward();
    PeakScope scope;
    auto next = clip_loss(x, y, ls, c10::nullopt, o);
    next.backward();
    EXPECT_LT(scope.peak_above_start(), buffer / 2) << "the previous step's graph still held the buffer";
  }
  // Below the threshold nothing is kept or replaced.
  clip_once(a.narrow(0, 0, 100), b.narrow(0, 0, 100));
  EXPECT_EQ(loss_workspace_bytes(), buffer);
  // Off: released at once, a fresh buffer per call, the same values.
  set_keep_loss_workspace(false);
  EXPECT_FALSE(keep_loss_workspace());
  EXPECT_EQ(loss_workspace_bytes(), 0);
  {
    PeakScope scope;
    auto third = clip_once(a, b);
    EXPECT_GE(scope.peak_above_start(), buffer);
    EXPECT_EQ(loss_workspace_bytes(), 0);
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(first[i], third[i])) << i;
  }
  set_keep_loss_workspace(true);
  clip_once(a, b);
  EXPECT_EQ(loss_workspace_bytes(), buffer);
  release_loss_workspace();
  EXPECT_EQ(loss_workspace_bytes(), 0);
}

TEST(LossWorkspace, TwoLossesAliveAtOnceAndAnotherDtypeStayExact) {
  release_loss_workspace();
  set_keep_loss_workspace(true);
  auto gen = at::detail::createCPUGenerator(6);
  const int64_t B = 2100;  // fp64 [2100 x 2100] = 35.3 MB; NT-Xent fp32 [2B x 2B] = 70.6 MB
  auto a = torch::randn({B, 6}, gen, torch::kDouble), b = torch::randn({B, 6}, gen, torch::kDouble);
  auto c = torch::randn({B, 6}, gen, torch::kDouble), d = torch::randn({B, 6}, gen, torch::kDouble);
  auto ls = torch::tensor(std::log(10.0), torch::kDouble);
  // The plain-autograd reference of each loss alone.
  auto ref = [&](const torch::Tensor& p, const torch::Tensor& q) {
    auto x = p.clone().requires_grad_(true), y = q.clone().requires_grad_(true);
    auto l = reference::clip_loss(x, y, ls, {});
    l.backward();
    return std::vector<torch::Tensor>{l.detach(), x.grad(), y.grad()};
  };
  auto r1 = ref(a, b), r2 = ref(c, d);
  // Both alive before either backward: the second may not get the first's buffer.
  auto x1 = a.clone().requires_grad_(true), y1 = b.clone().requires_grad_(true);
  auto x2 = c.clone().requires_grad_(true), y2 = d.clone().requires_grad_(true);
  const auto o = ClipLossOptions().path(MemoryPath::kMaterialised);
  auto l1 = clip_loss(x1, y1, ls, c10::nullopt, o);
  auto l2 = clip_loss(x2, y2, ls, c10::nullopt, o);
  (l1 + l2).backward();
  EXPECT_LE(rel_err(l1.detach(), r1[0]), 1e-10);
  EXPECT_LE(rel_err(l2.detach(), r2[0]), 1e-10);
  EXPECT_LE(rel_err(x1.grad(), r1[1]), 1e-10);
  EXPECT_LE(rel_err(y1.grad(), r1[2]), 1e-10);
  EXPECT_LE(rel_err(x2.grad(), r2[1]), 1e-10);
  EXPECT_LE(rel_err(y2.grad(), r2[2]), 1e-10);
  EXPECT_EQ(loss_workspace_bytes(), B * B * 8);
  // An fp32 NT-Xent next: a buffer of another dtype and size replaces it.
  auto z1 = a.to(torch::kFloat).requires_grad_(true), z2 = b.to(torch::kFloat).requires_grad_(true);
  auto w1 = a.clone().requires_grad_(true), w2 = b.clone().requires_grad_(true);
  auto nt = nt_xent_loss(z1, z2, NTXentLossOptions().temperature(0.5).path(MemoryPath::kMaterialised));
  auto nt_ref = reference::nt_xent_loss(w1, w2, 0.5);
  nt.backward();
  nt_ref.backward();
  EXPECT_EQ(loss_workspace_bytes(), 2 * B * 2 * B * 4);
  EXPECT_LE(rel_err(nt.detach().to(torch::kDouble), nt_ref.detach()), 1e-5);
  EXPECT_LE(rel_err(z1.grad().to(torch::kDouble), w1.grad()), 1e-4);
  release_loss_workspace();
}
