// Reading IDX files: the format of MNIST, Fashion-MNIST and their relatives.
//
// `contrax train` learns from Debian's `dataset-fashion-mnist` package, which
// ships the four IDX files gzip-compressed under /usr/share/datasets/fashion-mnist.
// The reader takes gzip-compressed or plain files alike (zlib reads both), and
// checks everything a damaged download can break: the magic number, the
// dimensions, that the payload is complete, and that images and labels agree in
// count. Every error names the file and says how to get a good copy.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace contrax::train {

/// Magic number of an IDX file of unsigned bytes with 3 dimensions (images).
constexpr uint32_t kIdxImagesMagic = 0x00000803;
/// Magic number of an IDX file of unsigned bytes with 1 dimension (labels).
constexpr uint32_t kIdxLabelsMagic = 0x00000801;

/// Where Debian's `dataset-fashion-mnist` installs the data set.
constexpr const char* kDefaultDataDir = "/usr/share/datasets/fashion-mnist";

/// Reads an IDX image file (gzip-compressed or plain): magic 0x00000803, then
/// count, rows and columns as big-endian uint32, then count*rows*cols pixels.
/// Returns uint8 [N, rows, cols]. `limit` >= 0 reads only the first `limit`
/// images (the header is still checked against the file size only up to what
/// is read). Default: read all.
///
///   auto x = contrax::train::load_idx_images("/data/t10k-images-idx3-ubyte.gz");
torch::Tensor load_idx_images(const std::string& path, int64_t limit = -1);

/// Reads an IDX label file (gzip-compressed or plain): magic 0x00000801, then
/// the count as big-endian uint32, then one byte per label. Returns int64 [N].
/// `limit` as for `load_idx_images`.
///
///   auto y = contrax::train::load_idx_labels("/data/t10k-labels-idx1-ubyte.gz");
torch::Tensor load_idx_labels(const std::string& path, int64_t limit = -1);

/// A labelled image data set held in memory.
struct Dataset {
  torch::Tensor images;  ///< uint8 [N, 1, H, W]
  torch::Tensor labels;  ///< int64 [N]
  /// Number of examples N (0 when empty).
  int64_t size() const { return images.defined() ? images.size(0) : 0; }
  /// The rows `indices` ([n] int64) of this data set.
  Dataset select(const torch::Tensor& indices) const;
  /// The first `n` rows (all if n < 0 or n >= size()).
  Dataset head(int64_t n) const;
};

/// Path of one IDX file of `split` ("train" or "test") in `dir`: prefers
/// `<prefix>-<kind>-idx?-ubyte.gz`, falls back to the uncompressed name when
/// only that exists, and returns the .gz name when neither does (so the error
/// names what was expected). `kind` is "images" or "labels".
std::string idx_file_path(const std::string& dir, const std::string& split, const std::string& kind);

/// Loads split "train" (train-*) or "test" (t10k-*) of an MNIST-format data set
/// from `dir` (default: Debian's Fashion-MNIST). Images come back as uint8
/// [N, 1, H, W], labels as int64 [N]; their counts must agree. `limit` >= 0
/// keeps the first `limit` examples (for smoke tests).
///
///   auto train = contrax::train::load_dataset(contrax::train::kDefaultDataDir, "train");
///   auto test = contrax::train::load_dataset("/tmp/mnist", "test", 1000);
Dataset load_dataset(const std::string& dir = kDefaultDataDir, const std::string& split = "train",
                     int64_t limit = -1);

/// Checks, without loading them, that the IDX files of every split in
/// `splits` exist, can be read, have plausible headers (magic, dimensions, a
/// payload the file can hold) and agree in count, so that a damaged test split
/// is found before the run, not after. Throws naming the file (or the
/// directory, when it cannot be searched) and the reason.
///
///   contrax::train::check_dataset_files(data_dir, {"train", "test"});
void check_dataset_files(const std::string& dir = kDefaultDataDir,
                         const std::vector<std::string>& splits = {"train", "test"});

}  // namespace contrax::train
