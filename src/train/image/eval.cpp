// Frozen-encoder evaluation: embedding, L-BFGS linear probe, weighted kNN,
// and the raw-pixel and random-init baselines.
#include "contrax/train/image/eval.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <vector>

#include "contrax/train/image/augment.h"

namespace contrax::train {
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
                    int64_t batch_size, torch::Dtype dtype, const std::function<void()>& after_batch) {
  TORCH_CHECK(images.dim() == 4 && images.size(1) == 1, "embed(): argument 'images' must have shape ",
              "[N, 1, H, W], but got ", images.sizes());
  TORCH_CHECK(batch_size >= 1, "embed(): argument 'batch_size' must be >= 1, but got ", batch_size);
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;
  for (int64_t i = 0; i < images.size(0); i += batch_size) {
    const int64_t n = std::min(batch_size, images.size(0) - i);
    parts.push_back(fn(normalize_images(images.narrow(0, i, n), kFashionMnistMean, kFashionMnistStd, dtype)));
    if (after_batch) after_batch();
  }
  TORCH_CHECK(!parts.empty(), "embed(): argument 'images' must hold at least one image");
  return torch::cat(parts);
}

torch::Tensor embed(Encoder encoder, const torch::Tensor& images, int64_t batch_size,
                    const std::function<void()>& after_batch) {
  const bool was_training = encoder->is_training();
  encoder->eval();
  const auto dtype = encoder->parameters().empty() ? torch::kFloat
                                                   : encoder->parameters().front().scalar_type();
  auto out =
      embed([&](const torch::Tensor& x) { return encoder->forward(x); }, images, batch_size, dtype, after_batch);
  encoder->train(was_training);
  return out;
}

namespace {

// Features scaled with the mean and std of the rows a probe is fitted on.
struct Standardizer {
  torch::Tensor mean, std;  // [1, d]
  Standardizer(const torch::Tensor& x, bool enabled) {
    if (!enabled) return;
    mean = x.mean(0, true);
    // Constant features (border pixels) get std 1 instead of a division by 0.
    auto s = x.std(0, /*unbiased=*/false, true);
    std = torch::where(s > 1e-6, s, torch::ones_like(s));
  }
  torch::Tensor operator()(const torch::Tensor& x) const { return mean.defined() ? (x - mean) / std : x; }
};

struct ProbeFit {
  torch::Tensor wt, b;  // W^T [C, d] (class-major, as linear_probe_objective fits it), [C]
  double loss = 0;
  int64_t iterations = 0;
  double grad_max = 0;
  bool converged = false;  // stopped by a tolerance, not by a budget
};

double accuracy(const ProbeFit& f, const torch::Tensor& x, const torch::Tensor& y) {
  return torch::addmm(f.b, x, f.wt.t()).argmax(1).eq(y).to(torch::kDouble).mean().item<double>();
}

}  // namespace

// The objective is L = (1/n) sum_i [logsumexp_c z_ci - z_(y_i)i] + l2/2 ||W||^2
// on the logits Z = Wt X^T + b 1^T ([C, n]: one column per row of x). Its
// gradient with respect to the logits is G = (softmax over classes of Z - Y)/n,
// Y the one-hot labels as columns, so dL/dWt = G X + l2 Wt and dL/db = G 1.
// The probe fits Wt = W^T rather than W, with both x and xt = x^T at hand,
// because then each of the two GEMMs reads its big operand along rows: with
// only 10 classes, x W ([n, d] x [d, C]) and x^T G^T (autograd's backward of
// it) ran 2.2x and 7.7x slower than Wt xt and G x (16.8 / 53.8 ms against 7.5 /
// 7.0 ms for n = 9000, d = 1024, one AMD EPYC core, MKL of PyPI torch 2.15).
double linear_probe_objective(const torch::Tensor& x, const torch::Tensor& xt, const torch::Tensor& y,
                              const torch::Tensor& wt, const torch::Tensor& b, double l2, torch::Tensor& grad_wt,
                              torch::Tensor& grad_b) {
  torch::NoGradGuard no_grad;
  const double n = static_cast<double>(x.size(0));
  const auto z = torch::addmm(b.unsqueeze(1), wt, xt);  // [C, n]
  const auto log_p = torch::log_softmax(z, 0);
  const auto picked = log_p.gather(0, y.unsqueeze(0));  // [1, n]
  const double loss = -picked.sum().item<double>() / n + 0.5 * l2 * wt.pow(2).sum().item<double>();
  auto g = log_p.exp_().scatter_add_(0, y.unsqueeze(0), torch::full({1, x.size(0)}, -1.0, z.options()));
  g.div_(n);
  grad_wt = torch::addmm(wt, g, x, /*beta=*/l2, /*alpha=*/1.0);
  grad_b = g.sum(1);
  return loss;
}

