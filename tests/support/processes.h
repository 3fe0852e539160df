// Background processes and a two-host network for tests that start real
// jobs: a command in its own process group with its output in a file, a wait
// with a hard limit, a temporary directory, and two network namespaces joined
// by a veth pair.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <c10/macros/Macros.h>

namespace contrax::testing {

/// A shell command started in its own process group, output in `out`.
struct Proc {
  pid_t pid = -1;
  std::string out;
};

/// Starts `sh -c "exec CMD > OUT 2>&1"` in a new process group.
Proc spawn(const std::string& cmd, const std::string& out);

/// Exit status (or 128 + signal), or -1 when the group had to be killed after `limit`.
int wait_for(const Proc& p, std::chrono::seconds limit);

/// A fresh directory under the system's temporary folder, removed at scope exit.
struct TempDir {
  explicit TempDir(const std::string& prefix = "contrax_test");
  ~TempDir();
  C10_DISABLE_COPY_AND_ASSIGN(TempDir);
  std::string path;
};

/// `<this test process's scratch folder>/<name>`, removed first if it exists
/// and not created. The scratch folder is one TempDir ("contrax_tests_*") made
/// on first use and removed when the test process exits, so a run of the suite
/// leaves nothing behind in the temporary folder (a forked child's exit leaves
/// it alone).
std::string scratch_path(const std::string& name);

/// scratch_path(name), created.
std::string scratch_dir(const std::string& name);

/// The lines of a file (0 when it does not exist yet), e.g. the steps a run
/// has logged to metrics.jsonl so far.
int64_t count_lines(const std::string& path);

/// The `"loss":` values of a metrics.jsonl, as written (17 digits).
std::vector<std::string> losses_of(const std::string& metrics_jsonl);

/// Two network namespaces joined by a veth pair, 10.77.0.1/24 and
/// 10.77.0.2/24 (addresses that exist only inside them), removed at scope
/// exit. Needs CAP_NET_ADMIN; `skip_reason()` says why not when it failed.
class TwoNodes {
 public:
  TwoNodes();
  ~TwoNodes();
  C10_DISABLE_COPY_AND_ASSIGN(TwoNodes);
  const std::string& skip_reason() const { return reason_; }
  const std::string& ns(int i) const { return ns_[i]; }
  const std::string& veth(int i) const { return veth_[i]; }
  static std::string address(int i) { return i == 0 ? "10.77.0.1" : "10.77.0.2"; }

 private:
  std::string ns_[2], veth_[2], reason_;
  bool made_[2] = {false, false};
};

}  // namespace contrax::testing
