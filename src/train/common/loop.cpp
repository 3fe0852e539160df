// The training loop of every recipe (see loop.h): the schedule, checkpoints
// and resume, the agreed stop, rank 0's record behind its write latch, and
// the non-finite guard, around a recipe's step.
#include "contrax/train/common/loop.h"

#include "contrax/train/common/errors.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <new>
#include <sstream>

namespace contrax::train {

namespace {

using Clock = std::chrono::steady_clock;

// Longest schedule accepted: far beyond any real run, far below where step
// counters, the sampler's epoch arithmetic or ETA would overflow.
constexpr int64_t kMaxTotalSteps = int64_t{1} << 40;

// How checkpoints record the training dtype.
std::string dtype_name(torch::Dtype d) { return d == torch::kDouble ? "double" : "float"; }

// The sum of every gradient entry of `params`, in fp64: finite exactly when no
// gradient holds a NaN or infinity (up to an overflow of the sum, which is a
// divergence too). One reduction per parameter and no host sync here; the
// caller reads it together with the loss after their all-reduce.
torch::Tensor gradient_sum(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> sums;
  for (const auto& p : params) {
    if (p.grad().defined()) sums.push_back(p.grad().sum(torch::kDouble));
  }
  return sums.empty() ? torch::zeros({}, torch::kDouble) : torch::stack(sums).sum();
}

// A testing aid (docs/reliability.md): CONTRAX_FAULT_EXIT_AT_STEP=<step>[:<rank>]
// makes rank <rank> (default 0) fail just before it runs step <step> (counted
// from 1, as on the console), in a launcher's first attempt only
// (TORCHELASTIC_RESTART_COUNT unset or 0): a restart test sees one failure,
// then a clean run. The failure is an error, so the process exits non-zero
// without writing a checkpoint, as a crash would.
struct Fault {
  int64_t step = -1;  // -1: none
  int64_t rank = 0;
  std::string spec;
};

Fault fault_from_env() {
  const char* v = std::getenv("CONTRAX_FAULT_EXIT_AT_STEP");
  Fault f;
  if (v == nullptr || *v == '\0') return f;
  f.spec = v;
  char* end = nullptr;
  errno = 0;
  const long long step = std::strtoll(v, &end, 10);
  long long rank = 0;
  bool ok = end != v && errno == 0 && step >= 1;
  if (ok && *end == ':') {
    const char* r = end + 1;
    rank = std::strtoll(r, &end, 10);
    ok = end != r && errno == 0 && rank >= 0;
  }
  TORCH_CHECK(ok && *end == '\0', "environment variable 'CONTRAX_FAULT_EXIT_AT_STEP' must be <step>[:<rank>] with ",
              "step >= 1 and rank >= 0, but got '", v, "'");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (restart != nullptr && *restart != '\0' && std::string(restart) != "0") return f;  // a restart: no fault
  f.step = step;
  f.rank = rank;
  return f;
}

// Whether an error is an allocation that failed: c10's OutOfMemoryError (the
// CUDA allocator's), the CPU allocator's "can't allocate memory" (a plain
// c10::Error in most versions) or "not enough memory", or std::bad_alloc.
bool is_allocation_failure(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr || dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return true;
  }
  const std::string what = e.what();
  return what.find("can't allocate memory") != std::string::npos ||
         what.find("not enough memory") != std::string::npos;
}

const RunOptions& checked_options(const RunOptions& o) {
  check_run_options(o);
  return o;
}

}  // namespace

// What rank 0 records of a step.
struct TrainLoop::Row {
  int64_t step = 0;  // from 0
  SamplerPosition pos;
  double loss = 0, lr = 0, elapsed = 0, examples_per_s = 0;
  int64_t bytes_sent = 0;
  bool finite = true;
};

void check_run_options(const RunOptions& o, const std::string& prefix) {
  TORCH_CHECK(o.batch_size() >= 1, prefix, "batch size must be >= 1, but got ", o.batch_size());
  TORCH_CHECK(o.dtype() == torch::kFloat || o.dtype() == torch::kDouble, prefix, "dtype must be float or double");
  TORCH_CHECK(o.skip_nonfinite() >= 0, prefix, "skip_nonfinite must be >= 0, but got ", o.skip_nonfinite());
  TORCH_CHECK(!o.resume() || !o.run_dir().empty(), prefix, "resuming needs a run directory");
}

