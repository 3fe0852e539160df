// The retrieval towers (see towers.h).
#include "contrax/train/retrieval/towers.h"

namespace contrax::train {

namespace F = torch::nn::functional;

BagTowerImpl::BagTowerImpl(const BagTowerOptions& o) : options(o) {
  TORCH_CHECK(o.buckets() >= 2 && o.embed_dim() >= 1 && o.hidden_dim() >= 1 && o.out_dim() >= 1,
              "BagTower: buckets must be >= 2 and every dimension >= 1, but got buckets ", o.buckets(), ", dims ",
              o.embed_dim(), "/", o.hidden_dim(), "/", o.out_dim());
  // Small rows (fastText-like): each feature's embedding is learnt from
  // scratch, and Adam's steps of ~lr are then large relative to them.
  embedding = register_parameter("embedding", torch::randn({o.buckets(), o.embed_dim()}) * o.init_std());
  norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.embed_dim()})));
  fc1 = register_module("fc1", torch::nn::Linear(o.embed_dim(), o.hidden_dim()));
  fc2 = register_module("fc2", torch::nn::Linear(o.hidden_dim(), o.out_dim()));
  skip = register_module("skip", torch::nn::Linear(torch::nn::LinearOptions(o.embed_dim(), o.out_dim()).bias(false)));
}

torch::Tensor BagTowerImpl::forward(const std::vector<torch::Tensor>& x) {
  TORCH_CHECK(x.size() == 2, "BagTower::forward(): expected {ids [n, L], weights [n, L]}, but got ", x.size(),
              " tensors");
  TORCH_CHECK((x[0].dim() == 2 || x[0].dim() == 3) && x[1].sizes() == x[0].sizes(),
              "BagTower::forward(): ids and weights must both be [n, L] or [n, T, L], but got ", x[0].sizes(), " and ",
              x[1].sizes());
  if (x[0].dim() == 3) {
    // Token bags: every token through the same layers, then back to [n, T, out].
    const int64_t n = x[0].size(0), T = x[0].size(1), L = x[0].size(2);
    return forward({x[0].reshape({n * T, L}), x[1].reshape({n * T, L})}).view({n, T, options.out_dim()});
  }
  const auto& ids = x[0];
  const auto& w = x[1];
  // The weighted sum of the rows' feature embeddings, as a gather and a
  // weighted sum (not F::embedding_bag: this form also serves a rank with
  // zero rows, whose zero gradient the reducer still has to see).
  const int64_t n = ids.size(0), L = ids.size(1);
  auto e = embedding.index_select(0, ids.reshape({-1})).view({n, L, options.embed_dim()});  // [n, L, e]
  auto h = norm->forward((e * w.to(embedding.dtype()).unsqueeze(-1)).sum(1));              // [n, e]
  auto z = skip->forward(h) + fc2->forward(torch::gelu(fc1->forward(h)));                   // [n, out]
  return F::normalize(z, F::NormalizeFuncOptions().dim(1).eps(1e-12));
}

LogitScaleImpl::LogitScaleImpl(double init_log_scale) {
  value = register_parameter("value", torch::full({}, init_log_scale, torch::kFloat));
}

}  // namespace contrax::train
