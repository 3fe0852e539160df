// Tests of atomic checkpoints: round trip of modules, optimizers, generators
// and scalars; clear errors; stale temporaries; a writer SIGKILLed mid-write
// leaves the last good checkpoint loadable.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <thread>

#include "contrax/train/common/checkpoint.h"
#include "contrax/train/image/models.h"
#include "support/errors.h"
#include "support/processes.h"

namespace ct = contrax::train;
using contrax::testing::error_of;
using contrax::testing::TempDir;

namespace {



int64_t file_size(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 ? st.st_size : -1;
}

bool same_parameters(torch::nn::Module& a, torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  if (pa.size() != pb.size()) return false;
  for (const auto& kv : pa) {
    if (!torch::equal(kv.value(), pb[kv.key()])) return false;
  }
  return true;
}

// Saves `module` as "m" with a step count, as a run's checkpoint holds them.
void save_module(torch::nn::Module& module, int64_t step, const std::string& path) {
  ct::Checkpoint c;
  c.module("m", module);
  c.ints["step"] = step;
  c.save(path);
}

// Loads `path` into a fresh Linear of `saved`'s shape: the step and saved's
// parameters must come back.
void expect_restores(const std::string& path, torch::nn::Linear saved, int64_t step) {
  torch::nn::Linear restored(saved->options);
  ct::Checkpoint c;
  c.module("m", *restored);
  c.load(path);
  EXPECT_EQ(c.ints.at("step"), step);
  EXPECT_TRUE(same_parameters(*restored, *saved));
}

// One Adam step on a tiny regression so that the optimizer has state.
void train_step(ct::SimCLRModel& model, torch::optim::Optimizer& opt, int seed) {
  torch::manual_seed(seed);
  opt.zero_grad();
  model(torch::randn({4, 1, 28, 28})).pow(2).mean().backward();
  opt.step();
}

ct::ContrastiveModelOptions small() {
  return ct::ContrastiveModelOptions().encoder(ct::EncoderOptions().channels({8, 16}).strides({2, 2})).proj_hidden_dim(16).proj_dim(8);
}

}  // namespace

// First in this file: the fork below runs before this process has used
// OpenMP threads in anything but tensor creation.
TEST(Checkpoint, KilledWriterLeavesLastGoodCheckpoint) {
  TempDir tmp;
  const auto& dir = tmp.path;
  const auto path = dir + "/ckpt.pt";
  torch::nn::Linear good_module(4, 4);
  save_module(*good_module, 100, path);
  const auto good_size = file_size(path);
  bool caught_mid_write = false;
  for (int attempt = 0; attempt < 5 && !caught_mid_write; ++attempt) {
    // A big module so the write takes long enough to be interrupted.
    torch::nn::Linear big(4096, 4096 << attempt);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      at::set_num_threads(1);
      save_module(*big, 200, path);
      ::_exit(0);
    }
    // The child's temporary: ckpt.pt.tmp.<child>.<random>, found once it exists.
    std::string tmp;
    const std::string prefix = "ckpt.pt.tmp." + std::to_string(child) + ".";
    // Kill as soon as the temporary holds a megabyte: mid-write.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (file_size(tmp) < (1 << 20) && std::chrono::steady_clock::now() < deadline) {
      for (const auto& e : std::filesystem::directory_iterator(dir)) {
        if (e.path().filename().string().rfind(prefix, 0) == 0) tmp = e.path().string();
      }
      int status = 0;
      if (::waitpid(child, &status, WNOHANG) == child) break;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    if (file_size(tmp) >= (1 << 20)) {
      caught_mid_write = true;
      // The final name still holds the old, complete checkpoint.
      EXPECT_EQ(file_size(path), good_size);
      expect_restores(path, good_module, 100);
      // The torn temporary is not a checkpoint and is cleaned up.
      EXPECT_FALSE(ct::is_valid_checkpoint(tmp));
      EXPECT_EQ(ct::remove_stale_temporaries(path), 1);
      EXPECT_EQ(file_size(tmp), -1);
    } else {
      // The child finished before we saw it writing: restore and retry bigger.
      save_module(*good_module, 100, path);
    }
  }
  EXPECT_TRUE(caught_mid_write) << "never caught the writer mid-write";
}

