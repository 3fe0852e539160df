// JSON helpers of the `contrax` tool (nlohmann-json). A JSON number cannot be
// NaN or infinite: such a value is written as null and its key is listed in
// the object's "nonfinite" array, so that a strict parser reads every line and
// a reader still learns that (and where) the run produced a non-finite value.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <string>

#include "contrax/check/verify.h"

namespace contrax::cli {

using Json = nlohmann::ordered_json;  // keys in the order written, as a reader expects

/// j[key] = v, or null plus key appended to j["nonfinite"] when v is NaN or infinite.
inline void put_number(Json& j, const std::string& key, double v) {
  if (std::isfinite(v)) {
    j[key] = v;
  } else {
    j[key] = nullptr;
    j["nonfinite"].push_back(key);
  }
}

/// One verify case as JSON: {"loss", "world_size", "rows", "loss_rel_err", "max_rel_err", "worst", "passed"}.
inline Json verify_json(const VerifyResult& r) {
  Json j;
  j["loss"] = r.loss;
  j["world_size"] = r.world_size;
  j["rows"] = r.rows;
  put_number(j, "loss_rel_err", r.loss_rel_err);
  put_number(j, "max_rel_err", r.max_rel_err);
  j["worst"] = r.worst;
  j["device"] = r.device;
  j["passed"] = r.passed;
  return j;
}

}  // namespace contrax::cli
