// Checkpoints as safetensors files (see checkpoint.h).
#include "contrax/train/common/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>

#include "train/common/optimizer_state.h"
#include "train/common/safetensors.h"
#include "util/files.h"

namespace contrax::train {
namespace {

using contrax::detail::Directory;
using detail::SafetensorsReader;

// The header's __metadata__ holds two strings: the format's name, checked
// first (a safetensors file of something else is told so, not that it
// lacks a module), and everything that is not a tensor, as one JSON text
// (kStateKey). Version 3 is the first safetensors version; 1 and 2 were
// TorchScript archives (legacy_checkpoint.cpp).
constexpr const char* kFormatKey = "format";
constexpr const char* kFormatName = "contrax.checkpoint";
constexpr const char* kStateKey = "contrax";
constexpr int64_t kFormatVersion = 3;

std::string base_of(const std::string& path) { return std::filesystem::path(path).filename().string(); }

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

// A module's tensors as records: "module.<name>.<dotted path>", parameters
// and buffers alike (their names cannot collide within a module).
struct ModuleRecord {
  std::string record;
  torch::Tensor tensor;
  const char* kind;  // "parameter" or "buffer", for messages
};
std::vector<ModuleRecord> module_records(const std::string& name, torch::nn::Module& m) {
  std::vector<ModuleRecord> out;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) {
    out.push_back({"module." + name + "." + p.key(), p.value(), "parameter"});
  }
  for (const auto& b : m.named_buffers(/*recurse=*/true)) out.push_back({"module." + name + "." + b.key(), b.value(), "buffer"});
  return out;
}

// Every record under "module.<name>." must be one of the model's, with the
// model's dtype and shape, and every one of the model's must be there.
void check_module(const SafetensorsReader& in, const std::string& name, torch::nn::Module& m) {
  const std::string prefix = "module." + name + ".";
  std::set<std::string> wanted;
  for (const auto& r : module_records(name, m)) {
    const std::string key = r.record.substr(prefix.size());
    wanted.insert(r.record);
    TORCH_CHECK(in.has(r.record), r.kind, " '", key, "' is missing in the checkpoint");
    TORCH_CHECK(in.shape(r.record) == r.tensor.sizes().vec(), r.kind, " '", key, "' has shape ",
                c10::IntArrayRef(in.shape(r.record)), " in the checkpoint but ", r.tensor.sizes(), " in the model");
    TORCH_CHECK(in.dtype(r.record) == r.tensor.scalar_type(), r.kind, " '", key, "' has dtype ", in.dtype(r.record),
                " in the checkpoint but ", r.tensor.scalar_type(), " in the model");
  }
  for (const auto& record : in.names()) {
    TORCH_CHECK(record.rfind(prefix, 0) != 0 || wanted.count(record) != 0, "the checkpoint holds '",
                record.substr(prefix.size()), "', which the model lacks");
  }
}

// The current state's size: a generator's state has one length per kind
// (the CPU's Mersenne Twister 5,056 bytes, CUDA's Philox 16).
int64_t state_bytes(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state().numel();
}

template <typename T, typename F>
std::map<std::string, T> read_scalars(const nlohmann::json& state, const char* key, F&& get) {
  std::map<std::string, T> out;
  if (!state.contains(key)) return out;
  for (const auto& [k, v] : state.at(key).items()) out[k] = get(k, v);
  return out;
}

}  // namespace

Checkpoint& Checkpoint::module(const std::string& name, torch::nn::Module& m) {
  modules_.emplace_back(name, &m);
  return *this;
}

