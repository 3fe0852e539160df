// tiled_info_nce, the InfoNCE core with arbitrary positive and masked
// offsets, as a front end of the engine's tiled one-directional block (see
// contrax/losses/tiled.h).
#include "contrax/losses/tiled.h"

#include "contrax/comm/collectives.h"
#include "engine/engine.h"

namespace contrax {

torch::Tensor tiled_info_nce(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& bias, const InfoNceOptions& options) {
  detail::NoAutocast no_autocast;
  constexpr const char* caller = "tiled_info_nce";
  detail::ArgChecker check(caller);
  check.features(q, "q").features(k, "k");
  if (check.error().empty()) {
    check.require(q.size(1) == k.size(1), "arguments 'q' and 'k' must have the same width, but got ", q.size(1),
                  " and ", k.size(1));
    check.require(q.scalar_type() == k.scalar_type(), "arguments 'q' and 'k' must have the same dtype, but got ",
                  q.scalar_type(), " and ", k.scalar_type());
    check.require(options.positive_offset() >= 0 && options.positive_offset() + q.size(0) <= k.size(0),
                  "argument 'positive_offset' must leave room for every row's positive: need 0 <= ",
                  options.positive_offset(), " and ", options.positive_offset(), " + ", q.size(0),
                  " <= k.size(0) = ", k.size(0));
    check.require(options.masked_offset() < 0 || options.masked_offset() + q.size(0) <= k.size(0),
                  "argument 'masked_offset' must leave room for every row's masked column: ",
                  options.masked_offset(), " + ", q.size(0), " > k.size(0) = ", k.size(0));
    check.require(options.masked_offset() < 0 || options.masked_offset() != options.positive_offset(),
                  "argument 'masked_offset' must differ from 'positive_offset' (a row's positive cannot be masked)");
  }
  check.scalar(scale, "scale");
  if (bias.has_value()) check.scalar(*bias, "bias");
  detail::check_memory_path(check, options.memory());
  check.require(options.path() != MemoryPath::kMaterialised,
                "argument 'path' must be kAuto or kTiled (the InfoNCE core walks tiles), but got kMaterialised");
  const auto& comm = options.comm();
  const bool ring = comm && comm->world_size() > 1;
  std::vector<int64_t> counts;  // key rows of every rank
  if (ring) {
    counts = detail::exchange_row_counts(check.error().empty() ? k : torch::Tensor(), comm, caller, "k",
                                         check.error());
  } else {
    check.throw_if_failed();
    counts = {k.size(0)};
  }
  // The engine's one-directional block with per-row losses (kNone) over the
  // key blocks, always tiled and on the ring when W > 1: its layout counts key
  // rows, so this rank's own block starts at column `offset`, and row i's
  // designated positive is column offset + i once the offset is moved by
  // positive_offset.
  auto p = detail::make_prologue(caller, comm, std::move(counts), q,
                                 MemoryPathOptions(options.memory()).path(MemoryPath::kTiled).ring(true), 1);
  detail::BlockSpec spec;
  spec.reduction = Reduction::kNone;
  if (options.masked_offset() >= 0) spec.masked = p.layout.offset + options.masked_offset();
  p.layout.offset += options.positive_offset();
  return detail::clip_block_loss(q.to(p.operand), k.to(p.operand), scale.to(p.dtype),
                                 bias.has_value() ? bias->to(p.dtype) : torch::Tensor(), p, spec);
}

}  // namespace contrax
