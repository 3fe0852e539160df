// Reading checkpoints of Contrax's earlier format (versions 1 and 2: a
// TorchScript archive written by torch::serialize::OutputArchive), only when
// the caller says it trusts the file (see Checkpoint::load_legacy). LibTorch
// reads such an archive with torch::jit::load, which compiles and runs the
// TorchScript stored in it (a module's __setstate__, say) before anything
// can be checked: a crafted file runs code of its author's choosing. This
// reader exists so that a run begun before the safetensors format can be
// resumed, and converted, by the person who wrote its checkpoint.
#include "contrax/train/common/checkpoint.h"

#include <c10/util/Type.h>

#include <fstream>
#include <typeinfo>


namespace contrax::train {
namespace {

constexpr const char* kLegacyFormatKey = "contrax_checkpoint_format";
constexpr int64_t kLegacyNewest = 2, kLegacyOldest = 1;

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
  if (advice != std::string::npos) s = s.substr(0, advice);
  // A crafted pickle can fail with an empty message (round five, item 6).
  return s.empty() ? "the reader gave no reason (" + c10::demangle(typeid(e).name()) + ")" : s;
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

// The device of the first registered module that has parameters (none: the
// archive's own): Module::load adopts the archive's tensors themselves, so
// they must be read onto the model's device.
c10::optional<torch::Device> device_of(const std::vector<std::pair<std::string, torch::nn::Module*>>& modules) {
  for (const auto& m : modules) {
    const auto params = m.second->parameters();
    if (!params.empty()) return params.front().device();
  }
  return c10::nullopt;
}

}  // namespace

bool is_legacy_checkpoint(const std::string& path) {
  // A zip archive's local file header: every TorchScript archive starts so,
  // a safetensors file never does (its first 8 bytes are a header size).
  char magic[4] = {};
  std::ifstream in(path, std::ios::binary);
  return in.read(magic, 4) && std::string(magic, 4) == std::string("PK\x03\x04", 4);
}

void Checkpoint::load_legacy(const std::string& path) {
  torch::serialize::InputArchive ar;
  try {
    ar.load_from(path, device_of(modules_));
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "Checkpoint::load_legacy(): '", path, "' is not a readable checkpoint of the earlier format: ",
                archive_error(e));
  }
  c10::IValue version;
  TORCH_CHECK(ar.try_read(kLegacyFormatKey, version) && version.isInt() && version.toInt() >= kLegacyOldest &&
                  version.toInt() <= kLegacyNewest,
              "Checkpoint::load_legacy(): '", path, "' is not a contrax checkpoint of format version 1 or 2");
  for (auto& m : modules_) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(ar.try_read("module." + m.first, sub), "Checkpoint::load_legacy(): '", path, "' holds no module '",
                m.first, "'");
    try {
      check_module_matches(*m.second, sub, "");
      m.second->load(sub);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "Checkpoint::load_legacy(): module '", m.first, "' in '", path,
                  "' does not match the model: ", first_line(e));
    }
  }
  for (auto& o : optimizers_) {
    torch::serialize::InputArchive sub;
    TORCH_CHECK(ar.try_read("optimizer." + o.first, sub), "Checkpoint::load_legacy(): '", path,
                "' holds no optimizer '", o.first, "'");
    o.second->load(sub);
  }
  for (auto& g : generators_) {
    torch::Tensor state;
    const bool found = ar.try_read("generator." + g.name, state, /*is_buffer=*/true);
    TORCH_CHECK(found || !g.required, "Checkpoint::load_legacy(): '", path, "' holds no generator '", g.name, "'");
    if (!found) continue;
    auto cpu_state = generator_state_on_cpu(state, g.name);
    std::lock_guard<std::mutex> lock(g.generator.mutex());
    g.generator.set_state(cpu_state);
  }
  ints = read_map<int64_t>(ar, "ints");
  doubles = read_map<double>(ar, "doubles");
  strings = read_map<std::string>(ar, "strings");
  c10::IValue meta;
  ar.read("metadata", meta);
  metadata = meta.toStringRef();
}

}  // namespace contrax::train
