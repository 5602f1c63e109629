#include "octet/train/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>

#include "octet/train/crc32c.h"

namespace octet::train {
namespace {

// The safetensors header length is a little-endian uint64.
constexpr size_t kLengthBytes = 8;
// The reference writer pads the header with spaces to this alignment, so the data starts
// aligned (safetensors/src/tensor.rs, N_LEN alignment).
constexpr size_t kHeaderAlignment = 8;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kE8M0Note = "e8m0";
// Offsets above this cannot describe a real file; rejecting them also keeps sums from overflowing.
constexpr uint64_t kMaxOffset = uint64_t{std::numeric_limits<int64_t>::max()};
// Dimensions a tensor may have: octet writes at most 3; other writers' models stay well within.
constexpr size_t kMaxRank = 8;
// A missing-tensor error lists this many of the file's names.
constexpr size_t kNamesInErrors = 8;

struct DTypeName {
  DType dtype;
  const char* name;
};
// safetensors dtype names (safetensors/src/tensor.rs, enum Dtype). e8m0 has none: see
// kDTypeNotePrefix.
constexpr std::array<DTypeName, 9> kDTypeNames{{
    {DType::f32, "F32"},
    {DType::bf16, "BF16"},
    {DType::f16, "F16"},
    {DType::i32, "I32"},
    {DType::i64, "I64"},
    {DType::u8, "U8"},
    {DType::u16, "U16"},
    {DType::e4m3, "F8_E4M3"},
    {DType::e5m2, "F8_E5M2"},
}};

std::string known_dtype_names() {
  std::string names;
  for (const DTypeName& d : kDTypeNames) names += std::string(names.empty() ? "" : ", ") + d.name;
  return names;
}

/// `text` with control characters escaped (\n as \x0a), so names and values taken from a file
/// keep error messages on one line.
std::string printable(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (static_cast<unsigned char>(c) >= 0x20 && c != 0x7f) {
      out += c;
      continue;
    }
    constexpr char kHex[] = "0123456789abcdef";
    out += "\\x";
    out += kHex[static_cast<unsigned char>(c) >> 4];
    out += kHex[c & 0xf];
  }
  return out;
}

/// A JSON value from a file, shown in an error message: as it is when short and flat (numbers,
/// short strings, small arrays or objects of those), else by its type and size; dumping a
/// hostile nesting would recurse without bound and a long one would flood the message.
std::string brief(const nlohmann::json& value) {
  constexpr size_t kLongest = 64;
  const auto short_primitive = [&](const nlohmann::json& v) {
    return v.is_primitive() &&
           !(v.is_string() && v.get_ref<const std::string&>().size() > kLongest);
  };
  if (short_primitive(value)) return value.dump();
  if (value.is_structured() && value.size() <= kLongest / 8 &&
      std::all_of(value.begin(), value.end(), short_primitive))
    return value.dump();
  if (value.is_string())
    return "a string of " + std::to_string(value.get_ref<const std::string&>().size()) + " bytes";
  return std::string("a JSON ") + value.type_name() + " of " + std::to_string(value.size()) +
         " elements";
}

[[noreturn]] void throw_errno(const std::string& what) {
  OCTET_ERROR(what, ": ", std::strerror(errno));
}

void write_all(std::FILE* file, const void* data, size_t bytes) {
  if (bytes > 0 && std::fwrite(data, 1, bytes, file) != bytes) throw_errno("write failed");
}

/// Reads exactly `bytes` at `offset`; returns how many were read before end of file.
size_t pread_all(int fd, void* out, size_t bytes, uint64_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t got = ::pread(fd, static_cast<char*>(out) + done, bytes - done,
                                static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw_errno("read failed");
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

void sync_directory(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno("'" + path + "' was written, but opening its directory to sync failed");
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  // Some file systems cannot sync directories (EINVAL); the rename is then as durable as it gets.
  if (rc != 0 && error != EINVAL) {
    errno = error;
    throw_errno("'" + path + "' was written, but syncing its directory failed");
  }
}

/// A checksum as the metadata records it: always 8 lowercase hex digits, so the header's length
/// does not depend on the values (save writes it once before the data, then again with them).
std::string checksum_text(uint32_t crc) {
  char text[9];
  std::snprintf(text, sizeof text, "%08x", crc);
  return text;
}

/// The header; `checksums` holds one CRC-32C per tensor, in order.
std::string checkpoint_header(const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& user_metadata,
                              const std::vector<uint32_t>& checksums) {
  std::map<std::string, std::string> metadata;
  for (const auto& [key, value] : user_metadata)
    if (!key.starts_with(kDTypeNotePrefix) && !key.starts_with(kChecksumPrefix) &&
        key != kFormatVersionKey)
      metadata[key] = value;
  metadata[kFormatVersionKey] = kFormatVersion;

  nlohmann::ordered_json header;
  header[kMetadataKey] = nullptr;  // first, so `head -c` of a checkpoint shows it; filled below
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    metadata[kChecksumPrefix + name] = checksum_text(checksums[i]);
    OCTET_CHECK(!name.empty() && name != kMetadataKey,
                "expected a non-empty tensor name other than __metadata__, got '", name, "'");
    OCTET_CHECK(seen.insert(name).second, "duplicate tensor name '", name, "'");
    OCTET_CHECK(tensor.defined(), "tensor '", name, "' is undefined");
    if (tensor.dtype() == DType::e8m0) metadata[kDTypeNotePrefix + name] = kE8M0Note;
    header[name] = {{"dtype", safetensors_dtype_name(tensor.dtype())},
                    {"shape", tensor.shape()},
                    {"data_offsets", {offset, offset + tensor.nbytes()}}};
    offset += tensor.nbytes();
  }
  header[kMetadataKey] = metadata;

  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::type_error& e) {
    OCTET_ERROR("tensor names and metadata must be valid UTF-8: ", e.what());
  }
  text.resize((text.size() + kHeaderAlignment - 1) / kHeaderAlignment * kHeaderAlignment, ' ');
  return text;
}

// ----------------------------------------------------------------------------
// Reading: every check names the file.

std::optional<uint32_t> parse_checksum(const std::string& text) {
  if (text.size() != 8 ||
      !std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isxdigit(c); }))
    return std::nullopt;
  return static_cast<uint32_t>(std::stoul(text, nullptr, 16));
}

