// Unpredictable strings (see util/secret.h).
#include "util/secret.h"

#include <sys/random.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <vector>

#include "util/files.h"

namespace contrax::detail {

std::string random_hex(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n > 0, "random_hex(): getrandom failed: ", errno_text(errno));
    got += static_cast<size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : raw) {
    s += hex[c >> 4];
    s += hex[c & 15];
  }
  return s;
}

}  // namespace contrax::detail
