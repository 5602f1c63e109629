// Checkpoints as safetensors files (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]},
// "__metadata__": {string: string}}, then the tensors' raw bytes back to back.
//
// Writes are atomic (temporary file, fsync, rename, directory fsync), so a crash or a failed
// write never leaves a half-written checkpoint in place of a good one. Reads validate the whole
// header against the file before any tensor is handed out.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "octet/core/tensor.h"

namespace octet::train {

/// Metadata key of octet's checkpoint format version; written on save, checked on load.
inline constexpr const char* kFormatVersionKey = "octet_format_version";
/// Version 2 records a CRC-32C per tensor; version 1 files (without them) are still read.
inline constexpr const char* kFormatVersion = "2";
/// Metadata "octet_crc32c.<tensor name>": "<8 hex digits>", the CRC-32C (octet/train/crc32c.h)
/// of the tensor's bytes as stored; SafetensorsFile::get verifies it.
inline constexpr const char* kChecksumPrefix = "octet_crc32c.";
/// safetensors has no E8M0 dtype: such tensors are stored as U8 with the metadata note
/// "octet_dtype.<tensor name>": "e8m0", which load turns back into DType::e8m0.
inline constexpr const char* kDTypeNotePrefix = "octet_dtype.";
/// Largest header accepted on load; the limit of the reference implementation
/// (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

/// Writes a file atomically: `write` fills "<path>.tmp.<pid>", which is flushed, fsynced and
/// renamed over `path`; then the directory is fsynced. On any failure (including an exception
/// from `write`) the temporary file is removed, an existing `path` is left as it was, and the
/// error is rethrown.
void write_file_atomically(const std::string& path, const std::function<void(std::FILE*)>& write);

/// Makes `link` a symbolic link to `target` atomically (a link "<link>.tmp.<pid>", renamed over
/// `link`; then the directory is fsynced): readers of `link` see the old target or the new one.
void link_atomically(const std::string& link, const std::string& target);

/// Writes `tensors` (any device; copied to the host one at a time) in the given order with
/// `metadata`, atomically. octet adds kFormatVersionKey, the E8M0 notes and the checksums itself
/// (values passed for those keys are replaced). Names must be unique, non-empty and not
/// "__metadata__".
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata);

/// The safetensors dtype name of `dtype` ("F32", "BF16", ..., "U8" for e8m0).
std::string safetensors_dtype_name(DType dtype);

/// A validated safetensors file; tensors are read from disk when asked for.
class SafetensorsFile {
 public:
  /// Tensor names in file order (by data offset, which is the order they were saved in).
  const std::vector<std::string>& names() const { return names_; }
  /// All of the file's metadata, octet's own keys included.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return entries_.contains(name); }
  /// Shape and dtype of a tensor without reading it.
  const Shape& shape(const std::string& name) const { return entry(name).shape; }
  DType dtype(const std::string& name) const { return entry(name).dtype; }
  /// The tensor `name` as a new CPU tensor; throws naming the file when there is none, and naming
  /// the tensor when its bytes do not match their recorded checksum.
  Tensor get(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  friend SafetensorsFile load_safetensors(const std::string& path);
  struct Entry {
    DType dtype;
    Shape shape;
    uint64_t begin = 0;  ///< absolute file offset of the data
    uint64_t bytes = 0;
    std::optional<uint32_t> checksum;  ///< from the kChecksumPrefix metadata, when recorded
  };
  const Entry& entry(const std::string& name) const;

  std::string path_;
  std::shared_ptr<const int> fd_;  ///< the open file (closed with the last copy)
  std::vector<std::string> names_;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

/// Opens and validates `path`. Throws octet::Error, naming the file, for: a file shorter than
/// 8 bytes, a header length beyond the file, invalid JSON, an unknown dtype, data offsets out of
/// range, overlapping, leaving gaps or not matching shape x dtype size, truncated data, an
/// unsupported octet_format_version, a malformed checksum, and (version 2) a missing one.
SafetensorsFile load_safetensors(const std::string& path);

}  // namespace octet::train
