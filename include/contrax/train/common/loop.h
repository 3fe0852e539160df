// The training loop every recipe of `contrax train` shares. A recipe
// (image/trainer.h, retrieval/trainer.h) builds its model, says what a
// checkpoint holds and gives the loop one step's forward and backward; the rest
// is the loop's, the same for every recipe:
//
//   * the data order: a ShardedSampler over the recipe's examples, each rank
//     taking its contiguous slice of every global batch. The short last batch
//     of an epoch is kept, even with fewer rows than ranks: a rank with an
//     empty slice still takes part in every collective of the step and
//     contributes a zero loss and zero gradients, exactly its share;
//   * AdamW, with a linear warm-up and a cosine decay of the learning rate;
//   * stopping together: at every step boundary the ranks agree (one
//     all-reduce) whether any of them was asked to stop (`stop_requested`,
//     `stop_at_step`, a failed write), and all stop after a checkpoint;
//   * RUN_DIR/checkpoint.pt (run_dir.h) every `checkpoint_every` steps, at the end and when
//     stopped; `resume` checks that the checkpoint belongs to this run, loads
//     it on every rank and continues at its step on the same loss curve;
//   * rank 0's record, RUN_DIR/metrics.jsonl (metrics.h) and the progress
//     line, behind a latch: a failed write (a full disk) stops the run at the
//     next step boundary with a checkpoint, then reports the cause;
//   * the non-finite guard: a step whose global loss or any gradient is not
//     finite is never applied; the run stops with an error naming the step
//     (the last checkpoint is kept), unless `skip_nonfinite` allows skipping
//     that many such steps.
//
// A new recipe costs its model, its data and a `Step`:
//
//   TrainLoop loop(comm, options.run(), {"my-recipe", data.size(), {{"model", model.get()}}, model->parameters()});
//   auto dp = std::make_shared<DataParallel>(model, comm);  // after the loop has loaded a checkpoint
//   Step step;
//   step.loss = [&](const StepBatch& b) { ... forward, loss, backward (through dp) ...; return loss; };
//   RunResult r = loop.run(step);
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "contrax/comm/communicator.h"
#include "contrax/train/common/checkpoint.h"
#include "contrax/train/common/metrics.h"
#include "contrax/train/common/run_dir.h"
#include "contrax/train/common/sampler.h"
#include "contrax/train/common/schedule.h"

