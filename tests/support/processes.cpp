// Background processes, temporary directories and network namespaces for the
// tests that start real jobs (see processes.h).
#include "support/processes.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace contrax::testing {

namespace {
bool sh(const std::string& cmd) { return std::system((cmd + " > /dev/null 2>&1").c_str()) == 0; }
}  // namespace

Proc spawn(const std::string& cmd, const std::string& out) {
  Proc p;
  p.out = out;
  std::fflush(nullptr);
  p.pid = ::fork();
  if (p.pid == 0) {
    ::setpgid(0, 0);
    ::execl("/bin/sh", "sh", "-c", ("exec " + cmd + " > '" + out + "' 2>&1").c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return p;
}

int wait_for(const Proc& p, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int st = 0;
  for (;;) {
    if (::waitpid(p.pid, &st, WNOHANG) == p.pid) break;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(-p.pid, SIGKILL);
      ::waitpid(p.pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

TempDir::TempDir(const std::string& prefix) {
  std::string templ = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
  if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("TempDir: mkdtemp failed for " + templ);
  path = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

namespace {
// The process's scratch TempDir; only the process that made it removes it.
struct Scratch {
  TempDir dir{"contrax_tests"};
  pid_t owner = ::getpid();
  ~Scratch() {
    if (::getpid() != owner) dir.path = "/nonexistent";  // a forked child: not ours to remove
  }
};
}  // namespace

std::string scratch_path(const std::string& name) {
  static Scratch scratch;
  const std::string p = scratch.dir.path + "/" + name;
  std::filesystem::remove_all(p);
  return p;
}

std::string scratch_dir(const std::string& name) {
  const std::string p = scratch_path(name);
  std::filesystem::create_directories(p);
  return p;
}

int64_t count_lines(const std::string& path) {
  std::ifstream in(path);
  int64_t n = 0;
  std::string line;
  while (std::getline(in, line)) ++n;
  return n;
}

std::vector<std::string> losses_of(const std::string& metrics_jsonl) {
  std::ifstream in(metrics_jsonl);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto p = line.find("\"loss\":");
    if (p == std::string::npos) continue;
    out.push_back(line.substr(p + 7, line.find(',', p) - p - 7));
  }
  return out;
}

TwoNodes::TwoNodes() {
  const std::string id = std::to_string(::getpid() % 100000);
  ns_[0] = "cxa" + id;
  ns_[1] = "cxb" + id;
  veth_[0] = "cxv" + id + "a";
  veth_[1] = "cxv" + id + "b";
  if (!sh("command -v ip")) {
    reason_ = "the `ip` tool (iproute2) is not installed";
    return;
  }
  if (!sh("ip netns add " + ns_[0])) {
    reason_ = "`ip netns add` is not permitted here (needs CAP_NET_ADMIN)";
    return;
  }
  made_[0] = true;
  made_[1] = sh("ip netns add " + ns_[1]);
  bool ok = made_[1] && sh("ip link add " + veth_[0] + " type veth peer name " + veth_[1]);
  for (int i = 0; ok && i < 2; ++i) {
    ok = sh("ip link set " + veth_[i] + " netns " + ns_[i]) &&
         sh("ip -n " + ns_[i] + " addr add " + address(i) + "/24 dev " + veth_[i]) &&
         sh("ip -n " + ns_[i] + " link set " + veth_[i] + " up") && sh("ip -n " + ns_[i] + " link set lo up");
  }
  if (!ok) reason_ = "could not set up the veth pair between the namespaces";
}

TwoNodes::~TwoNodes() {
  // Deleting a namespace deletes its end of the veth pair, and with it the pair.
  for (int i = 0; i < 2; ++i) {
    if (made_[i]) sh("ip netns del " + ns_[i]);
  }
}

}  // namespace contrax::testing
