// The words every contrastive loss of Contrax shares: how per-row losses are
// reduced, what a shared label means, and which memory path a loss takes with
// the one option set that chooses it. The bottom layer: the losses
// (contrax/losses/losses.h, grouped.h, tiled.h), the cost model (plan.h) and the
// engine include it; it includes nothing of Contrax.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace contrax {

/// How a loss reduces its per-row losses l_i (the global batch has N rows).
/// Under the gradient convention (rank r returns L_r, the mean over ranks is
/// the loss, every rank backpropagates):
///   kMean: L_r = (W/N) sum_{i in r} l_i   (mean over ranks = the global mean)
///   kSum:  L_r = W sum_{i in r} l_i       (mean over ranks = the global sum)
///   kNone: the [b_r] per-row losses l_i of this rank's rows, each the exact
///          global-batch loss of that row; backward with upstream g_i gives
///          this rank's rows W times the gradient of (1/W) sum_r <g_r, l_r>,
///          i.e. what each rank backpropagating its own weighted sum and
///          data-parallel averaging gives. Every rank must run backward (the
///          symmetric losses all-gather the upstream gradients, O(N)).
enum class Reduction { kMean, kSum, kNone };

/// Which memory path a loss takes (`path` of MemoryPathOptions; the same
/// words in every loss, SigLIP and the InfoNCE core `tiled_info_nce` included):
///   kAuto: materialise the logits while the largest rank's take at most
///     `max_logits_bytes`, otherwise tiled (the choice is made from the
///     exchanged row counts, identically on every rank);
///   kMaterialised: one logits buffer per rank (fastest while it fits);
///   kTiled: tile by tile (memory O(b x tile), same value and gradients;
///     `ring` passes the key blocks around the ring instead of gathering them).
enum class MemoryPath { kAuto, kMaterialised, kTiled };

/// What a shared label means (`labels` options).
/// kMultiPositive: every column whose label equals the row's label is a
///   positive (supervised-contrastive form: l_i = lse_i - mean_{p in P(i)} S_ip,
///   the designated positive always in P(i)).
/// kMaskDuplicates: such columns, other than the designated positive, are
///   removed from the softmax (-inf): duplicate / false-negative masking.
enum class LabelMode { kMultiPositive, kMaskDuplicates };

/// How a loss holds its logits: the option set nested in ClipLossOptions,
/// GroupedLossOptions, NTXentLossOptions, MocoV3LossOptions,
/// SigLipLossOptions, InfoNceOptions and PlanOptions (`memory()`), as
/// LibTorch nests option sets. Its checks are src/util/vocabulary.cpp's.
///
/// Defaults: automatic path, materialised up to 256 MiB of logits per rank,
/// otherwise tiles of about 16 MiB, keys gathered.
///
///   auto o = contrax::ClipLossOptions().memory(
///       contrax::MemoryPathOptions().path(contrax::MemoryPath::kTiled).ring(true));
struct MemoryPathOptions {
  /// Memory path (see MemoryPath); default automatic.
  TORCH_ARG(MemoryPath, path) = MemoryPath::kAuto;
  /// Tiled path: side of a logits tile; 0 (default) chooses it from
  /// `tile_bytes`. A positive value with path kAuto selects the tiled path.
  TORCH_ARG(int64_t, tile_size) = 0;
  /// Tiled path: budget of one logits tile when `tile_size` is 0.
  TORCH_ARG(int64_t, tile_bytes) = int64_t{16} << 20;
  /// Threshold of kAuto (default 256 MiB of logits per rank).
  TORCH_ARG(int64_t, max_logits_bytes) = int64_t{256} << 20;
  /// Tiled path only (implies it): key blocks travel around the ring instead
  /// of being gathered.
  TORCH_ARG(bool, ring) = false;
};

