// What the offline build (offline_build_test.sh) compiles and runs: one
// translation unit against each dependency the offline bundle supplies, as
// the tool's own sources use them: c10d's Gloo process group (Gloo's headers,
// which PyPI's wheels lack, under the machine's torch), CLI11, nlohmann's
// JSON and GoogleTest. The rest of the tool compiles against the very same
// headers in the normal build: the test checks that the bundle holds the
// versions installed there. LibTorch's headers, not its libraries: they are
// the machine's own, which the bundle does not supply.
#include <CLI/CLI.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/version.h>

#include <iostream>
#include <type_traits>

TEST(OfflineBundle, JsonRoundTrips) {
  const auto parsed = nlohmann::json::parse(R"({"batch": 512})");
  EXPECT_EQ(parsed.at("batch").get<int>(), 512);
}

TEST(OfflineBundle, CliParsesAFlag) {
  CLI::App app{"offline probe"};
  int batch = 0;
  app.add_option("--batch", batch);
  app.parse("--batch 64", false);
  EXPECT_EQ(batch, 64);
}

TEST(OfflineBundle, GlooProcessGroupIsDeclared) {
  // Compiled, not linked against LibTorch: the Gloo process group's header
  // (which includes Gloo's own) declares what the communicator uses.
  static_assert(std::is_base_of_v<c10d::Backend, c10d::ProcessGroupGloo>);
  static_assert(std::is_base_of_v<c10d::Backend::Options, c10d::ProcessGroupGloo::Options>);
  EXPECT_GT(sizeof(::gloo::transport::Device*), 0u);
}

int main(int argc, char** argv) {
  std::cout << "offline probe: torch " << TORCH_VERSION << ", CLI11 " << CLI11_VERSION << ", nlohmann_json "
            << NLOHMANN_JSON_VERSION_MAJOR << "." << NLOHMANN_JSON_VERSION_MINOR << "."
            << NLOHMANN_JSON_VERSION_PATCH << "\n";
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
