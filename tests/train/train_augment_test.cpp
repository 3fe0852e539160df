// Tests of the augmentations: determinism, independence from how the batch is
// split over ranks, shapes, ranges and option errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>

#include "contrax/train/image/augment.h"
#include "support/errors.h"

namespace ct = contrax::train;
using contrax::testing::expect_error;

namespace {

torch::Tensor fake_images(int64_t n) {
  torch::manual_seed(0);
  return torch::randint(0, 256, {n, 1, 28, 28}, torch::kUInt8);
}


ct::AugmentOptions all_on() { return ct::AugmentOptions().blur_prob(0.5).noise_prob(0.5); }

}  // namespace

TEST(Augment, ShapesDtypeAndRange) {
  auto x = fake_images(16);
  auto idx = torch::arange(16, torch::kInt64);
  auto v = ct::augment(x, idx, {1, 0, 0, 0}, all_on());
  EXPECT_EQ(v.sizes(), (std::vector<int64_t>{16, 1, 28, 28}));
  EXPECT_EQ(v.scalar_type(), torch::kFloat);
  const double lo = (0 - ct::kFashionMnistMean) / ct::kFashionMnistStd;
  const double hi = (1 - ct::kFashionMnistMean) / ct::kFashionMnistStd;
  EXPECT_GE(v.min().item<double>(), lo - 1e-5);
  EXPECT_LE(v.max().item<double>(), hi + 1e-5);
  auto d = ct::augment(x, idx, {1, 0, 0, 0}, all_on().dtype(torch::kDouble));
  EXPECT_EQ(d.scalar_type(), torch::kDouble);
  EXPECT_EQ(ct::augment(x.narrow(0, 0, 0), idx.narrow(0, 0, 0), {}).size(0), 0);
  EXPECT_EQ(ct::augment(x.squeeze(1), idx, {}).sizes(), (std::vector<int64_t>{16, 1, 28, 28}));
}

TEST(Augment, DeterministicAndKeyed) {
  auto x = fake_images(8);
  auto idx = torch::arange(100, 108, torch::kInt64);
  auto a = ct::augment(x, idx, {7, 1, 2, 0}, all_on());
  EXPECT_TRUE(torch::equal(a, ct::augment(x, idx, {7, 1, 2, 0}, all_on())));
  // Any part of the key changes the view.
  EXPECT_FALSE(torch::equal(a, ct::augment(x, idx, {8, 1, 2, 0}, all_on())));
  EXPECT_FALSE(torch::equal(a, ct::augment(x, idx, {7, 2, 2, 0}, all_on())));
  EXPECT_FALSE(torch::equal(a, ct::augment(x, idx, {7, 1, 3, 0}, all_on())));
  EXPECT_FALSE(torch::equal(a, ct::augment(x, idx, {7, 1, 2, 1}, all_on())));
  // The global RNG plays no part.
  torch::manual_seed(1234);
  EXPECT_TRUE(torch::equal(a, ct::augment(x, idx, {7, 1, 2, 0}, all_on())));
}

TEST(Augment, ExampleViewDoesNotDependOnTheBatchSplit) {
  // What 1 process computes for the global batch must equal, bit for bit, the
  // concatenation of what W ranks compute on their slices.
  auto x = fake_images(37);
  auto idx = torch::randperm(1000, torch::kInt64).narrow(0, 0, 37);
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    const auto o = all_on().dtype(dtype);
    const ct::AugmentKey key{11, 3, 5, 1};
    auto whole = ct::augment(x, idx, key, o);
    for (int64_t w : {2, 3, 5, 37}) {
      std::vector<torch::Tensor> parts;
      const int64_t base = 37 / w, extra = 37 % w;
      int64_t off = 0;
      for (int64_t r = 0; r < w; ++r) {
        const int64_t n = base + (r < extra ? 1 : 0);
        parts.push_back(ct::augment(x.narrow(0, off, n), idx.narrow(0, off, n), key, o));
        off += n;
      }
      EXPECT_TRUE(torch::equal(torch::cat(parts), whole)) << "world size " << w;
    }
  }
}

TEST(Augment, IdentityWhenEverythingIsOff) {
  auto x = fake_images(4);
  auto o = ct::AugmentOptions().scale_min(1.0).ratio_min(1.0).ratio_max(1.0).flip_prob(0).jitter_prob(0);
  auto v = ct::augment(x, torch::arange(4, torch::kInt64), {}, o.dtype(torch::kDouble));
  EXPECT_TRUE(torch::allclose(v, ct::normalize_images(x, ct::kFashionMnistMean, ct::kFashionMnistStd, torch::kDouble),
                              1e-12, 1e-12));
  // A certain flip mirrors the image exactly.
  auto f = ct::augment(x, torch::arange(4, torch::kInt64), {}, o.flip_prob(1.0).dtype(torch::kDouble));
  EXPECT_TRUE(torch::allclose(f, ct::normalize_images(x, ct::kFashionMnistMean, ct::kFashionMnistStd,
                                                      torch::kDouble).flip({3}),
                              1e-12, 1e-12));
}

TEST(Augment, FastEnoughForTraining) {
  auto x = fake_images(512);
  auto idx = torch::arange(512, torch::kInt64);
  ct::augment(x, idx, {});
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) ct::augment(x, idx, {0, 0, i, 0}, all_on());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "augment (blur+noise on): " << 5 * 512 / s << " images/s\n";
  EXPECT_LT(s, 5.0);
}

TEST(Augment, ErrorsNameTheArgument) {
  auto x = fake_images(2);
  auto idx = torch::arange(2, torch::kInt64);
  expect_error([&] { ct::augment(x.to(torch::kFloat), idx, {}); },
               "augment(): argument 'images' must be uint8, but got Float");
  expect_error([&] { ct::augment(x, torch::arange(3, torch::kInt64), {}); },
               "augment(): argument 'indices' must have shape [2] (one global index per image), but got [3]");
  expect_error([&] { ct::augment(x.expand({2, 3, 28, 28}), idx, {}); },
               "augment(): argument 'images' must have shape [b, 1, H, W] or [b, H, W], but got [2, 3, 28, 28]");
  // One bad option on good images: the message names it.
  using O = ct::AugmentOptions;
  const auto bad = [&](const O& o, const std::string& what) { expect_error([&] { ct::augment(x, idx, {}, o); }, what); };
  bad(O().scale_min(0), "options 'scale_min'/'scale_max' must satisfy 0 < min <= max <= 1, but got (0, 1)");
  bad(O().ratio_min(2), "options 'ratio_min'/'ratio_max' must satisfy 0 < min <= max");
  bad(O().flip_prob(1.5), "augment(): option 'flip_prob' must be in [0, 1], but got 1.5");
  bad(O().std(0), "augment(): option 'std' must be > 0, but got 0");
  bad(O().dtype(torch::kHalf), "augment(): option 'dtype' must be kFloat or kDouble");
  expect_error([&] { ct::normalize_images(x.squeeze(1)); },
               "normalize_images(): argument 'images' must have shape [b, 1, H, W], but got [2, 28, 28]");
}
