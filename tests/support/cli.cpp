#include "support/cli.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>

namespace contrax::testing {

CliRun run_cli(const std::string& args) {
  const std::string cmd = std::string(CONTRAX_CLI_PATH) + " " + args + " 2>&1";
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace contrax::testing