uint64_t json_offset(const nlohmann::json& value, const std::string& file, const std::string& name,
                     const char* field) {
  if (!value.is_number_unsigned() || value.get<uint64_t>() > kMaxOffset)
    OCTET_ERROR("checkpoint '", file, "': tensor '", printable(name), "' has ", field, " value ",
                brief(value), " out of range; expected an integer in [0, 2^63)");
  return value.get<uint64_t>();
}

struct ParsedEntry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;  // relative to the data section
};

ParsedEntry parse_entry(const std::string& file, const std::string& name,
                        const nlohmann::json& value) {
  const auto fail = [&](const std::string& why) -> ParsedEntry {
    OCTET_ERROR("checkpoint '", file, "': tensor '", printable(name), "' ", why);
  };
  if (!value.is_object()) return fail("expected {dtype, shape, data_offsets}, got " + brief(value));
  if (!value.contains("dtype") || !value["dtype"].is_string()) return fail("has no dtype string");
  const std::string dtype_text = value["dtype"].get<std::string>();
  const auto dtype = std::find_if(kDTypeNames.begin(), kDTypeNames.end(),
                                  [&](const DTypeName& d) { return dtype_text == d.name; });
  if (dtype == kDTypeNames.end())
    return fail("has unknown dtype '" + printable(dtype_text) + "'; expected one of " +
                known_dtype_names());

  ParsedEntry entry{name, dtype->dtype, {}, 0, 0};
  if (!value.contains("shape") || !value["shape"].is_array()) return fail("has no shape array");
  if (value["shape"].size() > kMaxRank)
    return fail("has a shape of " + std::to_string(value["shape"].size()) +
                " dimensions; expected at most " + std::to_string(kMaxRank));
  // `extent` is the product of the non-zero extents: a zero anywhere empties the tensor, but the
  // other extents must still multiply without overflow (strides and views use them).
  uint64_t extent = dtype_size(entry.dtype);
  bool empty = false;
  for (const nlohmann::json& dim : value["shape"]) {
    const uint64_t n = json_offset(dim, file, name, "shape");
    if (n == 0) empty = true;
    if (n != 0 && (__builtin_mul_overflow(extent, n, &extent) || extent > kMaxOffset))
      return fail("has shape " + value["shape"].dump() + " too large for any file");
    entry.shape.push_back(static_cast<int64_t>(n));
  }
  const uint64_t bytes = empty ? 0 : extent;

  if (!value.contains("data_offsets") || !value["data_offsets"].is_array() ||
      value["data_offsets"].size() != 2)
    return fail("expected data_offsets [begin, end]");
  entry.begin = json_offset(value["data_offsets"][0], file, name, "data_offsets");
  entry.end = json_offset(value["data_offsets"][1], file, name, "data_offsets");
  const std::string span =
      "[" + std::to_string(entry.begin) + ", " + std::to_string(entry.end) + ")";
  if (entry.begin > entry.end)
    return fail("has data_offsets " + span + " out of range: begin after end");
  if (entry.end - entry.begin != bytes)
    return fail("(" + std::string(dtype->name) + shape_str(entry.shape) + ") needs " +
                std::to_string(bytes) + " bytes, but its data_offsets " + span + " span " +
                std::to_string(entry.end - entry.begin));
  return entry;
}