int64_t total_steps(const RunOptions& o, int64_t dataset_size) {
  if (o.max_steps() > 0) {
    TORCH_CHECK(o.max_steps() <= kMaxTotalSteps, "max_steps must be <= 2^40, but got ", o.max_steps());
    return o.max_steps();
  }
  TORCH_CHECK(o.batch_size() >= 1, "batch size must be >= 1, but got ", o.batch_size());
  // (Not (n + b - 1) / b: that overflows for a batch size near 2^63.)
  const int64_t per_epoch = dataset_size / o.batch_size() + (dataset_size % o.batch_size() != 0);
  const int64_t epochs = std::max<int64_t>(1, o.epochs());
  TORCH_CHECK(epochs <= kMaxTotalSteps / std::max<int64_t>(1, per_epoch), "epochs x steps per epoch (", epochs,
              " x ", per_epoch, ") must be <= 2^40 steps");
  return epochs * per_epoch;
}

TrainLoop::TrainLoop(CommunicatorPtr comm, const RunOptions& options, LoopModel model)
    : comm_(comm ? std::move(comm) : Communicator::single()),
      options_(checked_options(options)),
      model_(std::move(model)),
      total_(train::total_steps(options_, model_.dataset_size)),
      sampler_(model_.dataset_size, ShardedSamplerOptions()
                                        .global_batch_size(options_.batch_size())
                                        .world_size(comm_->world_size())
                                        .seed(options_.seed())),
      optimizer_(model_.parameters, torch::optim::AdamWOptions(options_.lr()).weight_decay(options_.weight_decay())),
      schedule_(WarmupCosineOptions()
                    .base_lr(options_.lr())
                    .warmup_steps(std::min(options_.warmup_steps(), total_))
                    .total_steps(total_)),
      run_dir_(options_.run_dir()) {
  for (const auto& [name, module] : model_.modules) checkpoint_.module(name, *module);
  checkpoint_.optimizer("adamw", optimizer_).generator("cpu", at::detail::getDefaultCPUGenerator());
  // A model on a GPU draws from that GPU's generator too (dropout, random
  // initialisation on the device); optional, so that a run started on the
  // CPU resumes on a GPU.
  std::vector<c10::Device> devices;
  for (const auto& p : model_.parameters) {
    if (!p.device().is_cpu() && std::find(devices.begin(), devices.end(), p.device()) == devices.end()) {
      devices.push_back(p.device());
    }
  }
  for (const auto& d : devices) {
    checkpoint_.optional_generator(d.str(), at::globalContext().defaultGenerator(d));
  }
  if (options_.resume()) {
    const std::string file = run_dir_.checkpoint();
    const bool legacy = options_.trust_legacy_checkpoint() && is_legacy_checkpoint(file);
    check_resumable(file, legacy);
    if (legacy) {
      checkpoint_.load_legacy(file);
      // Every rank has read the old file before rank 0 replaces it.
      comm_->barrier();
      if (comm_->rank() == 0) checkpoint_.save(file);
    } else {
      checkpoint_.load(file);
    }
    start_ = checkpoint_.ints["step"];
  }
}

TrainLoop::~TrainLoop() = default;

