// The ATen operator counter of the tests (see support/op_counter.h).
#include "support/op_counter.h"

#include <mutex>
#include <set>
#include <sstream>
#include <vector>

namespace contrax::testing {

namespace {

std::mutex mutex;
std::map<std::string, int64_t> counts;  // guarded by mutex

// Per thread: for each open operator, whether an operator that launches was
// recorded inside it.
thread_local std::vector<bool> open_ops;

// Operators that make views, metadata or uninitialised storage: no kernel.
bool launches_nothing(const std::string& name) {
  static const std::set<std::string> none{
      "aten::empty",     "aten::empty_strided", "aten::empty_like", "aten::narrow",     "aten::slice",
      "aten::select",    "aten::t",             "aten::transpose",  "aten::diagonal",   "aten::as_strided",
      "aten::view",      "aten::reshape",       "aten::_reshape_alias", "aten::expand", "aten::unsqueeze",
      "aten::squeeze",   "aten::alias",         "aten::detach",     "aten::lift_fresh", "aten::to",
      "aten::contiguous", "aten::resize_",      "aten::set_",       "aten::_unsafe_view", "aten::permute",
      "aten::result_type", "aten::resolve_conj", "aten::resolve_neg", "aten::detach_",  "aten::numpy_T",
      "aten::split",     "aten::unbind",        "aten::chunk",      "aten::split_with_sizes",
      "aten::scalar_tensor"};  // a Scalar wrapped on the host, even beside CUDA tensors
  return none.count(name) > 0;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  open_ops.push_back(false);
  return nullptr;
}

// An operator launches when nothing inside it did (it is the kernel) and it
// is not a view or an allocation; then, and when something inside it did,
// its parent launched something.
void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (open_ops.empty()) return;  // started before the counter
  bool launched = open_ops.back();
  open_ops.pop_back();
  if (!launched) {
    const std::string name = fn.name();
    if (name.rfind("aten::", 0) == 0 && !launches_nothing(name)) {
      launched = true;
      std::lock_guard<std::mutex> lock(mutex);
      ++counts[name];
    }
  }
  if (launched && !open_ops.empty()) open_ops.back() = true;
}

}  // namespace

OpCounter::OpCounter() {
  reset();
  handle_ = at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end).scopes({at::RecordScope::FUNCTION}));
}

OpCounter::~OpCounter() { at::removeCallback(handle_); }

int64_t OpCounter::launches() const {
  std::lock_guard<std::mutex> lock(mutex);
  int64_t n = 0;
  for (const auto& [name, c] : counts) n += c;
  return n;
}

std::map<std::string, int64_t> OpCounter::by_name() const {
  std::lock_guard<std::mutex> lock(mutex);
  return counts;
}

std::string OpCounter::summary() const {
  std::ostringstream os;
  for (const auto& [name, c] : by_name()) os << name << " " << c << ", ";
  return os.str();
}

void OpCounter::reset() {
  std::lock_guard<std::mutex> lock(mutex);
  counts.clear();
}

}  // namespace contrax::testing
