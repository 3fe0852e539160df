// The safetensors format (Hugging Face's, https://huggingface.co/docs/safetensors):
// what a Contrax checkpoint is on disk (internal to the trainer, not
// installed). A reader of it only reads: an 8-byte little-endian header
// size, a JSON header naming each record's dtype, shape and byte range, and
// the records' raw bytes. Nothing in the file is executed, and nothing is
// inflated, so reading never takes more memory than the file's records
// that the caller asks for; the header is checked whole against the file's
// size before any record is read.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "util/files.h"

namespace contrax::train::detail {

/// Builds a safetensors file in memory: records and string metadata.
class SafetensorsWriter {
 public:
  /// Adds record `name` holding `t` (copied to a contiguous CPU tensor).
  void add(const std::string& name, const torch::Tensor& t);
  /// Adds `key` = `value` to the header's __metadata__.
  void metadata(const std::string& key, const std::string& value);
  /// The file's bytes: header (padded to 8 bytes) then the records.
  std::string bytes() const;

 private:
  std::map<std::string, torch::Tensor> records_;
  std::map<std::string, std::string> metadata_;
};

/// A safetensors file opened for reading. The constructor reads and checks
/// the header; records are read on demand, each only after its dtype and
/// shape were compared with what the caller expects.
class SafetensorsReader {
 public:
  /// Reads the header of the open file `fd` (`path` names it in errors).
  /// Throws "'<path>' is not a safetensors file: <why>" for a short file, a
  /// header larger than the file or than 100 MiB, malformed JSON, an unknown
  /// dtype, a record whose byte range does not match its shape or lies
  /// outside the file, or records that overlap or leave holes.
  SafetensorsReader(contrax::detail::UniqueFd fd, std::string path);

  /// The header's __metadata__ (empty when it has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// Whether record `name` exists.
  bool has(const std::string& name) const { return records_.count(name) != 0; }
  /// Every record's name, sorted.
  std::vector<std::string> names() const;
  /// The dtype and shape of record `name` (which must exist).
  torch::ScalarType dtype(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;  ///< the shape of record `name`
  /// Reads record `name` into `out`, whose dtype and shape must be the
  /// record's (checked by the caller, asserted here); any device.
  void read_into(const std::string& name, const torch::Tensor& out) const;

 private:
  struct Record {
    torch::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // byte range in the data section
  };
  const Record& record(const std::string& name) const;

  contrax::detail::UniqueFd fd_;
  std::string path_;
  int64_t data_start_ = 0;
  std::map<std::string, Record> records_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace contrax::train::detail