/// Checks that the entries tile the data section exactly (no overlap, no gap); returns its size.
uint64_t check_layout(const std::string& file, std::vector<ParsedEntry>& entries) {
  std::sort(entries.begin(), entries.end(), [](const ParsedEntry& a, const ParsedEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;
  const ParsedEntry* previous = nullptr;
  for (const ParsedEntry& e : entries) {
    const auto span = [](const ParsedEntry& x) {
      return "'" + printable(x.name) + "' [" + std::to_string(x.begin) + ", " +
             std::to_string(x.end) + ")";
    };
    if (e.begin < covered)
      OCTET_ERROR("checkpoint '", file, "': data_offsets of tensors ", span(*previous), " and ",
                  span(e), " overlap");
    if (e.begin > covered)
      OCTET_ERROR("checkpoint '", file, "': data bytes [", covered, ", ", e.begin,
                  ") before tensor ", span(e), " belong to no tensor");
    covered = e.end;
    previous = &e;
  }
  return covered;
}

}  // namespace

// ----------------------------------------------------------------------------
// Writing

std::string safetensors_dtype_name(DType dtype) {
  if (dtype == DType::e8m0) return "U8";
  for (const DTypeName& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  OCTET_ERROR("dtype ", dtype_name(dtype), " has no safetensors name");
}

void write_file_atomically(const std::string& path, const std::function<void(std::FILE*)>& write) {
  const bool existed = std::filesystem::exists(path);
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  std::FILE* file = std::fopen(temp.c_str(), "wb");
  if (file == nullptr) throw_errno("cannot write '" + path + "': cannot create '" + temp + "'");
  const auto discard = [&] {
    if (file != nullptr) std::fclose(file);
    std::remove(temp.c_str());
  };
  try {
    write(file);
    if (std::fflush(file) != 0) throw_errno("flush failed");
    if (::fsync(::fileno(file)) != 0) throw_errno("fsync failed");
    std::FILE* closing = file;
    file = nullptr;
    if (std::fclose(closing) != 0) throw_errno("close failed");
    if (std::rename(temp.c_str(), path.c_str()) != 0) throw_errno("rename failed");
  } catch (const Error& e) {
    discard();
    OCTET_ERROR("writing '", path, "' failed (", e.message(), "); ",
                existed ? "the previous file is unchanged" : "nothing was written");
  } catch (...) {
    discard();
    throw;
  }
  sync_directory(path);
}

void link_atomically(const std::string& link, const std::string& target) {
  const std::string temp = link + ".tmp." + std::to_string(::getpid());
  std::remove(temp.c_str());
  if (::symlink(target.c_str(), temp.c_str()) != 0)
    throw_errno("cannot link '" + link + "' to '" + target + "'");
  if (std::rename(temp.c_str(), link.c_str()) != 0) {
    const int error = errno;
    std::remove(temp.c_str());
    errno = error;
    throw_errno("cannot link '" + link + "' to '" + target + "'");
  }
  sync_directory(link);
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // The checksums are known only once the data is written: the header goes out first with
  // placeholders of the same length, then again over them.
  std::vector<uint32_t> checksums(tensors.size(), 0);
  const std::string placeholder = checkpoint_header(tensors, metadata, checksums);
  write_file_atomically(path, [&](std::FILE* file) {
    std::array<uint8_t, kLengthBytes> length{};
    for (size_t i = 0; i < kLengthBytes; ++i) length[i] = (placeholder.size() >> (8 * i)) & 0xFF;
    write_all(file, length.data(), length.size());
    write_all(file, placeholder.data(), placeholder.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      // One host copy at a time, so a checkpoint of GPU tensors needs little host memory.
      const Tensor& tensor = tensors[i].second;
      const Tensor host = tensor.device().is_cpu() ? tensor : tensor.to(Device::cpu());
      checksums[i] = crc32c(host.raw_data(), host.nbytes());
      write_all(file, host.raw_data(), host.nbytes());
    }
    const std::string header = checkpoint_header(tensors, metadata, checksums);
    OCTET_CHECK(header.size() == placeholder.size(), "safetensors header changed length (",
                placeholder.size(), " to ", header.size(), ") when its checksums were filled in");
    if (std::fseek(file, kLengthBytes, SEEK_SET) != 0) throw_errno("seek failed");
    write_all(file, header.data(), header.size());
  });
}

// ----------------------------------------------------------------------------
// Reading

const SafetensorsFile::Entry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) {
    std::ostringstream listed;
    for (size_t i = 0; i < std::min(names_.size(), kNamesInErrors); ++i)
      listed << (i ? ", " : "") << names_[i];
    if (names_.size() > kNamesInErrors) listed << ", ...";
    OCTET_ERROR("checkpoint '", path_, "' has no tensor '", name, "' (it has ", names_.size(),
                " tensors: ", listed.str(), ")");
  }
  return it->second;
}

