// IDX reader: gzip or plain MNIST-format files into tensors, with errors that
// name the file and say what is wrong and how to get a good copy.
#include "contrax/train/image/idx.h"

#include "contrax/train/common/errors.h"

#include <zlib.h>

#include <sys/stat.h>

#include <array>
#include <cerrno>
#include <unistd.h>
#include <vector>
#include <cstring>
#include <memory>
#include <sstream>

namespace contrax::train {
namespace {

const char* const kInstallHint =
    " (install Fashion-MNIST with `apt-get install dataset-fashion-mnist`, or use a directory holding "
    "MNIST-format IDX files)";

// A data file that cannot be used, as a typed error (kDataUnreadable): its
// fact without the hint, so that a caller can say in its own terms how to
// point the recipe at other data.
template <typename... Args>
void check_data(bool ok, const Args&... fact) {
  if (!ok) throw TrainError(TrainErrorKind::kDataUnreadable, c10::str(fact...), kInstallHint);
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Why `path` cannot be read, in words: "does not exist" only when it does
// not; a directory on the way without search permission is "permission
// denied" (stat fails with EACCES, which a bare existence test calls missing).
// Empty when the file is a readable regular file.
std::string unreadable_reason(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return "does not exist";
    return std::string("cannot be accessed: ") + std::strerror(err);
  }
  if (!S_ISREG(st.st_mode)) return "is not a regular file";
  if (::access(path.c_str(), R_OK) != 0) return std::string("cannot be read: ") + std::strerror(errno);
  return "";
}

int64_t file_size_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

// Deflate cannot expand data more than about 1032:1, so a gzip file of n
// bytes decompresses to at most this many: a header asking for more is
// corrupt, and is refused before anything is allocated for it.
int64_t max_payload_bytes(int64_t file_size, bool compressed) {
  return compressed ? file_size * 1032 + 4096 : file_size;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KB", "MB", "GB", "TB", "PB", "EB"};
  int u = 0;
  while (b >= 1000 && u < 6) {
    b /= 1000;
    ++u;
  }
  std::ostringstream o;
  o.precision(3);
  o << b << " " << units[u];
  return o.str();
}

struct GzCloser {
  void operator()(gzFile_s* f) const {
    if (f != nullptr) gzclose(f);
  }
};

// An open IDX file. zlib reads gzip streams and plain files through the same
// calls, so both formats share one code path.
class IdxFile {
 public:
  IdxFile(std::string path, const char* caller) : path_(std::move(path)), caller_(caller) {
    const std::string why = unreadable_reason(path_);
    check_data(why != "does not exist", caller_, "(): file '", path_, "' ", why);
    TORCH_CHECK(why.empty(), caller_, "(): file '", path_, "' ", why);
    file_.reset(gzopen(path_.c_str(), "rb"));
    TORCH_CHECK(file_ != nullptr, caller_, "(): cannot open file '", path_, "': ", std::strerror(errno));
    gzbuffer(file_.get(), 1 << 20);
  }

  // Reads up to `n` bytes; returns how many were read before the end of the
  // data. A damaged gzip stream is an error unless it merely ends early (that is
  // reported as truncation by the caller, which knows what was expected).
  int64_t read(void* dst, int64_t n) {
    auto* out = static_cast<char*>(dst);
    int64_t done = 0;
    while (done < n) {
      const auto want = static_cast<unsigned>(std::min<int64_t>(n - done, 1 << 30));
      const int got = gzread(file_.get(), out + done, want);
      if (got < 0) {
        int err = 0;
        const char* msg = gzerror(file_.get(), &err);
        check_data(err == Z_BUF_ERROR, caller_, "(): file '", path_, "' is corrupt (zlib: ", msg, ")");
        break;
      }
      if (got == 0) break;
      done += got;
    }
    return done;
  }

  // Reads the big-endian uint32 header field `what`.
  uint32_t read_u32(const char* what) {
    std::array<unsigned char, 4> b{};
    const int64_t got = read(b.data(), 4);
    check_data(got == 4, caller_, "(): file '", path_, "' is truncated: expected 4 bytes of ", what,
                " in the header, got ", got);
    return (uint32_t(b[0]) << 24) | (uint32_t(b[1]) << 16) | (uint32_t(b[2]) << 8) | uint32_t(b[3]);
  }

  void check_magic(uint32_t expected, const char* kind) {
    const uint32_t magic = read_u32("magic number");
    check_data(magic == expected, caller_, "(): file '", path_, "' is not an IDX ", kind,
                " file: magic number is 0x", hex(magic), ", expected 0x", hex(expected));
  }

