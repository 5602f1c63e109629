# libFuzzer targets for the file readers (included by CMakeLists.txt when OCTET_FUZZ=ON).
# scripts/fuzz.sh configures a separate clang build dir and runs them.
if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "OCTET_FUZZ=ON needs clang (libFuzzer): configure with CXX=clang++")
endif()

# The readers and what they use (src/core), instrumented for coverage and checked by ASan and
# UBSan; a separate small library, so fuzzing does not build the whole engine.
set(octet_fuzz_flags -fsanitize=address,undefined -fno-sanitize-recover=all
                     -fno-omit-frame-pointer -g)
file(GLOB octet_reader_sources CONFIGURE_DEPENDS src/core/*.cc)
list(FILTER octet_reader_sources EXCLUDE REGEX ".*/cuda_[a-z_]*\\.cc$")
list(APPEND octet_reader_sources src/train/data.cc src/train/safetensors.cc src/train/crc32c.cc)
add_library(octet_readers STATIC ${octet_reader_sources})
target_include_directories(octet_readers PUBLIC include PRIVATE src)
target_compile_options(octet_readers PRIVATE -fsanitize=fuzzer-no-link ${octet_fuzz_flags})
target_compile_definitions(octet_readers PUBLIC OCTET_WITH_CUDA=0)
target_link_libraries(octet_readers PUBLIC OpenMP::OpenMP_CXX nlohmann_json::nlohmann_json)

foreach(reader safetensors bin_shard text_source)
  add_executable(fuzz_${reader} fuzz/fuzz_${reader}.cc)
  target_include_directories(fuzz_${reader} PRIVATE fuzz)
  target_compile_options(fuzz_${reader} PRIVATE -fsanitize=fuzzer ${octet_fuzz_flags})
  target_link_options(fuzz_${reader} PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_${reader} PRIVATE octet_readers)
endforeach()