Tensor SafetensorsFile::get(const std::string& name) const {
  const Entry& e = entry(name);
  Tensor t = Tensor::empty(e.shape, e.dtype);
  const size_t got = pread_all(*fd_, t.raw_data(), e.bytes, e.begin);
  if (got != e.bytes)
    OCTET_ERROR("checkpoint truncated: expected ", e.bytes, " bytes of tensor '", name,
                "' at offset ", e.begin, " of '", path_, "', got ", got);
  if (e.checksum) {
    const uint32_t computed = crc32c(t.raw_data(), e.bytes);
    if (computed != *e.checksum)
      OCTET_ERROR("checkpoint '", path_, "' is corrupt: tensor '", name, "' has CRC-32C ",
                  checksum_text(computed), ", but the file recorded ", checksum_text(*e.checksum));
  }
  return t;
}

SafetensorsFile load_safetensors(const std::string& path) {
  SafetensorsFile out;
  out.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno("cannot open checkpoint '" + path + "'");
  out.fd_ = std::shared_ptr<const int>(new int(fd), [](const int* p) {
    ::close(*p);
    delete p;
  });
  struct stat info {};
  if (::fstat(fd, &info) != 0) throw_errno("cannot stat checkpoint '" + path + "'");
  if (!S_ISREG(info.st_mode)) OCTET_ERROR("checkpoint '", path, "' is not a regular file");
  const uint64_t file_bytes = static_cast<uint64_t>(info.st_size);

  if (file_bytes < kLengthBytes)
    OCTET_ERROR("checkpoint '", path, "' is ", file_bytes, " bytes, shorter than the ",
                kLengthBytes, "-byte header length");
  std::array<uint8_t, kLengthBytes> length{};
  pread_all(fd, length.data(), length.size(), 0);
  uint64_t header_bytes = 0;
  for (size_t i = 0; i < kLengthBytes; ++i) header_bytes |= uint64_t{length[i]} << (8 * i);
  if (header_bytes > file_bytes - kLengthBytes)
    OCTET_ERROR("checkpoint '", path, "': header length ", header_bytes,
                " extends beyond the end of the file (", file_bytes, " bytes)");
  if (header_bytes > kMaxHeaderBytes)
    OCTET_ERROR("checkpoint '", path, "': header length ", header_bytes, " exceeds the limit of ",
                kMaxHeaderBytes, " bytes");
  std::string text(header_bytes, '\0');
  pread_all(fd, text.data(), text.size(), kLengthBytes);

  // JSON lets a key repeat and the parser keeps the last one; a safetensors header whose tensor
  // (or field, or metadata key) appears twice is ambiguous, so it is refused.
  std::vector<std::set<std::string>> keys;  // the keys seen in each open object
  const auto unique_keys = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start) keys.emplace_back();
    if (event == Event::object_end) keys.pop_back();
    if (event == Event::key && !keys.back().insert(parsed.get<std::string>()).second)
      OCTET_ERROR("checkpoint '", path, "': key '", printable(parsed.get<std::string>()),
                  "' appears twice in one object of the JSON header");
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, unique_keys);
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number no double holds (e.g. 1e400).
    OCTET_ERROR("checkpoint '", path, "': invalid JSON header: ", e.what());
  }
  if (!header.is_object())
    OCTET_ERROR("checkpoint '", path, "': expected a JSON object header, got ", header.type_name());

  std::vector<ParsedEntry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key != kMetadataKey) {
      entries.push_back(parse_entry(path, key, value));
      continue;
    }
    if (!value.is_object())
      OCTET_ERROR("checkpoint '", path, "': expected __metadata__ to be an object, got ",
                  value.type_name());
    for (const auto& [meta_key, meta_value] : value.items()) {
      if (!meta_value.is_string())
        OCTET_ERROR("checkpoint '", path, "': metadata '", printable(meta_key),
                    "' must be a string, got ", brief(meta_value));
      out.metadata_[meta_key] = meta_value.get<std::string>();
    }
  }

  const uint64_t data_bytes = check_layout(path, entries);
  const uint64_t data_start = kLengthBytes + header_bytes;
  const uint64_t expected = data_start + data_bytes;  // < 2^64: both terms are bounded
  if (file_bytes < expected)
    OCTET_ERROR("checkpoint truncated: expected ", expected, " bytes, got ", file_bytes, " ('",
                path, "')");
  if (file_bytes > expected)
    OCTET_ERROR("checkpoint '", path, "': expected ", expected, " bytes, got ", file_bytes,
                " (trailing bytes after the last tensor)");

  const auto version = out.metadata_.find(kFormatVersionKey);
  const bool unchecked_version = version != out.metadata_.end() && version->second == "1";
  if (version != out.metadata_.end() && version->second != kFormatVersion && !unchecked_version)
    OCTET_ERROR("checkpoint '", path, "' has ", kFormatVersionKey, " '", version->second,
                "'; this build reads versions 1 and ", kFormatVersion);

  for (const ParsedEntry& e : entries) {
    out.names_.push_back(e.name);
    out.entries_[e.name] = {e.dtype, e.shape, data_start + e.begin, e.end - e.begin, std::nullopt};
  }
  for (const auto& [key, value] : out.metadata_) {
    if (!key.starts_with(kDTypeNotePrefix)) continue;
    const std::string name = key.substr(std::strlen(kDTypeNotePrefix));
    const auto it = out.entries_.find(name);
    if (value != kE8M0Note || it == out.entries_.end() || it->second.dtype != DType::u8)
      OCTET_ERROR("checkpoint '", path, "': metadata note ", printable(key), "='", printable(value),
                  "' expected 'e8m0' on a U8 tensor of that name");
    it->second.dtype = DType::e8m0;
  }
  for (const auto& [key, value] : out.metadata_) {
    if (!key.starts_with(kChecksumPrefix)) continue;
    const auto it = out.entries_.find(key.substr(std::strlen(kChecksumPrefix)));
    const std::optional<uint32_t> crc = parse_checksum(value);
    if (it == out.entries_.end() || !crc)
      OCTET_ERROR("checkpoint '", path, "': metadata ", key, "='", value,
                  "' expected 8 hex digits naming a tensor of the file");
    it->second.checksum = crc;
  }
  // Version 2 promises a checksum for every tensor: one missing means the header was altered.
  if (version != out.metadata_.end() && version->second == kFormatVersion)
    for (const auto& [name, entry] : out.entries_)
      if (!entry.checksum)
        OCTET_ERROR("checkpoint '", path, "': tensor '", name, "' has no ", kChecksumPrefix,
                    " metadata, which format version ", kFormatVersion, " requires");
  return out;
}

}  // namespace octet::train
