// Files opened without following planted links (see util/files.h).
#include "util/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "util/secret.h"

namespace contrax::detail {

namespace {

// "uid 1000 (alice)", or the number alone where the name is unknown.
std::string user_text(uid_t uid) {
  passwd pw{}, *found = nullptr;
  char buf[1024];
  std::string s = "uid " + std::to_string(uid);
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &found) == 0 && found != nullptr) s += " (" + std::string(pw.pw_name) + ")";
  return s;
}

// The pid in "<pid>" or "<pid>.<random>" (what follows NAME.tmp.), -1 if
// it is neither.
long temporary_pid(const std::string& rest) {
  const std::string pid = rest.substr(0, rest.find('.'));
  if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stol(pid);
}

}  // namespace

std::string errno_text(int err) {
  const char* name = ::strerrorname_np(err);
  return std::string(std::strerror(err)) + (name != nullptr ? std::string(" (") + name + ")" : std::string());
}

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

int UniqueFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

Directory::Directory(const std::string& path, std::string who, bool owned)
    : path_(path.empty() ? "." : path), who_(std::move(who)), owned_(owned) {
  fd_ = UniqueFd(::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd_.valid()) {
    const int err = errno;
    TORCH_CHECK(false, who_, ": cannot open directory '", path_, "': ", errno_text(err));
  }
  struct stat st {};
  TORCH_CHECK(::fstat(fd_.get(), &st) == 0, who_, ": cannot stat directory '", path_, "': ", errno_text(errno));
  TORCH_CHECK(!owned_ || st.st_uid == ::geteuid(), who_, ": directory '", path_, "' belongs to ",
              user_text(st.st_uid), ", not to ", user_text(::geteuid()),
              ", who runs this; another user's directory could hold links to this user's files (use a directory of "
              "your own)");
}

Directory Directory::of_file(const std::string& file_path, std::string who, bool owned) {
  const auto parent = std::filesystem::path(file_path).parent_path();
  return Directory(parent.empty() ? "." : parent.string(), std::move(who), owned);
}

std::string Directory::file(const std::string& name) const { return path_ == "." ? name : path_ + "/" + name; }

bool Directory::stat(const std::string& name, struct stat* st) const {
  return ::fstatat(fd_.get(), name.c_str(), st, AT_SYMLINK_NOFOLLOW) == 0;
}

bool Directory::exists(const std::string& name) const {
  struct stat st {};
  return stat(name, &st);
}

void Directory::check_entry(const std::string& name) const {
  struct stat st {};
  if (!stat(name, &st)) return;
  TORCH_CHECK(!S_ISLNK(st.st_mode), who_, ": '", file(name), "' is a symbolic link; Contrax follows no link where ",
              "its own file should be (remove the link; nothing was written through it)");
  TORCH_CHECK(!owned_ || st.st_uid == ::geteuid(), who_, ": '", file(name), "' belongs to ", user_text(st.st_uid),
              ", not to ", user_text(::geteuid()), ", who runs this (remove it or use another directory)");
}

UniqueFd Directory::open(const std::string& name, int flags, mode_t mode) const {
  // Never O_TRUNC at open: the checks below come first, the truncation
  // after them.
  const bool truncate = (flags & O_TRUNC) != 0;
  UniqueFd fd(::openat(fd_.get(), name.c_str(), (flags & ~O_TRUNC) | O_NOFOLLOW | O_CLOEXEC, mode));
  if (!fd.valid()) {
    const int err = errno;
    if (err == ENOENT && (flags & O_CREAT) == 0) return fd;
    if (err == ELOOP) check_entry(name);  // a link: says so by name
    TORCH_CHECK(false, who_, ": cannot open '", file(name), "': ", errno_text(err));
  }
  struct stat st {};
  TORCH_CHECK(::fstat(fd.get(), &st) == 0, who_, ": cannot stat '", file(name), "': ", errno_text(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), who_, ": '", file(name), "' is not a regular file");
  TORCH_CHECK(!owned_ || st.st_uid == ::geteuid(), who_, ": '", file(name), "' belongs to ", user_text(st.st_uid),
              ", not to ", user_text(::geteuid()), ", who runs this (remove it or use another directory)");
  if (truncate) {
    TORCH_CHECK(::ftruncate(fd.get(), 0) == 0, who_, ": cannot truncate '", file(name), "': ", errno_text(errno));
  }
  return fd;
}

