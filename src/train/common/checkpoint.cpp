// Atomic checkpoints over torch::serialize archives (see checkpoint.h).
#include "contrax/train/common/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace contrax::train {
namespace {

// Written first and checked first: a zip archive that opens but was not
// written by Checkpoint::save is reported as such, not as a missing module.
constexpr const char* kFormatKey = "contrax_checkpoint_format";
// Version 2 adds the floating dtype of every module ("module.<name>.dtype"),
// so that a resume in another dtype is refused by name before any tensor
// is copied. Version 1 files still load: their tensors carry their dtype and
// check_module_matches compares it.
constexpr int64_t kFormatVersion = 2;
constexpr int64_t kOldestReadableVersion = 1;

// "No space left on device (ENOSPC)": the symbolic name is what people search
// for, the text is what they read.
std::string errno_text(int err = errno) {
  const char* name = ::strerrorname_np(err);
  return std::string(std::strerror(err)) + (name != nullptr ? std::string(" (") + name + ")" : std::string());
}

std::string dir_of(const std::string& path) {
  const auto dir = std::filesystem::path(path).parent_path();
  return dir.empty() ? "." : dir.string();
}

void fsync_dir(const std::string& dir, const std::string& caller) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  TORCH_CHECK(fd >= 0, caller, ": cannot open directory '", dir, "' to sync it: ", errno_text());
  const int rc = ::fsync(fd);
  const int saved_errno = errno;
  ::close(fd);
  // Some file systems (e.g. certain network mounts) refuse fsync on
  // directories; the rename is still atomic there, only durability is weaker.
  TORCH_CHECK(rc == 0 || saved_errno == EINVAL || saved_errno == EROFS, caller, ": fsync of directory '", dir,
              "' failed: ", errno_text(saved_errno));
}

// Writes `bytes` to `path`.tmp.<pid> with checked POSIX calls, syncs and
// renames it over `path`, then syncs the directory. Every failure (ENOSPC,
// EIO, EROFS, EFBIG, ...) becomes one c10::Error naming the file and the
// cause; the temporary is removed and `path` is untouched until the rename.
// The bytes are complete before the first write: a serialiser that throws
// from its destructor on a short write (LibTorch's archive writer aborts the
// process that way) never sees the disk.
void write_atomically(const std::string& path, const std::string& caller, const std::string& bytes) {
  TORCH_CHECK(!path.empty(), caller, ": argument 'path' must not be empty");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  // What a failure leaves: the file as it was, or (a first write) none.
  struct stat before {};
  const std::string unchanged = ::stat(path.c_str(), &before) == 0
                                    ? "; the previous '" + path + "' is unchanged"
                                    : "; '" + path + "' was not written (there was none before)";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    TORCH_CHECK(false, caller, ": cannot create '", tmp, "': ", errno_text(err), " (does the directory '",
                dir_of(path), "' exist and is it writable?)", unchanged);
  }
  std::string write_error;
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      write_error = errno_text(errno);
      break;
    }
    if (w == 0) {  // not expected from a regular file; never spin on it
      write_error = "write returned 0";
      break;
    }
    done += static_cast<size_t>(w);
  }
  if (write_error.empty() && ::fsync(fd) != 0) write_error = "fsync: " + errno_text(errno);
  if (::close(fd) != 0 && write_error.empty()) write_error = "close: " + errno_text(errno);
  if (!write_error.empty()) {
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, caller, ": writing '", tmp, "' failed after ", done, " of ", bytes.size(),
                " bytes: ", write_error, unchanged);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = errno_text(errno);
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, caller, ": renaming '", tmp, "' to '", path, "' failed: ", err, unchanged);
  }
  fsync_dir(dir_of(path), caller);
}

template <typename T>
void write_map(torch::serialize::OutputArchive& ar, const std::string& name, const std::map<std::string, T>& m) {
  c10::List<std::string> keys;
  c10::List<T> values;
  for (const auto& kv : m) {
    keys.push_back(kv.first);
    values.push_back(kv.second);
  }
  ar.write(name + ".keys", c10::IValue(keys));
  ar.write(name + ".values", c10::IValue(values));
}

template <typename T>
std::map<std::string, T> read_map(torch::serialize::InputArchive& ar, const std::string& name) {
  c10::IValue keys, values;
  ar.read(name + ".keys", keys);
  ar.read(name + ".values", values);
  auto k = c10::impl::toTypedList<std::string>(keys.toList());
  auto v = c10::impl::toTypedList<T>(values.toList());
  TORCH_CHECK(k.size() == v.size(), "keys and values of '", name, "' differ in length");
  std::map<std::string, T> m;
  for (size_t i = 0; i < k.size(); ++i) m[k.get(i)] = v.get(i);
  return m;
}

