// Tests of the IDX reader: good files (plain and gzip), every error a damaged
// or missing file can cause, and the real Fashion-MNIST test split when installed.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <filesystem>
#include <string>
#include <vector>

#include "contrax/train/common/errors.h"
#include "contrax/train/image/idx.h"
#include "support/errors.h"
#include "support/processes.h"

namespace ct = contrax::train;
using contrax::testing::error_of;
using contrax::testing::expect_error;
using contrax::testing::TempDir;

namespace {


void put_u32(std::string& s, uint32_t v) {
  s.push_back(char((v >> 24) & 0xff));
  s.push_back(char((v >> 16) & 0xff));
  s.push_back(char((v >> 8) & 0xff));
  s.push_back(char(v & 0xff));
}

// n images of rows x cols, pixel (i, r, c) = (i * 7 + r * 3 + c) mod 256.
std::string image_bytes(uint32_t n, uint32_t rows = 28, uint32_t cols = 28, uint32_t magic = 0x803) {
  std::string s;
  put_u32(s, magic);
  put_u32(s, n);
  put_u32(s, rows);
  put_u32(s, cols);
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t r = 0; r < rows; ++r)
      for (uint32_t c = 0; c < cols; ++c) s.push_back(char((i * 7 + r * 3 + c) % 256));
  return s;
}

std::string label_bytes(uint32_t n, uint32_t magic = 0x801) {
  std::string s;
  put_u32(s, magic);
  put_u32(s, n);
  for (uint32_t i = 0; i < n; ++i) s.push_back(char(i % 10));
  return s;
}

void write_plain(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), int(bytes.size()));
  gzclose(f);
}

// The two files of a split ("train" or "t10k") with `images` images and
// `labels` labels, gzip-compressed or (gz false) plain.
void write_split(const std::string& dir, const std::string& split, uint32_t images, uint32_t labels, bool gz = true) {
  const auto write = gz ? write_gz : write_plain;
  const std::string ext = gz ? ".gz" : "";
  write(dir + "/" + split + "-images-idx3-ubyte" + ext, image_bytes(images));
  write(dir + "/" + split + "-labels-idx1-ubyte" + ext, label_bytes(labels));
}

void expect_pixels(const torch::Tensor& x) {
  for (int64_t i = 0; i < x.size(0); ++i) {
    EXPECT_EQ(x[i][2][5].item<int64_t>(), (i * 7 + 2 * 3 + 5) % 256);
  }
}

}  // namespace

TEST(IdxReader, ReadsPlainAndGzipFilesAlike) {
  TempDir tmp;
  const auto& dir = tmp.path;
  write_plain(dir + "/a.idx", image_bytes(5));
  write_gz(dir + "/a.idx.gz", image_bytes(5));
  for (const auto& p : {dir + "/a.idx", dir + "/a.idx.gz"}) {
    auto x = ct::load_idx_images(p);
    EXPECT_EQ(x.sizes(), (std::vector<int64_t>{5, 28, 28}));
    EXPECT_EQ(x.scalar_type(), torch::kUInt8);
    expect_pixels(x);
  }
  write_gz(dir + "/l.gz", label_bytes(5));
  auto y = ct::load_idx_labels(dir + "/l.gz");
  EXPECT_EQ(y.scalar_type(), torch::kInt64);
  EXPECT_TRUE(torch::equal(y, torch::tensor({0, 1, 2, 3, 4}, torch::kInt64)));
  EXPECT_EQ(ct::load_idx_images(dir + "/a.idx", 2).size(0), 2);
}

TEST(IdxReader, LoadDatasetFromDirectoryWithLimit) {
  TempDir tmp;
  const auto& dir = tmp.path;
  write_split(dir, "train", 12, 12);
  // The test split uncompressed: the reader falls back to the plain name.
  write_split(dir, "t10k", 4, 4, /*gz=*/false);
  auto train = ct::load_dataset(dir, "train");
  EXPECT_EQ(train.images.sizes(), (std::vector<int64_t>{12, 1, 28, 28}));
  EXPECT_EQ(train.labels.sizes(), (std::vector<int64_t>{12}));
  auto test = ct::load_dataset(dir, "test", 3);
  EXPECT_EQ(test.size(), 3);
  EXPECT_EQ(test.labels[2].item<int64_t>(), 2);
  auto sel = train.select(torch::tensor({11, 0}, torch::kInt64));
  EXPECT_EQ(sel.labels[0].item<int64_t>(), 1);
  EXPECT_EQ(train.head(5).size(), 5);
}

TEST(IdxReader, TruncatedFileNamesExpectedAndActualBytes) {
  TempDir tmp;
  const auto& dir = tmp.path;
  auto bytes = image_bytes(4).substr(0, 16 + 100);
  write_plain(dir + "/t.idx", bytes);
  write_gz(dir + "/t.idx.gz", bytes);
  for (const auto& p : {dir + "/t.idx", dir + "/t.idx.gz"}) {
    expect_error([&] { ct::load_idx_images(p); },
                 "load_idx_images(): file '" + p + "' is truncated: expected 3136 bytes of pixels, got 100");
  }
  write_plain(dir + "/l.idx", label_bytes(10).substr(0, 8 + 3));
  expect_error([&] { ct::load_idx_labels(dir + "/l.idx"); }, "is truncated: expected 10 bytes of labels, got 3");
  write_plain(dir + "/h.idx", image_bytes(1).substr(0, 6));
  expect_error([&] { ct::load_idx_images(dir + "/h.idx"); },
               "is truncated: expected 4 bytes of image count in the header, got 2");
}

