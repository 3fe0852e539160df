// Files opened so that no link planted by someone else is followed
// (internal, not installed). A run directory is a place other users may
// reach (a shared file system, a directory made by someone else): a
// symbolic link named like a run's file would make a truncate, an append or
// a checkpoint write land wherever the link points. So every file of a run
// is opened by name relative to an opened directory, with O_NOFOLLOW;
// temporaries are created with O_EXCL under unpredictable names; and where
// the caller asks for it (the run directory), a directory or file that
// belongs to another user is refused by name.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

namespace contrax::detail {

/// "No space left on device (ENOSPC)": the text is what people read, the
/// symbolic name what they search for.
std::string errno_text(int err);

/// A file descriptor that closes itself; -1 when none.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  /// Gives up ownership: the caller closes the descriptor.
  int release();

 private:
  int fd_ = -1;
};

/// An opened directory whose files are reached by name (openat and its
/// siblings), never through a symbolic link at the name itself. Links in
/// the directory's own path are the caller's choice and are followed.
///
///   contrax::detail::Directory dir("runs/a", "RunDir", /*owned=*/true);
///   dir.write_atomically("config.json", text);
///   auto fd = dir.open("train.log", O_WRONLY | O_APPEND | O_CREAT);
class Directory {
 public:
  /// Opens directory `path` ("" is "."). `who` starts every error message.
  /// With `owned`, the directory and every file opened in it must belong to
  /// this process's effective user; anything else is refused by name.
  Directory(const std::string& path, std::string who, bool owned = false);
  /// The directory that holds `file_path` (its parent, "." for a bare name).
  static Directory of_file(const std::string& file_path, std::string who, bool owned = false);

  const std::string& path() const { return path_; }
  /// PATH/NAME, for messages.
  std::string file(const std::string& name) const;

  /// NAME opened with `flags` plus O_NOFOLLOW and O_CLOEXEC. An absent file
  /// (without O_CREAT) gives an invalid descriptor and errno ENOENT; a link,
  /// something other than a regular file, or (owned) another user's file is
  /// refused with an error naming it, before anything is written to it.
  UniqueFd open(const std::string& name, int flags, mode_t mode = 0644) const;
  /// lstat of NAME (links not followed); false when it does not exist.
  bool stat(const std::string& name, struct stat* st) const;
  /// Whether NAME exists (a link counts: it is what stands there).
  bool exists(const std::string& name) const;
  /// Refuses NAME, naming it, when it is a link or (owned) another user's;
  /// nothing when it is absent.
  void check_entry(const std::string& name) const;
  /// Removes NAME (a link itself, never its target); absent is fine.
  void remove(const std::string& name) const;

  /// Writes NAME atomically: a temporary NAME.tmp.<pid>.<random> created
  /// with O_EXCL, filled, fsync'ed, renamed over NAME (which replaces a link
  /// there, never writes through it), then the directory fsync'ed. A failure
  /// leaves NAME as it was and removes the temporary; it throws naming the
  /// file, the cause and what was kept.
  void write_atomically(const std::string& name, const std::string& bytes) const;
  /// Removes NAME.tmp.<pid>[.<random>] files whose writer no longer runs;
  /// returns how many.
  int64_t remove_stale_temporaries(const std::string& name) const;
  /// fsync of the directory (renames durable); a file system that refuses
  /// fsync on directories is accepted.
  void sync() const;

 private:
  std::string path_, who_;
  bool owned_ = false;
  UniqueFd fd_;
};

}  // namespace contrax::detail
