// A worker for tests/launcher_test.cpp: behaves according to its RANK and
// argv so that the test can provoke each way a launched job ends.
//
//   launcher_probe ok              print the launcher's environment, exit 0
//   launcher_probe fail DIR        rank 1 exits 3, the others sleep
//   launcher_probe signal DIR      rank 2 kills itself with SIGKILL, the others sleep
//   launcher_probe stubborn DIR    rank 1 exits 3, the others ignore SIGTERM and sleep
//   launcher_probe sleep DIR       every rank sleeps
//
// With a DIR, every sleeping rank first writes DIR/<rank>.pid, and a failing
// rank waits until all the others have done so: the test then knows exactly
// which processes must be gone afterwards, with no timing guesswork.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace {

long env_int(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atol(v) : -1;
}

std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "<unset>";
}

void write_pid(const std::string& dir, long rank) {
  // Write then rename: the test must never read a half-written file.
  const std::string path = dir + "/" + std::to_string(rank) + ".pid";
  {
    std::ofstream f(path + ".tmp");
    f << getpid() << "\n";
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

void wait_for_others(const std::string& dir, long rank, long world) {
  for (int tries = 0; tries < 3000; ++tries) {  // at most 30 s: LibTorch loads slowly on a busy machine
    bool all = true;
    for (long r = 0; r < world && all; ++r) {
      if (r != rank && access((dir + "/" + std::to_string(r) + ".pid").c_str(), F_OK) != 0) all = false;
    }
    if (all) return;
    usleep(10000);
  }
}

[[noreturn]] void sleep_forever() {
  // sleep() returns early on a caught or ignored-then-delivered signal; a
  // stubborn worker must really stay until SIGKILL.
  for (;;) sleep(60);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "ok";
  const std::string dir = argc > 2 ? argv[2] : "";
  const long rank = env_int("RANK"), world = env_int("WORLD_SIZE");

  if (mode == "ok") {
    std::printf("env RANK=%s LOCAL_RANK=%s WORLD_SIZE=%s LOCAL_WORLD_SIZE=%s GROUP_RANK=%s MASTER_ADDR=%s MASTER_PORT=%s\n",
                env_str("RANK").c_str(), env_str("LOCAL_RANK").c_str(), env_str("WORLD_SIZE").c_str(),
                env_str("LOCAL_WORLD_SIZE").c_str(), env_str("GROUP_RANK").c_str(), env_str("MASTER_ADDR").c_str(),
                env_str("MASTER_PORT").c_str());
    std::fprintf(stderr, "stderr of rank %ld\n", rank);
    return 0;
  }
  const bool fail = mode == "fail" || mode == "stubborn";
  if ((fail && rank == 1) || (mode == "signal" && rank == 2)) {
    wait_for_others(dir, rank, world);
    if (mode == "signal") raise(SIGKILL);
    return 3;
  }
  if (mode == "stubborn") signal(SIGTERM, SIG_IGN);
  if (fail || mode == "signal" || mode == "sleep") {
    write_pid(dir, rank);
    sleep_forever();
  }
  std::fprintf(stderr, "launcher_probe: unknown mode '%s'\n", mode.c_str());
  return 2;
}
