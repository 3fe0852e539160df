// Environment switches (see util/env.h).
#include "util/env.h"

#include <cstdlib>
#include <cstring>

namespace contrax::detail {

bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return !(v && std::strcmp(v, "0") == 0);
}

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "1") == 0;
}

}  // namespace contrax::detail
