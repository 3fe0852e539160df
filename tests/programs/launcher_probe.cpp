// A worker for tests/launch/launcher_test.cpp: behaves according to its RANK and
// argv so that the test can provoke each way a launched job ends.
//
//   launcher_probe ok              print the launcher's environment, exit 0
//   launcher_probe fail DIR        rank 1 exits 3, the others sleep
//   launcher_probe signal DIR      rank 2 kills itself with SIGKILL, the others sleep
//   launcher_probe stubborn DIR    rank 1 exits 3, the others ignore SIGTERM and sleep
//   launcher_probe sleep DIR       every rank sleeps
//   launcher_probe blame DIR       rank 0 records a failure of its own, then
//                                  rank 1 one caused by its peer; rank 1 exits
//                                  (status 1) before rank 0 (status 4)
//   launcher_probe once DIR        rank 1 exits 3 unless DIR/failed exists (it
//                                  creates it): a worker that fails once
//   launcher_probe stop DIR        rank 1 stops itself (SIGSTOP), rank 0 then
//                                  exits 2 as if its collective had timed out
//   launcher_probe chatter         every rank writes 200 lines in many small
//                                  pieces: lines must arrive whole
//   launcher_probe hog             rank 1 leaves a memory note (as
//                                  contrax::note_worker_memory does), then
//                                  allocates and touches 16 MiB blocks until
//                                  something stops it; the others sleep
//
// With a DIR, every sleeping rank first writes DIR/<rank>.pid, and a failing
// rank waits until all the others have done so: the test then knows exactly
// which processes must be gone afterwards, with no timing guesswork.
#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <algorithm>
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

// The record contrax::record_worker_failure() writes (see src/launch/diagnosis.cpp):
// "<CLOCK_MONOTONIC ns> origin|peer" then the message, in CONTRAX_ERROR_FILE.
void record_failure(const char* kind, const char* what) {
  const char* path = std::getenv("CONTRAX_ERROR_FILE");
  if (path == nullptr) return;
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const long long ns = static_cast<long long>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) return;
  std::fprintf(f, "%lld %s\n%s\n", ns, kind, what);
  std::fclose(f);
}

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

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
  if (mode == "blame") {
    if (rank == 0) {
      // Like the trainer, which catches SIGTERM to finish cleanly.
      signal(SIGTERM, SIG_IGN);
      record_failure("origin", "cannot write run directory");
      std::fprintf(stderr, "error: cannot write '/ro/metrics.jsonl': Read-only file system\n");
      std::fflush(stderr);
      // Rank 0 tears down slowly; its peer notices the failure and exits first.
      std::ofstream(dir + "/0.recorded") << "x";
      usleep(800000);
      return 4;
    }
    while (!exists(dir + "/0.recorded")) usleep(1000);
    record_failure("peer", "collective 'all_reduce' failed: Connection closed by peer");
    std::fprintf(stderr, "error: collective 'all_reduce' failed: Connection closed by peer\n");
    return 1;
  }
  if (mode == "once") {
    if (rank == 1 && !exists(dir + "/failed")) {
      std::ofstream(dir + "/failed") << "x";
      std::fprintf(stderr, "failing once\n");
      return 3;
    }
    std::printf("attempt ok on rank %ld (restart %s)\n", rank, env_str("TORCHELASTIC_RESTART_COUNT").c_str());
    return 0;
  }
  if (mode == "stop") {
    if (rank == 1) {
      write_pid(dir, rank);
      raise(SIGSTOP);
      // Continued by the launcher: behave like a worker that then sees its
      // peer gone and stops.
      return 1;
    }
    wait_for_others(dir, rank, world);
    usleep(200000);  // let rank 1 reach its stop
    std::fprintf(stderr, "collective timed out\n");
    return 2;
  }
  if (mode == "hog") {
    if (rank != 1) sleep_forever();
    if (const char* err = std::getenv("CONTRAX_ERROR_FILE")) {
      if (FILE* f = std::fopen((std::string(err) + ".memory").c_str(), "w")) {
        std::fprintf(f, "allocating 16 MiB blocks until it is stopped\n");
        std::fclose(f);
      }
    }
    for (;;) {
      char* block = static_cast<char*>(std::malloc(16 << 20));
      if (block == nullptr) return 5;
      for (size_t i = 0; i < (16u << 20); i += 4096) block[i] = 1;
    }
  }
  if (mode == "chatter") {
    // Unbuffered pieces of lines, so a launcher that forwarded raw reads
    // would interleave ranks mid-line.
    for (int i = 0; i < 200; ++i) {
      const std::string line = "rank" + std::to_string(rank) + "-line" + std::to_string(i) + "-" +
                               std::string(50, static_cast<char>('a' + rank)) + "\n";
      for (size_t off = 0; off < line.size(); off += 7) {
        const size_t n = std::min<size_t>(7, line.size() - off);
        ssize_t ignored = write(1, line.data() + off, n);
        (void)ignored;
        if (off % 21 == 0) usleep(50);
      }
    }
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
