// One rank's run of `contrax train`: launch, train, report (train_run.h).
#include "train/train_run.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <thread>
#include <utility>

#include "cli/build_info.h"
#include "cli/cli.h"
#include "cli/plot.h"
#include "cli/stop_signal.h"
#include "contrax/check/verify.h"
#include "contrax/launch/launcher.h"
#include "contrax/train/common/run_dir.h"
#include "train/train_errors.h"

namespace contrax::cli {

namespace ct = contrax::train;

TrainRun::TrainRun(TrainRecipe& recipe, TrainSettings& settings, bool resumed,
                   std::function<std::string()> divergence_cause)
    : recipe_(recipe), s_(settings), resumed_(resumed), divergence_cause_(std::move(divergence_cause)) {}

std::string TrainRun::message(const ct::TrainError& e) const {
  return train_error_message(e, recipe_.data_hint());
}

void TrainRun::launch(const Json& settings, const std::vector<std::string>& command) {
  wall0_ = std::chrono::steady_clock::now();
  contrax::note_worker_memory("starting: joining its peers, loading the data set and building the model");
  comm_ = with_thread_hint([&] {
    return contrax::Communicator::from_env(contrax::CommunicatorOptions()
                                               .timeout(std::chrono::seconds(s_.timeout_s))
                                               .device(s_.device == "cuda" ? torch::kCUDA : torch::kCPU));
  });
  const int64_t world = comm_->world_size(), rank = comm_->rank();
  threads_guard_ = std::make_unique<IntraOpThreads>(s_.threads_per_process(world), "rank " + std::to_string(rank));
  console_ = std::make_unique<TrainConsole>(s_.json);
  if (rank == 0) {
    const ct::RunDir dir(s_.run_dir);
    console_->open_log(dir, resumed_);
    Json config;
    config["settings"] = settings;
    config["command"] = command;
    config["resumed"] = resumed_;
    config["world_size"] = world;
    config["threads_per_process"] = at::get_num_threads();
    config["versions"] = {{"contrax", CONTRAX_VERSION}, {"libtorch", TORCH_VERSION}, {"blas", blas_library()}};
    dir.write(ct::RunDir::kConfig, config.dump(2) + "\n");
  }
}

// Loads the data, checks the run's length and sets the loop's options.
void TrainRun::prepare_loop() {
  const int64_t n = recipe_.load(s_.tool);
  // epochs x steps per epoch, before anything trains (the loop checks it
  // too, but cannot name the flags).
  auto& run = recipe_.run();
  const int64_t per_epoch = n / run.batch_size() + (n % run.batch_size() != 0);
  usage_check(run.max_steps() > 0 || run.epochs() <= kMaxSteps / std::max<int64_t>(1, per_epoch),
              "flag '--epochs' x ", per_epoch, " steps per epoch must be <= 2^40 steps, but got --epochs ",
              run.epochs());
  run.seed(static_cast<uint64_t>(s_.seed))
      .dtype(s_.dtype == "double" ? torch::kDouble : torch::kFloat)
      .run_dir(s_.run_dir)
      .resume(resumed_)
      .trust_legacy_checkpoint(s_.trust_legacy)
      .log([this](const std::string& line) { console_->progress_line(line); })
      .on_step([this](const ct::StepProgress& p) {
        console_->live().show(train_step_line(p), p.step == p.total_steps);
      })
      .on_record_error([](const std::string& line) { std::cerr << "contrax train: " << line << std::flush; })
      .stop_requested([] {
        // The loop's first stop check: from here on a signal stops it at a
        // step boundary with a checkpoint; until now it ended the rank at
        // once (stop_signal.h).
        stop_signals(OnSignal::kRequestStop);
        return stop_signal() != 0;
      });
}

// The run's first line, on rank 0.
void TrainRun::announce() const {
  if (comm_->rank() != 0) return;
  const int64_t world = comm_->world_size(), t = at::get_num_threads();
  console_->out(c10::str("contrax train: ", recipe_.what(), ", ", world, " process", world > 1 ? "es" : "", " x ", t,
                         " thread", t > 1 ? "s" : "", ", global batch ", recipe_.batch(), ", run dir ", s_.run_dir,
                         resumed_ ? " (resuming)" : "", "\n"));
}

ct::RunResult TrainRun::train() {
  prepare_loop();
  announce();
  ct::RunResult r;
  // A peer that a signal ended first fails this rank's collective: the
  // signal, not the error, is why the run ended. Otherwise train.log keeps
  // why the run ended, in the words the console gets.
  const auto ended = [this](const std::string& msg) {
    if (stop_signal() != 0) end_by_signal(stop_signal());
    console_->log_only(c10::str("contrax train: error: ", msg, "\n"));
  };
  try {
    contrax::note_worker_memory("training");  // the recipe may say how much a step needs
    r = recipe_.train(comm_);
  } catch (const ct::Diverged& e) {
    // The loop names the step; the flags that may have caused it are the tool's to name.
    const std::string msg = message(e) + divergence_cause_();
    ended(msg);
    throw_train_error(e, msg);
  } catch (const ct::TrainError& e) {
    ended(message(e));
    throw_train_error(e, message(e));
  } catch (const c10::Error& e) {
    ended(e.what_without_backtrace());
    throw;
  }
  console_->live().keep();  // the training's last state stays on the screen
  // Evaluation has nothing to save: a signal ends it at once.
  if (!r.interrupted) stop_signals(OnSignal::kEndAtOnce);
  return r;
}

// A run stopped by a signal or --stop-at-step, with its checkpoint.
int TrainRun::stopped(const ct::RunResult& r) const {
  if (comm_->rank() == 0) {
    console_->err(c10::str("contrax train: stopped at step ", r.steps, "/", r.total_steps, "; checkpoint ",
                           ct::RunDir(s_.run_dir).checkpoint(), " written; continue with --resume\n"));
  }
  return stop_signal() != 0 && !contrax::in_launched_worker() ? 128 + stop_signal() : 0;
}

// `contrax verify` over the run's communicator.
Json TrainRun::verify() const {
  Json v;
  double worst = 0;
  bool ok = true;
  const auto results = contrax::verify(comm_);
  for (const auto& c : results) {
    worst = std::max(worst, c.max_rel_err);
    ok = ok && c.passed;
  }
  v["ok"] = ok;
  put_number(v, "max_rel_err", worst);
  v["cases"] = results.size();
  v["world_size"] = comm_->world_size();
  return v;
}

// The exactness check, then on rank 0 the evaluation, results.json, the
// summary and the curves.
int TrainRun::report(const ct::RunResult& r) {
  if (r.interrupted) return stopped(r);
  if (comm_->rank() == 0 && !s_.no_verify) {
    console_->live().show("verify  the distributed gradients against one device's", true);
  }
  const Json verify_j = s_.no_verify ? Json() : verify();
  // Evaluation on rank 0, after the last collective: the other ranks are done
  // and exit, so a slow evaluation can never time out a peer that waits for it
  // (a barrier here failed after its 300 s timeout when a loaded machine slowed
  // the evaluation down). Its parts use the cores the finished ranks left
  // (unless --threads was given) side by side, one thread each, rather than as
  // threads of one part: on a shared 2-core machine two OpenMP threads made
  // the probe's many small L-BFGS steps many times slower (threads spinning
  // against other processes).
  if (comm_->rank() != 0) return 0;
  s_.tool.eval_threads = s_.threads > 0 ? s_.threads : std::max<int64_t>(1, std::thread::hardware_concurrency());
  Json s;
  s["recipe"] = s_.recipe;
  s["world_size"] = comm_->world_size();
  s["steps"] = r.steps;
  s["start_step"] = r.start_step;
  s["steps_run"] = r.steps - r.start_step;
  s["total_steps"] = r.total_steps;
  s["epochs"] = r.epochs_done;
  s["batch_size"] = recipe_.run().batch_size();
  s["skipped_steps"] = r.skipped_steps;
  put_number(s, "final_loss", r.losses.empty() ? std::nan("") : r.losses.back());
  recipe_.summarize(s);
  std::ostringstream table;
  const auto e0 = std::chrono::steady_clock::now();
  std::string part;  // shown at once when it changes; its stages at most ten times a second
  if (!s_.tool.no_eval) contrax::note_worker_memory("evaluating the trained model (training had finished)");
  const double eval_s = s_.tool.no_eval ? 0 : recipe_.evaluate(s_.tool, s, table, [&](const std::string& what) {
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - e0).count();
    const std::string now_part = what.substr(0, what.find(':'));
    console_->live().show("evaluate  " + what + "  (" + ct::format_duration(t) + ")", now_part != part);
    part = now_part;
  });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0_).count();
  put_number(s, "examples_per_s", r.examples_per_s);
  put_number(s, "train_s", r.train_s);
  put_number(s, "wall_s", wall);
  s["bytes_sent_rank0"] = r.bytes_sent;
  if (!s_.no_verify) s["verify"] = verify_j;
  s["run_dir"] = s_.run_dir;
  ct::RunDir(s_.run_dir).write(ct::RunDir::kResults, s.dump(2) + "\n");
  console_->result(s_.json ? s.dump() + "\n" : table.str() + summary(r, verify_j, eval_s, wall));
  // A missing matplotlib costs the picture, not the run: the script says why.
  if (!s_.no_plot && r.steps > 0 && plot_run(s_.run_dir, /*quiet=*/true) != 0) {
    console_->err("contrax train: curves.png not drawn (see above); the run itself is complete\n");
  }
  return verify_j.is_null() || verify_j["ok"].get<bool>() ? 0 : 1;
}