// First line of an exception message: LibTorch appends long backtraces.
std::string first_line(const std::exception& e) {
  std::string s = e.what();
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// The reader's own words, without the advice PyTorch 2.15 appends to
// miniz's ("This is an internal miniz error. If you are seeing this error,
// there is a high likelihood ..."): the message before it says the file is
// truncated or corrupt.
std::string archive_error(const std::exception& e) {
  std::string s = first_line(e);
  const auto advice = s.find(". This is an internal miniz error");
  return advice == std::string::npos ? s : s.substr(0, advice);
}

// Module::load replaces a tensor with whatever the archive holds, whatever its
// shape; check names and shapes first so a mismatch is an error, not a
// silently different model.
void check_module_matches(torch::nn::Module& m, torch::serialize::InputArchive& ar, const std::string& prefix) {
  auto check = [&](const char* what, const std::string& key, const torch::Tensor& want, bool is_buffer) {
    torch::Tensor t;
    TORCH_CHECK(ar.try_read(key, t, is_buffer), what, " '", prefix + key, "' is missing in the checkpoint");
    TORCH_CHECK(t.sizes() == want.sizes(), what, " '", prefix + key, "' has shape ", t.sizes(),
                " in the checkpoint but ", want.sizes(), " in the model");
    // Module::load copies with set_ semantics: a float tensor loaded into a
    // double parameter reinterprets its storage (heap corruption, SIGSEGV).
    TORCH_CHECK(t.scalar_type() == want.scalar_type(), what, " '", prefix + key, "' has dtype ", t.scalar_type(),
                " in the checkpoint but ", want.scalar_type(), " in the model");
  };
  for (const auto& p : m.named_parameters(/*recurse=*/false)) check("parameter", p.key(), p.value(), false);
  for (const auto& b : m.named_buffers(/*recurse=*/false)) check("buffer", b.key(), b.value(), true);
  for (const auto& c : m.named_children()) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(ar.try_read(c.key(), sub), "submodule '", prefix + c.key(), "' is missing in the checkpoint");
    check_module_matches(*c.value(), sub, prefix + c.key() + ".");
  }
}

// The floating dtype of a module's parameters and buffers ("Float",
// "Double", ...), "mixed" when they differ, "none" when it has none.
std::string module_dtype(torch::nn::Module& m) {
  std::string found;
  auto note = [&](const torch::Tensor& t) {
    if (!t.defined() || !t.is_floating_point()) return;
    const std::string name = c10::toString(t.scalar_type());
    if (found.empty()) found = name;
    else if (found != name) found = "mixed";
  };
  for (const auto& p : m.parameters()) note(p);
  for (const auto& b : m.buffers()) note(b);
  return found.empty() ? "none" : found;
}

// The device of the first registered module that has parameters (none: the
// archive's own).
c10::optional<torch::Device> device_of(const std::vector<std::pair<std::string, torch::nn::Module*>>& modules) {
  for (const auto& m : modules) {
    const auto params = m.second->parameters();
    if (!params.empty()) return params.front().device();
  }
  return c10::nullopt;
}

}  // namespace

Checkpoint& Checkpoint::module(const std::string& name, torch::nn::Module& m) {
  modules_.emplace_back(name, &m);
  return *this;
}

Checkpoint& Checkpoint::optimizer(const std::string& name, torch::optim::Optimizer& o) {
  optimizers_.emplace_back(name, &o);
  return *this;
}

Checkpoint& Checkpoint::generator(const std::string& name, at::Generator g) {
  TORCH_CHECK(g.defined(), "Checkpoint::generator(): argument 'generator' for '", name, "' is undefined");
  generators_.push_back({name, std::move(g), /*required=*/true});
  return *this;
}

Checkpoint& Checkpoint::optional_generator(const std::string& name, at::Generator g) {
  TORCH_CHECK(g.defined(), "Checkpoint::optional_generator(): argument 'generator' for '", name, "' is undefined");
  generators_.push_back({name, std::move(g), /*required=*/false});
  return *this;
}

torch::Tensor generator_state_on_cpu(const torch::Tensor& state, const std::string& name) {
  TORCH_CHECK(state.defined() && state.scalar_type() == torch::kByte && state.dim() == 1,
              "Checkpoint::load(): generator '", name, "' holds no byte state (",
              state.defined() ? std::string(c10::toString(state.scalar_type())) : std::string("undefined"),
              ", ", state.defined() ? state.dim() : 0, " dims)");
  return state.to(torch::kCPU).contiguous();
}

