// Differentiable and plain row gathers over a Communicator, with the
// cross-rank agreement check that keeps a bad argument on one rank from
// hanging the others.
#include "contrax/comm/collectives.h"

#include <torch/csrc/autograd/custom_function.h>

#include <sstream>

#include "comm/comm_capsule.h"

namespace contrax {

int64_t Gathered::total() const {
  int64_t n = 0;
  for (auto c : counts) n += c;
  return n;
}

namespace detail {

namespace {
// Metadata layout exchanged before any data collective.
constexpr int64_t kMaxTrailingDims = 6;
enum Field : int64_t {
  kError = 0,
  kRows,
  kDim,
  kDtype,
  kDevice,
  kExtra,  // a caller's integer riding along (grouped_loss: candidates per query)
  kTrailing,
  kFields = kTrailing + kMaxTrailingDims
};

std::string metadata_shape(const std::vector<int64_t>& m) {
  std::ostringstream os;
  os << "[b";
  for (int64_t i = 1; i < m[kDim]; ++i) os << ", " << m[kTrailing + i - 1];
  os << "]";
  return os.str();
}
}  // namespace

std::vector<int64_t> exchange_row_counts(const torch::Tensor& local, const CommunicatorPtr& comm, const char* caller,
                                         const char* arg, const std::string& local_error) {
  return exchange_row_counts(local, comm, caller, arg, local_error, 0, nullptr);
}

std::vector<int64_t> exchange_row_counts(const torch::Tensor& local, const CommunicatorPtr& comm, const char* caller,
                                         const char* arg, const std::string& local_error, int64_t extra,
                                         std::vector<int64_t>* extras) {
  std::string error = local_error;
  if (error.empty() && !local.defined()) error = c10::str(caller, "(): argument '", arg, "' is undefined");
  if (error.empty() && local.dim() < 1) {
    error = c10::str(caller, "(): argument '", arg, "' must have at least 1 dimension (rows), but got a 0-dim tensor");
  }
  if (error.empty() && local.dim() - 1 > kMaxTrailingDims) {
    error = c10::str(caller, "(): argument '", arg, "' has ", local.dim(), " dimensions; at most ",
                     kMaxTrailingDims + 1, " are supported");
  }
  const bool distributed = comm && comm->world_size() > 1;
  if (!distributed) {
    TORCH_CHECK(error.empty(), error);
    if (extras) *extras = {extra};
    return {local.size(0)};
  }
  if (comm->static_shapes()) {
    // The promise of equal shapes stands for the exchange: nothing is sent,
    // and an error is this rank's alone (the others learn of it only when
    // their next collective times out).
    TORCH_CHECK(error.empty(), error, " (static shapes: no other rank was told; they wait in their next collective "
                "until the communicator's timeout)");
    if (extras) extras->assign(comm->world_size(), extra);
    return std::vector<int64_t>(comm->world_size(), local.size(0));
  }
  std::vector<int64_t> meta(kFields, 0);
  if (!error.empty()) {
    meta[kError] = 1;
  } else {
    meta[kRows] = local.size(0);
    meta[kDim] = local.dim();
    meta[kDtype] = static_cast<int64_t>(local.scalar_type());
    meta[kDevice] = static_cast<int64_t>(local.device().type());
    meta[kExtra] = extra;
    for (int64_t i = 1; i < local.dim(); ++i) meta[kTrailing + i - 1] = local.size(i);
  }
  // Under NCCL the table travels through the GPU the features are on.
  const bool on_gpu = local.defined() && local.is_cuda();
  auto all = comm->all_gather_ints(meta, "metadata", on_gpu ? c10::optional<torch::Device>(local.device()) : c10::nullopt);
  // Every rank sees the same table, so every rank raises (the same) error.
  TORCH_CHECK(error.empty(), error);
  const int64_t W = comm->world_size();
  for (int64_t s = 0; s < W; ++s) {
    TORCH_CHECK(all[s][kError] == 0, caller, "(): rank ", s, " passed an invalid argument (its own error says which); ",
                "no data was exchanged");
  }
  std::vector<int64_t> counts(W);
  const auto& ref = all[0];
  for (int64_t s = 0; s < W; ++s) {
    const auto& m = all[s];
    bool same_shape = m[kDim] == ref[kDim];
    for (int64_t i = kTrailing; i < kFields && same_shape; ++i) same_shape = m[i] == ref[i];
    TORCH_CHECK(same_shape, caller, "(): argument '", arg, "' must have the same trailing shape on every rank, but it is ",
                metadata_shape(m), " on rank ", s, " and ", metadata_shape(ref), " on rank 0");
    TORCH_CHECK(m[kDtype] == ref[kDtype], caller, "(): argument '", arg,
                "' must have the same dtype on every rank, but it is ", c10::ScalarType(m[kDtype]), " on rank ", s,
                " and ", c10::ScalarType(ref[kDtype]), " on rank 0");
    TORCH_CHECK(m[kDevice] == ref[kDevice], caller, "(): argument '", arg,
                "' must be on the same device type on every rank, but it is on ", c10::DeviceType(m[kDevice]),
                " on rank ", s, " and on ", c10::DeviceType(ref[kDevice]), " on rank 0");
    counts[s] = m[kRows];
  }
  if (extras) {
    extras->resize(W);
    for (int64_t s = 0; s < W; ++s) (*extras)[s] = all[s][kExtra];
  }
  return counts;
}

std::vector<int64_t> exchange_row_counts(const torch::Tensor& local, const CommunicatorPtr& comm, const char* caller,
                                         const char* arg) {
  return exchange_row_counts(local, comm, caller, arg, std::string());
}

}  // namespace detail

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;


struct GatherRowsFunction : public torch::autograd::Function<GatherRowsFunction> {
  // local: [b_r, ...]  ->  [B, ...]
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& local, const CommunicatorPtr& comm,
                               const std::vector<int64_t>& counts) {
    ctx->saved_data["comm"] = detail::comm_capsule(comm);
    ctx->saved_data["counts"] = counts;
    auto out = comm->all_gather_rows(local.detach(), counts, "all_gather");
    ctx->saved_data["shape"] = out.sizes().vec();
    ctx->saved_data["zeros_like"] = torch::empty({0}, out.options());
    return out;
  }

