// The test programs' main: GoogleTest's, with deprecation warnings made
// errors on the main thread (support/strict_warnings.h).
#include <gtest/gtest.h>

#include "support/strict_warnings.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  contrax::testing::install_strict_warnings();
  return RUN_ALL_TESTS();
}
