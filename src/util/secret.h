// Unpredictable strings from the kernel's random source (internal, not
// installed): a job's shared secret (the launcher's CONTRAX_JOB_SECRET) and
// the names of temporaries that nobody can plant a link at in advance.
#pragma once

#include <cstddef>
#include <string>

namespace contrax::detail {

/// `bytes` random bytes (getrandom) as 2 x `bytes` lowercase hex digits.
std::string random_hex(size_t bytes);

}  // namespace contrax::detail