// Checks that a checkpoint belongs to this run before loading it: the run's
// settings first (a checkpoint with nothing registered reads only its
// scalars), so that a MoCo checkpoint resumed as SimCLR is told so, not that
// its modules do not match.
void TrainLoop::check_resumable(const std::string& file, bool legacy) const {
  Checkpoint saved;
  if (legacy) {
    saved.load_legacy(file);
  } else {
    saved.load(file);
  }
  const auto& o = options_;
  TORCH_CHECK(saved.strings["recipe"] == model_.recipe, "checkpoint ", file, " is of recipe '",
              saved.strings["recipe"], "', not '", model_.recipe, "'");
  bool same = saved.ints["batch_size"] == o.batch_size() && saved.ints["seed"] == static_cast<int64_t>(o.seed()) &&
              saved.ints["dataset_size"] == model_.dataset_size && saved.ints["total_steps"] == total_;
  std::ostringstream was, is;
  for (const auto& s : model_.settings) {
    same = same && saved.ints[s.key] == s.value;
    was << ", " << saved.ints[s.key] << " " << s.what;
    is << ", " << s.value;
  }
  if (!same) {
    throw TrainError(TrainErrorKind::kCheckpointMismatch,
                     c10::str("checkpoint ", file, " was written by a run with batch size ", saved.ints["batch_size"],
                              ", seed ", saved.ints["seed"], ", ", saved.ints["dataset_size"], " examples, ",
                              saved.ints["total_steps"], " steps", was.str(), "; this run has ", o.batch_size(), ", ",
                              o.seed(), ", ", model_.dataset_size, ", ", total_, is.str()),
                     " (resume with the same settings)");
  }
  // Older checkpoints carry no dtype string; Checkpoint::load still refuses
  // a dtype change by comparing the tensors themselves.
  const std::string want_dtype = dtype_name(o.dtype());
  if (saved.strings.count("dtype") != 0 && saved.strings["dtype"] != want_dtype) {
    throw CheckpointMismatch(file, "dtype", saved.strings["dtype"], want_dtype);
  }
  // The world size is not checked: the model and AdamW's state are the same
  // on every rank, the data order and the augmentations are functions of the
  // global batch, seed, epoch and step (sampler.h, augment.h), and the loss
  // and gradients are those of the global batch at any world size, so a run
  // resumes at any number of processes on the same curve (to rounding).
}

void TrainLoop::save(int64_t step) {
  if (run_dir_.empty() || comm_->rank() != 0) return;
  const auto pos = sampler_.position(step);
  auto& c = checkpoint_;
  c.ints = {{"step", step},
            {"epoch", pos.epoch},
            {"step_in_epoch", pos.step},
            {"batch_size", options_.batch_size()},
            {"seed", static_cast<int64_t>(options_.seed())},
            {"dataset_size", model_.dataset_size},
            {"total_steps", total_},
            {"world_size", comm_->world_size()}};
  for (const auto& s : model_.settings) c.ints[s.key] = s.value;
  c.strings = {{"recipe", model_.recipe}, {"dtype", dtype_name(options_.dtype())}};
  c.doubles = model_.recorded;
  c.doubles["lr"] = options_.lr();
  std::ostringstream meta;
  meta << "{\"recipe\":\"" << model_.recipe << "\",\"step\":" << step << ",\"total_steps\":" << total_ << "}";
  c.metadata = meta.str();
  c.save(run_dir_.checkpoint());
}

double plain_nan(double v) { return std::isnan(v) ? std::fabs(v) : v; }

std::string format_duration(double s) {
  if (!(s >= 0) || s > 1e7) return "?";
  int64_t t = static_cast<int64_t>(s + 0.5);
  std::ostringstream o;
  if (t >= 3600) o << t / 3600 << "h";
  if (t >= 60) o << std::setw(t >= 3600 ? 2 : 1) << std::setfill('0') << (t / 60) % 60 << "m";
  o << std::setw(t >= 60 ? 2 : 1) << std::setfill('0') << t % 60 << "s";
  return o.str();
}

// Agrees on stopping at the step boundary: any rank's request stops all.
bool TrainLoop::stop_agreed(int64_t step) {
  const bool want_stop = (options_.stop_requested() && options_.stop_requested()()) ||
                         (options_.stop_at_step() >= 0 && step >= options_.stop_at_step()) || !write_error_.empty();
  auto flag = torch::full({1}, want_stop ? 1.0 : 0.0, torch::kDouble);
  comm_->all_reduce_sum(flag, "stop_flag");
  return flag.item<double>() > 0;
}