  // Output row block s is rank s's input, and every rank's loss may depend on
  // every gathered row. So dL/d(local_r) = sum over ranks q of (grad_q)[rows of r]:
  // a reduce-scatter with SUM of the incoming [B, ...] gradient, each rank
  // keeping its own slice — (W-1)/W of the buffer sent per rank, where an
  // all-reduce followed by slicing would send twice that.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "gather_with_grad(): double backward is not supported (the backward is a collective)");
    auto comm = detail::capsule_comm(ctx->saved_data["comm"]);
    auto counts = ctx->saved_data["counts"].toIntVector();
    auto grad = grads[0];
    if (!grad.defined()) {
      // Our gathered copy fed nothing, but the other ranks' may have: we must
      // still take part in the collective, contributing zeros.
      grad = torch::zeros(ctx->saved_data["shape"].toIntVector(), ctx->saved_data["zeros_like"].toTensor().options());
    }
    return {comm->reduce_scatter_rows(grad, counts, "reduce_scatter"), torch::Tensor(), torch::Tensor()};
  }
};

Gathered make_gathered(torch::Tensor all, std::vector<int64_t> counts, int64_t rank) {
  Gathered g;
  g.all = std::move(all);
  g.counts = std::move(counts);
  for (int64_t s = 0; s < rank; ++s) g.offset += g.counts[s];
  return g;
}

}  // namespace

