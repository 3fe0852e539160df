// Tests of the evaluation read-outs on synthetic data: separable -> near 1,
// random labels -> near chance; plus embedding and baseline helpers.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "contrax/train/eval.h"

namespace ct = contrax::train;

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

// Gaussian clusters around well separated class means.
std::pair<torch::Tensor, torch::Tensor> clusters(int64_t n, int64_t d, int64_t classes, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto means = torch::randn({classes, d}, gen) * 4;
  auto y = torch::randint(0, classes, {n}, gen, torch::kInt64);
  auto x = means.index_select(0, y) + torch::randn({n, d}, gen);
  return {x, y};
}

// Noisy dark images whose class is the quadrant that is bright.
ct::Dataset quadrant_images(int64_t n, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto y = torch::randint(0, 4, {n}, gen, torch::kInt64);
  auto x = torch::randn({n, 1, 28, 28}, gen) * 20 + 40;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t q = y[i].item<int64_t>();
    x[i].narrow(1, (q / 2) * 14, 14).narrow(2, (q % 2) * 14, 14).add_(150);
  }
  return ct::Dataset{x.clamp(0, 255).to(torch::kUInt8), y};
}

}  // namespace

TEST(Eval, LinearProbeSeparatesClusters) {
  auto [xtr, ytr] = clusters(2000, 16, 5, 1);
  auto [xte, yte] = clusters(500, 16, 5, 1);  // same means: same seed
  auto r = ct::linear_probe(xtr, ytr, xte, yte);
  EXPECT_GT(r.test_acc, 0.97);
  EXPECT_GT(r.train_acc, 0.97);
  EXPECT_LT(r.seconds, 10.0);
}

TEST(Eval, LinearProbeOnRandomLabelsIsNearChance) {
  auto gen = at::detail::createCPUGenerator(7);
  auto xtr = torch::randn({2000, 16}, gen), xte = torch::randn({2000, 16}, gen);
  auto ytr = torch::randint(0, 10, {2000}, gen, torch::kInt64), yte = torch::randint(0, 10, {2000}, gen, torch::kInt64);
  auto r = ct::linear_probe(xtr, ytr, xte, yte);
  EXPECT_LT(r.test_acc, 0.16);
  EXPECT_GT(r.test_acc, 0.04);
}

TEST(Eval, KnnSeparatesClustersAndRandomIsChance) {
  auto [xtr, ytr] = clusters(2000, 16, 5, 2);
  auto [xte, yte] = clusters(300, 16, 5, 2);
  EXPECT_GT(ct::knn_accuracy(xtr, ytr, xte, yte), 0.97);
  // Blocks smaller than the test set and k above the bank size behave.
  EXPECT_GT(ct::knn_accuracy(xtr, ytr, xte, yte, ct::KnnOptions().k(200).block_size(7)), 0.97);
  EXPECT_GT(ct::knn_accuracy(xtr.narrow(0, 0, 50), ytr.narrow(0, 0, 50), xte, yte, ct::KnnOptions().k(200)), 0.5);
  auto gen = at::detail::createCPUGenerator(8);
  auto rtr = torch::randn({2000, 16}, gen), rte = torch::randn({2000, 16}, gen);
  auto ltr = torch::randint(0, 10, {2000}, gen, torch::kInt64), lte = torch::randint(0, 10, {2000}, gen, torch::kInt64);
  const double acc = ct::knn_accuracy(rtr, ltr, rte, lte);
  EXPECT_LT(acc, 0.16);
  EXPECT_GT(acc, 0.04);
}

TEST(Eval, KnnMatchesABruteForceReference) {
  auto [xtr, ytr] = clusters(300, 8, 3, 3);
  auto gen = at::detail::createCPUGenerator(9);
  auto xte = torch::randn({40, 8}, gen) * 3;
  auto yte = torch::randint(0, 3, {40}, gen, torch::kInt64);
  // Reference: one query at a time, explicit weighted vote.
  auto a = xtr / xtr.norm(2, 1, true), q = xte / xte.norm(2, 1, true);
  int64_t correct = 0;
  for (int64_t i = 0; i < 40; ++i) {
    auto sim = torch::mv(a, q[i]);
    auto top = sim.topk(10);
    std::vector<double> votes(3, 0.0);
    for (int64_t j = 0; j < 10; ++j) {
      votes[ytr[std::get<1>(top)[j].item<int64_t>()].item<int64_t>()] +=
          std::exp(std::get<0>(top)[j].item<double>() / 0.07);
    }
    const int64_t pred = std::max_element(votes.begin(), votes.end()) - votes.begin();
    correct += pred == yte[i].item<int64_t>();
  }
  EXPECT_DOUBLE_EQ(ct::knn_accuracy(xtr, ytr, xte, yte, ct::KnnOptions().k(10).block_size(16)), correct / 40.0);
}

