// The towers of the retrieval recipe: a hashed feature-bag encoder for the
// glosses (queries) and the lemma lists (passages), and the learnable logit
// scale, each a module of its own (one DataParallel each, see trainer.h).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace contrax {
namespace train {

/// A hashed feature bag encoder: the mean of the features' embeddings,
/// layer-normalised (h), then z = skip(h) + fc2(GELU(fc1(h))), L2-normalised.
/// The layer norm keeps h at unit scale whatever the bag's length and the
/// embeddings' size; the linear skip lets a lexical match pass straight through.
struct BagTowerOptions {
  BagTowerOptions(int64_t buckets = int64_t{1} << 15) : buckets_(buckets) {}
  TORCH_ARG(int64_t, buckets);
  TORCH_ARG(int64_t, embed_dim) = 64;
  TORCH_ARG(int64_t, hidden_dim) = 256;
  TORCH_ARG(int64_t, out_dim) = 128;
  /// Standard deviation of the initial feature embeddings.
  TORCH_ARG(double, init_std) = 0.1;
};

class BagTowerImpl : public torch::nn::Module {
 public:
  explicit BagTowerImpl(const BagTowerOptions& options = {});
  /// x = {ids int64 [n, L], weights [n, L]} (feature_batch's output) -> [n, out_dim], unit rows.
  torch::Tensor forward(const std::vector<torch::Tensor>& x);
  BagTowerOptions options;
  torch::Tensor embedding;  // [buckets, embed_dim]
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, skip{nullptr};
};
TORCH_MODULE(BagTower);

/// The learnable log of the logit scale (0-dim), in a module of its own so
/// that its gradient is averaged over ranks by its own DataParallel.
class LogitScaleImpl : public torch::nn::Module {
 public:
  explicit LogitScaleImpl(double init_log_scale);
  torch::Tensor forward() { return value; }
  torch::Tensor value;
};
TORCH_MODULE(LogitScale);

}  // namespace train
}  // namespace contrax