namespace detail {
torch::Tensor gather_rows_with_grad(const torch::Tensor& local, const CommunicatorPtr& comm,
                                    const std::vector<int64_t>& counts) {
  if (!comm || comm->world_size() == 1) return local;
  return GatherRowsFunction::apply(local, comm, counts);
}
void ring_for_each_block(const CommunicatorPtr& comm, const std::vector<int64_t>& counts,
                         const torch::Tensor& local,
                         const std::function<void(int64_t, const torch::Tensor&)>& visit,
                         const std::string& stat_name) {
  const int64_t W = comm ? comm->world_size() : 1;
  if (W == 1) {
    visit(comm ? comm->rank() : 0, local);
    return;
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W);
  const int64_t r = comm->rank();
  torch::Tensor cur = local;
  for (int64_t t = 0; t < W; ++t) {
    const int64_t owner = (r - t + W) % W;
    Communicator::Pending pending;
    if (t < W - 1) {
      auto shape = cur.sizes().vec();
      shape[0] = counts[(r - t - 1 + W) % W];
      pending = comm->ring_exchange_async(cur, shape, 1, stat_name);
    }
    visit(owner, cur);
    if (pending.valid()) cur = pending.wait();
  }
}

namespace {

// A packed ring message: the partial gradient's bytes, then the block's (if
// any); and one part of a received one, back in its dtype and shape.
torch::Tensor as_bytes(const torch::Tensor& partial, const torch::Tensor& block) {
  auto bytes = [](const torch::Tensor& x) { return x.contiguous().view(-1).view(torch::kUInt8); };
  return block.defined() ? torch::cat({bytes(partial), bytes(block)}, 0) : bytes(partial);
}

torch::Tensor from_bytes(const torch::Tensor& bytes, c10::ScalarType dtype, c10::IntArrayRef shape) {
  return bytes.view(dtype).view(shape);
}

}  // namespace

// Schedule (identical on every rank, so the exchanges match): at step t rank r
// holds the key block of owner r - t. The partial gradient of block o starts
// at rank o + 1, picks up each holder's contribution and, after the visit at
// rank o - 1, makes one last hop home. Step t therefore sends the block in
// hand (t <= W-2, needed by rank+1 at step t+1) and the finished partial of
// the previous step's block (t >= 2); step W sends only that partial.
//
// From step 2 on, the message received at step t brings both the next block
// and the partial of the block visited at step t: the visit's contribution
// is added into that partial in place, and the message leaves as it is at
// step t + 1 (its partial alone once no block goes on). So no message is
// copied, and a rank holds two messages (the one leaving, whose block it
// visits, and the one arriving), the contribution and its own gradient.
//
// A gradient wider than its block (bf16 keys, fp32 gradient sums: the
// engine's reduced operands) travels in its own dtype (`packed`): the message
// is then the partial's bytes followed by the block's (the partial first, so
// that the block's bytes start at a multiple of its element size).
torch::Tensor ring_for_each_block_grad(const CommunicatorPtr& comm, const std::vector<int64_t>& counts,
                                       const torch::Tensor& local,
                                       const std::function<torch::Tensor(int64_t, const torch::Tensor&)>& visit,
                                       const std::string& stat_name) {
  const int64_t W = comm ? comm->world_size() : 1;
  if (W == 1) return visit(comm ? comm->rank() : 0, local);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(counts.size()) == W);
  const int64_t r = comm->rank();
  auto count = [&](int64_t s) { return counts[((s % W) + W) % W]; };
  torch::Tensor cur = local, own, partial;
  torch::Tensor held, held_partial;  // the next message, built in place (undefined: build it)
  auto rows_shape = [&](int64_t rows) {
    auto shape = local.sizes().vec();
    shape[0] = rows;
    return shape;
  };
  int64_t per_row = 1;  // elements per row
  for (int64_t i = 1; i < local.dim(); ++i) per_row *= local.size(i);
  for (int64_t t = 0; t <= W; ++t) {
    const bool send_block = t <= W - 2;
    const bool send_partial = t >= 2;
    const bool packed = send_partial && partial.scalar_type() != local.scalar_type();
    Communicator::Pending pending;
    int64_t recv_block_rows = 0, recv_partial_rows = 0;
    if (send_block || send_partial) {
      // What rank r-1 sends: its block in hand (owner r-1-t) and its partial
      // for owner r-1-(t-1) = r-t, which is the block this rank visits now.
      recv_block_rows = send_block ? count(r - t - 1) : 0;
      recv_partial_rows = send_partial ? count(r - t) : 0;
      torch::Tensor message;
      if (held.defined()) {
        message = send_block ? held : held_partial;
      } else if (packed) {
        message = as_bytes(partial, send_block ? cur : torch::Tensor());
      } else {
        message = send_block && send_partial ? torch::cat({cur, partial}, 0) : send_block ? cur : partial;
      }
      const int64_t n =
          per_row * (recv_partial_rows * (packed ? partial.element_size() : 1) +
                     recv_block_rows * (packed ? local.element_size() : 1));
      pending = comm->ring_exchange_async(message, packed ? std::vector<int64_t>{n}
                                                          : rows_shape(recv_block_rows + recv_partial_rows),
                                          1, stat_name);
    }
    torch::Tensor contribution;
    if (t < W) {
      contribution = visit((r - t + W) % W, cur);
      TORCH_INTERNAL_ASSERT(contribution.sizes() == cur.sizes(), "ring visit returned a gradient of the wrong shape");
    }
    torch::Tensor received, partial_in, partial_part;
    if (pending.valid() && packed) {
      received = pending.wait();  // bytes: [partial ; block]
      const int64_t partial_bytes = received.numel() - per_row * recv_block_rows * local.element_size();
      partial_part = received.narrow(0, 0, partial_bytes);
      partial_in = from_bytes(partial_part, partial.scalar_type(), rows_shape(recv_partial_rows));
      cur = send_block ? from_bytes(received.narrow(0, partial_bytes, received.numel() - partial_bytes),
                                    local.scalar_type(), rows_shape(recv_block_rows))
                       : cur;
    } else if (pending.valid()) {
      received = pending.wait();  // rows: [block ; partial]
      partial_part = partial_in = received.narrow(0, recv_block_rows, recv_partial_rows);
      if (send_block) cur = received.narrow(0, 0, recv_block_rows);
    }
    held = held_partial = torch::Tensor();
    if (t == 0) {
      own = contribution;
    } else if (t == 1) {
      partial = contribution;
    } else if (t < W) {
      partial = partial_in.add_(contribution);  // in the message, which goes on as it is
      held = received, held_partial = partial_part;
    } else {
      own = own + partial_in;
    }
  }
  return own;
}

}  // namespace detail

Gathered gather_with_grad(const torch::Tensor& local, const CommunicatorPtr& comm, const char* caller,
                          const char* arg) {
  auto counts = detail::exchange_row_counts(local, comm, caller, arg);
  if (!comm || comm->world_size() == 1) return make_gathered(local, counts, 0);
  return make_gathered(detail::gather_rows_with_grad(local, comm, counts), counts, comm->rank());
}

Gathered gather_no_grad(const torch::Tensor& local, const CommunicatorPtr& comm, const char* caller,
                        const char* arg) {
  auto counts = detail::exchange_row_counts(local, comm, caller, arg);
  if (!comm || comm->world_size() == 1) return make_gathered(local.detach(), counts, 0);
  torch::NoGradGuard no_grad;
  auto all = comm->all_gather_rows(local.detach(), counts, "all_gather_no_grad");
  return make_gathered(all, counts, comm->rank());
}

}  // namespace contrax
