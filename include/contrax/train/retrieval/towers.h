// The towers of the retrieval recipe: a hashed feature-bag encoder for the
// glosses (queries) and the lemma lists (passages), and the learnable logit
// scale, each a module of its own (one DataParallel each, see trainer.h).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace contrax::train {

/// A hashed feature bag encoder: the mean of the features' embeddings,
/// layer-normalised (h), then z = skip(h) + fc2(GELU(fc1(h))), L2-normalised.
/// The layer norm keeps h at unit scale whatever the bag's length and the
/// embeddings' size; the linear skip lets a lexical match pass straight through.
struct BagTowerOptions {
  /// Options of a tower with `buckets` hashed feature buckets.
  BagTowerOptions(int64_t buckets = int64_t{1} << 15) : buckets_(buckets) {}
  /// Rows of the feature-embedding table (hash buckets; >= 2).
  TORCH_ARG(int64_t, buckets);
  /// Width of the feature embeddings.
  TORCH_ARG(int64_t, embed_dim) = 64;
  /// Hidden width of fc1.
  TORCH_ARG(int64_t, hidden_dim) = 256;
  /// Width of the output embedding.
  TORCH_ARG(int64_t, out_dim) = 128;
  /// Standard deviation of the initial feature embeddings.
  TORCH_ARG(double, init_std) = 0.1;
};

/// The tower BagTowerOptions describes: hashed feature bag -> unit-length embedding.
class BagTowerImpl : public torch::nn::Module {
 public:
  /// Checks the options and registers the embedding table (normal, `init_std`),
  /// the layer norm and the linear layers.
  explicit BagTowerImpl(const BagTowerOptions& options = {});
  /// x = {ids int64 [n, L], weights [n, L]} (feature_batch's output) -> [n, out_dim], unit rows;
  /// or token bags {ids [N, L], weights [N, L], slots [N], mask [n, T]} (token_feature_batch's)
  /// -> [n, T, out_dim]: each token through the same layers, into its slot (padding slots zero).
  torch::Tensor forward(const std::vector<torch::Tensor>& x);
  BagTowerOptions options;              ///< the options the tower was built with
  torch::Tensor embedding;              ///< feature embeddings [buckets, embed_dim], parameter "embedding"
  torch::nn::LayerNorm norm{nullptr};   ///< layer norm of the mean embedding h
  ///@{
  /// The layers of z = skip(h) + fc2(GELU(fc1(h))); skip has no bias.
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, skip{nullptr};
  ///@}
};
TORCH_MODULE(BagTower);

/// The learnable log of the logit scale (0-dim), in a module of its own so
/// that its gradient is averaged over ranks by its own DataParallel.
class LogitScaleImpl : public torch::nn::Module {
 public:
  /// Registers `value` as the parameter `init_log_scale`.
  explicit LogitScaleImpl(double init_log_scale);
  /// The log of the logit scale, `value`.
  torch::Tensor forward() { return value; }
  torch::Tensor value;  ///< the log of the logit scale (0-dim float parameter "value")
};
TORCH_MODULE(LogitScale);

}  // namespace contrax::train