void Directory::remove(const std::string& name) const {
  if (::unlinkat(fd_.get(), name.c_str(), 0) == 0 || errno == ENOENT) return;
  TORCH_CHECK(false, who_, ": cannot remove '", file(name), "': ", errno_text(errno));
}

void Directory::sync() const {
  // Some file systems (certain network mounts) refuse fsync on directories;
  // the rename is still atomic there, only durability is weaker.
  if (::fsync(fd_.get()) == 0 || errno == EINVAL || errno == EROFS) return;
  TORCH_CHECK(false, who_, ": fsync of directory '", path_, "' failed: ", errno_text(errno));
}

// Every failure (ENOSPC, EIO, EROFS, EFBIG, ...) becomes one c10::Error
// naming the file and the cause; the temporary is removed and NAME is
// untouched until the rename. The bytes are complete before the first
// write: a serialiser that fails halfway never reaches the disk.
void Directory::write_atomically(const std::string& name, const std::string& bytes) const {
  TORCH_CHECK(!name.empty(), who_, ": the file name must not be empty");
  // What a failure leaves: the file as it was, or (a first write) none.
  const std::string unchanged = exists(name) ? "; the previous '" + file(name) + "' is unchanged"
                                             : "; '" + file(name) + "' was not written (there was none before)";
  std::string tmp;
  UniqueFd fd;
  for (int attempt = 0; !fd.valid(); ++attempt) {
    tmp = name + ".tmp." + std::to_string(::getpid()) + "." + random_hex(8);
    fd = UniqueFd(::openat(fd_.get(), tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (!fd.valid() && (errno != EEXIST || attempt >= 8)) {
      const int err = errno;
      TORCH_CHECK(false, who_, ": cannot create '", file(tmp), "': ", errno_text(err), " (does the directory '",
                  path_, "' exist and is it writable?)", unchanged);
    }
  }
  std::string write_error;
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      write_error = errno_text(errno);
      break;
    }
    if (w == 0) {  // not expected from a regular file; never spin on it
      write_error = "write returned 0";
      break;
    }
    done += static_cast<size_t>(w);
  }
  if (write_error.empty() && ::fsync(fd.get()) != 0) write_error = "fsync: " + errno_text(errno);
  if (::close(fd.release()) != 0 && write_error.empty()) write_error = "close: " + errno_text(errno);
  if (!write_error.empty()) {
    ::unlinkat(fd_.get(), tmp.c_str(), 0);
    TORCH_CHECK(false, who_, ": writing '", file(tmp), "' failed after ", done, " of ", bytes.size(),
                " bytes: ", write_error, unchanged);
  }
  if (::renameat(fd_.get(), tmp.c_str(), fd_.get(), name.c_str()) != 0) {
    const std::string err = errno_text(errno);
    ::unlinkat(fd_.get(), tmp.c_str(), 0);
    TORCH_CHECK(false, who_, ": renaming '", file(tmp), "' to '", file(name), "' failed: ", err, unchanged);
  }
  sync();
}

int64_t Directory::remove_stale_temporaries(const std::string& name) const {
  const int dup = ::fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0);
  if (dup < 0) return 0;
  DIR* d = ::fdopendir(dup);
  if (d == nullptr) {
    ::close(dup);
    return 0;
  }
  ::rewinddir(d);
  const std::string prefix = name + ".tmp.";
  int64_t removed = 0;
  while (dirent* e = ::readdir(d)) {
    const std::string entry = e->d_name;
    if (entry.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = temporary_pid(entry.substr(prefix.size()));
    if (pid <= 0) continue;
    const bool alive = pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
    if (!alive && ::unlinkat(fd_.get(), entry.c_str(), 0) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

}  // namespace contrax::detail
