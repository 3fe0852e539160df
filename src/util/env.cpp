// Environment switches (see util/env.h).
#include "util/env.h"

#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

namespace contrax::detail {

bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return !(v && std::strcmp(v, "0") == 0);
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "1") == 0;
}

int64_t env_int(const char* name, int64_t def, const char* expected, const char* who) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0', who, ": environment variable '", name, "' must be ", expected, ", but got '", v,
              "'");
  return x;
}

}  // namespace contrax::detail