namespace contrax::train {

/// Where a run stands after a step: what a live display shows (rank 0, every
/// step, through `RunOptions::on_step`).
struct StepProgress {
  int64_t step = 0;             ///< steps done, from 1
  int64_t total_steps = 0;      ///< the schedule's length
  int64_t epoch = 0;            ///< from 1
  int64_t epochs = 0;           ///< epochs the schedule spans
  int64_t step_in_epoch = 0;    ///< from 1
  int64_t steps_per_epoch = 0;  ///< steps of one epoch (the last may be short)
  double loss = 0;              ///< the step's global loss
  double examples_per_s = 0;    ///< of the last step
  std::string rate_unit;        ///< what the examples are ("img", "queries")
  double elapsed_s = 0;         ///< since the run (or its resume) began
  double eta_s = 0;             ///< at the rate so far
};

/// A duration as the progress line writes it: "1h02m03s", "4m05s", "6s";
/// "?" when negative, not a number or beyond 10^7 s.
std::string format_duration(double seconds);

/// `v` without a NaN's sign bit: streams print a negative NaN (what an
/// overflowing loss gives) as "-nan", which reads like a negative number.
double plain_nan(double v);

/// The options of a run that every recipe shares, nested in each recipe's
/// options (`TrainOptions::run()`, `RetrievalOptions::run()`), which set
/// their own defaults for the schedule's length, the batch and AdamW.
///
///   auto o = contrax::train::TrainOptions();
///   o.run().epochs(2).run_dir("runs/a");
struct RunOptions {
  /// Epochs over the training set (used when max_steps <= 0).
  TORCH_ARG(int64_t, epochs) = 1;
  /// > 0: the run is this many steps (the schedule's length).
  TORCH_ARG(int64_t, max_steps) = -1;
  /// >= 0: stop (as if interrupted, with a checkpoint) once this global step
  /// is reached, without changing the schedule. For resume tests.
  TORCH_ARG(int64_t, stop_at_step) = -1;
  /// Global batch size (all ranks together).
  TORCH_ARG(int64_t, batch_size) = 256;
  /// Peak learning rate of AdamW.
  TORCH_ARG(double, lr) = 1e-3;
  /// AdamW's decoupled weight decay.
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// Linear warm-up steps before the cosine decay to 0.
  TORCH_ARG(int64_t, warmup_steps) = 20;
  /// Seed of the model, the data order and the recipe's randomness.
  TORCH_ARG(uint64_t, seed) = 0;
  /// kFloat or kDouble (exactness tests).
  TORCH_ARG(torch::Dtype, dtype) = torch::kFloat;
  /// Empty: no metrics or checkpoints written.
  TORCH_ARG(std::string, run_dir) = "";
  /// Checkpoint every K steps (0: only at the end / when stopped).
  TORCH_ARG(int64_t, checkpoint_every) = 200;
  /// Load run_dir/checkpoint.pt first and continue from it.
  TORCH_ARG(bool, resume) = false;
  /// With `resume`: a checkpoint of the earlier format (a TorchScript
  /// archive, whose reading runs the code it holds) is read and rewritten
  /// as safetensors instead of refused. Only for a checkpoint you wrote.
  TORCH_ARG(bool, trust_legacy_checkpoint) = false;
  /// Progress line on rank 0 every this many steps (0: never).
  TORCH_ARG(int64_t, log_every) = 10;
  /// Progress lines go to stderr instead of stdout (keeps a caller's JSON on stdout clean).
  TORCH_ARG(bool, progress_to_stderr) = false;
  /// Set: rank 0's progress lines go here instead (the tool copies them to
  /// the console and RUN_DIR/train.log).
  TORCH_ARG(std::function<void(const std::string&)>, log) = nullptr;
  /// Set: called on rank 0 after every step, whatever `log_every` (the
  /// tool's progress bar on a terminal).
  TORCH_ARG(std::function<void(const StepProgress&)>, on_step) = nullptr;
  /// Set: told at once, on the rank that saw it, when a write of the run's
  /// record fails ("cannot write RUN_DIR/metrics.jsonl: ...; stopping at the
  /// next step boundary"); the run then stops with a kRecordLost error.
  /// Unset: the line goes to stderr.
  TORCH_ARG(std::function<void(const std::string&)>, on_record_error) = nullptr;
  /// Steps with a non-finite loss or gradient that may be skipped (not
  /// applied) before training stops with an error. 0: the first one stops it.
  TORCH_ARG(int64_t, skip_nonfinite) = 0;
  /// Polled at every step boundary on every rank; when any rank sees true,
  /// all ranks stop together after a checkpoint.
  TORCH_ARG(std::function<bool()>, stop_requested) = nullptr;
};

/// What a run returns (identical on every rank except where noted); each
/// recipe's result extends it with its trained model.
struct RunResult {
  int64_t start_step = 0;      ///< step the run (re)started at
  int64_t steps = 0;           ///< global step reached (`total_steps` when the run finished)
  int64_t total_steps = 0;     ///< the schedule's length in steps
  int64_t epochs_done = 0;     ///< epoch of the last step, plus 1
  bool interrupted = false;    ///< stopped early (a signal or `stop_at_step`)
  double train_s = 0;          ///< wall time of the loop, in seconds
  double examples_per_s = 0;   ///< global examples per second over the steps run here
  std::vector<double> losses;  ///< global mean loss of each step run here
  int64_t skipped_steps = 0;   ///< steps not applied because the loss or a gradient was not finite
  int64_t bytes_sent = 0;      ///< bytes this rank sent in the steps run here (differs by rank)
};

/// A setting of a recipe, besides the loop's own, that its checkpoints record
/// and a resumed run must share (the retrieval recipe's hard negatives).
struct RunSetting {
  std::string key;    ///< name of the setting among the checkpoint's integers
  int64_t value = 0;  ///< its value in this run
  std::string what;   ///< how a refusal names it ("hard negatives")
};

/// A recipe's model as the loop trains and checkpoints it.
struct LoopModel {
  std::string recipe;        ///< recorded in checkpoints; a checkpoint of another recipe is refused
  int64_t dataset_size = 0;  ///< examples the sampler draws the global batches from
  /// What a checkpoint holds, by name (registered by reference, not owned).
  std::vector<std::pair<std::string, torch::nn::Module*>> modules;
  std::vector<torch::Tensor> parameters;   ///< what AdamW trains and the non-finite guard checks
  std::vector<RunSetting> settings;        ///< settings a resumed run must share with its checkpoint
  std::map<std::string, double> recorded;  ///< recorded in checkpoints, never checked (the lr is added)
};

/// One step's share of this rank, as the sampler gives it.
struct StepBatch {
  int64_t step = 0;           ///< global step, from 0
  int64_t epoch = 0;          ///< from 0
  int64_t step_in_epoch = 0;  ///< from 0
  torch::Tensor indices;      ///< this rank's examples of the step: int64 [b_r], possibly empty
};

/// What a recipe does in a step.
struct Step {
  /// Forward, loss and backward on this rank's examples, the gradients
  /// averaged over ranks (DataParallel); returns this rank's loss L_r with
  /// (1/W) sum_r L_r the global loss. The optimizer step is the loop's, so
  /// that a non-finite step is refused before it is applied.
  std::function<torch::Tensor(const StepBatch&)> loss;
  /// Called after each applied update (MoCo v3's momentum encoder); optional.
  std::function<void(int64_t step, int64_t total_steps)> after_update;
  std::function<std::string()> progress;  ///< more of the progress line, after the loss ("  scale 14.3"); optional
  std::string rate_unit = "ex";           ///< what the progress line's rate counts: "ex" (examples), "q" (queries)
};

/// The name of the DataParallel reducer's all-reduce, which runs inside backward
/// outside the Communicator's calls, for its failures to be named and not raw
/// Gloo: `with_collective_context(*comm, kReducerAllReduce, ...)`.
inline constexpr const char* kReducerAllReduce = "gradient all_reduce (DataParallel, in backward)";

/// The checks of `options` every recipe shares; `prefix` starts each message
/// (a recipe's name, or nothing). TrainLoop calls it; a recipe calls it first
/// to refuse bad options before it builds anything.
void check_run_options(const RunOptions& options, const std::string& prefix = "");

/// Steps per run: max_steps when > 0, else epochs x steps per epoch of
/// `dataset_size` examples. Throws (naming the option) when that product
/// overflows or exceeds 2^40 steps.
int64_t total_steps(const RunOptions& options, int64_t dataset_size);

/// The loop, collectively on every rank of a communicator (null: world 1).
///
///   contrax::train::TrainLoop loop(comm, options, model);
///   contrax::train::RunResult r = loop.run(step);
class TrainLoop {
 public:
  /// Checks the options, builds the optimizer and the schedule, and with
  /// `resume` checks and loads the checkpoint into the model's modules: a
  /// recipe wraps them in DataParallel afterwards.
  TrainLoop(CommunicatorPtr comm, const RunOptions& options, LoopModel model);
  C10_DISABLE_COPY_AND_ASSIGN(TrainLoop);
  ~TrainLoop();

