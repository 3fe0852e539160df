// MaxSim on the tiled walk (engine/maxsim_tiles.h, with the packing, the
// steps and the backward's derivation).
#include "engine/maxsim_tiles.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "engine/maxsim.h"
#include "engine/tiled_blocks.h"

namespace contrax::detail {

namespace {

// Scores steps of the packed queries [b, Lq d] against packed document rows
// [n, Ld d + Ld (+ 1)].
class MaxSimTiles : public TileScorer {
 public:
  MaxSimTiles(torch::Tensor weight, int64_t Lq, int64_t Ld, int64_t width, bool floor)
      : weight_(std::move(weight)), Lq_(Lq), Ld_(Ld), width_(width), floor_(floor) {}

  torch::Tensor logits(const torch::Tensor& q, const torch::Tensor& block, const torch::Tensor& scale, const Tile& t,
                       bool keep) override {
    auto p = panel(q, block, t);
    auto m = maxsim_panel_scores(p, weight_.narrow(0, t.r0, t.rows));  // [R, C]
    if (keep) kept_ = {std::move(p), m};
    return m * scale;
  }

  void backward(const torch::Tensor& G, const torch::Tensor& q, const torch::Tensor& block,
                const torch::Tensor& scale, const Tile& t, torch::Tensor& dq, torch::Tensor& dblock,
                torch::Tensor& ds) override {
    ds.add_((G * kept_.scores).sum());  // dL/ds = sum_ij G_ij M_ij
    torch::Tensor dd;                   // the step's documents' tokens as rows [C Ld, d]
    if (dblock.defined()) dd = torch::zeros({t.cols * Ld_, width_}, dblock.options());
    maxsim_panel_backward(kept_.panel, G * scale, weight_.narrow(0, t.r0, t.rows), queries(q, t), tokens(block, t),
                          dq.narrow(0, t.r0, t.rows).view({t.rows, Lq_, width_}), dd);
    if (dd.defined()) dblock.narrow(0, t.c0, t.cols).narrow(1, 0, Ld_ * width_).add_(dd.view({t.cols, -1}));
    kept_ = {};
  }

 private:
  struct Kept {
    MaxSimPanel panel;
    torch::Tensor scores;  // [R, C] M, before the scale
  };

  torch::Tensor queries(const torch::Tensor& q, const Tile& t) const {
    return q.narrow(0, t.r0, t.rows).view({t.rows, Lq_, width_});
  }
  torch::Tensor tokens(const torch::Tensor& block, const Tile& t) const {
    return block.narrow(0, t.c0, t.cols).narrow(1, 0, Ld_ * width_).view({t.cols, Ld_, width_});
  }
  MaxSimPanel panel(const torch::Tensor& q, const torch::Tensor& block, const Tile& t) const {
    auto rows = block.narrow(0, t.c0, t.cols);
    auto valid = rows.narrow(1, Ld_ * width_, Ld_) > 0.5;
    auto floor = floor_ ? rows.select(1, Ld_ * width_ + Ld_) : torch::empty({0}, rows.options());
    return maxsim_panel(queries(q, t), tokens(block, t), valid, floor);
  }

  torch::Tensor weight_;  // [b, Lq]
  int64_t Lq_, Ld_, width_;
  bool floor_;
  Kept kept_;
};

}  // namespace

int64_t maxsim_pair_bytes(int64_t Lq, int64_t Ld, int64_t width, int64_t element_size) {
  return Lq * std::max(Ld, width) * element_size;
}

torch::Tensor tiled_maxsim_loss(const torch::Tensor& queries, const torch::Tensor& query_weight,
                                const torch::Tensor& documents, const torch::Tensor& document_mask,
                                const torch::Tensor& floor, const torch::Tensor& scale, const Prologue& p,
                                const BlockSpec& spec, int64_t panel_bytes) {
  const int64_t b = queries.size(0), Lq = queries.size(1), n = documents.size(0), Ld = documents.size(1),
                width = documents.size(2);
  std::vector<torch::Tensor> parts{documents.reshape({n, Ld * width}), document_mask.to(documents.scalar_type())};
  if (floor.defined()) parts.push_back(floor.unsqueeze(1));
  auto packed = torch::cat(parts, 1);  // [b g, Ld d + Ld (+ 1)], differentiable in the tokens
  if (!p.ring) packed = gather_rows(packed, p.layout.comm, p.layout.key_counts(spec.group), /*with_grad=*/true);
  auto walk = p.walk;
  walk.panels = false;  // MaxSim's steps are its token panels on every device
  walk.pair_bytes = maxsim_pair_bytes(Lq, Ld, width, documents.element_size());
  walk.budget = panel_bytes;
  auto scorer = std::make_shared<MaxSimTiles>(query_weight, Lq, Ld, width, floor.defined());
  return tiled_clip_block(queries.reshape({b, Lq * width}), packed, scale, torch::Tensor(), p.layout, spec, walk,
                          p.ring, std::move(scorer));
}

}  // namespace contrax::detail
