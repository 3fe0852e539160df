// The main of the test programs from the engine up (support/main.cpp's
// below): GoogleTest's, with deprecation warnings made errors on the main
// thread (support/strict_warnings.h). With
// CONTRAX_TEST_EMULATED_CUDA=<multiprocessors> in the environment the whole
// program runs the engine's CUDA walk on the CPU, its panel kernels under the
// SIMT emulator (support/emulated_panels.h), and fails unless some tile
// reached them: how tests/CMakeLists.txt runs the exactness suites a second
// time, as a GPU would run them.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "engine/lse_kernels.h"
#include "support/emulated_panels.h"
#include "support/strict_warnings.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  contrax::testing::install_strict_warnings();
  std::unique_ptr<contrax::testing::EmulatedCudaWalk> emulated;
  if (const char* sms = std::getenv("CONTRAX_TEST_EMULATED_CUDA")) {
    emulated = std::make_unique<contrax::testing::EmulatedCudaWalk>(std::atoi(sms));
  }
  const int64_t calls = contrax::detail::cuda_panel_calls();
  const int status = RUN_ALL_TESTS();
  if (emulated && contrax::detail::cuda_panel_calls() == calls) {
    std::fprintf(stderr, "CONTRAX_TEST_EMULATED_CUDA is set, but no tile reached the emulated CUDA kernels\n");
    return 1;
  }
  return status;
}
