// The main of the test programs below the engine (tests/util, launch, comm):
// GoogleTest's, with deprecation warnings made errors on the main thread
// (support/strict_warnings.h). From the engine up the programs take
// support/emulated_cuda_main.cpp instead, which adds the emulated CUDA walk.
#include <gtest/gtest.h>

#include "support/strict_warnings.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  contrax::testing::install_strict_warnings();
  return RUN_ALL_TESTS();
}
