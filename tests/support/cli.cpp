#include "support/cli.h"

#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace contrax::testing {

namespace {

double children_cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_CHILDREN, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

}  // namespace

CliRun run_shell(const std::string& cmd) {
  CliRun r;
  const double cpu0 = children_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = ::pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.cpu_seconds = children_cpu_seconds() - cpu0;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

CliRun run_cli(const std::string& args) { return run_shell(std::string(CONTRAX_CLI_PATH) + " " + args + " 2>&1"); }

CliRun run_cli_in(const std::string& dir, const std::string& args) {
  return run_shell("cd '" + dir + "' && " + std::string(CONTRAX_CLI_PATH) + " " + args + " 2>&1");
}

CliRun run_cli_stdout(const std::string& args) {
  return run_shell(std::string(CONTRAX_CLI_PATH) + " " + args + " 2>/dev/null");
}

void expect_exit(const CliRun& run, int status, const std::string& text) {
  EXPECT_EQ(run.status, status) << run.out;
  EXPECT_NE(run.out.find(text), std::string::npos) << run.out;
}

bool have_fashion_mnist() {
  std::ifstream f("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
  return f.good();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace contrax::testing