Checkpoint& Checkpoint::optimizer(const std::string& name, torch::optim::Optimizer& o) {
  detail::optimizer_kind(o, name);  // refuses, by name, a kind whose state it cannot store
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
  TORCH_CHECK(!path.empty(), "Checkpoint::save(): argument 'path' must not be empty");
  detail::SafetensorsWriter out;
  nlohmann::json state;
  state["version"] = kFormatVersion;
  state["modules"] = nlohmann::json::object();
  for (const auto& m : modules_) {
    for (const auto& r : module_records(m.first, *m.second)) out.add(r.record, r.tensor);
    state["modules"][m.first] = {{"dtype", module_dtype(*m.second)}};
  }
  state["optimizers"] = nlohmann::json::object();
  for (const auto& o : optimizers_) {
    state["optimizers"][o.first] = detail::save_optimizer(*o.second, "optimizer." + o.first + ".", out);
  }
  for (const auto& g : generators_) {
    at::Generator gen = g.generator;  // a handle: mutex() is non-const
    std::lock_guard<std::mutex> lock(gen.mutex());
    out.add("generator." + g.name, gen.get_state());
  }
  state["ints"] = ints;
  state["strings"] = strings;
  state["doubles"] = nlohmann::json::object();
  for (const auto& [k, v] : doubles) state["doubles"][k] = detail::exact_double(v);
  state["metadata"] = metadata;
  out.metadata(kFormatKey, kFormatName);
  out.metadata(kStateKey, state.dump());
  Directory::of_file(path, "Checkpoint::save()").write_atomically(base_of(path), out.bytes());
}

namespace {

// A checkpoint file opened and its scalar state read, before anything of it
// is trusted: no link followed, the earlier TorchScript format refused (reading
// it would run its code), the safetensors header checked by the reader, the
// format marker and version ours.
struct OpenedCheckpoint {
  std::unique_ptr<SafetensorsReader> in;
  nlohmann::json state;
};
OpenedCheckpoint open_checkpoint(const std::string& path) {
  const Directory dir = Directory::of_file(path, "Checkpoint::load()");
  struct stat st {};
  TORCH_CHECK(dir.stat(base_of(path), &st), "Checkpoint::load(): checkpoint '", path, "' does not exist");
  TORCH_CHECK(!S_ISDIR(st.st_mode), "Checkpoint::load(): '", path, "' is a directory, not a checkpoint file");
  auto fd = dir.open(base_of(path), O_RDONLY);
  TORCH_CHECK(fd.valid(), "Checkpoint::load(): checkpoint '", path, "' does not exist");
  TORCH_CHECK(!is_legacy_checkpoint(path), "Checkpoint::load(): '", path, "' is a checkpoint of Contrax's earlier ",
              "format (a TorchScript archive), and reading one runs the code it holds, so it is not read. If you ",
              "wrote it yourself, resume with 'contrax train --resume --trust-legacy-checkpoint', which reads it and ",
              "rewrites it as safetensors (C++: Checkpoint::load_legacy); otherwise start the run again");
  OpenedCheckpoint c;
  auto& in = c.in;
  auto& state = c.state;
  try {
    in = std::make_unique<SafetensorsReader>(std::move(fd), path);
  } catch (const c10::Error& e) {
    // The reader's words start with the path, which this message has said.
    std::string why = e.what_without_backtrace();
    const std::string named = "'" + path + "' is ";
    if (why.rfind(named, 0) == 0) why = why.substr(named.size());
    TORCH_CHECK(false, "Checkpoint::load(): '", path, "' is not a readable checkpoint (truncated or corrupt; ",
                st.st_size, " bytes): ", why);
  }
  const auto& meta = in->metadata();
  TORCH_CHECK(meta.count(kFormatKey) != 0 && meta.at(kFormatKey) == kFormatName && meta.count(kStateKey) != 0,
              "Checkpoint::load(): '", path, "' is not a contrax checkpoint (no format marker)");
  try {
    state = nlohmann::json::parse(meta.at(kStateKey));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "Checkpoint::load(): scalar state in '", path, "' is corrupt: ", e.what());
  }
  const int64_t version = state.is_object() && state.contains("version") && state["version"].is_number_integer()
                              ? state["version"].get<int64_t>()
                              : -1;
  TORCH_CHECK(version == kFormatVersion, "Checkpoint::load(): '", path, "' has format version ", version,
              ", this build reads version ", kFormatVersion, " (and, on request, 1 and 2: Checkpoint::load_legacy)");
  return c;
}

}  // namespace

