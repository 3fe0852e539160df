// The POSIX helpers of the launcher: a clock shared by every process of the
// machine, descriptors closed once, writes that finish, directories made.
// Internal to the launcher (src/launch/), not installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "util/files.h"  // errno_text

namespace contrax::detail {

/// CLOCK_MONOTONIC in nanoseconds: the workers' failure records and the
/// launcher compare on it.
int64_t monotonic_ns();

/// Closes `fd` (when >= 0) and sets it to -1. Linux closes the descriptor
/// even when close() reports EINTR; retrying could close a descriptor another
/// thread just opened.
void close_fd(int& fd);

/// write() until done: short writes happen on pipes, EINTR whenever a signal
/// arrives. EPIPE (the reader went away) drops the output rather than killing
/// the launcher, which would orphan the workers.
void write_all(int fd, const char* data, size_t size);

/// mkdir -p; errors name the directory (`what` says which: "log directory").
void make_dirs(const std::string& dir, const char* what);

}  // namespace contrax::detail