namespace {

// Minimises mean CE + l2/2 ||W||^2 with L-BFGS from (wt0 = W0^T, b0). The objective is
// smooth and strictly convex for l2 > 0, so the result depends only on the
// data and l2 (up to the tolerances), not on the start: a warm start from a
// neighbouring l2 only saves iterations. The gradient is linear_probe_objective's,
// not autograd's (see there why).
ProbeFit fit_probe(const torch::Tensor& x, const torch::Tensor& xt, const torch::Tensor& y, double l2,
                   const torch::Tensor& wt0, const torch::Tensor& b0, const LinearProbeOptions& o) {
  auto wt = wt0.clone().requires_grad_(true);
  auto b = b0.clone().requires_grad_(true);
  const int64_t max_eval = std::max<int64_t>(1, o.max_iter() * 5 / 4);  // LBFGS's own default ratio
  torch::optim::LBFGS opt({wt, b}, torch::optim::LBFGSOptions(1.0)
                                       .max_iter(o.max_iter())
                                       .max_eval(max_eval)
                                       .history_size(20)
                                       .tolerance_grad(o.tolerance_grad())
                                       .tolerance_change(1e-9)
                                       .line_search_fn("strong_wolfe"));
  ProbeFit f;
  auto closure = [&]() {
    torch::Tensor gw, gb;
    f.loss = linear_probe_objective(x, xt, y, wt.detach(), b.detach(), l2, gw, gb);
    wt.mutable_grad() = gw;
    b.mutable_grad() = gb;
    return torch::tensor(f.loss, torch::kDouble);
  };
  opt.step(closure);
  // Where it stopped: the gradient at the final point (the line search's
  // last evaluation may have been elsewhere).
  closure();
  f.grad_max = std::max(wt.grad().abs().max().item<double>(), b.grad().abs().max().item<double>());
  for (const auto& kv : opt.state()) {
    const auto& st = static_cast<const torch::optim::LBFGSParamState&>(*kv.second);
    f.iterations = st.n_iter();
    f.converged = st.n_iter() < o.max_iter() && st.func_evals() < max_eval;
  }
  f.wt = wt.detach();
  f.b = b.detach();
  return f;
}

}  // namespace