// A failed write of the metrics or the log (a full disk) stops the run at
// the next step boundary, with a checkpoint while one can still be written,
// then reports the cause: never a run that silently loses its record.
void TrainLoop::checked(const std::function<void()>& write) {
  if (!write_error_.empty()) return;
  try {
    write();
  } catch (const std::exception& e) {
    const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
    write_error_ = ce != nullptr ? ce->what_without_backtrace() : e.what();
    // Said at once, never through the log (it may be what failed).
    const std::string line = write_error_ + "; stopping at the next step boundary\n";
    if (options_.on_record_error()) {
      options_.on_record_error()(line);
    } else {
      std::cerr << line << std::flush;
    }
  }
}

// Rank 0's metrics row and progress line of a step.
void TrainLoop::record(const Row& r, const Step& step) {
  const int64_t rows = sampler_.global_batch_rows(r.pos.step);
  if (metrics_) {
    // {step, epoch, step_in_epoch, rows, loss, lr, examples_per_s, elapsed_s, bytes_sent, applied}, from 1.
    const StepMetrics m{r.step + 1, r.pos.epoch + 1, r.pos.step + 1, rows, r.loss, r.lr,
                        r.examples_per_s, r.elapsed, r.bytes_sent, r.finite};
    checked([&] { metrics_->write(m); });
  }
  const int64_t done = r.step + 1 - start_, every = options_.log_every();
  const double eta = r.elapsed / done * (total_ - r.step - 1);
  if (options_.on_step()) {
    const int64_t per_epoch = sampler_.steps_per_epoch();
    options_.on_step()({r.step + 1, total_, r.pos.epoch + 1, (total_ + per_epoch - 1) / per_epoch, r.pos.step + 1,
                         per_epoch, r.loss, r.examples_per_s, step.rate_unit, r.elapsed, eta});
  }
  if (every <= 0 || !(done % every == 0 || r.step + 1 == total_ || done == 1 || !r.finite)) return;
  std::ostringstream line;
  line << "step " << r.step + 1 << "/" << total_ << "  epoch " << r.pos.epoch + 1 << " (" << r.pos.step + 1 << "/"
       << sampler_.steps_per_epoch() << ")  loss " << std::fixed << std::setprecision(4) << plain_nan(r.loss)
       << (step.progress ? step.progress() : std::string()) << "  lr " << std::scientific << std::setprecision(2)
       << r.lr << std::fixed << std::setprecision(0) << "  " << r.examples_per_s << " " << step.rate_unit
       << "/s  ETA " << format_duration(eta);
  if (rows < options_.batch_size()) line << "  (short batch: " << rows << " rows)";
  if (!r.finite) line << "  NOT APPLIED: non-finite " << (std::isfinite(r.loss) ? "gradient" : "loss");
  checked([&] {
    if (options_.log()) {
      options_.log()(line.str() + "\n");
    } else {
      (options_.progress_to_stderr() ? std::cerr : std::cout) << line.str() << "\n" << std::flush;
    }
  });
}

// Every rank reaches this on the same numbers. No checkpoint is written: the
// last one (if any) stays the last good state.
void TrainLoop::diverged(const Row& r) const {
  throw Diverged(r.step + 1, total_, r.loss, r.lr, std::isfinite(r.loss), options_.skip_nonfinite(),
                 run_dir_.empty() ? std::string() : run_dir_.checkpoint());
}

// A step's allocation failed on this rank (its peers fail in their next
// collective when this process ends, and its launcher ends them). No
// checkpoint is written: the last one, if any, is the last good state.
void TrainLoop::out_of_memory(const Row& r, const std::string& what) const {
  const int64_t rows = sampler_.global_batch_rows(r.pos.step), world = comm_->world_size();
  throw OutOfMemory(r.step + 1, total_, comm_->rank(), rows, (rows + world - 1) / world,
                    what.substr(0, what.find('\n')), run_dir_.empty() ? std::string() : run_dir_.checkpoint());
}

