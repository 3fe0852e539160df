// Checkpoints that survive a crash at any moment.
//
// A checkpoint holds everything a run needs to continue as if it had never
// stopped: the parameters and buffers of several named modules, the state of
// named optimizers, named random generators, integer/float/string scalars
// (step, epoch, schedule state, ...) and a free-form metadata string (JSON).
//
// On disk a checkpoint is a safetensors file (Hugging Face's format): the
// tensors as records "module.<name>.<parameter>", "optimizer.<name>.<group>.
// <index>.<field>" and "generator.<name>", everything else as JSON in the
// header's metadata. Reading it runs nothing and inflates nothing: every
// record's dtype and shape is checked against the registered model,
// optimizer and generator before it is read, so a crafted file can neither
// run code nor take more memory than its own size. It also opens in Python:
// `safetensors.torch.load_file("runs/simclr/checkpoint.pt")`.
//
// Writing is atomic: the file goes to a temporary `<path>.tmp.<pid>.<random>`
// created exclusively (a link planted there is never written through), is
// fsync'ed, renamed over `<path>`, and the directory is fsync'ed; rename(2)
// replaces the old file in one step, so a crash (even SIGKILL or power loss
// after the fsyncs) leaves the old or the new checkpoint, never a torn one.
// Stale temporaries of crashed writers are ignored by `load` and removed by
// `remove_stale_temporaries`. Neither `load` nor `save` follows a symbolic
// link at `path` itself.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace contrax::train {

/// A set of named things to save or restore, plus scalar state.
///
/// Modules, optimizers and generators are registered by reference (not owned):
/// `save` reads them, `load` writes into them in place, so the same object can
/// be built once and used for both.
///
///   contrax::train::Checkpoint ckpt;
///   ckpt.module("model", *model).optimizer("adam", adam).generator("cpu", gen);
///   ckpt.ints["step"] = step;
///   ckpt.metadata = R"({"recipe": "simclr"})";
///   ckpt.save(run_dir + "/checkpoint.pt");
///   ...
///   ckpt.load(run_dir + "/checkpoint.pt");   // model, adam, gen restored; ints refilled
class Checkpoint {
 public:
  /// Registers module `name` (parameters and buffers, recursively).
  Checkpoint& module(const std::string& name, torch::nn::Module& module);
  /// Registers optimizer `name`: a torch::optim::Adam, AdamW, SGD, Adagrad or
  /// RMSprop (their options per group and state per parameter are saved);
  /// any other kind is refused here, naming it.
  Checkpoint& optimizer(const std::string& name, torch::optim::Optimizer& optimizer);
  /// Registers a random generator; `at::Generator` is a handle, so the copy
  /// restores the caller's generator.
  Checkpoint& generator(const std::string& name, at::Generator generator);
  /// Registers a generator that a checkpoint may lack, restored where it has it
  /// (a GPU's, absent when a run started on the CPU resumes on a GPU).
  Checkpoint& optional_generator(const std::string& name, at::Generator generator);

  /// Scalars saved and restored by value (load replaces these maps).
  std::map<std::string, int64_t> ints;
  std::map<std::string, double> doubles;       ///< floating-point scalars, as `ints`
  std::map<std::string, std::string> strings;  ///< string values, as `ints`
  std::string metadata;                        ///< free-form metadata (JSON by convention), restored by `load`

  /// Writes atomically to `path` (see file comment). Throws on I/O errors;
  /// the previous file at `path` is intact if it throws.
  void save(const std::string& path) const;

  /// Restores every registered module, optimizer and generator from `path`
  /// and refills the scalars and metadata. Throws naming the path for a
  /// missing, truncated or corrupt file, a symbolic link, or a checkpoint of
  /// the earlier format (see load_legacy), and naming the entry when a
  /// registered module/optimizer/generator is absent from the file or does
  /// not match it (name, dtype, shape, size); nothing is changed then.
  void load(const std::string& path);

  /// Restores from a checkpoint of Contrax's earlier format (versions 1 and
  /// 2, TorchScript archives). **Reading one runs the TorchScript code it
  /// holds**: call this only for a file you wrote yourself. `save` then
  /// writes the current format (what `contrax train --resume
  /// --trust-legacy-checkpoint` does).
  void load_legacy(const std::string& path);

 private:
  std::vector<std::pair<std::string, torch::nn::Module*>> modules_;
  std::vector<std::pair<std::string, torch::optim::Optimizer*>> optimizers_;
  struct NamedGenerator {
    std::string name;
    at::Generator generator;
    bool required;
  };
  std::vector<NamedGenerator> generators_;
};

/// A generator state read from a checkpoint as `set_state` takes it: a
/// contiguous CPU byte tensor. The archive loads every tensor onto the model's
/// device, so a run resumed on a GPU reads its generator states there. Throws
/// naming `name` when `state` is not a 1-D byte tensor.
torch::Tensor generator_state_on_cpu(const torch::Tensor& state, const std::string& name);

/// True when `path` holds a complete checkpoint written by `Checkpoint::save`
/// (reads its header and checks the format marker); never throws.
bool is_valid_checkpoint(const std::string& path);

/// True when `path` starts like a checkpoint of the earlier format (a zip
/// archive); reads 4 bytes, runs nothing, never throws.
bool is_legacy_checkpoint(const std::string& path);

/// Removes `<path>.tmp.<pid>[.<random>]` files whose writer process no longer runs
/// (left behind by a crash). Returns how many were removed.
int64_t remove_stale_temporaries(const std::string& path);

/// Writes `bytes` to `path` atomically: an exclusively created temporary,
/// fsync, rename, fsync of the directory. The building block of `Checkpoint::save`, also
/// useful for small files such as a run summary.
///
///   contrax::train::write_file_atomically(dir + "/summary.json", json);
void write_file_atomically(const std::string& path, const std::string& bytes);

}  // namespace contrax::train