/// How a loss scores a query against a key beyond one dot product of the
/// whole width: Matryoshka representation learning's nested prefixes
/// (Kusupati et al., 2022), the option set nested in every loss's options
/// (`matryoshka()`, or the shorthands `matryoshka_dims()` and
/// `matryoshka_weights()`). With prefixes m_1 < ... < m_P = d the loss is
///   sum_p w_p loss(features[:, :m_p], each row L2-normalised),
/// every loss's own form on every prefix (its scale, temperature, bias,
/// labels and hard negatives shared). Each prefix is L2-normalised inside the
/// loss whatever `normalize` says (a prefix of a unit row is not a unit row;
/// sentence-transformers' MatryoshkaLoss scores cosine similarities too): a
/// loss that takes unnormalised features by default (CLIP, grouped, SigLIP)
/// takes cosine similarities of each prefix here. The full width d is always
/// one of the prefixes (added with weight 1 when `dims` omits it). One gather
/// of the full-width features serves every prefix; each prefix's logits are
/// the loss's own (engine/prefixes.h), so the automatic memory path counts P
/// logits blocks. Its checks are src/util/vocabulary.cpp's.
///
///   auto o = contrax::ClipLossOptions().matryoshka_dims({64, 128, 256});  // and 768, the width
struct MatryoshkaOptions {
  /// The prefix widths, in any order, each in [1, d], no repeats; empty
  /// (default): one dot product of the whole width.
  TORCH_ARG(std::vector<int64_t>, dims) = {};
  /// One finite weight per entry of `dims`, in the same order; empty
  /// (default): 1 each. The full width, when `dims` omits it, weighs 1.
  TORCH_ARG(std::vector<double>, weights) = {};
};

namespace detail {

/// The nested `matryoshka()` option set of a loss's options, with the
/// shorthands `matryoshka_dims()` and `matryoshka_weights()`.
template <typename Options>
class WithMatryoshka {
 public:
  /// Replaces the nested Matryoshka option set.
  Options& matryoshka(const MatryoshkaOptions& m) {
    matryoshka_ = m;
    return static_cast<Options&>(*this);
  }
  /// The nested Matryoshka option set.
  const MatryoshkaOptions& matryoshka() const noexcept { return matryoshka_; }
  /// Sets `matryoshka().dims()`.
  Options& matryoshka_dims(std::vector<int64_t> v) {
    matryoshka_.dims(std::move(v));
    return static_cast<Options&>(*this);
  }
  /// `matryoshka().dims()`.
  const std::vector<int64_t>& matryoshka_dims() const noexcept { return matryoshka_.dims(); }
  /// Sets `matryoshka().weights()`.
  Options& matryoshka_weights(std::vector<double> v) {
    matryoshka_.weights(std::move(v));
    return static_cast<Options&>(*this);
  }
  /// `matryoshka().weights()`.
  const std::vector<double>& matryoshka_weights() const noexcept { return matryoshka_.weights(); }

 private:
  MatryoshkaOptions matryoshka_;
};

}  // namespace detail

namespace detail {

/// A setter and a getter of the nested memory option set's field `name`, as
/// TORCH_ARG declares an option's (one pair per field of MemoryPathOptions).
#define CONTRAX_MEMORY_PATH_ARG(T, name)                       \
  Options& name(T v) {                                         \
    memory_.name(v);                                           \
    return self();                                             \
  }                                                            \
  T name() const noexcept { return memory_.name(); }

/// The nested `memory()` option set of a loss's options, with the shorthands
/// `path()`, `tile_size()`, `tile_bytes()`, `max_logits_bytes()` and `ring()`
/// that read and set its fields (`ClipLossOptions().ring(true)` is
/// `ClipLossOptions().memory(MemoryPathOptions().ring(true))`).
template <typename Options>
class WithMemoryPath {
 public:
  /// Replaces the nested memory option set.
  Options& memory(const MemoryPathOptions& m) {
    memory_ = m;
    return self();
  }
  /// The nested memory option set.
  const MemoryPathOptions& memory() const noexcept { return memory_; }
  /// The nested memory option set, to change in place.
  MemoryPathOptions& memory() noexcept { return memory_; }

  /// `memory().path()`: its setter and getter.
  CONTRAX_MEMORY_PATH_ARG(MemoryPath, path)
  /// `memory().tile_size()`: its setter and getter.
  CONTRAX_MEMORY_PATH_ARG(int64_t, tile_size)
  /// `memory().tile_bytes()`: its setter and getter.
  CONTRAX_MEMORY_PATH_ARG(int64_t, tile_bytes)
  /// `memory().max_logits_bytes()`: its setter and getter.
  CONTRAX_MEMORY_PATH_ARG(int64_t, max_logits_bytes)
  /// `memory().ring()`: its setter and getter.
  CONTRAX_MEMORY_PATH_ARG(bool, ring)

 private:
  Options& self() { return static_cast<Options&>(*this); }
  MemoryPathOptions memory_;
};

#undef CONTRAX_MEMORY_PATH_ARG

}  // namespace detail

}  // namespace contrax
