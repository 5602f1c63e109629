#include "octet/train/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include "test_util.h"
#include "train/scratch_dir.h"

namespace octet::train {
namespace {

using octet::testing::bitwise_equal;
using octet::testing::error_of;
using octet::testing::fresh_seed;
using octet::testing::read_file;
using octet::testing::scratch_dir;
using ::testing::HasSubstr;

constexpr DType kAllDTypes[] = {DType::f32,  DType::bf16, DType::f16, DType::e4m3, DType::e5m2,
                                DType::e8m0, DType::u8,   DType::u16, DType::i32,  DType::i64};

/// A CPU tensor of random bytes (every bit pattern, NaNs included: the format must not care).
Tensor random_bytes_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<uint8_t*>(t.raw_data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
  return t;
}

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  // A new file each time: ext4 flushes a file truncated and rewritten in place on close
  // (auto_da_alloc), which made the corruption sweeps 70x slower.
  std::filesystem::remove(path);
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

/// A safetensors file from a header text and data bytes, as any writer could produce it.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((uint64_t{header.size()} >> (8 * i)));
  return out + header + data;
}

/// Files in `dir` other than `keep` (temporary files left behind would show up here).
std::vector<std::string> other_files(const std::filesystem::path& dir, const std::string& keep) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename() != keep) out.push_back(entry.path().filename().string());
  return out;
}

// ----------------------------------------------------------------------------
// Round trips

class SafetensorsRoundTrip : public ::testing::TestWithParam<std::tuple<Device, DType>> {};

TEST_P(SafetensorsRoundTrip, EveryDTypeAndShapeIsBitwise) {
  const auto [device, dtype] = GetParam();
  OCTET_SKIP_IF_UNAVAILABLE(device);
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  const std::vector<Shape> shapes{{}, {0}, {1, 3221}, {2333, 1}, {7, 0, 3}, {13, 41, 3}};
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::vector<Tensor> host;
  for (size_t i = 0; i < shapes.size(); ++i) {
    host.push_back(random_bytes_tensor(shapes[i], dtype, rng));
    // Names out of alphabetical order: the file keeps the given order.
    tensors.emplace_back("t" + std::to_string(shapes.size() - i), host.back().to(device));
  }
  const auto path = scratch_dir() / "ckpt.safetensors";
  save_safetensors(path.string(), tensors, {{"step", "12"}});

  const SafetensorsFile file = load_safetensors(path.string());
  ASSERT_EQ(file.names().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(file.names()[i], tensors[i].first);
    EXPECT_EQ(file.shape(tensors[i].first), shapes[i]);
    EXPECT_EQ(file.dtype(tensors[i].first), dtype);
    const Tensor loaded = file.get(tensors[i].first);
    EXPECT_TRUE(loaded.device().is_cpu());
    EXPECT_TRUE(bitwise_equal(host[i], loaded)) << tensors[i].first;
  }

  // The file itself follows the format: LE length, 8-aligned JSON header, safetensors names.
  const std::string bytes = read_file(path);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  EXPECT_EQ(header_bytes % 8, 0u);
  const auto header = nlohmann::json::parse(bytes.substr(8, header_bytes));
  const std::string expected_name = safetensors_dtype_name(dtype);
  EXPECT_EQ(header["t1"]["dtype"], expected_name);
  EXPECT_EQ(header["__metadata__"][kFormatVersionKey], kFormatVersion);
  if (dtype == DType::e8m0) {
    EXPECT_EQ(expected_name, "U8");
    EXPECT_EQ(header["__metadata__"]["octet_dtype.t1"], "e8m0");
  } else {
    EXPECT_FALSE(header["__metadata__"].contains("octet_dtype.t1"));
  }
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, SafetensorsRoundTrip,
                         ::testing::Combine(::testing::ValuesIn(octet::testing::all_backends()),
                                            ::testing::ValuesIn(kAllDTypes)),
                         [](const auto& info) {
                           std::string device = std::get<0>(info.param).str();
                           std::replace(device.begin(), device.end(), ':', '_');
                           return device + "_" + std::string(dtype_name(std::get<1>(info.param)));
                         });