TEST(Checkpoint, RoundTripModulesOptimizersGeneratorsAndScalars) {
  TempDir tmp;
  const auto& dir = tmp.path;
  const auto path = dir + "/ckpt.pt";
  torch::manual_seed(0);
  ct::SimCLRModel model(small());
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::nn::Linear other(3, 2);
  torch::optim::SGD sgd(other->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  train_step(model, adamw, 1);
  other(torch::randn({2, 3})).sum().backward();
  sgd.step();
  auto gen = at::detail::createCPUGenerator(77);
  torch::rand({5}, gen);

  ct::Checkpoint out;
  out.module("model", *model).module("other", *other).optimizer("adamw", adamw).optimizer("sgd", sgd).generator("g", gen);
  out.ints = {{"step", 12}, {"epoch", 3}};
  out.doubles = {{"lr", 0.125}};
  out.strings = {{"recipe", "simclr"}};
  out.metadata = R"({"nproc": 2})";
  out.save(path);
  EXPECT_TRUE(ct::is_valid_checkpoint(path));
  EXPECT_EQ(file_size(path + ".tmp." + std::to_string(::getpid())), -1);

  // What the uninterrupted run does next.
  auto next_random = torch::rand({5}, gen);
  train_step(model, adamw, 2);

  // A fresh process's objects, restored from the checkpoint, continue identically.
  torch::manual_seed(99);
  ct::SimCLRModel model2(small());
  torch::optim::AdamW adamw2(model2->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::nn::Linear other2(3, 2);
  torch::optim::SGD sgd2(other2->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto gen2 = at::detail::createCPUGenerator(1);
  ct::Checkpoint in;
  in.module("model", *model2).module("other", *other2).optimizer("adamw", adamw2).optimizer("sgd", sgd2).generator("g", gen2);
  in.load(path);
  EXPECT_EQ(in.ints.at("step"), 12);
  EXPECT_EQ(in.ints.at("epoch"), 3);
  EXPECT_DOUBLE_EQ(in.doubles.at("lr"), 0.125);
  EXPECT_EQ(in.strings.at("recipe"), "simclr");
  EXPECT_EQ(in.metadata, R"({"nproc": 2})");
  EXPECT_TRUE(same_parameters(*other2, *other));
  EXPECT_TRUE(torch::equal(torch::rand({5}, gen2), next_random));
  train_step(model2, adamw2, 2);
  EXPECT_TRUE(same_parameters(*model2, *model));  // Adam moments were restored too
}

// A checkpoint loaded onto a GPU brings its generator states there too
// (the archive maps every tensor to the model's device), and set_state takes
// a CPU byte tensor whatever the generator's device: the state comes back as
// contiguous CPU bytes from any layout, and anything but 1-D bytes is named.
TEST(Checkpoint, GeneratorStatesComeBackAsCpuBytes) {
  auto gen = at::detail::createCPUGenerator(5);
  torch::Tensor state;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = gen.get_state();
  }
  // A strided copy of the same bytes, as a device copy read back might be.
  auto strided = torch::stack({state, state}, 1).select(1, 0);
  ASSERT_FALSE(strided.is_contiguous());
  const auto back = ct::generator_state_on_cpu(strided, "cuda:0");
  EXPECT_TRUE(back.device().is_cpu());
  EXPECT_TRUE(back.is_contiguous());
  EXPECT_TRUE(torch::equal(back, state));
  auto other = at::detail::createCPUGenerator(6);
  {
    std::lock_guard<std::mutex> lock(other.mutex());
    other.set_state(back);
  }
  EXPECT_TRUE(torch::equal(torch::rand({4}, other), torch::rand({4}, gen)));
  EXPECT_EQ(error_of([&] { ct::generator_state_on_cpu(state.to(torch::kFloat), "cpu"); }),
            "Checkpoint::load(): generator 'cpu' holds no byte state (Float, 1 dims)");
  EXPECT_EQ(error_of([] { ct::generator_state_on_cpu(torch::Tensor(), "cpu"); }),
            "Checkpoint::load(): generator 'cpu' holds no byte state (undefined, 0 dims)");
}

// A GPU's generator is optional: a checkpoint written on the CPU has none and
// still loads (the generator keeps its state), while one that has it restores
// it; a required generator that is absent is named.
TEST(Checkpoint, AnOptionalGeneratorMayBeAbsent) {
  TempDir tmp;
  const auto path = tmp.path + "/ckpt.pt";
  auto cpu = at::detail::createCPUGenerator(1);
  ct::Checkpoint out;
  out.generator("cpu", cpu);
  out.save(path);
  auto extra = at::detail::createCPUGenerator(2);
  const auto untouched = torch::rand({3}, at::detail::createCPUGenerator(2));
  ct::Checkpoint in;
  in.generator("cpu", at::detail::createCPUGenerator(9)).optional_generator("cuda:0", extra);
  in.load(path);
  EXPECT_TRUE(torch::equal(torch::rand({3}, extra), untouched));

  auto device_gen = at::detail::createCPUGenerator(3);
  torch::rand({7}, device_gen);
  ct::Checkpoint both;
  both.generator("cpu", cpu).optional_generator("cuda:0", device_gen);
  both.save(path);
  const auto next = torch::rand({3}, device_gen);
  auto restored = at::detail::createCPUGenerator(4);
  ct::Checkpoint again;
  again.generator("cpu", cpu).optional_generator("cuda:0", restored);
  again.load(path);
  EXPECT_TRUE(torch::equal(torch::rand({3}, restored), next));

  ct::Checkpoint strict;
  strict.generator("cuda:1", at::detail::createCPUGenerator(5));
  EXPECT_NE(error_of([&] { strict.load(path); }).find("holds no generator 'cuda:1'"), std::string::npos);
  EXPECT_EQ(error_of([] { ct::Checkpoint().optional_generator("cuda:0", at::Generator()); }),
            "Checkpoint::optional_generator(): argument 'generator' for 'cuda:0' is undefined");
}

TEST(Checkpoint, MoCoModelWithMomentumBranchRoundTrips) {
  TempDir tmp;
  const auto& dir = tmp.path;
  torch::manual_seed(0);
  ct::MocoV3Model a(small());
  a->update_momentum(0.5);
  ct::Checkpoint c;
  c.module("model", *a);
  c.save(dir + "/m.pt");
  torch::manual_seed(1);
  ct::MocoV3Model b(small());
  ct::Checkpoint d;
  d.module("model", *b);
  d.load(dir + "/m.pt");
  EXPECT_TRUE(same_parameters(*a, *b));
}

TEST(Checkpoint, OverwriteKeepsOnlyTheNewOneAndStaleTmpIsIgnored) {
  TempDir tmp;
  const auto& dir = tmp.path;
  const auto path = dir + "/ckpt.pt";
  ct::Checkpoint c;
  c.ints["step"] = 1;
  c.save(path);
  // A crashed writer's garbage next to it (pid 999999999 does not exist).
  const auto stale = path + ".tmp.999999999";
  std::ofstream(stale) << "PK\x03\x04 garbage";
  c.ints["step"] = 2;
  c.save(path);
  ct::Checkpoint r;
  r.load(path);
  EXPECT_EQ(r.ints.at("step"), 2);
  EXPECT_EQ(ct::remove_stale_temporaries(path), 1);
  EXPECT_EQ(file_size(stale), -1);
  ct::write_file_atomically(dir + "/summary.json", "{\"ok\": true}\n");
  std::ifstream f(dir + "/summary.json");
  std::string s;
  std::getline(f, s);
  EXPECT_EQ(s, "{\"ok\": true}");
}

TEST(Checkpoint, LoadErrorsAreClear) {
  TempDir tmp;
  const auto& dir = tmp.path;
  auto msg = error_of([&] { ct::Checkpoint().load(dir + "/none.pt"); });
  EXPECT_NE(msg.find("Checkpoint::load(): checkpoint '" + dir + "/none.pt' does not exist"), std::string::npos) << msg;

  torch::nn::Linear lin(4, 4);
  ct::Checkpoint c;
  c.module("lin", *lin);
  c.save(dir + "/good.pt");
  // Truncated copy.
  {
    std::ifstream in(dir + "/good.pt", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(dir + "/trunc.pt", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  msg = error_of([&] { ct::Checkpoint().load(dir + "/trunc.pt"); });
  EXPECT_NE(msg.find("Checkpoint::load(): '" + dir + "/trunc.pt' is not a readable checkpoint (truncated or corrupt;"),
            std::string::npos)
      << msg;
  EXPECT_FALSE(ct::is_valid_checkpoint(dir + "/trunc.pt"));
  std::ofstream(dir + "/junk.pt") << "not a zip";
  msg = error_of([&] { ct::Checkpoint().load(dir + "/junk.pt"); });
  EXPECT_NE(msg.find("is not a readable checkpoint"), std::string::npos) << msg;
  // A LibTorch archive (what Checkpoint wrote before safetensors, or
  // anything torch::save writes) is never read: reading runs its code.
  {
    torch::serialize::OutputArchive ar;
    ar.write("x", torch::ones({1}));
    ar.save_to(dir + "/foreign.pt");
  }
  msg = error_of([&] { ct::Checkpoint().load(dir + "/foreign.pt"); });
  EXPECT_NE(msg.find("is a checkpoint of Contrax's earlier format"), std::string::npos) << msg;
  // Entry missing or not matching.
  torch::nn::Linear lin2(4, 4);
  // The error of loading good.pt with the one entry `add` registers.
  auto load_error = [&](const std::function<void(ct::Checkpoint&)>& add) {
    return error_of([&] {
      ct::Checkpoint d;
      add(d);
      d.load(dir + "/good.pt");
    });
  };
  msg = load_error([&](ct::Checkpoint& d) { d.module("encoder", *lin2); });
  EXPECT_NE(msg.find("holds no module 'encoder'"), std::string::npos) << msg;
  torch::nn::Linear wrong(5, 4);
  msg = load_error([&](ct::Checkpoint& d) { d.module("lin", *wrong); });
  EXPECT_NE(msg.find("module 'lin' in '" + dir + "/good.pt' does not match the model: parameter 'weight' has "
                     "shape [4, 4] in the checkpoint but [4, 5] in the model"),
            std::string::npos)
      << msg;
  // A model with an extra submodule.
  torch::nn::Sequential seq(torch::nn::Linear(4, 4));
  msg = load_error([&](ct::Checkpoint& d) { d.module("lin", *seq); });
  EXPECT_NE(msg.find("parameter '0.weight' is missing in the checkpoint"), std::string::npos) << msg;
  torch::optim::SGD sgd(lin->parameters(), 0.1);
  msg = load_error([&](ct::Checkpoint& d) { d.optimizer("sgd", sgd); });
  EXPECT_NE(msg.find("holds no optimizer 'sgd'"), std::string::npos) << msg;
  msg = load_error([&](ct::Checkpoint& d) { d.generator("cpu", at::detail::createCPUGenerator(0)); });
  EXPECT_NE(msg.find("holds no generator 'cpu'"), std::string::npos) << msg;
  msg = error_of([&] { ct::Checkpoint().save("/nonexistent-dir/x.pt"); });
  EXPECT_NE(msg.find("Checkpoint::save(): cannot open directory '/nonexistent-dir': No such file or directory"),
            std::string::npos)
      << msg;
}

TEST(Checkpoint, ArgumentAndMismatchErrors) {
  TempDir tmp;
  const std::string dir = tmp.path;
  auto msg = error_of([] { ct::Checkpoint().save(""); });
  EXPECT_NE(msg.find("Checkpoint::save(): argument 'path' must not be empty"), std::string::npos) << msg;
  msg = error_of([] { ct::write_file_atomically("", "x"); });
  EXPECT_NE(msg.find("write_file_atomically(): argument 'path' must not be empty"), std::string::npos) << msg;
  msg = error_of([] { ct::Checkpoint().generator("cpu", at::Generator()); });
  EXPECT_NE(msg.find("Checkpoint::generator(): argument 'generator' for 'cpu' is undefined"), std::string::npos)
      << msg;
  // The final rename cannot replace a directory.
  std::filesystem::create_directory(dir + "/taken.pt");
  msg = error_of([&] { ct::Checkpoint().save(dir + "/taken.pt"); });
  EXPECT_NE(msg.find("Checkpoint::save(): renaming '" + dir + "/taken.pt.tmp."), std::string::npos) << msg;
  EXPECT_NE(msg.find("' to '" + dir + "/taken.pt' failed: "), std::string::npos) << msg;
  // An optimizer of another kind under the same name.
  torch::manual_seed(0);
  ct::SimCLRModel model(small());
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  train_step(model, adam, 1);
  ct::Checkpoint a;
  a.optimizer("opt", adam);
  a.save(dir + "/adam.pt");
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  msg = error_of([&] {
    ct::Checkpoint b;
    b.optimizer("opt", sgd);
    b.load(dir + "/adam.pt");
  });
  EXPECT_NE(msg.find("Checkpoint::load(): optimizer 'opt' in '" + dir + "/adam.pt' does not match the optimizer: "),
            std::string::npos)
      << msg;
}

// ---- issue 14 items 1, 2, 11: dtype, write errors, stale temporaries -----------

namespace {

// A small tmpfs (a real ENOSPC) when this process may mount one; otherwise
// RLIMIT_FSIZE (EFBIG, the kernel's own short write) stands in, and the test
// says which it used.
struct SmallDisk {
  explicit SmallDisk(const std::string& dir, int64_t bytes) : path(dir + "/small") {
    std::filesystem::create_directory(path);
    const std::string cmd = "mount -t tmpfs -o size=" + std::to_string(bytes) + " contrax_test " + path + " 2>/dev/null";
    mounted = std::system(cmd.c_str()) == 0;
  }
  ~SmallDisk() {
    if (mounted) std::system(("umount " + path).c_str());
  }
  std::string path;
  bool mounted = false;
};

// Lowers RLIMIT_FSIZE for the scope; SIGXFSZ ignored so a write past it fails
// with EFBIG instead of killing the process.
struct FileSizeLimit {
  explicit FileSizeLimit(rlim_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &saved);
    old_handler = std::signal(SIGXFSZ, SIG_IGN);
    rlimit l = saved;
    l.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &l);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, old_handler);
  }
  rlimit saved{};
  void (*old_handler)(int) = nullptr;
};

bool has_temporaries(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().find(".tmp.") != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST(Checkpoint, ResumeInAnotherDtypeIsRefusedByNameNotAHeapCorruption) {
  // Before: Module::load set_ float storage into double parameters (SIGSEGV,
  // "malloc(): unaligned tcache chunk", "setStorage: ... out of bounds").
  TempDir tmp;
  const std::string path = tmp.path + "/f.pt";
  torch::manual_seed(0);
  ct::SimCLRModel f(small());
  ct::Checkpoint save;
  save.module("model", *f);
  save.save(path);
  for (auto dtype : {torch::kDouble, torch::kHalf}) {
    ct::SimCLRModel d(small());
    d->to(dtype);
    auto before = d->parameters()[0].clone();
    const std::string msg = error_of([&] {
      ct::Checkpoint c;
      c.module("model", *d);
      c.load(path);
    });
    EXPECT_NE(msg.find("Checkpoint::load(): module 'model' in '" + path + "' was saved in dtype Float but the model is " +
                       std::string(dtype == torch::kDouble ? "Double" : "Half") +
                       " (resume with the dtype the run was started with, Float)"),
              std::string::npos)
        << msg;
    EXPECT_TRUE(torch::equal(before, d->parameters()[0])) << "the model must be untouched";
  }
  // The reverse, and a version-1 style file (read only on request) without
  // the dtype record: the tensors' own dtypes are compared.
  ct::SimCLRModel dbl(small());
  dbl->to(torch::kDouble);
  torch::serialize::OutputArchive v1, sub;
  v1.write("contrax_checkpoint_format", c10::IValue(int64_t{1}));
  dbl->save(sub);
  v1.write("module.model", sub);
  v1.save_to(tmp.path + "/v1.pt");
  ct::SimCLRModel flt(small());
  const std::string msg = error_of([&] {
    ct::Checkpoint c;
    c.module("model", *flt);
    c.load_legacy(tmp.path + "/v1.pt");
  });
  EXPECT_NE(msg.find("does not match the model: parameter '"), std::string::npos) << msg;
  EXPECT_NE(msg.find("' has dtype Double in the checkpoint but Float in the model"), std::string::npos) << msg;
}

TEST(Checkpoint, FullDiskIsAClearErrorAndThePreviousCheckpointStaysLoadable) {
  // Before: the archive writer threw from its destructor on the short write:
  // SIGABRT ("unexpected pos ... vs ...") and a partial .tmp.PID left behind.
  TempDir tmp;
  SmallDisk disk(tmp.path, 256 * 1024);
  const std::string dir = disk.mounted ? disk.path : tmp.path;
  const std::string path = dir + "/checkpoint.pt";
  torch::nn::Linear small_module(8, 8);
  save_module(*small_module, 7, path);
  const auto good_size = file_size(path);

  torch::nn::Linear big(512, 1024);  // 2 MB of parameters: more than the disk or the limit allows
  ct::Checkpoint c;
  c.module("m", *big);
  std::string msg;
  if (disk.mounted) {
    msg = error_of([&] { c.save(path); });
    EXPECT_NE(msg.find("No space left on device (ENOSPC)"), std::string::npos) << msg;
  } else {
    FileSizeLimit limit(256 * 1024);
    msg = error_of([&] { c.save(path); });
    EXPECT_NE(msg.find("File too large (EFBIG)"), std::string::npos) << msg;
  }
  std::cout << "disk-full injection: " << (disk.mounted ? "256 KB tmpfs (ENOSPC)" : "RLIMIT_FSIZE (EFBIG)") << "\n";
  EXPECT_NE(msg.find("Checkpoint::save(): writing '" + path + ".tmp." + std::to_string(::getpid()) + "."),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("' failed after "),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("; the previous '" + path + "' is unchanged"), std::string::npos) << msg;
  EXPECT_FALSE(has_temporaries(dir)) << "the partial temporary must be removed";
  EXPECT_EQ(file_size(path), good_size);
  expect_restores(path, small_module, 7);
}

TEST(Checkpoint, ReadOnlyDirectoryNamesPathAndCause) {
  TempDir tmp;
  SmallDisk disk(tmp.path, 64 * 1024);
  if (!disk.mounted) GTEST_SKIP() << "cannot mount a tmpfs here to make a read-only file system";
  ct::Checkpoint().save(disk.path + "/c.pt");
  ASSERT_EQ(std::system(("mount -o remount,ro " + disk.path).c_str()), 0);
  const std::string msg = error_of([&] { ct::Checkpoint().save(disk.path + "/c.pt"); });
  EXPECT_NE(msg.find("Checkpoint::save(): cannot create '" + disk.path + "/c.pt.tmp."), std::string::npos) << msg;
  EXPECT_NE(msg.find("Read-only file system (EROFS)"), std::string::npos) << msg;
  EXPECT_TRUE(ct::is_valid_checkpoint(disk.path + "/c.pt"));
}
