// Argument checks shared by the losses and the gathers (internal, not
// installed). They *return* the error text instead of
// throwing so that a distributed loss can tell every rank about a bad argument
// before any data collective (see detail::exchange_row_counts), instead of
// letting the healthy ranks hang in a gather the failing rank never joins.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "contrax/util/vocabulary.h"

namespace contrax::detail {

/// Collects the first failed check's message.
class ArgChecker {
 public:
  explicit ArgChecker(const char* caller) : caller_(caller) {}

  /// `name` must be a defined 2-D floating-point tensor: [rows, width].
  ArgChecker& features(const torch::Tensor& t, const char* name);
  /// `name` must have the same shape, dtype and device as `ref_name`.
  ArgChecker& same_as(const torch::Tensor& t, const char* name, const torch::Tensor& ref, const char* ref_name);
  /// Two towers of paired rows: both `features`, with the same row count on
  /// this rank, the same width, dtype and device (CLIP, SigLIP).
  ArgChecker& paired_features(const torch::Tensor& a, const char* a_name, const torch::Tensor& b, const char* b_name);
  /// Two feature sets scored against each other: the same width (last
  /// dimension), dtype and device.
  ArgChecker& same_kind(const torch::Tensor& a, const char* a_name, const torch::Tensor& b, const char* b_name);
  /// `name` holds g rows per query (g >= 1: its positive, then g - 1 hard
  /// negatives) for `queries` queries, or none on a rank with none; returns g
  /// (0 without queries or when the check fails).
  int64_t rows_per_query(int64_t queries, int64_t rows, const char* name);
  /// `name` must be a 0-dim floating tensor (a learnable scalar).
  ArgChecker& scalar(const torch::Tensor& t, const char* name);
  /// `name` must be > 0 (and finite).
  ArgChecker& positive(double v, const char* name);
  /// Free-form condition.
  template <typename... Args>
  ArgChecker& require(bool ok, const Args&... msg) {
    if (!ok && error_.empty()) error_ = c10::str(caller_, "(): ", msg...);
    return *this;
  }
  const std::string& error() const { return error_; }
  /// The function whose arguments are checked (the messages' prefix).
  const char* caller() const { return caller_; }
  /// Throws the collected error (for code paths with no peer to tell).
  void throw_if_failed() const { TORCH_CHECK(error_.empty(), error_); }

 private:
  // Defined, `dim` dimensions (`shape` names them in the error) and a
  // floating dtype: what features() and scalar() share. False once failed.
  bool floating(const torch::Tensor& t, const char* name, int64_t dim, const char* shape);
  // The message "<caller>(): argument '<name>' <msg>" of a failed check.
  template <typename... Args>
  void fail(const char* name, const Args&... msg) { error_ = c10::str(caller_, "(): argument '", name, "' ", msg...); }

  const char* caller_;
  std::string error_;
};

/// Checks the memory-path options into `check` (inconsistent ones are an
/// argument error; src/util/vocabulary.cpp, beside the option set).
void check_memory_path(ArgChecker& check, const MemoryPathOptions& o);

/// Checks the Matryoshka options against the features' `width` d into `check`:
/// every dim in [1, d], none repeated, as many finite weights as dims (or none).
void check_matryoshka(ArgChecker& check, const MatryoshkaOptions& o, int64_t width);

/// One prefix of a Matryoshka loss: its width and weight.
struct Prefix {
  int64_t dim = 0;
  double weight = 1.0;
};

/// The prefixes of checked options over features `width` wide, in increasing
/// width, the full width last (added with weight 1 when `dims` omits it);
/// empty when `dims` is (one dot product of the whole width).
std::vector<Prefix> matryoshka_prefixes(const MatryoshkaOptions& o, int64_t width);

}  // namespace contrax::detail