TEST(Safetensors, DTypeNamesFollowTheFormat) {
  EXPECT_EQ(safetensors_dtype_name(DType::f32), "F32");
  EXPECT_EQ(safetensors_dtype_name(DType::bf16), "BF16");
  EXPECT_EQ(safetensors_dtype_name(DType::f16), "F16");
  EXPECT_EQ(safetensors_dtype_name(DType::e4m3), "F8_E4M3");
  EXPECT_EQ(safetensors_dtype_name(DType::e5m2), "F8_E5M2");
  EXPECT_EQ(safetensors_dtype_name(DType::e8m0), "U8");
  EXPECT_EQ(safetensors_dtype_name(DType::u8), "U8");
  EXPECT_EQ(safetensors_dtype_name(DType::u16), "U16");
  EXPECT_EQ(safetensors_dtype_name(DType::i32), "I32");
  EXPECT_EQ(safetensors_dtype_name(DType::i64), "I64");
}

TEST(Safetensors, MixedDTypesAndMetadataRoundTrip) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (DType dtype : kAllDTypes)
    tensors.emplace_back("layers.0." + std::string(dtype_name(dtype)),
                         random_bytes_tensor({5, 3}, dtype, rng));
  const std::map<std::string, std::string> metadata{
      {"config", R"({"n_layer": 2, "recipe": "delayed"})"},
      {"empty", ""},
      {"unicode", "\xce\xbb \xe2\x86\x92 \xf0\x9f\x94\xa5"},
      {"quotes\"and\\slashes", "line\nbreak\ttab"},
      {kFormatVersionKey, "999"},            // octet owns this key: replaced by the real version
      {"octet_dtype.layers.0.f32", "e8m0"},  // and this one: dropped, f32 is not e8m0
  };
  const auto path = scratch_dir() / "mixed.safetensors";
  save_safetensors(path.string(), tensors, metadata);
  const SafetensorsFile file = load_safetensors(path.string());
  for (const auto& [key, value] : metadata)
    if (!key.starts_with("octet_")) EXPECT_EQ(file.metadata().at(key), value) << key;
  EXPECT_EQ(file.metadata().at(kFormatVersionKey), kFormatVersion);
  EXPECT_FALSE(file.metadata().contains("octet_dtype.layers.0.f32"));
  EXPECT_EQ(file.metadata().at("octet_dtype.layers.0.e8m0"), "e8m0");
  for (const auto& [name, tensor] : tensors) {
    EXPECT_EQ(file.dtype(name), tensor.dtype()) << name;
    EXPECT_TRUE(bitwise_equal(tensor, file.get(name))) << name;
  }
  EXPECT_THAT(error_of([&] { file.get("layers.1.f32"); }),
              HasSubstr("has no tensor 'layers.1.f32' (it has 10 tensors: layers.0.f32, "
                        "layers.0.bf16"));
}

TEST(Safetensors, ReadsFilesFromOtherWriters) {
  // As the reference Python writer lays it out: metadata without octet's keys, tensors sorted by
  // name in the header but not in the data, and space padding.
  const auto path = scratch_dir() / "other.safetensors";
  const std::string header =
      R"({"a":{"dtype":"I32","shape":[2],"data_offsets":[4,12]},)"
      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"__metadata__":{"format":"pt"}})"
      "      ";
  const std::string data =
      std::string("\x01\x02\x03\x04", 4) + std::string("\x05\x00\x00\x00\xff\xff\xff\xff", 8);
  write_file(path, raw_file(header, data));
  const SafetensorsFile file = load_safetensors(path.string());
  EXPECT_EQ(file.names(), (std::vector<std::string>{"b", "a"}));  // file order
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  const Tensor a = file.get("a");
  EXPECT_EQ(a.data<int32_t>()[0], 5);
  EXPECT_EQ(a.data<int32_t>()[1], -1);
  EXPECT_EQ(static_cast<uint8_t*>(file.get("b").raw_data())[3], 4);
}

// ----------------------------------------------------------------------------
// Atomic writes: a failed save never damages the checkpoint already there.

struct OldCheckpoint {
  std::filesystem::path dir, path;
  std::vector<std::pair<std::string, Tensor>> tensors;
  std::string bytes;
};

OldCheckpoint write_old_checkpoint() {
  OldCheckpoint old;
  old.dir = scratch_dir();
  old.path = old.dir / "model.safetensors";
  old.tensors = {{"w", octet::testing::random_tensor({64, 33}, DType::f32, fresh_seed())}};
  save_safetensors(old.path.string(), old.tensors, {{"step", "100"}});
  old.bytes = read_file(old.path);
  return old;
}

