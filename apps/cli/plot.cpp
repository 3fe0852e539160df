// Drawing a run's curves with the plotting script (see plot.h).
#include "cli/plot.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "contrax/launch/launcher.h"

namespace fs = std::filesystem;

namespace contrax::cli {

std::string plot_script() {
  if (const char* env = std::getenv("CONTRAX_PLOT_SCRIPT")) return env;
  const fs::path exe_dir = fs::path(contrax::self_executable()).parent_path();
  for (const fs::path& p : {exe_dir / "plot_run.py", exe_dir / "../share/contrax/plot_run.py"}) {
    std::error_code ec;
    if (fs::exists(p, ec)) return p.lexically_normal().string();
  }
  return "";
}

int plot_run(const std::string& dir, bool quiet) {
  const std::string script = plot_script();
  if (script.empty()) {
    std::cerr << "contrax plot: the plotting script plot_run.py is not next to " << contrax::self_executable()
              << " nor in ../share/contrax (set CONTRAX_PLOT_SCRIPT)\n";
    return 1;
  }
  // CONTRAX_PYTHON, else the interpreter the build was configured with
  // (tools/setup.sh: .venv's, with matplotlib from PyPI), else Debian's, where
  // python3-matplotlib installs it (a python3 earlier on PATH, e.g. pyenv's,
  // would not see it), else PATH's.
  std::string python = "python3";
  if (const char* env = std::getenv("CONTRAX_PYTHON")) {
    python = env;
#ifdef CONTRAX_PLOT_PYTHON
  } else if (::access(CONTRAX_PLOT_PYTHON, X_OK) == 0) {
    python = CONTRAX_PLOT_PYTHON;
#endif
  } else if (::access("/usr/bin/python3", X_OK) == 0) {
    python = "/usr/bin/python3";
  }
  const pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "cannot start ", python, ": ", std::strerror(errno));
  if (pid == 0) {
    if (quiet) {
      const int devnull = ::open("/dev/null", O_WRONLY);
      if (devnull >= 0) ::dup2(devnull, STDOUT_FILENO);
    }
    ::execlp(python.c_str(), python.c_str(), script.c_str(), dir.c_str(), static_cast<char*>(nullptr));
    std::fprintf(stderr, "contrax plot: cannot run %s: %s (set CONTRAX_PYTHON to a python3 with matplotlib)\n",
                 python.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace contrax::cli
