// Deprecation warnings as errors in the test programs (issue 38, item 6): a
// test that calls a deprecated spelling of Contrax's or PyTorch's fails where
// it calls it, instead of printing a line nobody reads. c10's warning handler
// is per thread, so the rank harness installs it in each rank thread too.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace contrax::testing {

/// Makes every TORCH_WARN / TORCH_WARN_ONCE on this thread whose message says
/// "deprecated" throw (as a c10::Error naming the warning); other warnings go
/// to the handler that was there before. A test that checks a deprecation
/// warning on purpose installs its own handler around the call.
void install_strict_warnings();

/// Collects the warnings raised on this thread while alive, instead of
/// passing them on: how a test checks a warning, deprecations included.
class WarningCapture : public c10::WarningHandler {
 public:
  WarningCapture() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
  }
  ~WarningCapture() override { c10::WarningUtils::set_warning_handler(previous_); }
  C10_DISABLE_COPY_AND_ASSIGN(WarningCapture);
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  std::vector<std::string> messages;

 private:
  c10::WarningHandler* previous_;
};

}  // namespace contrax::testing