::testing::AssertionResult old_is_intact(const OldCheckpoint& old) {
  if (read_file(old.path) != old.bytes) return ::testing::AssertionFailure() << "bytes changed";
  const SafetensorsFile file = load_safetensors(old.path.string());
  if (file.metadata().at("step") != "100") return ::testing::AssertionFailure() << "metadata";
  if (auto same = bitwise_equal(old.tensors[0].second, file.get("w")); !same) return same;
  const auto others = other_files(old.dir, old.path.filename().string());
  if (!others.empty()) return ::testing::AssertionFailure() << "left behind: " << others[0];
  return ::testing::AssertionSuccess();
}

TEST(SafetensorsAtomic, OverwriteReplacesTheOldFile) {
  OldCheckpoint old = write_old_checkpoint();
  const Tensor next = octet::testing::random_tensor({3, 5}, DType::bf16, fresh_seed());
  save_safetensors(old.path.string(), {{"w2", next}}, {{"step", "200"}});
  const SafetensorsFile file = load_safetensors(old.path.string());
  EXPECT_EQ(file.metadata().at("step"), "200");
  EXPECT_TRUE(bitwise_equal(next, file.get("w2")));
  EXPECT_TRUE(other_files(old.dir, old.path.filename().string()).empty());
}

TEST(SafetensorsAtomic, InvalidTensorsAreRejectedBeforeTouchingDisk) {
  OldCheckpoint old = write_old_checkpoint();
  const Tensor t = Tensor::zeros({2}, DType::f32);
  EXPECT_THAT(error_of([&] {
                save_safetensors(old.path.string(), {{"a", t}, {"b", Tensor()}}, {});
              }),
              HasSubstr("tensor 'b' is undefined"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(old.path.string(), {{"a", t}, {"a", t}}, {});
              }),
              HasSubstr("duplicate tensor name 'a'"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(old.path.string(), {{"__metadata__", t}}, {});
              }),
              HasSubstr("other than __metadata__"));
  EXPECT_THAT(error_of([&] {
                save_safetensors(old.path.string(), {{"a", t}}, {{"bad", "\xff\xfe"}});
              }),
              HasSubstr("valid UTF-8"));
  EXPECT_TRUE(old_is_intact(old));
}

TEST(SafetensorsAtomic, FailureWhileWritingLeavesTheOldFileIntact) {
  // The copy of a tensor throwing mid-file: the temporary file goes, the old file stays.
  OldCheckpoint old = write_old_checkpoint();
  const std::string message = error_of([&] {
    write_file_atomically(old.path.string(), [](std::FILE* file) {
      std::fputs("partial checkpoint bytes", file);
      OCTET_ERROR("copy of tensor 'w' failed");
    });
  });
  EXPECT_THAT(message, HasSubstr("writing '" + old.path.string() + "' failed"));
  EXPECT_THAT(message, HasSubstr("copy of tensor 'w' failed"));
  EXPECT_THAT(message, HasSubstr("the previous file is unchanged"));
  EXPECT_TRUE(old_is_intact(old));
}

TEST(SafetensorsAtomic, RenameFailureRemovesTheTemporaryFile) {
  // The target is a non-empty folder: everything succeeds up to the rename.
  const auto dir = scratch_dir();
  std::filesystem::create_directories(dir / "ckpt" / "inside");
  const std::string message = error_of([&] {
    save_safetensors((dir / "ckpt").string(), {{"a", Tensor::zeros({4}, DType::f32)}}, {});
  });
  EXPECT_THAT(message, HasSubstr("rename failed"));
  EXPECT_TRUE(std::filesystem::is_directory(dir / "ckpt" / "inside"));
  EXPECT_EQ(other_files(dir, "ckpt"), std::vector<std::string>{});
}

TEST(SafetensorsAtomic, UnwritableDirectoryLeavesTheOldFileIntact) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  OldCheckpoint old = write_old_checkpoint();
  std::filesystem::permissions(
      old.dir, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  const std::string message = error_of([&] {
    save_safetensors(old.path.string(), {{"w", Tensor::zeros({1}, DType::f32)}}, {});
  });
  std::filesystem::permissions(old.dir, std::filesystem::perms::owner_all);
  EXPECT_THAT(message, HasSubstr("cannot create"));
  EXPECT_THAT(message, HasSubstr("Permission denied"));
  EXPECT_TRUE(old_is_intact(old));
}

