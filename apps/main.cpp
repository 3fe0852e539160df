// Entry point of the `contrax` tool: dispatches to the registered subcommands.
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <iostream>

#include "cli.h"

namespace contrax::cli {

std::map<std::string, CommandInfo>& registry() {
  static std::map<std::string, CommandInfo> commands;
  return commands;
}

Args::Args(std::string command, const std::vector<std::string>& args) : command_(std::move(command)) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      rest_.assign(args.begin() + i + 1, args.end());
      break;
    }
    if (a.rfind("--", 0) != 0) {
      rest_.assign(args.begin() + i, args.end());
      break;
    }
    std::string name = a.substr(2), value;
    auto eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) {
      value = args[++i];
    } else {
      value = "\x01";  // boolean flag
    }
    if (name == "help") {
      help_ = true;
      continue;
    }
    values_[name] = value;
    order_.push_back(name);
  }
}

std::string Args::get(const std::string& name, const std::string& def, const std::string& help) {
  help_lines_.push_back("  --" + name + " (default: " + (def.empty() ? "\"\"" : def) + ")  " + help);
  used_[name] = true;
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  TORCH_CHECK(it->second != "\x01", "flag '--", name, "' needs a value");
  return it->second;
}

int64_t Args::get_int(const std::string& name, int64_t def, const std::string& help) {
  std::string v = get(name, std::to_string(def), help);
  try {
    size_t pos = 0;
    int64_t x = std::stoll(v, &pos);
    TORCH_CHECK(pos == v.size(), "");
    return x;
  } catch (...) {
    TORCH_CHECK(false, "flag '--", name, "' must be an integer, but got '", v, "'");
  }
}

double Args::get_double(const std::string& name, double def, const std::string& help) {
  std::ostringstream d;
  d << def;
  std::string v = get(name, d.str(), help);
  try {
    size_t pos = 0;
    double x = std::stod(v, &pos);
    TORCH_CHECK(pos == v.size(), "");
    return x;
  } catch (...) {
    TORCH_CHECK(false, "flag '--", name, "' must be a number, but got '", v, "'");
  }
}

std::vector<int64_t> Args::get_int_list(const std::string& name, const std::string& def, const std::string& help) {
  const std::string v = get(name, def, help);
  std::vector<int64_t> out;
  std::stringstream ss(v);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      size_t pos = 0;
      out.push_back(std::stoll(item, &pos));
      TORCH_CHECK(pos == item.size(), "");
    } catch (...) {
      TORCH_CHECK(false, "flag '--", name, "' must be comma-separated integers, but got '", v, "'");
    }
  }
  return out;
}

std::string blas_library() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    auto pos = line.find('/');
    if (pos == std::string::npos) continue;
    std::string path = line.substr(pos);
    if (path.find("blas") != std::string::npos || path.find("mkl") != std::string::npos) return path;
  }
  return "unknown";
}

bool Args::flag(const std::string& name, const std::string& help) {
  help_lines_.push_back("  --" + name + "  " + help);
  used_[name] = true;
  auto it = values_.find(name);
  if (it == values_.end()) return false;
  if (it->second == "\x01" || it->second == "1" || it->second == "true") return true;
  if (it->second == "0" || it->second == "false") return false;
  // "--flag positional": the value was really the first positional argument.
  rest_.insert(rest_.begin(), it->second);
  return true;
}

bool Args::finish() {
  if (help_) {
    std::cout << "usage: contrax " << command_ << " [flags]\n";
    for (const auto& l : help_lines_) std::cout << l << "\n";
    return true;
  }
  for (const auto& n : order_) {
    TORCH_CHECK(used_.count(n), "unknown flag '--", n, "' (see contrax ", command_, " --help)");
  }
  return false;
}

}  // namespace contrax::cli

int main(int argc, char** argv) {
  using namespace contrax::cli;
  auto usage = [] {
    std::cout << "usage: contrax COMMAND [flags]   (contrax COMMAND --help for its flags)\n\ncommands:\n";
    for (const auto& [name, info] : registry()) std::cout << "  " << name << "  " << info.summary << "\n";
  };
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    usage();
    return argc < 2 ? 2 : 0;
  }
  auto it = registry().find(argv[1]);
  if (it == registry().end()) {
    std::cerr << "contrax: unknown command '" << argv[1] << "'\n";
    usage();
    return 2;
  }
  std::vector<std::string> args(argv + 2, argv + argc);
  try {
    return it->second.run(args);
  } catch (const c10::Error& e) {
    std::cerr << "contrax " << argv[1] << ": error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "contrax " << argv[1] << ": error: " << e.what() << "\n";
    return 1;
  }
}
