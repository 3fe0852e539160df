// Deprecation warnings as errors (see support/strict_warnings.h).
#include "support/strict_warnings.h"

#include <c10/util/Exception.h>

#include <string>

namespace contrax::testing {

namespace {

class DeprecationsAreErrors : public c10::WarningHandler {
 public:
  explicit DeprecationsAreErrors(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    TORCH_CHECK(warning.msg().find("deprecated") == std::string::npos,
                "a deprecation warning, which the test suite treats as an error: ", warning.msg());
    next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

}  // namespace

void install_strict_warnings() {
  auto* current = c10::WarningUtils::get_warning_handler();
  if (dynamic_cast<DeprecationsAreErrors*>(current) != nullptr) return;
  // One per thread that asks, alive until the process ends: the handler is
  // a thread's setting, and a rank thread's warnings may come after it ends
  // (a warning raised in a destructor).
  thread_local DeprecationsAreErrors handler(current);
  c10::WarningUtils::set_warning_handler(&handler);
}

}  // namespace contrax::testing