TEST(SafetensorsAtomic, MissingDirectoryFailsCleanly) {
  const auto dir = scratch_dir();
  EXPECT_THAT(error_of([&] {
                save_safetensors((dir / "no" / "such" / "x.safetensors").string(),
                                 {{"w", Tensor::zeros({1}, DType::f32)}}, {});
              }),
              HasSubstr("No such file or directory"));
}

/// The child of the full-disk test: saves under a 64 KiB file size limit, so write(2) fails
/// with EFBIG part-way through, like a full disk. Returns the exit code (0: all as expected).
int save_on_a_full_disk(const OldCheckpoint& old) {
  std::signal(SIGXFSZ, SIG_IGN);  // get EFBIG instead of being killed
  const rlimit limit{64 * 1024, 64 * 1024};
  if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return 2;
  const Tensor big = Tensor::zeros({1 << 20}, DType::f32);  // 4 MiB
  const std::string message = error_of([&] {
    save_safetensors(old.path.string(), {{"w", big}}, {{"step", "200"}});
  });
  std::fprintf(stderr, "%s\n", message.c_str());
  if (message.find("File too large") == std::string::npos ||
      message.find("previous file is unchanged") == std::string::npos)
    return 3;
  return old_is_intact(old) ? 0 : 4;
}

TEST(SafetensorsAtomicDeathTest, FullDiskLeavesTheOldFileIntact) {
  // In a child process, so the limit does not reach the other tests. The threadsafe style
  // re-executes the binary: the child writes its own old checkpoint, and exit() (not _Exit) runs
  // the static destructors that remove its scratch folder.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  OldCheckpoint old = write_old_checkpoint();
  EXPECT_EXIT(std::exit(save_on_a_full_disk(old)), ::testing::ExitedWithCode(0), "File too large");
  EXPECT_TRUE(old_is_intact(old));
}

// ----------------------------------------------------------------------------
// Corrupt files: always an octet::Error with a clear message, never a crash.

/// A small valid checkpoint: its bytes and the length of its header.
std::pair<std::string, uint64_t> small_checkpoint(const std::filesystem::path& path) {
  std::mt19937_64 rng(fresh_seed());
  save_safetensors(path.string(),
                   {{"a", random_bytes_tensor({3, 5}, DType::bf16, rng)},
                    {"b", random_bytes_tensor({7}, DType::e8m0, rng)},
                    {"c", random_bytes_tensor({2, 2}, DType::i64, rng)}},
                   {{"step", "3"}});
  const std::string bytes = read_file(path);
  uint64_t header = 0;
  for (int i = 0; i < 8; ++i) header |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  return {bytes, header};
}

TEST(SafetensorsCorrupt, TruncatedAtEveryByte) {
  const auto dir = scratch_dir();
  const auto [bytes, header] = small_checkpoint(dir / "good.safetensors");
  const auto path = dir / "cut.safetensors";
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    SCOPED_TRACE(::testing::Message() << "cut at " << cut << " of " << bytes.size());
    write_file(path, bytes.substr(0, cut));
    const std::string message = error_of([&] { load_safetensors(path.string()); });
    if (cut < 8) {
      EXPECT_THAT(message, HasSubstr("is " + std::to_string(cut) +
                                     " bytes, shorter than the 8-byte header length"));
    } else if (cut < 8 + header) {
      EXPECT_THAT(message, HasSubstr("header length " + std::to_string(header) +
                                     " extends beyond the end of the file (" + std::to_string(cut) +
                                     " bytes)"));
    } else {
      EXPECT_THAT(message,
                  HasSubstr("checkpoint truncated: expected " + std::to_string(bytes.size()) +
                            " bytes, got " + std::to_string(cut)));
    }
  }
  write_file(path, bytes + "x");
  EXPECT_THAT(error_of([&] { load_safetensors(path.string()); }),
              HasSubstr("trailing bytes after the last tensor"));
}

TEST(SafetensorsCorrupt, DamagedHeaderBytesNeverCrash) {
  // Every header byte replaced by characters that break JSON in different ways.
  const auto dir = scratch_dir();
  const auto [bytes, header] = small_checkpoint(dir / "good.safetensors");
  const auto path = dir / "bad.safetensors";
  int errors = 0, loaded = 0;
  for (size_t i = 8; i < 8 + header; ++i) {
    for (char c : {'\0', '{', '}', '"', '9', '-', 'x', ','}) {
      std::string damaged = bytes;
      if (damaged[i] == c) continue;
      damaged[i] = c;
      write_file(path, damaged);
      try {
        SafetensorsFile file = load_safetensors(path.string());
        for (const std::string& name : file.names()) file.get(name);
        ++loaded;  // e.g. a digit of a metadata value changed
      } catch (const Error& e) {
        ++errors;
        EXPECT_THAT(e.what(), HasSubstr(path.string())) << "byte " << i << " -> " << c;
      } catch (const std::exception& e) {
        ADD_FAILURE() << "byte " << i << " -> '" << c << "': not an octet::Error: " << e.what();
      }
    }
  }
  EXPECT_GT(errors, 100);
  EXPECT_LT(loaded, errors);
}