TEST(IdxReader, WrongMagicIsRejected) {
  TempDir tmp;
  const auto& dir = tmp.path;
  write_plain(dir + "/labels-as-images", label_bytes(3));
  expect_error([&] { ct::load_idx_images(dir + "/labels-as-images"); },
               "is not an IDX image file: magic number is 0x00000801, expected 0x00000803");
  write_plain(dir + "/images-as-labels", image_bytes(1));
  expect_error([&] { ct::load_idx_labels(dir + "/images-as-labels"); },
               "is not an IDX label file: magic number is 0x00000803, expected 0x00000801");
}

TEST(IdxReader, InvalidDimensionsAreRejected) {
  TempDir tmp;
  const auto& dir = tmp.path;
  write_plain(dir + "/z.idx", image_bytes(1, 0, 28));
  expect_error([&] { ct::load_idx_images(dir + "/z.idx"); }, "has invalid image dimensions 0x28");
}

TEST(IdxReader, CorruptGzipIsRejected) {
  TempDir tmp;
  const auto& dir = tmp.path;
  write_gz(dir + "/c.gz", image_bytes(20));
  std::string raw;
  {
    std::ifstream f(dir + "/c.gz", std::ios::binary);
    raw.assign(std::istreambuf_iterator<char>(f), {});
  }
  for (size_t i = 20; i < raw.size(); i += 3) raw[i] = char(raw[i] ^ 0x5a);  // damage the deflate stream
  write_plain(dir + "/c.gz", raw);
  const auto msg = error_of([&] { ct::load_idx_images(dir + "/c.gz"); });
  EXPECT_TRUE(msg.find("is corrupt") != std::string::npos || msg.find("is truncated") != std::string::npos ||
              msg.find("magic number") != std::string::npos)
      << msg;
}

TEST(IdxReader, MissingFileHintsAtThePackage) {
  auto msg = error_of([] { ct::load_idx_images("/nonexistent/x-idx3-ubyte.gz"); });
  EXPECT_NE(msg.find("load_idx_images(): file '/nonexistent/x-idx3-ubyte.gz' does not exist"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("apt-get install dataset-fashion-mnist"), std::string::npos) << msg;
  EXPECT_NE(msg.find("or use a directory holding MNIST-format IDX files"), std::string::npos) << msg;
  // Typed, so that the tool can name its flag instead (cli_train_errors_test.cpp).
  try {
    ct::load_idx_images("/nonexistent/x-idx3-ubyte.gz");
    ADD_FAILURE() << "no error";
  } catch (const ct::TrainError& e) {
    EXPECT_EQ(e.kind(), ct::TrainErrorKind::kDataUnreadable);
    EXPECT_EQ(e.fact(), "load_idx_images(): file '/nonexistent/x-idx3-ubyte.gz' does not exist");
  }
  expect_error([] { ct::load_dataset("/nonexistent", "train"); },
               "load_dataset(): file '/nonexistent/train-images-idx3-ubyte.gz' does not exist");
  expect_error([] { ct::load_dataset("/nonexistent", "val"); },
               "load_dataset(): argument 'split' must be \"train\" or \"test\", but got \"val\"");
}

TEST(IdxReader, ImageAndLabelCountsMustAgree) {
  TempDir tmp;
  const auto& dir = tmp.path;
  write_split(dir, "train", 4, 5);
  expect_error([&] { ct::load_dataset(dir, "train", 2); },
               "holds 4 images but '" + dir + "/train-labels-idx1-ubyte.gz' holds 5 labels");
}

TEST(IdxReader, RealFashionMnistTestSplit) {
  struct stat st {};
  const std::string dir = ct::kDefaultDataDir;
  if (::stat((dir + "/t10k-images-idx3-ubyte.gz").c_str(), &st) != 0) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  auto test = ct::load_dataset(dir, "test");
  EXPECT_EQ(test.images.sizes(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(test.labels.min().item<int64_t>(), 0);
  EXPECT_EQ(test.labels.max().item<int64_t>(), 9);
  // Fashion-MNIST's test split is balanced: 1000 per class.
  EXPECT_TRUE(torch::equal(torch::bincount(test.labels), torch::full({10}, 1000, torch::kInt64)));
}

// ---- issue 14 item 12: absurd headers, files checked up front, permissions ----

namespace {

// Only the 16-byte header of an image file claiming n images of rows x cols.
std::string header_only(uint32_t n, uint32_t rows, uint32_t cols) {
  std::string s;
  put_u32(s, 0x803);
  put_u32(s, n);
  put_u32(s, rows);
  put_u32(s, cols);
  s += std::string(100, '\0');
  return s;
}

// Runs `fn` in a child process as user nobody (root reads everything, so a
// permission test must drop privileges); returns the error message it got.
std::string error_as_nobody(const std::function<void()>& fn) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(pipefd[0]);
    std::string msg = "no error";
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) {
      msg = "cannot drop privileges";
    } else {
      msg = error_of(fn);
    }
    ssize_t ignored = ::write(pipefd[1], msg.data(), msg.size());
    (void)ignored;
    ::_exit(0);
  }
  ::close(pipefd[1]);
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  ::close(pipefd[0]);
  ::waitpid(pid, nullptr, 0);
  return out;
}

}  // namespace

