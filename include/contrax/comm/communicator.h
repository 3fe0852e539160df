// The communicator: everything distributed in Contrax (gathers, ring exchanges,
// the data-parallel reducer) talks to it, never to a c10d `ProcessGroup`, so a
// moved c10d API means adapting src/comm/ only. At world size 1 it holds no
// process group and every collective is a local no-op: the losses become plain
// single-device losses. Every collective records the bytes this rank sends
// (`CommStats`), so benchmarks can report communication volume.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// expand_slurm_nodelist moved to contrax/comm/slurm.h; included here for one
// release, for code that found it in this header.
#include "contrax/comm/slurm.h"

namespace contrax {

/// How a ring step (`Communicator::ring_exchange`) moves a block from each
/// rank to its neighbour.
enum class RingTransport {
  /// kAllToAll under NCCL, kSendRecv under every other backend.
  kAuto,
  /// A send to the next rank and a receive from the previous one: two
  /// point-to-point operations, what Gloo serves best.
  kSendRecv,
  /// One all-to-all on the main communicator with only the two neighbours'
  /// splits non-zero. Under NCCL each send/receive pair would open its own
  /// two-rank communicator, and at W >= 3 every rank would block setting up
  /// the link its neighbour is setting up too; the all-to-all is one
  /// collective that every rank issues in the same order.
  kAllToAll,
};

/// Options for building a communicator explicitly.
///
/// Defaults: rank 0 of a world of 1, rendezvous over TCP at 127.0.0.1:29500
/// (or over a shared file when `file_store` is set), backend chosen from the
/// device, 5-minute timeout.
///
///   auto comm = contrax::Communicator::create(
///       contrax::CommunicatorOptions().rank(1).world_size(4).master_port(29511));
struct CommunicatorOptions {
  /// This process's rank in [0, world_size).
  TORCH_ARG(int64_t, rank) = 0;
  /// Number of ranks. 1 means no process group at all.
  TORCH_ARG(int64_t, world_size) = 1;
  /// Host of the rank-0 TCP store (torchrun's MASTER_ADDR).
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// Port of the rank-0 TCP store (torchrun's MASTER_PORT).
  TORCH_ARG(int64_t, master_port) = 29500;
  /// When non-empty, rendezvous through this file instead of TCP (one machine
  /// or a shared filesystem; the thread-rank tests).
  TORCH_ARG(std::string, file_store) = "";
  /// The TCP store at master_addr:master_port is served by another process
  /// (torchrun's elastic agent): every rank, rank 0 too, connects as a client.
  TORCH_ARG(bool, external_store) = false;
  /// Prefix of every key written to the store, so that runs sharing one store
  /// (torchrun's restarts of a job) never read each other's keys.
  TORCH_ARG(std::string, store_prefix) = "";
  /// A secret every rank of the job shares (from_env: CONTRAX_JOB_SECRET,
  /// which `contrax launch` and `contrax train` make for a one-node job).
  /// Every key of the rendezvous store lives under a prefix derived from it,
  /// so that a process without it can neither read the job's keys, nor stop
  /// the job, nor join it as a rank. Empty: keys are c10d's plain names,
  /// open to anyone who can reach the store (docs/reliability.md).
  TORCH_ARG(std::string, job_secret) = "";
  /// "auto" (NCCL for CUDA `device`, Gloo otherwise), "gloo", "nccl" or "mpi".
  TORCH_ARG(std::string, backend) = "auto";
  /// The device the collectives will see tensors on; picks the "auto" backend.
  TORCH_ARG(torch::Device, device) = torch::kCPU;
  /// How long any collective or the rendezvous may wait for a peer.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);
  /// How ring steps move their blocks (see RingTransport).
  TORCH_ARG(RingTransport, ring_transport) = RingTransport::kAuto;
  /// A promise that every rank passes tensors of the same shape, dtype and
  /// device type to every loss and gather (see Communicator::static_shapes).
  TORCH_ARG(bool, static_shapes) = false;
};

/// What one kind of collective has cost this rank so far.
///
/// `bytes_sent` is what this rank sends under a bandwidth-optimal algorithm:
/// all-gather of `n_r` bytes per rank, `(W-1) * n_r`; reduce-scatter of `n`
/// bytes, `n - n_r` (all but its own slice); all-reduce of `n` bytes,
/// `2 (W-1)/W * n` (ring); point-to-point sends, their payload.
struct OpStats {
  int64_t calls = 0;       ///< how many times the operation ran
  int64_t bytes_sent = 0;  ///< bytes this rank sent (see above)
};

/// Per-collective statistics keyed by operation name ("all_gather",
/// "reduce_scatter", "all_reduce", "all_to_all", "send", "broadcast",
/// "metadata", ...).
struct CommStats {
  std::map<std::string, OpStats> ops;  ///< the statistics of each operation, keyed by its name
  /// Sum of `bytes_sent` over all operations.
  int64_t total_bytes_sent() const;
  /// Sum of `calls` over all operations.
  int64_t total_calls() const;
  /// Statistics of one operation (zeros when it never ran).
  OpStats op(const std::string& name) const;
};

namespace detail {
struct CommunicatorImpl;
}  // namespace detail

/// A rank's handle on a group of processes.
///
/// All collectives block and must be called by every rank in the same order
/// (as with c10d). Tensors stay on the caller's device; under NCCL, which moves
/// CUDA tensors only, a CPU tensor (row counts, a stop flag) is staged through
/// the rank's GPU (`device()`) and its result copied back.
///
/// A CUDA `device` in the options is bound to the rank: `cuda:k` as given;
/// `cuda` without an index becomes `cuda:(LOCAL_RANK mod #GPUs)` under
/// `from_env`, and is refused by `create` for one of several ranks (whose
/// local rank it cannot know). The bound device is made current, so that c10d's
/// "current device" is the rank's own GPU.
class Communicator {
 public:
  /// Builds a communicator from explicit options. World size 1 builds nothing.
  static std::shared_ptr<Communicator> create(const CommunicatorOptions& options);

