// Argument checks that report instead of throw (see util/check.h).
#include "util/check.h"

#include <cmath>

namespace contrax::detail {

bool ArgChecker::floating(const torch::Tensor& t, const char* name, int64_t dim, const char* shape) {
  if (!error_.empty()) return false;
  if (!t.defined()) {
    fail(name, "is undefined");
  } else if (t.dim() != dim) {
    fail(name, "must be a ", shape, ", but got shape ", t.sizes());
  } else if (!c10::isFloatingType(t.scalar_type())) {
    fail(name, "must be a floating-point tensor, but got dtype ", t.scalar_type());
  }
  return error_.empty();
}

ArgChecker& ArgChecker::features(const torch::Tensor& t, const char* name) {
  if (floating(t, name, 2, "2-D tensor [rows, width]") && t.size(1) == 0) {
    fail(name, "must have a width of at least 1 (features [rows, width]), but got shape ", t.sizes());
  }
  return *this;
}

ArgChecker& ArgChecker::same_as(const torch::Tensor& t, const char* name, const torch::Tensor& ref,
                                const char* ref_name) {
  if (!error_.empty()) return *this;
  if (t.sizes() != ref.sizes()) {
    fail(name, "must have the same shape as '", ref_name, "' (", ref.sizes(), "), but got ", t.sizes());
  } else if (t.scalar_type() != ref.scalar_type()) {
    fail(name, "must have the same dtype as '", ref_name, "' (", ref.scalar_type(), "), but got ", t.scalar_type());
  } else if (t.device() != ref.device()) {
    fail(name, "must be on the same device as '", ref_name, "' (", ref.device(), "), but got ", t.device());
  }
  return *this;
}

ArgChecker& ArgChecker::paired_features(const torch::Tensor& a, const char* a_name, const torch::Tensor& b,
                                        const char* b_name) {
  features(a, a_name).features(b, b_name);
  if (!error_.empty()) return *this;
  require(a.size(0) == b.size(0), "arguments '", a_name, "' and '", b_name,
          "' must have the same number of rows on each rank, but got ", a.size(0), " and ", b.size(0));
  return same_kind(a, a_name, b, b_name);
}

ArgChecker& ArgChecker::same_kind(const torch::Tensor& a, const char* a_name, const torch::Tensor& b,
                                  const char* b_name) {
  if (!error_.empty()) return *this;
  require(a.size(-1) == b.size(-1), "arguments '", a_name, "' and '", b_name, "' must have the same width, but got ",
          a.size(-1), " and ", b.size(-1));
  require(a.scalar_type() == b.scalar_type(), "arguments '", a_name, "' and '", b_name,
          "' must have the same dtype, but got ", a.scalar_type(), " and ", b.scalar_type());
  require(a.device() == b.device(), "arguments '", a_name, "' and '", b_name,
          "' must be on the same device, but got ", a.device(), " and ", b.device());
  return *this;
}

int64_t ArgChecker::rows_per_query(int64_t queries, int64_t rows, const char* name) {
  if (queries == 0) {
    require(rows == 0, "argument '", name, "' must be empty on a rank with no queries, but got ", rows, " rows");
    return 0;
  }
  const bool ok = rows >= queries && rows % queries == 0;
  require(ok, "argument '", name, "' must have g * queries.size(0) rows (g >= 1 per query: its positive, then g-1 ",
          "hard negatives), but got ", rows, " rows for ", queries, " queries");
  return ok ? rows / queries : 0;
}

ArgChecker& ArgChecker::scalar(const torch::Tensor& t, const char* name) {
  floating(t, name, 0, "0-dim tensor");
  return *this;
}

ArgChecker& ArgChecker::positive(double v, const char* name) {
  if (!error_.empty()) return *this;
  if (!(v > 0.0) || !std::isfinite(v)) {
    fail(name, "must be a positive finite number, but got ", v);
  }
  return *this;
}

}  // namespace contrax::detail