TEST(IdxReader, AbsurdHeaderIsRefusedNamingTheFileBeforeAllocating) {
  // Before: count 2^31 of 4096x4096 asked the allocator for 36 PB and failed
  // with a raw allocator error that named no file.
  TempDir tmp;
  const auto& dir = tmp.path;
  write_plain(dir + "/big-idx3-ubyte", header_only(0x80000000u, 4096, 4096));
  write_gz(dir + "/big-idx3-ubyte.gz", header_only(0x80000000u, 4096, 4096));
  expect_error([&] { ct::load_idx_images(dir + "/big-idx3-ubyte"); },
               "load_idx_images(): file '" + dir + "/big-idx3-ubyte' is truncated: expected 36028797018963968 "
               "bytes of pixels, got 100 (the header announces 2147483648 images of 4096x4096 pixels, 36 PB: is "
               "it corrupt?)");
  const auto msg = error_of([&] { ct::load_idx_images(dir + "/big-idx3-ubyte.gz"); });
  EXPECT_NE(msg.find("file '" + dir + "/big-idx3-ubyte.gz' has a corrupt header: it announces 2147483648 images"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("but a gzip file of "), std::string::npos) << msg;
  // Labels: 2^32-1 labels in a file of a few bytes.
  std::string labels;
  put_u32(labels, 0x801);
  put_u32(labels, 0xffffffffu);
  write_plain(dir + "/l-idx1-ubyte", labels + "abc");
  expect_error([&] { ct::load_idx_labels(dir + "/l-idx1-ubyte"); },
               "load_idx_labels(): file '" + dir + "/l-idx1-ubyte' is truncated: expected 4294967295 bytes of "
               "labels, got 3");
  // A limit keeps what is read within the file: the header is then fine.
  write_plain(dir + "/ok-idx3-ubyte", image_bytes(3));
  EXPECT_EQ(ct::load_idx_images(dir + "/ok-idx3-ubyte", 2).size(0), 2);
}

TEST(IdxReader, CheckDatasetFilesFindsAMissingOrDamagedTestSplitUpFront) {
  TempDir tmp;
  const auto& dir = tmp.path;
  write_split(dir, "train", 4, 4);
  ct::check_dataset_files(dir, {"train"});
  expect_error([&] { ct::check_dataset_files(dir, {"train", "test"}); },
               "check_dataset_files(): file '" + dir + "/t10k-images-idx3-ubyte.gz' does not exist (nor without .gz)");
  write_split(dir, "t10k", 3, 2);
  expect_error([&] { ct::check_dataset_files(dir, {"train", "test"}); },
               "holds 3 images but '" + dir + "/t10k-labels-idx1-ubyte.gz' holds 2 labels");
  write_plain(dir + "/t10k-labels-idx1-ubyte.gz", "not gzip, not idx");
  expect_error([&] { ct::check_dataset_files(dir, {"test"}); },
               "file '" + dir + "/t10k-labels-idx1-ubyte.gz' is not an IDX label file");
}

TEST(IdxReader, UnreadableDirectoryIsPermissionDeniedNotMissing) {
  // Before: stat() failing with EACCES was reported as "does not exist".
  TempDir tmp;
  const std::string dir = tmp.path + "/data";
  std::filesystem::create_directory(dir);
  write_split(dir, "train", 2, 2);
  ::chmod(tmp.path.c_str(), 0755);
  ::chmod(dir.c_str(), 0700);  // owned by root: nobody may not search it
  std::string msg = error_as_nobody([&] { ct::load_dataset(dir, "train"); });
  if (msg == "cannot drop privileges") GTEST_SKIP() << "not root: cannot test as another user";
  EXPECT_NE(msg.find("load_dataset(): data directory '" + dir + "' cannot be accessed: Permission denied"),
            std::string::npos)
      << msg;
  msg = error_as_nobody([&] { ct::load_idx_images(dir + "/train-images-idx3-ubyte.gz"); });
  EXPECT_NE(msg.find("file '" + dir + "/train-images-idx3-ubyte.gz' cannot be accessed: Permission denied"),
            std::string::npos)
      << msg;
  // An unreadable file in a searchable directory.
  ::chmod(dir.c_str(), 0755);
  ::chmod((dir + "/train-images-idx3-ubyte.gz").c_str(), 0600);
  msg = error_as_nobody([&] { ct::check_dataset_files(dir, {"train"}); });
  EXPECT_NE(msg.find("file '" + dir + "/train-images-idx3-ubyte.gz' cannot be read: Permission denied"),
            std::string::npos)
      << msg;
}
