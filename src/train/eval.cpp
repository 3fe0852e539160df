// Frozen-encoder evaluation: embedding, L-BFGS linear probe, weighted kNN,
// and the raw-pixel and random-init baselines.
#include "contrax/train/eval.h"

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>

#include "contrax/train/augment.h"

namespace contrax {
namespace train {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void check_features(const char* fn, const torch::Tensor& x, const char* xname, const torch::Tensor& y,
                    const char* yname) {
  TORCH_CHECK(x.dim() == 2, fn, "(): argument '", xname, "' must have shape [n, d], but got ", x.sizes());
  TORCH_CHECK(y.dim() == 1 && y.size(0) == x.size(0), fn, "(): argument '", yname, "' must have shape [",
              x.size(0), "] (one label per row of '", xname, "'), but got ", y.sizes());
  TORCH_CHECK(x.size(0) > 0, fn, "(): argument '", xname, "' must have at least one row");
}

int64_t infer_classes(const char* fn, int64_t given, const torch::Tensor& a, const torch::Tensor& b) {
  const int64_t lo = std::min(a.min().item<int64_t>(), b.min().item<int64_t>());
  TORCH_CHECK(lo >= 0, fn, "(): labels must be >= 0, but got ", lo);
  const int64_t hi = std::max(a.max().item<int64_t>(), b.max().item<int64_t>());
  if (given < 0) return hi + 1;
  TORCH_CHECK(hi < given, fn, "(): option 'num_classes' is ", given, " but a label is ", hi);
  return given;
}

}  // namespace

torch::Tensor embed(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& images,
                    int64_t batch_size, torch::Dtype dtype) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 1, "embed(): argument 'images' must have shape ",
              "[N, 1, H, W], but got ", images.sizes());
  TORCH_CHECK(batch_size >= 1, "embed(): argument 'batch_size' must be >= 1, but got ", batch_size);
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;
  for (int64_t i = 0; i < images.size(0); i += batch_size) {
    const int64_t n = std::min(batch_size, images.size(0) - i);
    parts.push_back(fn(normalize_images(images.narrow(0, i, n), kFashionMnistMean, kFashionMnistStd, dtype)));
  }
  TORCH_CHECK(!parts.empty(), "embed(): argument 'images' must hold at least one image");
  return torch::cat(parts);
}

torch::Tensor embed(Encoder encoder, const torch::Tensor& images, int64_t batch_size) {
  const bool was_training = encoder->is_training();
  encoder->eval();
  const auto dtype = encoder->parameters().empty() ? torch::kFloat
                                                   : encoder->parameters().front().scalar_type();
  auto out = embed([&](const torch::Tensor& x) { return encoder->forward(x); }, images, batch_size, dtype);
  encoder->train(was_training);
  return out;
}

LinearProbeResult linear_probe(const torch::Tensor& train_x_in, const torch::Tensor& train_y,
                               const torch::Tensor& test_x_in, const torch::Tensor& test_y,
                               const LinearProbeOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  check_features("linear_probe", train_x_in, "train_x", train_y, "train_y");
  check_features("linear_probe", test_x_in, "test_x", test_y, "test_y");
  TORCH_CHECK(test_x_in.size(1) == train_x_in.size(1), "linear_probe(): argument 'test_x' must have ",
              train_x_in.size(1), " columns like 'train_x', but got ", test_x_in.size(1));
  TORCH_CHECK(o.l2() >= 0, "linear_probe(): option 'l2' must be >= 0, but got ", o.l2());
  TORCH_CHECK(o.max_iter() >= 1, "linear_probe(): option 'max_iter' must be >= 1, but got ", o.max_iter());
  const int64_t classes = infer_classes("linear_probe", o.num_classes(), train_y, test_y);
  torch::NoGradGuard outer_no_grad;
  auto train_x = train_x_in.to(torch::kFloat);
  auto test_x = test_x_in.to(torch::kFloat);
  if (o.standardize()) {
    auto mean = train_x.mean(0, true);
    // Constant features (border pixels) get std 1 instead of a division by 0.
    auto std = train_x.std(0, /*unbiased=*/false, true);
    std = torch::where(std > 1e-6, std, torch::ones_like(std));
    train_x = (train_x - mean) / std;
    test_x = (test_x - mean) / std;
  }
  const int64_t d = train_x.size(1);
  auto w = torch::zeros({d, classes}, torch::kFloat).requires_grad_(true);
  auto b = torch::zeros({classes}, torch::kFloat).requires_grad_(true);
  torch::optim::LBFGS opt({w, b}, torch::optim::LBFGSOptions(1.0)
                                      .max_iter(o.max_iter())
                                      .history_size(20)
                                      .tolerance_grad(1e-6)
                                      .tolerance_change(1e-9)
                                      .line_search_fn("strong_wolfe"));
  double final_loss = 0;
  auto closure = [&]() {
    torch::AutoGradMode grad(true);
    opt.zero_grad();
    auto logits = torch::addmm(b, train_x, w);  // [N, C]
    auto loss = torch::nn::functional::cross_entropy(logits, train_y) + 0.5 * o.l2() * w.pow(2).sum();
    loss.backward();
    final_loss = loss.item<double>();
    return loss;
  };
  {
    torch::AutoGradMode grad(true);
    opt.step(closure);
  }
  LinearProbeResult r;
  r.final_loss = final_loss;
  r.train_acc = torch::addmm(b, train_x, w).argmax(1).eq(train_y).to(torch::kDouble).mean().item<double>();
  r.test_acc = torch::addmm(b, test_x, w).argmax(1).eq(test_y).to(torch::kDouble).mean().item<double>();
  r.seconds = seconds_since(t0);
  return r;
}