RunResult TrainLoop::run(const Step& step) {
  const int64_t rank = comm_->rank(), world = comm_->world_size();
  if (rank == 0 && !run_dir_.empty()) {
    // Named as a directory ('runs/a/') in its error.
    RunDir(run_dir_.path() + "/").create();
    metrics_ = std::make_unique<MetricsWriter>(run_dir_.metrics(), options_.resume() ? start_ : -1);
  }
  const Fault fault = fault_from_env();
  RunResult result;
  result.start_step = start_;
  result.total_steps = total_;
  const auto t0 = Clock::now();
  const int64_t bytes0 = comm_->stats().total_bytes_sent();
  int64_t s = start_, examples = 0;
  for (; s < total_; ++s) {
    if (stop_agreed(s)) {
      result.interrupted = true;
      break;
    }
    TORCH_CHECK(fault.step != s + 1 || fault.rank != rank, "rank ", rank, " failed before step ", s + 1,
                " as asked by CONTRAX_FAULT_EXIT_AT_STEP=", fault.spec, " (a testing aid; unset it to train)");
    Row row;
    row.step = s;
    row.pos = sampler_.position(s);
    row.bytes_sent = comm_->stats().total_bytes_sent();
    row.lr = warmup_cosine_lr(s, schedule_);
    set_learning_rate(optimizer_, row.lr);
    optimizer_.zero_grad();
    torch::Tensor loss;
    try {
      loss = step.loss({s, row.pos.epoch, row.pos.step, sampler_.local_indices(row.pos.epoch, row.pos.step, rank)});
    } catch (const std::exception& e) {
      if (!is_allocation_failure(e)) throw;
      const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
      out_of_memory(row, ce != nullptr ? ce->what_without_backtrace() : e.what());
    }
    // The global loss and whether any rank's gradient is non-finite, in the
    // one all-reduce the step already had: decided before the update, so a
    // diverged step never reaches the parameters or a checkpoint. (The
    // gradients are averaged over ranks already, so every rank sees the same
    // ones; summing them too keeps the decision on identical numbers.)
    auto lt = torch::stack({loss.detach().to(torch::kDouble).reshape({}), gradient_sum(model_.parameters)});
    comm_->all_reduce_sum(lt, "loss");
    row.loss = lt[0].item<double>() / static_cast<double>(world);
    row.finite = std::isfinite(row.loss) && std::isfinite(lt[1].item<double>());
    if (row.finite) {
      optimizer_.step();
      if (step.after_update) step.after_update(s, total_);
    } else {
      ++result.skipped_steps;
    }
    result.losses.push_back(row.loss);
    examples += sampler_.global_batch_rows(row.pos.step);
    row.elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    row.examples_per_s = row.elapsed > 0 ? examples / row.elapsed : 0;
    row.bytes_sent = comm_->stats().total_bytes_sent() - row.bytes_sent;
    if (rank == 0) record(row, step);
    if (!row.finite && result.skipped_steps > options_.skip_nonfinite()) diverged(row);
    const int64_t every = options_.checkpoint_every();
    if (every > 0 && (s + 1) % every == 0 && s + 1 < total_) save(s + 1);
  }
  finish(result, s, examples, std::chrono::duration<double>(Clock::now() - t0).count(), bytes0);
  return result;
}

void TrainLoop::finish(RunResult& result, int64_t step, int64_t examples, double elapsed, int64_t bytes0) {
  result.steps = step;
  result.train_s = elapsed;
  result.examples_per_s = elapsed > 0 ? examples / elapsed : 0;
  result.epochs_done = step > 0 ? sampler_.position(step - 1).epoch + 1 : 0;
  result.bytes_sent = comm_->stats().total_bytes_sent() - bytes0;
  try {
    // A resumed run that had nothing left to do (re-evaluating a finished
    // run) leaves its checkpoint untouched.
    if (step > start_ || !options_.resume()) save(step);
  } catch (const c10::Error& e) {
    if (write_error_.empty()) throw;
    TORCH_CHECK(false, write_error_, "; the run stopped at step ", step, "/", total_,
                " but its checkpoint could not be written either: ", e.what_without_backtrace());
  }
  comm_->barrier();  // the checkpoint is on disk before any rank moves on
  if (!write_error_.empty()) {
    throw TrainError(TrainErrorKind::kRecordLost,
                     c10::str(write_error_, "; the run stopped at step ", step, "/", total_,
                              run_dir_.empty() ? std::string() : " with checkpoint " + run_dir_.checkpoint()),
                     " (free space, then resume the run)");
  }
}

}  // namespace contrax::train
