// Reading and writing the safetensors format (see safetensors.h).
#include "train/common/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <limits>

namespace contrax::train::detail {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors records are little-endian, as this host");

namespace {

// The Rust reference implementation's bound: a header is names and shapes,
// never data.
constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;

struct DtypeName {
  const char* name;
  torch::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", torch::kDouble}, {"F32", torch::kFloat}, {"F16", torch::kHalf}, {"BF16", torch::kBFloat16},
    {"I64", torch::kLong},   {"I32", torch::kInt},   {"I16", torch::kShort}, {"I8", torch::kChar},
    {"U8", torch::kByte},    {"BOOL", torch::kBool},
};

const char* dtype_name(torch::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  TORCH_CHECK(false, "safetensors: dtype ", t, " has no safetensors name");
  return nullptr;
}

bool dtype_of(const std::string& name, torch::ScalarType* t) {
  for (const auto& d : kDtypes) {
    if (name == d.name) {
      *t = d.type;
      return true;
    }
  }
  return false;
}

void put_le64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// A non-negative integer of the header (a dimension or an offset), at most
// 2^62 so that products and sums below are checked without overflow.
bool header_int(const nlohmann::json& j, int64_t* v) {
  if (!j.is_number_integer() && !j.is_number_unsigned()) return false;
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    if (u > (uint64_t{1} << 62)) return false;
    *v = static_cast<int64_t>(u);
    return true;
  }
  const int64_t s = j.get<int64_t>();
  if (s < 0) return false;
  *v = s;
  return true;
}

// pread until `n` bytes are in `dst`; false on an error or end of file.
bool read_exactly(int fd, void* dst, int64_t n, int64_t offset) {
  auto* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, static_cast<size_t>(std::min<int64_t>(n, int64_t{1} << 30)), offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= got;
    offset += got;
  }
  return true;
}

}  // namespace

void SafetensorsWriter::add(const std::string& name, const torch::Tensor& t) {
  TORCH_CHECK(name != "__metadata__", "safetensors: '__metadata__' is not a record name");
  dtype_name(t.scalar_type());  // refuses a dtype the format lacks
  records_[name] = t.detach().to(torch::kCPU).contiguous();
}

void SafetensorsWriter::metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