struct CorruptCase {
  const char* name;
  std::string header;
  std::string data;
  std::string expected;
};

class SafetensorsCorruptHeader : public ::testing::TestWithParam<CorruptCase> {};

TEST_P(SafetensorsCorruptHeader, ThrowsAClearError) {
  const auto path = scratch_dir() / "bad.safetensors";
  write_file(path, raw_file(GetParam().header, GetParam().data));
  const std::string message = error_of([&] { load_safetensors(path.string()); });
  EXPECT_THAT(message, HasSubstr(GetParam().expected));
  EXPECT_THAT(message, HasSubstr(path.string()));
}

const std::string k16Bytes(16, '\x11');

INSTANTIATE_TEST_SUITE_P(
    Cases, SafetensorsCorruptHeader,
    ::testing::Values(
        CorruptCase{"InvalidJson", R"({"a":{"dtype":"F32",)", "", "invalid JSON header"},
        CorruptCase{"NotAnObject", "[1, 2]", "", "expected a JSON object header, got array"},
        CorruptCase{"NumberNoDoubleHolds", R"({"a":1e400})", "",
                    "invalid JSON header: [json.exception.out_of_range.406] number overflow"},
        CorruptCase{"UnknownDType", R"({"a":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})",
                    k16Bytes,
                    "tensor 'a' has unknown dtype 'F64'; expected one of F32, BF16, F16, I32, "
                    "I64, U8, U16, F8_E4M3, F8_E5M2"},
        CorruptCase{"NoShape", R"({"a":{"dtype":"F32","data_offsets":[0,16]}})", k16Bytes,
                    "tensor 'a' has no shape array"},
        CorruptCase{"NegativeExtent", R"({"a":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})",
                    k16Bytes, "shape value -4 out of range"},
        CorruptCase{
            "HugeShape",
            R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})",
            k16Bytes, "too large for any file"},
        CorruptCase{"OffsetsNotAPair", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0]}})",
                    k16Bytes, "expected data_offsets [begin, end]"},
        CorruptCase{"NegativeOffset", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[-16,0]}})",
                    k16Bytes, "data_offsets value -16 out of range"},
        CorruptCase{"FractionalOffset",
                    R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16.0]}})", k16Bytes,
                    "data_offsets value 16.0 out of range"},
        CorruptCase{
            "HugeOffset",
            R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,18446744073709551615]}})",
            "", "data_offsets value 18446744073709551615 out of range"},
        CorruptCase{"BeginAfterEnd", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[16,0]}})",
                    k16Bytes, "data_offsets [16, 0) out of range: begin after end"},
        CorruptCase{"SizeMismatch", R"({"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,16]}})",
                    k16Bytes,
                    "tensor 'a' (BF16[4]) needs 8 bytes, but its data_offsets [0, 16) span 16"},
        CorruptCase{"Overlap",
                    R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
                    R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                    k16Bytes, "tensors 'a' [0, 12) and 'b' [8, 16) overlap"},
        CorruptCase{"Gap",
                    R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]}})",
                    k16Bytes, "data bytes [8, 12) before tensor 'b' [12, 16) belong to no tensor"},
        CorruptCase{"DataPastTheEnd", R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})",
                    k16Bytes, "checkpoint truncated: expected"},
        CorruptCase{"MetadataNotObject", R"({"__metadata__":["x"]})", "",
                    "expected __metadata__ to be an object, got array"},
        CorruptCase{"MetadataNotString", R"({"__metadata__":{"step":12}})", "",
                    "metadata 'step' must be a string, got 12"},
        CorruptCase{"NewerFormatVersion", R"({"__metadata__":{"octet_format_version":"3"}})", "",
                    "has octet_format_version '3'; this build reads versions 1 and 2"},
        CorruptCase{"ChecksumNotHex",
                    R"({"__metadata__":{"octet_crc32c.a":"0000000g"},)"
                    R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                    std::string(4, '\0'), "expected 8 hex digits naming a tensor of the file"},
        CorruptCase{"ChecksumOfNoTensor",
                    R"({"__metadata__":{"octet_crc32c.b":"00000000"},)"
                    R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                    std::string(4, '\0'), "metadata octet_crc32c.b='00000000' expected 8 hex"},
        CorruptCase{"Version2WithoutChecksum",
                    R"({"__metadata__":{"octet_format_version":"2"},)"
                    R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                    std::string(4, '\0'), "tensor 'a' has no octet_crc32c. metadata"},
        CorruptCase{"E8M0NoteOnF32",
                    R"({"__metadata__":{"octet_dtype.a":"e8m0"},)"
                    R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                    k16Bytes, "metadata note octet_dtype.a='e8m0' expected 'e8m0' on a U8 tensor"},
        CorruptCase{"EntryNotObject", R"({"a":[1,2,3]})", "",
                    "tensor 'a' expected {dtype, shape, data_offsets}, got [1,2,3]"},
        CorruptCase{
            "DeeplyNestedEntry",
            std::string(R"({"a":)") + std::string(100000, '[') + std::string(100000, ']') + "}", "",
            "tensor 'a' expected {dtype, shape, data_offsets}, got a JSON array of 1"},
        CorruptCase{"DuplicateTensor",
                    R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                    R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                    k16Bytes, "key 'a' appears twice in one object of the JSON header"},
        CorruptCase{"DuplicateField",
                    R"({"a":{"dtype":"F32","shape":[4],"dtype":"U8","data_offsets":[0,16]}})",
                    k16Bytes, "key 'dtype' appears twice"},
        CorruptCase{"DuplicateMetadataKey", R"({"__metadata__":{"step":"1","step":"2"}})", "",
                    "key 'step' appears twice"},
        CorruptCase{
            "HugeExtentsBesideAZero",
            R"({"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})", "",
            "too large for any file"},
        CorruptCase{"TooManyDimensions",
                    R"({"a":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})", "x",
                    "has a shape of 9 dimensions; expected at most 8"},
        CorruptCase{"ControlCharactersInAName",
                    R"({"a\nb\u0007":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})",
                    k16Bytes, R"(tensor 'a\x0ab\x07' has unknown dtype 'F64')"},
        CorruptCase{"LongMetadataValueNotString",
                    R"({"__metadata__":{"step":[1,2,3,4,5,6,7,8,9,10]}})", "",
                    "metadata 'step' must be a string, got a JSON array of 10 elements"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(SafetensorsCorrupt, ErrorsStayOnOneLine) {
  const auto path = scratch_dir() / "bad.safetensors";
  write_file(path, raw_file(R"({"x\ny":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})",
                            std::string(8, '\0')));
  const std::string message = error_of([&] { load_safetensors(path.string()); });
  EXPECT_THAT(message, HasSubstr(R"(tensor 'x\x0ay')"));
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(SafetensorsCorrupt, HeaderLongerThanTheCap) {
  // A sparse file: the header length is inside the file, but over the cap, and nothing of it is
  // read (a hostile length must not make the reader allocate it).
  const auto path = scratch_dir() / "long_header.safetensors";
  std::string length(8, '\0');
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((kMaxHeaderBytes + 1) >> (8 * i));
  write_file(path, length);
  std::filesystem::resize_file(path, 8 + kMaxHeaderBytes + 16);
  EXPECT_THAT(error_of([&] { load_safetensors(path.string()); }),
              HasSubstr("header length 100000001 exceeds the limit of 100000000 bytes"));
}

TEST(SafetensorsCorrupt, HeaderLengthBeyondTheFileAndOtherPaths) {
  const auto dir = scratch_dir();
  std::string huge(8, '\xff');
  write_file(dir / "huge.safetensors", huge + "{}");
  EXPECT_THAT(error_of([&] { load_safetensors((dir / "huge.safetensors").string()); }),
              HasSubstr("header length 18446744073709551615 extends beyond the end of the file "
                        "(10 bytes)"));
  EXPECT_THAT(error_of([&] { load_safetensors((dir / "missing.safetensors").string()); }),
              HasSubstr("cannot open checkpoint"));
  EXPECT_THAT(error_of([&] { load_safetensors(dir.string()); }),
              HasSubstr("is not a regular file"));
}

}  // namespace
}  // namespace octet::train
