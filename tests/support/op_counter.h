// Counting the ATen operators a piece of code runs, by a process-wide
// RecordFunction callback: what the tests use to bound the launches a loss
// call would make on a GPU without one. An operator counts as a launch when
// no operator recorded inside it launches and it is not one that only makes a
// view or an uninitialised tensor (narrow, t, empty, a no-op `to`, ...): on
// CUDA each such operator is one kernel (or one copy). Composite operators
// (zeros = empty + zero_, to = _to_copy + copy_) count through what they
// run; mm counts though it records a resolve_conj inside.
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <map>
#include <string>

namespace contrax::testing {

/// Counts from construction to destruction (one at a time per process).
///
///   OpCounter ops;
///   auto loss = clip_loss(...); loss.backward();
///   EXPECT_LE(ops.launches(), bound) << ops.summary();
class OpCounter {
 public:
  OpCounter();
  ~OpCounter();
  C10_DISABLE_COPY_AND_ASSIGN(OpCounter);

  /// Leaf operators that launch work (see above).
  int64_t launches() const;
  /// Launches per operator name.
  std::map<std::string, int64_t> by_name() const;
  /// "aten::mm 8, aten::exp_ 4, ..." for a failure message.
  std::string summary() const;
  /// Forgets what was counted so far.
  void reset();

 private:
  at::CallbackHandle handle_;
};

}  // namespace contrax::testing
