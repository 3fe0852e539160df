// Memory of the tiled losses, measured with the counting CPU allocator
// (contrax/util/memory.h): a tiled forward + backward must never allocate anything
// near a `[b x B]` logits buffer, while the materialised loss on the same
// inputs does (which also proves the tracker sees such buffers).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

#include "contrax/losses/losses.h"
#include "contrax/losses/siglip.h"
#include "contrax/losses/tiled.h"
#include "contrax/util/memory.h"
#include "support/ranks.h"

namespace {

constexpr int64_t kB = 2048, kD = 16, kTile = 128;
constexpr auto kTiled = contrax::MemoryPath::kTiled;
constexpr int64_t kLogitsBytes = kB * kB * 4;  // one [B x B] fp32 buffer: 16 MiB

struct Inputs {
  torch::Tensor a, b, ls, bias;
};

Inputs make_inputs(int64_t rows) {
  // One intra-op thread: the test measures bytes, and OpenMP teams spinning on
  // a loaded 2-core machine only cost time.
  at::set_num_threads(1);
  return {torch::randn({rows, kD}).requires_grad_(true), torch::randn({rows, kD}).requires_grad_(true),
          torch::tensor(2.0f).requires_grad_(true), torch::tensor(-1.0f).requires_grad_(true)};
}

// Peak bytes above the level at entry while `fn` runs its forward + backward.
int64_t peak_of(const std::function<void()>& fn) {
  contrax::MemoryTracker::install();
  contrax::PeakScope scope;
  fn();
  return scope.peak_above_start();
}

TEST(TiledMemory, ClipNeverAllocatesLogits) {
  torch::manual_seed(0);
  auto in = make_inputs(kB);
  const int64_t tiled = peak_of([&] {
    contrax::clip_loss(in.a, in.b, in.ls, in.bias, contrax::ClipLossOptions().path(kTiled).tile_size(kTile)).backward();
  });
  const int64_t materialised = peak_of([&] { contrax::clip_loss(in.a, in.b, in.ls, in.bias).backward(); });
  std::cout << "[ memory ] B=" << kB << " d=" << kD << " tile=" << kTile << ": tiled peak " << tiled
            << " bytes, materialised peak " << materialised << " bytes, [B x B] = " << kLogitsBytes << "\n";
  EXPECT_GT(materialised, kLogitsBytes);
  // Feature-sized buffers (copies, gradients: a few x B d x 4 = 128 KiB each)
  // and tiles of 64 KiB are all the tiled path may hold.
  EXPECT_LT(tiled, kLogitsBytes / 8);
}

TEST(TiledMemory, NTXentAndMocoNeverAllocateLogits) {
  torch::manual_seed(1);
  auto in = make_inputs(kB);
  auto k1 = torch::randn({kB, kD}), k2 = torch::randn({kB, kD});
  const int64_t nt = peak_of([&] {
    contrax::nt_xent_loss(in.a, in.b, contrax::NTXentLossOptions().path(kTiled).tile_size(kTile)).backward();
  });
  EXPECT_LT(nt, kLogitsBytes / 8);
  const int64_t moco = peak_of([&] {
    contrax::moco_v3_loss(in.a, in.b, k1, k2, contrax::MocoV3LossOptions().path(kTiled).tile_size(kTile)).backward();
  });
  EXPECT_LT(moco, kLogitsBytes / 8);
  // The automatic tile follows its byte budget: 1 MiB -> 512 x 512 fp32 tiles.
  const int64_t automatic = peak_of([&] {
    contrax::clip_loss(in.a, in.b, in.ls, {}, contrax::ClipLossOptions().path(kTiled).tile_bytes(1 << 20)).backward();
  });
  EXPECT_LT(automatic, kLogitsBytes / 4);
}

TEST(TiledMemory, SigLipChunkedNeverAllocatesLogits) {
  torch::manual_seed(2);
  auto in = make_inputs(kB);
  const int64_t peak = peak_of([&] {
    contrax::siglip_loss(in.a, in.b, in.ls, in.bias, contrax::SigLipLossOptions().path(kTiled).tile_size(kTile))
        .backward();
  });
  EXPECT_LT(peak, kLogitsBytes / 8);
}

// Two ranks in one process (the tracker counts both): the ring holds at most
// two remote blocks per rank, never [b x B] logits nor all B keys' logits.
TEST(TiledMemory, RingNeverAllocatesLogits) {
  const int64_t W = 2, b = kB / W;
  std::mutex m;
  std::vector<Inputs> inputs;
  torch::manual_seed(3);
  for (int64_t r = 0; r < W; ++r) inputs.push_back(make_inputs(b));
  contrax::MemoryTracker::install();
  contrax::PeakScope scope;
  contrax::testing::run_ranks(W, [&](const contrax::CommunicatorPtr& comm) {
    auto& in = inputs[comm->rank()];
    contrax::clip_loss(in.a, in.b, in.ls, {},
                       contrax::ClipLossOptions().comm(comm).path(kTiled).tile_size(kTile).ring(true))
        .backward();
    contrax::siglip_loss(in.a, in.b, in.ls, in.bias, contrax::SigLipLossOptions().comm(comm).tile_size(kTile))
        .backward();
  });
  // One rank's [b x B] logits would be kLogitsBytes / 2.
  EXPECT_LT(scope.peak_above_start(), kLogitsBytes / 8);
}

}  // namespace