  /// Runs from the start step to the end of the schedule or a stop, then
  /// writes the last checkpoint (all ranks wait until it is on disk).
  RunResult run(const Step& step);

  /// Step the run starts at (0, or the checkpoint's step when resuming).
  int64_t start_step() const { return start_; }
  /// The schedule's length in steps.
  int64_t total_steps() const { return total_; }

 private:
  struct Row;
  void check_resumable(const std::string& file, bool legacy) const;
  void save(int64_t step);
  bool stop_agreed(int64_t step);
  void checked(const std::function<void()>& write);
  void record(const Row& row, const Step& step);
  [[noreturn]] void diverged(const Row& row) const;
  [[noreturn]] void out_of_memory(const Row& row, const std::string& what) const;
  void finish(RunResult& result, int64_t step, int64_t examples, double elapsed, int64_t bytes0);

  CommunicatorPtr comm_;
  RunOptions options_;
  LoopModel model_;
  int64_t total_ = 0;
  int64_t start_ = 0;
  ShardedSampler sampler_;
  torch::optim::AdamW optimizer_;
  WarmupCosineOptions schedule_;
  RunDir run_dir_;  // empty: nothing written
  Checkpoint checkpoint_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::string write_error_;  // the first failed write of the record, if any
};

}  // namespace contrax::train