void Checkpoint::load(const std::string& path) {
  auto [in, state] = open_checkpoint(path);
  try {
    // Everything is checked before anything is assigned: a checkpoint that
    // does not fit leaves the model, the optimizers and the scalars as
    // they were. (An optimizer checks itself whole before it assigns.)
    for (auto& m : modules_) {
      TORCH_CHECK(state["modules"].contains(m.first), "Checkpoint::load(): '", path, "' holds no module '", m.first,
                  "'");
      const nlohmann::json& saved = state["modules"][m.first];
      const std::string want = module_dtype(*m.second);
      const std::string was = saved.value("dtype", want);
      TORCH_CHECK(was == want, "Checkpoint::load(): module '", m.first, "' in '", path, "' was saved in dtype ", was,
                  " but the model is ", want, " (resume with the dtype the run was started with, ", was, ")");
      try {
        check_module(*in, m.first, *m.second);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "Checkpoint::load(): module '", m.first, "' in '", path, "' does not match the model: ",
                    e.what_without_backtrace());
      }
    }
    for (const auto& g : generators_) {
      const std::string record = "generator." + g.name;
      TORCH_CHECK(in->has(record) || !g.required, "Checkpoint::load(): '", path, "' holds no generator '", g.name,
                  "'");
      if (!in->has(record)) continue;
      const int64_t want = state_bytes(g.generator);
      TORCH_CHECK(in->dtype(record) == torch::kByte && in->shape(record) == std::vector<int64_t>{want},
                  "Checkpoint::load(): generator '", g.name, "' in '", path, "' holds ", in->dtype(record), " ",
                  c10::IntArrayRef(in->shape(record)), ", not the ", want, " bytes of its state");
    }
    auto new_ints = read_scalars<int64_t>(state, "ints", [](const std::string&, const nlohmann::json& v) {
      return v.get<int64_t>();
    });
    auto new_doubles = read_scalars<double>(state, "doubles", [&](const std::string& k, const nlohmann::json& v) {
      return detail::parse_exact_double(v.get<std::string>(), "scalar '" + k + "'");
    });
    auto new_strings = read_scalars<std::string>(state, "strings", [](const std::string&, const nlohmann::json& v) {
      return v.get<std::string>();
    });
    std::string new_metadata = state.value("metadata", std::string());
    for (auto& o : optimizers_) {
      TORCH_CHECK(state["optimizers"].contains(o.first), "Checkpoint::load(): '", path, "' holds no optimizer '",
                  o.first, "'");
      try {
        detail::load_optimizer(*o.second, state["optimizers"][o.first], "optimizer." + o.first + ".", *in);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "Checkpoint::load(): optimizer '", o.first, "' in '", path,
                    "' does not match the optimizer: ", e.what_without_backtrace());
      }
    }
    torch::NoGradGuard no_grad;
    for (auto& m : modules_) {
      for (const auto& r : module_records(m.first, *m.second)) in->read_into(r.record, r.tensor);
    }
    for (auto& g : generators_) {
      const std::string record = "generator." + g.name;
      if (!in->has(record)) continue;
      torch::Tensor bytes = torch::empty({in->shape(record)[0]}, torch::kByte);
      in->read_into(record, bytes);
      std::lock_guard<std::mutex> lock(g.generator.mutex());
      g.generator.set_state(bytes);
    }
    ints = std::move(new_ints);
    doubles = std::move(new_doubles);
    strings = std::move(new_strings);
    metadata = std::move(new_metadata);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "Checkpoint::load(): scalar state in '", path, "' is corrupt: ", e.what());
  }
}

bool is_valid_checkpoint(const std::string& path) {
  try {
    const Directory dir = Directory::of_file(path, "is_valid_checkpoint()");
    auto fd = dir.open(base_of(path), O_RDONLY);
    if (!fd.valid()) return false;
    const SafetensorsReader in(std::move(fd), path);
    const auto& meta = in.metadata();
    if (meta.count(kFormatKey) == 0 || meta.at(kFormatKey) != kFormatName || meta.count(kStateKey) == 0) return false;
    const nlohmann::json state = nlohmann::json::parse(meta.at(kStateKey));
    return state.value("version", int64_t{-1}) == kFormatVersion;
  } catch (...) {
    return false;
  }
}

int64_t remove_stale_temporaries(const std::string& path) {
  try {
    return Directory::of_file(path, "remove_stale_temporaries()").remove_stale_temporaries(base_of(path));
  } catch (const c10::Error&) {
    return 0;  // no directory: nothing stale
  }
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  TORCH_CHECK(!path.empty(), "write_file_atomically(): argument 'path' must not be empty");
  Directory::of_file(path, "write_file_atomically()").write_atomically(base_of(path), bytes);
}

}  // namespace contrax::train
