// What this machine lets a subcommand's flags ask for: processes and
// intra-op threads as a multiple of its cores (--force allows more
// processes), and a usable GPU, one per rank, for `--device cuda`. Each
// refusal is a UsageError (cli.h) that names the flag.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

#include "cli/cli.h"

namespace contrax::cli {

/// Why `--device cuda` cannot run here, or "" when it can.
std::string cuda_unavailable_reason();

/// The checks of `--device cuda` before any process starts (UsageError): a
/// usable GPU when `device` is "cuda"; and when `one_gpu_per_rank` names why
/// each rank needs a GPU of its own (NCCL: "flag '--backend' is 'nccl'"), at
/// most one of the `nproc` processes per GPU, `hint` ending that message.
void check_cuda_device(const std::string& device, int64_t nproc, const std::string& one_gpu_per_rank = "",
                       const std::string& hint = "");

/// Processes or threads a flag may ask for without --force: a small multiple of
/// the cores (oversubscribing more than that only thrashes, and a typo such as
/// --nproc 1000 would fork a thousand processes).
int64_t max_procs();
constexpr int64_t kMaxProcsPerCore = 8;

/// `--force`, and its check: UsageError "flag 'FLAG' must be <= N (K per core;
/// --force allows more), but got n" unless `force` or `n` <= max_procs().
CLI::Option* add_force(CLI::App& app, bool& force);
void check_procs(const std::string& flag, int64_t n, bool force);

/// Intra-op threads per process that not even --force allows: a multiple of
/// the cores. OpenMP starts its whole team at the first parallel region and
/// cannot fail politely: `--force --threads 100000` hung silently (and ignored
/// SIGTERM) while the kernel created the threads.
int64_t max_threads();
constexpr int64_t kMaxThreadsPerCore = 64;

}  // namespace contrax::cli
