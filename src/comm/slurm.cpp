// SLURM's host lists (see contrax/comm/slurm.h).
#include "contrax/comm/slurm.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace contrax {

namespace {

constexpr size_t kMaxHosts = 1 << 20;  // a corrupt range must not allocate without bound

// The entries of a list, split at top-level commas (commas inside brackets
// separate ranges).
std::vector<std::string> top_level_entries(const std::string& list) {
  std::vector<std::string> entries;
  int depth = 0;
  std::string cur;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    TORCH_CHECK(depth >= 0 && depth <= 1, "expand_slurm_nodelist(): unbalanced or nested brackets in '", list, "'");
    if (c == ',' && depth == 0) {
      entries.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  TORCH_CHECK(depth == 0, "expand_slurm_nodelist(): unbalanced brackets in '", list, "'");
  entries.push_back(cur);
  return entries;
}

// The numbers of one bracket group "01-03,07" (zero padding of each lower
// bound kept, as SLURM does: node[01-10]).
std::vector<std::string> bracket_numbers(const std::string& group, const std::string& list) {
  std::vector<std::string> items;
  std::stringstream ranges(group);
  std::string range;
  while (std::getline(ranges, range, ',')) {
    const size_t dash = range.find('-');
    const std::string lo = range.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
    TORCH_CHECK(!lo.empty() && !hi.empty() && lo.find_first_not_of("0123456789") == std::string::npos &&
                    hi.find_first_not_of("0123456789") == std::string::npos && lo.size() <= 9 && hi.size() <= 9,
                "expand_slurm_nodelist(): range '", range, "' in '", list, "' is not N or N-M");
    const long a = std::stol(lo), b = std::stol(hi);
    TORCH_CHECK(a <= b, "expand_slurm_nodelist(): range '", range, "' in '", list, "' is descending");
    TORCH_CHECK(static_cast<size_t>(b - a) < kMaxHosts, "expand_slurm_nodelist(): range '", range, "' in '", list,
                "' is too long");
    for (long v = a; v <= b; ++v) {
      std::string num = std::to_string(v);
      if (num.size() < lo.size()) num = std::string(lo.size() - num.size(), '0') + num;
      items.push_back(num);
    }
  }
  return items;
}

// The hosts of one entry, its bracket groups expanded left to right:
// "rack[1-2]-n[01,03]" has four hosts.
std::vector<std::string> expand_entry(const std::string& entry, const std::string& list) {
  std::vector<std::string> partial{""};
  size_t pos = 0;
  while (pos < entry.size()) {
    const size_t open = entry.find('[', pos);
    const std::string literal = entry.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    for (auto& p : partial) p += literal;
    if (open == std::string::npos) break;
    const size_t close = entry.find(']', open);
    const auto items = bracket_numbers(entry.substr(open + 1, close - open - 1), list);
    std::vector<std::string> next;
    for (const auto& p : partial) {
      for (const auto& it : items) next.push_back(p + it);
    }
    TORCH_CHECK(next.size() <= kMaxHosts, "expand_slurm_nodelist(): '", list, "' names too many hosts");
    partial.swap(next);
    pos = close + 1;
  }
  return partial;
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(const std::string& list) {
  std::vector<std::string> hosts;
  for (const auto& entry : top_level_entries(list)) {
    if (entry.empty()) continue;
    const auto expanded = expand_entry(entry, list);
    hosts.insert(hosts.end(), expanded.begin(), expanded.end());
    TORCH_CHECK(hosts.size() <= kMaxHosts, "expand_slurm_nodelist(): '", list, "' names too many hosts");
  }
  return hosts;
}

}  // namespace contrax
