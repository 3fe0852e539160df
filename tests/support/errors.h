// Assertion helpers: the statement throws a c10::Error whose message contains
// the expected text (the suite tests every user-facing error message).
#pragma once

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace contrax::testing {

/// The message of the c10::Error that `fn` throws, "" when it throws none:
///   EXPECT_NE(error_of([&] { f(bad); }).find("argument 'x'"), std::string::npos);
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace contrax::testing

#define CONTRAX_EXPECT_ERROR(statement, substring)                                                 \
  do {                                                                                             \
    bool contrax_threw_ = false;                                                                   \
    try {                                                                                          \
      statement;                                                                                   \
    } catch (const c10::Error& e) {                                                                \
      contrax_threw_ = true;                                                                       \
      std::string msg = e.what_without_backtrace();                                                \
      EXPECT_NE(msg.find(substring), std::string::npos) << "message was: " << msg;               \
    }                                                                                              \
    EXPECT_TRUE(contrax_threw_) << "expected an error containing: " << (substring);                \
  } while (0)

namespace contrax::testing {

/// Expects `fn` to throw a c10::Error whose message contains `text`.
inline void expect_error(const std::function<void()>& fn, const std::string& text) {
  CONTRAX_EXPECT_ERROR(fn(), text);
}

}  // namespace contrax::testing
