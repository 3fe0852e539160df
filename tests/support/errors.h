// Assertion helper: the statement throws a c10::Error whose message contains
// the expected text (the suite tests every user-facing error message).
#pragma once

#include <gtest/gtest.h>

#include <string>

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
