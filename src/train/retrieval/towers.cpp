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
  TORCH_CHECK(x.size() == 2 || x.size() == 4, "BagTower::forward(): expected {ids [n, L], weights [n, L]} or "
              "token bags {ids, weights, slots, mask}, but got ", x.size(), " tensors");
  if (x.size() == 4) {
    // Token bags: every token through the same layers, each in its slot of
    // [n, T, out] (padding slots zero: masked by the scorer).
    const auto& mask = x[3];
    TORCH_CHECK(mask.dim() == 2 && x[2].dim() == 1 && x[2].size(0) == x[0].size(0),
                "BagTower::forward(): token bags need slots [N] for ids [N, L] and a mask [n, T], but got ",
                x[2].sizes(), ", ", x[0].sizes(), " and ", mask.sizes());
    auto z = forward({x[0], x[1]});  // [N, out]
    return torch::zeros({mask.numel(), options.out_dim()}, z.options())
        .index_copy(0, x[2], z)
        .view({mask.size(0), mask.size(1), options.out_dim()});
  }
  TORCH_CHECK(x[0].dim() == 2 && x[1].sizes() == x[0].sizes(), "BagTower::forward(): ids and weights must both be "
              "[n, L], but got ", x[0].sizes(), " and ", x[1].sizes());
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