  // Reads exactly `n` bytes of `what` or fails naming expected and actual sizes.
  void read_payload(void* dst, int64_t n, const char* what) {
    const int64_t got = read(dst, n);
    check_data(got == n, caller_, "(): file '", path_, "' is truncated: expected ", n, " bytes of ",
                what, ", got ", got);
  }

  const std::string& path() const { return path_; }

  // Refuses a header whose payload (`bytes` of `payload`, announced as
  // `what`) cannot be in this file, before the caller allocates for it. A
  // plain file is simply too short (truncated, as a cut download is); a gzip
  // file is bounded by deflate's largest expansion.
  void check_payload_fits(int64_t bytes, const std::string& what, const char* payload, int64_t header_bytes) {
    const bool compressed = gzdirect(file_.get()) == 0;
    const int64_t size = file_size_of(path_);
    if (!compressed) {
      const int64_t have = std::max<int64_t>(0, size - header_bytes);
      check_data(bytes <= have, caller_, "(): file '", path_, "' is truncated: expected ", bytes, " bytes of ",
                  payload, ", got ", have,
                  bytes > (int64_t{1} << 32) ? " (the header announces " + what + ", " +
                                                   human_bytes(static_cast<double>(bytes)) + ": is it corrupt?)"
                                             : std::string());
      return;
    }
    const int64_t most = max_payload_bytes(size, true);
    check_data(bytes <= most, caller_, "(): file '", path_, "' has a corrupt header: it announces ", what, " (",
                human_bytes(static_cast<double>(bytes)), "), but a gzip file of ", size, " bytes holds at most ",
                human_bytes(static_cast<double>(most)));
  }

 private:
  static std::string hex(uint32_t v) {
    std::ostringstream s;
    s.width(8);
    s.fill('0');
    s << std::hex << v;
    return s.str();
  }