// The summary's lines after the recipe's table: what was trained, how fast,
// and the exactness check.
std::string TrainRun::summary(const ct::RunResult& r, const Json& verify_j, double eval_s, double wall) const {
  const int64_t steps_run = r.steps - r.start_step;
  std::ostringstream out;
  if (steps_run == 0 && r.start_step >= r.total_steps) {
    // --resume auto (or --resume) of a run that had already finished.
    out << "nothing to train: the run in " << s_.run_dir << " had already finished (" << r.steps << " of "
        << r.total_steps << " steps); " << std::fixed << std::setprecision(1);
  } else {
    out << "trained " << steps_run << " step" << (steps_run == 1 ? "" : "s");
    if (r.start_step > 0) out << " (steps " << r.start_step + 1 << "-" << r.steps << " of " << r.total_steps << ")";
    out << " to epoch " << r.epochs_done << " in " << std::fixed << std::setprecision(1) << r.train_s << " s, "
        << std::setprecision(0) << r.examples_per_s << " " << recipe_.rate_note() << std::setprecision(1);
  }
  if (r.skipped_steps > 0) out << r.skipped_steps << " non-finite steps skipped; ";
  if (!s_.tool.no_eval) out << "evaluated in " << eval_s << " s; ";
  out << "wall " << wall << " s\n";
  if (!s_.no_verify) {
    out << (verify_j["ok"].get<bool>() ? "distributed gradients equal single-device"
                                       : "MISMATCH: distributed gradients differ from single-device")
        << ": max rel err " << std::setprecision(3) << std::scientific
        << (verify_j["max_rel_err"].is_null() ? std::nan("") : verify_j["max_rel_err"].get<double>()) << " over "
        << verify_j["cases"].get<int64_t>() << " cases (W=" << comm_->world_size() << ")\n";
  }
  return out.str();
}

}  // namespace contrax::cli