std::string SafetensorsWriter::bytes() const {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  int64_t offset = 0;
  for (const auto& [name, t] : records_) {
    const int64_t n = static_cast<int64_t>(t.nbytes());
    header[name] = {{"dtype", dtype_name(t.scalar_type())}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  // The records start 8-aligned, as the format recommends.
  text.append((8 - (text.size() % 8)) % 8, ' ');
  std::string out;
  out.reserve(8 + text.size() + static_cast<size_t>(offset));
  put_le64(out, text.size());
  out += text;
  for (const auto& kv : records_) out.append(static_cast<const char*>(kv.second.data_ptr()), kv.second.nbytes());
  return out;
}

SafetensorsReader::SafetensorsReader(contrax::detail::UniqueFd fd, std::string path)
    : fd_(std::move(fd)), path_(std::move(path)) {
  auto fail = [&](const auto&... why) { TORCH_CHECK(false, "'", path_, "' is not a safetensors file: ", why...); };
  struct stat st {};
  TORCH_CHECK(::fstat(fd_.get(), &st) == 0, "cannot stat '", path_, "': ", contrax::detail::errno_text(errno));
  const int64_t size = st.st_size;
  unsigned char le[8];
  if (size < 8 || !read_exactly(fd_.get(), le, 8, 0)) fail(size, " bytes, fewer than its 8-byte header size");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | le[i];
  if (n > static_cast<uint64_t>(size - 8)) fail("its header claims ", n, " bytes, but the file has ", size - 8, " after the size");
  if (n > static_cast<uint64_t>(kMaxHeaderBytes)) fail("its header claims ", n, " bytes, more than the 100 MiB allowed");
  std::string text(n, '\0');
  if (!read_exactly(fd_.get(), text.data(), static_cast<int64_t>(n), 8)) fail("its header cannot be read");
  data_start_ = 8 + static_cast<int64_t>(n);
  const int64_t data_bytes = size - data_start_;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("its header is not JSON (", e.what(), ")");
  }
  if (!header.is_object()) fail("its header is not a JSON object");
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) fail("__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) fail("__metadata__ '", k, "' is not a string");
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    Record r;
    if (!entry.is_object() || !entry.contains("dtype") || !entry["dtype"].is_string() ||
        !dtype_of(entry["dtype"].get<std::string>(), &r.dtype)) {
      fail("record '", name, "' has no known dtype");
    }
    const nlohmann::json& shape = entry.contains("shape") ? entry["shape"] : nlohmann::json();
    const nlohmann::json& offsets = entry.contains("data_offsets") ? entry["data_offsets"] : nlohmann::json();
    if (!shape.is_array() || shape.size() > 64) fail("record '", name, "' has no valid shape");
    int64_t numel = 1;
    for (const auto& d : shape) {
      int64_t v = 0;
      if (!header_int(d, &v)) fail("record '", name, "' has a dimension that is not a non-negative integer");
      r.shape.push_back(v);
      // numel stays <= the data section's size (else the range check fails).
      if (v != 0 && numel > data_bytes / v) numel = data_bytes + 1;
      else numel *= v;
    }
    if (!offsets.is_array() || offsets.size() != 2 || !header_int(offsets[0], &r.begin) ||
        !header_int(offsets[1], &r.end) || r.begin > r.end || r.end > data_bytes) {
      fail("record '", name, "' has data_offsets outside the file's ", data_bytes, " bytes of records");
    }
    const int64_t item = static_cast<int64_t>(c10::elementSize(r.dtype));
    if (numel > data_bytes || numel * item != r.end - r.begin) {
      fail("record '", name, "' holds ", r.end - r.begin, " bytes, but its shape and dtype need ",
           numel > data_bytes ? std::string("more than the file holds") : std::to_string(numel * item));
    }
    ranges.emplace_back(r.begin, r.end);
    records_.emplace(name, std::move(r));
  }
  // The records cover the data section exactly: no overlap (one byte read
  // as two records) and no hole (bytes that no record explains).
  std::sort(ranges.begin(), ranges.end());
  int64_t covered = 0;
  for (const auto& [b, e] : ranges) {
    if (b != covered) fail(b < covered ? "two records overlap" : "bytes between records belong to none");
    covered = e;
  }
  if (covered != data_bytes) fail(data_bytes - covered, " bytes after the last record belong to none");
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const auto& kv : records_) out.push_back(kv.first);
  return out;
}

const SafetensorsReader::Record& SafetensorsReader::record(const std::string& name) const {
  const auto it = records_.find(name);
  TORCH_INTERNAL_ASSERT(it != records_.end(), "no record '", name, "'");
  return it->second;
}

torch::ScalarType SafetensorsReader::dtype(const std::string& name) const { return record(name).dtype; }

std::vector<int64_t> SafetensorsReader::shape(const std::string& name) const { return record(name).shape; }

void SafetensorsReader::read_into(const std::string& name, const torch::Tensor& out) const {
  const Record& r = record(name);
  TORCH_INTERNAL_ASSERT(out.scalar_type() == r.dtype && out.sizes().vec() == r.shape, "record '", name,
                        "' read into a tensor of another dtype or shape");
  const bool direct = out.device().is_cpu() && out.is_contiguous();
  torch::Tensor buf = direct ? out : torch::empty(out.sizes(), out.options().device(torch::kCPU));
  TORCH_CHECK(read_exactly(fd_.get(), buf.data_ptr(), r.end - r.begin, data_start_ + r.begin), "cannot read record '",
              name, "' of '", path_, "': ", errno != 0 ? contrax::detail::errno_text(errno) : "the file ended early");
  if (!direct) {
    torch::NoGradGuard no_grad;
    out.copy_(buf);
  }
}

}  // namespace contrax::train::detail