  std::string path_;
  const char* caller_;
  std::unique_ptr<gzFile_s, GzCloser> file_;
};

int64_t items_to_read(int64_t count, int64_t limit) {
  return limit < 0 ? count : std::min(count, limit);
}

// An image file's header: its magic, then count, rows and columns. Real files
// are 28x28; a bound keeps a corrupt header from asking for terabytes before
// the truncation check can fire.
struct ImageHeader {
  int64_t count, rows, cols;
};

ImageHeader read_image_header(IdxFile& f, const std::string& path, const char* caller) {
  f.check_magic(kIdxImagesMagic, "image");
  ImageHeader h{};
  h.count = f.read_u32("image count");
  h.rows = f.read_u32("row count");
  h.cols = f.read_u32("column count");
  check_data(h.rows > 0 && h.cols > 0 && h.rows <= 4096 && h.cols <= 4096, caller, "(): file '", path,
              "' has invalid image dimensions ", h.rows, "x", h.cols, " (expected 1..4096 each)");
  return h;
}

// Whether the file holds the pixels of `n` images of the header's size.
void check_pixels_fit(IdxFile& f, int64_t n, const ImageHeader& h) {
  f.check_payload_fits(n * h.rows * h.cols,
                       std::to_string(n) + " images of " + std::to_string(h.rows) + "x" + std::to_string(h.cols) +
                           " pixels",
                       "pixels", 16);
}

torch::Tensor read_images(const std::string& path, int64_t limit, int64_t* header_count) {
  IdxFile f(path, "load_idx_images");
  const auto h = read_image_header(f, path, "load_idx_images");
  const int64_t count = h.count, rows = h.rows, cols = h.cols;
  *header_count = count;
  const int64_t n = items_to_read(count, limit);
  check_pixels_fit(f, n, h);
  auto images = torch::empty({n, rows, cols}, torch::kUInt8);
  f.read_payload(images.data_ptr<uint8_t>(), n * rows * cols, "pixels");
  return images;
}

torch::Tensor read_labels(const std::string& path, int64_t limit, int64_t* header_count) {
  IdxFile f(path, "load_idx_labels");
  f.check_magic(kIdxLabelsMagic, "label");
  const int64_t count = f.read_u32("label count");
  *header_count = count;
  const int64_t n = items_to_read(count, limit);
  f.check_payload_fits(n, std::to_string(n) + " labels", "labels", 8);
  auto labels = torch::empty({n}, torch::kUInt8);
  f.read_payload(labels.data_ptr<uint8_t>(), n, "labels");
  return labels.to(torch::kInt64);
}

// A missing or unreadable data file, named with the reason; a directory that
// cannot be searched is reported as such, not as missing files.
void check_readable(const std::string& dir, const std::string& path, const char* caller) {
  const std::string dir_why = unreadable_reason(dir + "/.");
  if (!dir_why.empty() && dir_why != "does not exist" && dir_why != "is not a regular file") {
    TORCH_CHECK(false, caller, "(): data directory '", dir, "' ", dir_why);
  }
  const std::string why = unreadable_reason(path);
  if (why == "does not exist") {
    struct stat st {};
    const bool no_dir = ::stat(dir.c_str(), &st) != 0;
    check_data(false, caller, "(): file '", path, "' does not exist (nor without .gz)",
               no_dir ? "; the directory '" + dir + "' does not exist either" : std::string());
  }
  TORCH_CHECK(why.empty(), caller, "(): file '", path, "' ", why);
}

}  // namespace

void check_dataset_files(const std::string& dir, const std::vector<std::string>& splits) {
  for (const auto& split : splits) {
    const std::string images_path = idx_file_path(dir, split, "images");
    const std::string labels_path = idx_file_path(dir, split, "labels");
    check_readable(dir, images_path, "check_dataset_files");
    check_readable(dir, labels_path, "check_dataset_files");
    // Headers too: a corrupt test file must stop the run before training,
    // not after it.
    IdxFile fi(images_path, "check_dataset_files");
    const auto h = read_image_header(fi, images_path, "check_dataset_files");
    check_pixels_fit(fi, h.count, h);
    IdxFile fl(labels_path, "check_dataset_files");
    fl.check_magic(kIdxLabelsMagic, "label");
    const int64_t labels = fl.read_u32("label count");
    fl.check_payload_fits(labels, std::to_string(labels) + " labels", "labels", 8);
    check_data(h.count == labels, "check_dataset_files(): '", images_path, "' holds ", h.count, " images but '",
                labels_path, "' holds ", labels, " labels");
  }
}

torch::Tensor load_idx_images(const std::string& path, int64_t limit) {
  int64_t count = 0;
  return read_images(path, limit, &count);
}

torch::Tensor load_idx_labels(const std::string& path, int64_t limit) {
  int64_t count = 0;
  return read_labels(path, limit, &count);
}

Dataset Dataset::select(const torch::Tensor& indices) const {
  return Dataset{images.index_select(0, indices), labels.index_select(0, indices)};
}

Dataset Dataset::head(int64_t n) const {
  if (n < 0 || n >= size()) return *this;
  return Dataset{images.narrow(0, 0, n), labels.narrow(0, 0, n)};
}

std::string idx_file_path(const std::string& dir, const std::string& split, const std::string& kind) {
  TORCH_CHECK(split == "train" || split == "test", "idx_file_path(): argument 'split' must be \"train\" or ",
              "\"test\", but got \"", split, "\"");
  TORCH_CHECK(kind == "images" || kind == "labels", "idx_file_path(): argument 'kind' must be \"images\" ",
              "or \"labels\", but got \"", kind, "\"");
  const std::string prefix = split == "train" ? "train" : "t10k";
  const std::string base = dir + "/" + prefix + "-" + kind + (kind == "images" ? "-idx3-ubyte" : "-idx1-ubyte");
  if (file_exists(base + ".gz")) return base + ".gz";
  if (file_exists(base)) return base;
  return base + ".gz";
}

Dataset load_dataset(const std::string& dir, const std::string& split, int64_t limit) {
  TORCH_CHECK(split == "train" || split == "test", "load_dataset(): argument 'split' must be \"train\" or ",
              "\"test\", but got \"", split, "\"");
  const std::string images_path = idx_file_path(dir, split, "images");
  const std::string labels_path = idx_file_path(dir, split, "labels");
  // Check both names up front so a missing directory gives one clear message.
  check_readable(dir, images_path, "load_dataset");
  check_readable(dir, labels_path, "load_dataset");
  int64_t image_count = 0, label_count = 0;
  auto images = read_images(images_path, limit, &image_count);
  auto labels = read_labels(labels_path, limit, &label_count);
  check_data(image_count == label_count, "load_dataset(): '", images_path, "' holds ", image_count,
              " images but '", labels_path, "' holds ", label_count, " labels");
  return Dataset{images.unsqueeze(1), labels};
}

}  // namespace contrax::train