  /// Builds a communicator from torchrun's environment (`RANK`, `WORLD_SIZE`,
  /// `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); without `WORLD_SIZE`, a world
  /// of 1. `base`'s other fields (timeout, backend, device) are kept; a `cuda`
  /// device without an index is bound to `cuda:(LOCAL_RANK mod #GPUs)`, and
  /// under NCCL more ranks on a machine (`LOCAL_WORLD_SIZE`) than GPUs is refused.
  ///
  /// Under SLURM (`srun`) without `WORLD_SIZE`: `SLURM_NTASKS`, `SLURM_PROCID`
  /// and `SLURM_LOCALID` give world size, rank and local rank; MASTER_ADDR
  /// defaults to the first host of `SLURM_JOB_NODELIST` (`node[01-04,07]`
  /// expanded) and MASTER_PORT to 29500 + (SLURM_JOB_ID mod 1000), so that two
  /// jobs sharing a node do not collide.
  ///
  /// Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) every rank connects
  /// to the agent's store, with its keys under
  /// `contrax/attempt_<TORCHELASTIC_RESTART_COUNT>/`, as PyTorch's `env://` does.
  ///
  /// Otherwise rank 0 serves the store, listening on MASTER_ADDR only (never on
  /// every interface; a warning when that is beyond loopback). Within
  /// `timeout` a missing rank, a WORLD_SIZE that differs between ranks, a
  /// rank started twice or an unresolvable MASTER_ADDR each end in an error
  /// saying so. CONTRAX_JOB_SECRET, when set, is the `job_secret`.
  static std::shared_ptr<Communicator> from_env(
      const CommunicatorOptions& base = CommunicatorOptions());

  /// A world of size 1: no process group, every collective a local no-op.
  static std::shared_ptr<Communicator> single();

  ~Communicator();
  C10_DISABLE_COPY_AND_ASSIGN(Communicator);

  /// This process's rank, in [0, world_size()).
  int64_t rank() const;
  /// The device this rank is bound to: the options' device with a CUDA
  /// index resolved (see the class comment); the CPU for `single()`.
  torch::Device device() const;
  /// The number of ranks in the group.
  int64_t world_size() const;
  /// `LOCAL_RANK` when built from the environment, otherwise `rank()`.
  int64_t local_rank() const;
  /// Name of the c10d backend ("gloo", "nccl", "mpi"), or "none" for world 1.
  std::string backend() const;
  /// How long a collective waits for a peer before failing (the options' `timeout`).
  std::chrono::milliseconds timeout() const;

  /// Static shapes: every rank promises the same shape, dtype and device type
  /// to every loss and gather, so the per-call metadata exchange (one small
  /// all-gather of row counts and arguments; under NCCL a host synchronisation)
  /// is skipped and each rank takes its own row count for all. The price: an
  /// invalid argument is raised only on the rank that passed it, and the others
  /// wait in their next collective until `timeout()`; differing shapes give
  /// results as undefined as c10d's own (uneven batches need this off, the
  /// default). `set_static_shapes` changes it between calls, on every rank alike.
  bool static_shapes() const;
  /// Turns static shapes on or off (see static_shapes()).
  void set_static_shapes(bool on);