double knn_accuracy(const torch::Tensor& train_x_in, const torch::Tensor& train_y, const torch::Tensor& test_x_in,
                    const torch::Tensor& test_y, const KnnOptions& o) {
  check_features("knn_accuracy", train_x_in, "train_x", train_y, "train_y");
  check_features("knn_accuracy", test_x_in, "test_x", test_y, "test_y");
  TORCH_CHECK(test_x_in.size(1) == train_x_in.size(1), "knn_accuracy(): argument 'test_x' must have ",
              train_x_in.size(1), " columns like 'train_x', but got ", test_x_in.size(1));
  TORCH_CHECK(o.k() >= 1, "knn_accuracy(): option 'k' must be >= 1, but got ", o.k());
  TORCH_CHECK(o.temperature() > 0, "knn_accuracy(): option 'temperature' must be > 0, but got ",
              o.temperature());
  TORCH_CHECK(o.block_size() >= 1, "knn_accuracy(): option 'block_size' must be >= 1, but got ",
              o.block_size());
  const int64_t classes = infer_classes("knn_accuracy", o.num_classes(), train_y, test_y);
  torch::NoGradGuard no_grad;
  namespace F = torch::nn::functional;
  auto bank = F::normalize(train_x_in.to(torch::kFloat), F::NormalizeFuncOptions().dim(1));  // [N, d]
  auto queries = F::normalize(test_x_in.to(torch::kFloat), F::NormalizeFuncOptions().dim(1));  // [M, d]
  const int64_t k = std::min(o.k(), bank.size(0));
  int64_t correct = 0;
  for (int64_t i = 0; i < queries.size(0); i += o.block_size()) {
    const int64_t n = std::min(o.block_size(), queries.size(0) - i);
    auto sim = torch::mm(queries.narrow(0, i, n), bank.t());  // [n, N]
    auto top = sim.topk(k, 1);
    auto weights = (std::get<0>(top) / o.temperature()).exp();  // [n, k]
    auto neighbour_labels = train_y.index_select(0, std::get<1>(top).reshape({-1})).view({n, k});
    auto votes = torch::zeros({n, classes}, torch::kFloat).scatter_add_(1, neighbour_labels, weights);
    correct += votes.argmax(1).eq(test_y.narrow(0, i, n)).sum().item<int64_t>();
  }
  return static_cast<double>(correct) / static_cast<double>(queries.size(0));
}

namespace {
EvalResult evaluate_features(const torch::Tensor& ftrain, const Dataset& train, const torch::Tensor& ftest,
                             const Dataset& test, const EvalOptions& options,
                             std::chrono::steady_clock::time_point t0) {
  EvalResult r;
  r.linear_probe_acc = linear_probe(ftrain, train.labels, ftest, test.labels, options.probe()).test_acc;
  r.knn_acc = knn_accuracy(ftrain, train.labels, ftest, test.labels, options.knn());
  r.seconds = seconds_since(t0);
  return r;
}
}  // namespace

EvalResult evaluate_encoder(Encoder encoder, const Dataset& train, const Dataset& test,
                            const EvalOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  auto ftrain = embed(encoder, train.images, options.batch_size());
  auto ftest = embed(encoder, test.images, options.batch_size());
  return evaluate_features(ftrain, train, ftest, test, options, t0);
}

EvalResult evaluate_raw_pixels(const Dataset& train, const Dataset& test, const EvalOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  TORCH_CHECK(train.size() > 0 && test.size() > 0, "evaluate_raw_pixels(): both splits must be non-empty");
  auto ftrain = normalize_images(train.images).flatten(1);  // [N, H*W]
  auto ftest = normalize_images(test.images).flatten(1);
  return evaluate_features(ftrain, train, ftest, test, options, t0);
}

EvalResult evaluate_random_init(const EncoderOptions& encoder_options, uint64_t seed, const Dataset& train,
                                const Dataset& test, const EvalOptions& options) {
  auto gen = at::detail::getDefaultCPUGenerator();
  torch::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    saved = gen.get_state();
  }
  torch::manual_seed(seed);
  Encoder encoder(encoder_options);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  }
  return evaluate_encoder(encoder, train, test, options);
}

}  // namespace train
}  // namespace contrax