TEST(Eval, EmbedAndBaselines) {
  auto train = quadrant_images(600, 4), test = quadrant_images(200, 5);
  torch::manual_seed(0);
  ct::Encoder enc(ct::EncoderOptions().channels({8, 16}).strides({2, 2}));
  enc->train();
  auto f = ct::embed(enc, test.images, 64);
  EXPECT_EQ(f.sizes(), (std::vector<int64_t>{200, 16}));
  EXPECT_FALSE(f.requires_grad());
  EXPECT_TRUE(enc->is_training());  // restored
  auto raw = ct::evaluate_raw_pixels(train, test);
  EXPECT_GT(raw.linear_probe_acc, 0.95);
  EXPECT_GT(raw.knn_acc, 0.95);
  auto rnd = ct::evaluate_random_init(ct::EncoderOptions().channels({8, 16}).strides({2, 2}), 1, train, test);
  EXPECT_GT(rnd.linear_probe_acc, 0.5);
  // Random init does not disturb the global RNG.
  torch::manual_seed(5);
  auto a = torch::rand({3});
  torch::manual_seed(5);
  ct::evaluate_random_init(ct::EncoderOptions().channels({8, 16}).strides({2, 2}), 1, train.head(50), test.head(20));
  EXPECT_TRUE(torch::equal(a, torch::rand({3})));
}

TEST(Eval, RawPixelProbeOnFashionMnistSlice) {
  // A few thousand real images: the raw-pixel baseline of the evaluation
  // table, with its time. Skipped when the data set is not installed.
  ct::Dataset train, test;
  try {
    train = ct::load_dataset(ct::kDefaultDataDir, "train", 5000);
    test = ct::load_dataset(ct::kDefaultDataDir, "test", 2000);
  } catch (const c10::Error&) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  auto r = ct::evaluate_raw_pixels(train, test);
  std::cout << "raw pixels, 5000 train / 2000 test: linear probe " << r.linear_probe_acc << ", kNN " << r.knn_acc
            << ", " << r.seconds << " s\n";
  EXPECT_GT(r.linear_probe_acc, 0.75);
  EXPECT_GT(r.knn_acc, 0.70);
}

TEST(Eval, ErrorsNameTheArgument) {
  auto x = torch::randn({4, 3});
  auto y = torch::tensor({0, 1, 0, 1}, torch::kInt64);
  EXPECT_NE(error_of([&] { ct::linear_probe(x.view({-1}), y, x, y); })
                .find("linear_probe(): argument 'train_x' must have shape [n, d], but got [12]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::linear_probe(x, y.narrow(0, 0, 3), x, y); })
                .find("linear_probe(): argument 'train_y' must have shape [4] (one label per row of 'train_x'), but got [3]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::linear_probe(x, y, torch::randn({4, 2}), y); })
                .find("linear_probe(): argument 'test_x' must have 3 columns like 'train_x', but got 2"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::linear_probe(x, y, x, y, ct::LinearProbeOptions().num_classes(1)); })
                .find("linear_probe(): option 'num_classes' is 1 but a label is 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::linear_probe(x, y - 1, x, y); }).find("linear_probe(): labels must be >= 0, but got -1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::knn_accuracy(x, y, x, y, ct::KnnOptions().k(0)); })
                .find("knn_accuracy(): option 'k' must be >= 1, but got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::knn_accuracy(x, y, x, y, ct::KnnOptions().temperature(0)); })
                .find("knn_accuracy(): option 'temperature' must be > 0, but got 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ct::embed(ct::Encoder(ct::EncoderOptions()), torch::zeros({2, 28, 28}, torch::kUInt8)); })
                .find("embed(): argument 'images' must have shape [N, 1, H, W], but got [2, 28, 28]"),
            std::string::npos);
}

TEST(Eval, FullFashionMnistRawPixelsWhenAsked) {
  // Full 60000 / 10000 raw-pixel baseline; slow-ish (seconds), so opt-in:
  // CONTRAX_FULL_EVAL=1 ./train_eval_test --gtest_filter='*Full*'
  if (std::getenv("CONTRAX_FULL_EVAL") == nullptr) GTEST_SKIP() << "set CONTRAX_FULL_EVAL=1";
  at::set_num_threads(2);
  auto train = ct::load_dataset(ct::kDefaultDataDir, "train");
  auto test = ct::load_dataset(ct::kDefaultDataDir, "test");
  auto r = ct::evaluate_raw_pixels(train, test);
  std::cout << "raw pixels, full Fashion-MNIST: linear probe " << r.linear_probe_acc << ", kNN(k=20) " << r.knn_acc
            << ", " << r.seconds << " s\n";
  torch::manual_seed(0);
  ct::Encoder enc(ct::EncoderOptions{});
  auto rnd = ct::evaluate_encoder(enc, train, test);
  std::cout << "random-init encoder, full Fashion-MNIST: linear probe " << rnd.linear_probe_acc << ", kNN "
            << rnd.knn_acc << ", " << rnd.seconds << " s\n";
}