  // ---- collectives (no autograd; see collectives.h for the differentiable ones)

  /// All-gathers rows: `local` is `[b_r, ...]` on every rank, `counts[s]` is rank
  /// s's row count (known to all ranks), result is `[sum(counts), ...]` in rank
  /// order. Even counts use a native all-gather; uneven ones an all-to-all with
  /// per-rank splits (never padding), so the volume is exact either way.
  torch::Tensor all_gather_rows(const torch::Tensor& local,
                                const std::vector<int64_t>& counts,
                                const std::string& stat_name = "all_gather");

  /// Reduce-scatter with SUM over rows: `full` is `[sum(counts), ...]` on every
  /// rank; returns this rank's `[counts[rank], ...]` slice of the sum over ranks.
  /// Native reduce-scatter where the backend has it and counts are even;
  /// otherwise all-to-all plus a local sum (Gloo) — reduce-scatter's volume.
  torch::Tensor reduce_scatter_rows(const torch::Tensor& full,
                                    const std::vector<int64_t>& counts,
                                    const std::string& stat_name = "reduce_scatter");

  /// In-place all-reduce with SUM.
  void all_reduce_sum(torch::Tensor& tensor, const std::string& stat_name = "all_reduce");

  /// All-gathers one int64 vector of the same length from every rank:
  /// result[s] is rank s's vector (sizes, and the agreement checked before a
  /// collective whose mismatch would hang). `via`, a CUDA device, is where the
  /// values travel under NCCL (the caller's tensors' device); by default the
  /// bound device.
  std::vector<std::vector<int64_t>> all_gather_ints(const std::vector<int64_t>& values,
                                                    const std::string& stat_name = "metadata",
                                                    const c10::optional<torch::Device>& via = c10::nullopt);

  /// Broadcasts `tensor` in place from `root`.
  void broadcast(torch::Tensor& tensor, int64_t root = 0,
                 const std::string& stat_name = "broadcast");

  /// Sends `send` to rank `(rank + shift) mod W` and receives, into a new
  /// tensor of `recv_shape`, what rank `(rank - shift) mod W` sent. The two
  /// transfers run concurrently. Building block of the ring losses.
  torch::Tensor ring_exchange(const torch::Tensor& send, at::IntArrayRef recv_shape,
                              int64_t shift = 1, const std::string& stat_name = "ring");

  /// The handle of a started `ring_exchange`, to overlap it with compute.
  class Pending {
   public:
    Pending() = default;
    /// Waits for the exchange to finish and returns the received tensor.
    torch::Tensor wait();
    /// Whether the handle refers to a started exchange (false when default-constructed).
    bool valid() const { return static_cast<bool>(state_); }

   private:
    friend class Communicator;
    struct State;
    std::shared_ptr<State> state_;
  };
  /// Starts ring_exchange()'s two transfers; the handle's `wait()` gives the received tensor.
  Pending ring_exchange_async(const torch::Tensor& send, at::IntArrayRef recv_shape,
                              int64_t shift = 1, const std::string& stat_name = "ring");

  /// Blocks until every rank arrives (or the timeout passes).
  void barrier();

  /// Statistics since construction or the last `reset_stats()`.
  CommStats stats() const;
  /// Sets every statistic back to zero.
  void reset_stats();
  /// Adds to the statistics, for code on the process group itself (the reducer).
  void record(const std::string& name, int64_t bytes_sent, int64_t calls = 1);

  /// The implementation (c10d types; see contrax/comm/detail/c10d.h).
  detail::CommunicatorImpl& impl() const { return *impl_; }

 private:
  explicit Communicator(std::unique_ptr<detail::CommunicatorImpl> impl);
  std::unique_ptr<detail::CommunicatorImpl> impl_;
  mutable std::mutex stats_mutex_;
  CommStats stats_;
  int64_t ring_tag_ = 0;  // matching send/recv tags: all ranks exchange in the same order
};

using CommunicatorPtr = std::shared_ptr<Communicator>;

/// Where Gloo's sockets bind for MASTER_ADDR `master_addr`, in words, with the
/// reason, as the communicator decides it (`contrax env`): e.g. "10.0.0.2
/// (eth0): the route to MASTER_ADDR 10.0.0.1", "interface eth1: GLOO_SOCKET_IFNAME";
/// with no route, the host name's address.
std::string gloo_binding(const std::string& master_addr);

}  // namespace contrax