void Checkpoint::save(const std::string& path) const {
  torch::serialize::OutputArchive ar;
  ar.write(kFormatKey, c10::IValue(kFormatVersion));
  for (const auto& m : modules_) {
    torch::serialize::OutputArchive sub;
    m.second->save(sub);
    ar.write("module." + m.first, sub);
    ar.write("module." + m.first + ".dtype", c10::IValue(module_dtype(*m.second)));
  }
  for (const auto& o : optimizers_) {
    torch::serialize::OutputArchive sub;
    o.second->save(sub);
    ar.write("optimizer." + o.first, sub);
  }
  for (const auto& g : generators_) {
    at::Generator gen = g.generator;  // a handle: mutex() is non-const
    torch::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    ar.write("generator." + g.name, state.to(torch::kCPU), /*is_buffer=*/true);
  }
  write_map(ar, "ints", ints);
  write_map(ar, "doubles", doubles);
  write_map(ar, "strings", strings);
  ar.write("metadata", c10::IValue(metadata));
  // Serialised to memory first: the archive writer cannot fail there, and the
  // disk sees only the checked writes of write_atomically.
  std::string bytes;
  ar.save_to([&bytes](const void* data, size_t n) -> size_t {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  write_atomically(path, "Checkpoint::save()", bytes);
}

void Checkpoint::load(const std::string& path) {
  struct stat st {};
  TORCH_CHECK(::stat(path.c_str(), &st) == 0, "Checkpoint::load(): checkpoint '", path, "' does not exist");
  TORCH_CHECK(!S_ISDIR(st.st_mode), "Checkpoint::load(): '", path, "' is a directory, not a checkpoint file");
  // Tensors are read onto the device of the registered model: a checkpoint
  // that rank 0 wrote from cuda:0 must land on each rank's own GPU, since
  // Module::load adopts the loaded tensors themselves.
  torch::serialize::InputArchive ar;
  try {
    ar.load_from(path, device_of(modules_));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Checkpoint::load(): '", path, "' is not a readable checkpoint (truncated or corrupt; ",
                st.st_size, " bytes): ", archive_error(e));
  }
  c10::IValue version;
  TORCH_CHECK(ar.try_read(kFormatKey, version) && version.isInt(), "Checkpoint::load(): '", path,
              "' is not a contrax checkpoint (no format marker)");
  TORCH_CHECK(version.toInt() >= kOldestReadableVersion && version.toInt() <= kFormatVersion,
              "Checkpoint::load(): '", path, "' has format version ", version.toInt(), ", this build reads versions ",
              kOldestReadableVersion, " to ", kFormatVersion);
  for (auto& m : modules_) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(ar.try_read("module." + m.first, sub), "Checkpoint::load(): '", path, "' holds no module '",
                m.first, "'");
    c10::IValue saved_dtype;
    if (ar.try_read("module." + m.first + ".dtype", saved_dtype) && saved_dtype.isString()) {
      const std::string want = module_dtype(*m.second);
      TORCH_CHECK(saved_dtype.toStringRef() == want, "Checkpoint::load(): module '", m.first, "' in '", path,
                  "' was saved in dtype ", saved_dtype.toStringRef(), " but the model is ", want,
                  " (resume with the dtype the run was started with, ",
                  saved_dtype.toStringRef(), ")");
    }
    try {
      check_module_matches(*m.second, sub, "");
      m.second->load(sub);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "Checkpoint::load(): module '", m.first, "' in '", path,
                  "' does not match the model: ", first_line(e));
    }
  }
  for (auto& o : optimizers_) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(ar.try_read("optimizer." + o.first, sub), "Checkpoint::load(): '", path,
                "' holds no optimizer '", o.first, "'");
    try {
      o.second->load(sub);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "Checkpoint::load(): optimizer '", o.first, "' in '", path,
                  "' does not match the optimizer: ", first_line(e));
    }
  }
  // The archive put every tensor on the model's device, generator states
  // too; set_state takes a CPU byte tensor whatever the generator's device.
  for (auto& g : generators_) {
    torch::Tensor state;
    const bool found = ar.try_read("generator." + g.name, state, /*is_buffer=*/true);
    TORCH_CHECK(found || !g.required, "Checkpoint::load(): '", path, "' holds no generator '", g.name, "'");
    if (!found) continue;
    auto cpu_state = generator_state_on_cpu(state, g.name);
    std::lock_guard<std::mutex> lock(g.generator.mutex());
    g.generator.set_state(cpu_state);
  }
  try {
    ints = read_map<int64_t>(ar, "ints");
    doubles = read_map<double>(ar, "doubles");
    strings = read_map<std::string>(ar, "strings");
    c10::IValue meta;
    ar.read("metadata", meta);
    metadata = meta.toStringRef();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Checkpoint::load(): scalar state in '", path, "' is corrupt: ", first_line(e));
  }
}

bool is_valid_checkpoint(const std::string& path) {
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(path);
    c10::IValue version;
    return ar.try_read(kFormatKey, version) && version.isInt() && version.toInt() >= kOldestReadableVersion &&
           version.toInt() <= kFormatVersion;
  } catch (...) {
    return false;
  }
}

int64_t remove_stale_temporaries(const std::string& path) {
  const std::string dir = dir_of(path);
  const std::string prefix = std::filesystem::path(path).filename().string() + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  int64_t removed = 0;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string pid_text = name.substr(prefix.size());
    if (pid_text.empty() || pid_text.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::stol(pid_text);
    const bool alive = pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
    if (!alive && ::unlink((dir + "/" + name).c_str()) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  write_atomically(path, "write_file_atomically()", bytes);
}

}  // namespace contrax::train