LinearProbeResult linear_probe(const torch::Tensor& train_x_in, const torch::Tensor& train_y,
                               const torch::Tensor& test_x_in, const torch::Tensor& test_y,
                               const LinearProbeOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  check_features("linear_probe", train_x_in, "train_x", train_y, "train_y");
  check_features("linear_probe", test_x_in, "test_x", test_y, "test_y");
  TORCH_CHECK(test_x_in.size(1) == train_x_in.size(1), "linear_probe(): argument 'test_x' must have ",
              train_x_in.size(1), " columns like 'train_x', but got ", test_x_in.size(1));
  TORCH_CHECK(!o.l2_grid().empty(), "linear_probe(): option 'l2_grid' must hold at least one value");
  for (double l2 : o.l2_grid()) {
    TORCH_CHECK(l2 >= 0, "linear_probe(): option 'l2_grid' must hold values >= 0, but got ", l2);
  }
  TORCH_CHECK(o.max_iter() >= 1, "linear_probe(): option 'max_iter' must be >= 1, but got ", o.max_iter());
  TORCH_CHECK(o.tolerance_grad() > 0, "linear_probe(): option 'tolerance_grad' must be > 0, but got ",
              o.tolerance_grad());
  const bool select = o.l2_grid().size() > 1;
  const int64_t n = train_x_in.size(0);
  if (select) {
    TORCH_CHECK(o.val_fraction() > 0 && o.val_fraction() < 1,
                "linear_probe(): option 'val_fraction' must be in (0, 1), but got ", o.val_fraction());
    TORCH_CHECK(n >= 2, "linear_probe(): choosing the L2 strength from 'l2_grid' holds out validation rows, so ",
                "'train_x' needs at least 2 rows, but has ", n, " (give 'l2_grid' a single value)");
  }
  const int64_t classes = infer_classes("linear_probe", o.num_classes(), train_y, test_y);
  torch::NoGradGuard outer_no_grad;
  const auto train_x = train_x_in.to(torch::kFloat);
  const auto test_x = test_x_in.to(torch::kFloat);
  const int64_t d = train_x.size(1);
  auto wt0 = torch::zeros({classes, d}, torch::kFloat);
  auto b0 = torch::zeros({classes}, torch::kFloat);

  LinearProbeResult r;
  r.l2 = o.l2_grid().front();
  if (select) {
    // A seeded split, so that every representation is judged on the same rows.
    auto gen = at::detail::createCPUGenerator(o.seed());
    auto perm = torch::randperm(n, gen, torch::kLong);
    const int64_t n_val = std::min(n - 1, std::max<int64_t>(1, std::llround(o.val_fraction() * n)));
    auto val_idx = perm.narrow(0, 0, n_val), fit_idx = perm.narrow(0, n_val, n - n_val);
    const auto fit_x_raw = train_x.index_select(0, fit_idx);
    const Standardizer st(fit_x_raw, o.standardize());
    const auto fit_x = st(fit_x_raw), val_x = st(train_x.index_select(0, val_idx));
    const auto fit_xt = fit_x.t().contiguous();
    const auto fit_y = train_y.index_select(0, fit_idx), val_y = train_y.index_select(0, val_idx);
    // Strongest penalty first: its fit is quick, and each weaker one starts
    // from the previous solution (a regularisation path).
    auto grid = o.l2_grid();
    std::sort(grid.begin(), grid.end(), std::greater<double>());
    // The path stops at the first lambda that validates worse than the best so
    // far: weaker penalties only overfit more from there on, and they are the
    // slow fits (the weaker the penalty, the worse conditioned the problem).
    torch::Tensor best_wt, best_b;
    for (double l2 : grid) {
      auto f = fit_probe(fit_x, fit_xt, fit_y, l2, wt0, b0, o);
      const double acc = accuracy(f, val_x, val_y);
      if (acc < r.val_acc) break;
      if (acc > r.val_acc) {
        r.val_acc = acc;
        r.l2 = l2;
        best_wt = f.wt;
        best_b = f.b;
      }
      wt0 = f.wt;
      b0 = f.b;
    }
    // The refit on all rows starts from the chosen fit (same lambda, 90% of
    // the rows): close to its optimum, so it needs few iterations.
    wt0 = best_wt;
    b0 = best_b;
  }
  const Standardizer st(train_x, o.standardize());
  const auto x = st(train_x);
  const auto f = fit_probe(x, x.t().contiguous(), train_y, r.l2, wt0, b0, o);
  r.final_loss = f.loss;
  r.iterations = f.iterations;
  r.grad_max = f.grad_max;
  r.converged = f.converged;
  r.train_acc = accuracy(f, x, train_y);
  r.test_acc = accuracy(f, st(test_x), test_y);
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
// Checked before the (slow) embedding, not after it.
void check_eval_options(const char* fn, const EvalOptions& o) {
  TORCH_CHECK(o.probe_train_limit() == -1 || o.probe_train_limit() >= 1, fn,
              "(): option 'probe_train_limit' must be -1 (all) or >= 1, but got ", o.probe_train_limit());
  TORCH_CHECK(o.batch_size() >= 1, fn, "(): option 'batch_size' must be >= 1, but got ", o.batch_size());
}

void tell(const EvalOptions& o, const char* stage, int64_t done, int64_t total) {
  if (o.progress()) o.progress()(stage, done, total);
}

EvalResult evaluate_features(const torch::Tensor& ftrain, const Dataset& train, const torch::Tensor& ftest,
                             const Dataset& test, const EvalOptions& options,
                             std::chrono::steady_clock::time_point t0) {
  const int64_t n_probe = options.probe_train_limit() > 0 ? std::min(options.probe_train_limit(), ftrain.size(0))
                                                          : ftrain.size(0);
  EvalResult r;
  tell(options, "linear probe", 0, 1);
  r.probe = linear_probe(ftrain.narrow(0, 0, n_probe), train.labels.narrow(0, 0, n_probe), ftest, test.labels,
                         options.probe());
  r.linear_probe_acc = r.probe.test_acc;
  tell(options, "kNN", 0, 1);
  r.knn_acc = knn_accuracy(ftrain, train.labels, ftest, test.labels, options.knn());
  tell(options, "kNN", 1, 1);
  r.seconds = seconds_since(t0);
  return r;
}

}  // namespace

EvalResult evaluate_encoder(Encoder encoder, const Dataset& train, const Dataset& test,
                            const EvalOptions& options) {
  check_eval_options("evaluate_encoder", options);
  const auto t0 = std::chrono::steady_clock::now();
  // Both splits, telling the display after each batch.
  const int64_t b = options.batch_size();
  const int64_t batches = (train.size() + b - 1) / b + (test.size() + b - 1) / b;
  int64_t done = 0;
  std::function<void()> after_batch;
  if (options.progress()) after_batch = [&] { tell(options, "embedding", ++done, batches); };
  tell(options, "embedding", 0, batches);
  auto ftrain = embed(encoder, train.images, b, after_batch);
  auto ftest = embed(encoder, test.images, b, after_batch);
  return evaluate_features(ftrain, train, ftest, test, options, t0);
}

EvalResult evaluate_raw_pixels(const Dataset& train, const Dataset& test, const EvalOptions& options) {
  check_eval_options("evaluate_raw_pixels", options);
  const auto t0 = std::chrono::steady_clock::now();
  TORCH_CHECK(train.size() > 0 && test.size() > 0, "evaluate_raw_pixels(): both splits must be non-empty");
  auto ftrain = normalize_images(train.images).flatten(1);  // [N, H*W]
  auto ftest = normalize_images(test.images).flatten(1);
  return evaluate_features(ftrain, train, ftest, test, options, t0);
}

EvalResult evaluate_random_init(const EncoderOptions& encoder_options, uint64_t seed, const Dataset& train,
                                const Dataset& test, const EvalOptions& options) {
  check_eval_options("evaluate_random_init", options);
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

}  // namespace contrax::train
