#!/usr/bin/env bash
# Checks for what octet needs to build (commands, versions, headers and libraries, wherever they
# came from: Debian packages, pip, /usr/local), installs with apt-get only what is missing (when
# apt-get is there), then configures and builds into ./build. Arguments name the targets to build
# (default: all). Used by scripts/test.sh, scripts/train.sh and scripts/fuzz.sh.
#
# Environment: OCTET_BUILD_DIR (default build), OCTET_CMAKE_ARGS (extra cmake arguments; with
# -DOCTET_SANITIZE=ON or -DOCTET_FUZZ=ON the sanitizer and libFuzzer runtimes are checked too;
# OpenMPI is wanted unless -DOCTET_WITH_MPI=OFF: installed when missing, but a machine that cannot
# get it still builds, without data parallelism),
# CXX (the compiler CMake will use; default g++).
set -euo pipefail
cd "$(dirname "$0")/.."

readonly kMinCmake=3.25  # CMakeLists.txt's cmake_minimum_required
cxx=${CXX:-g++}
cmake_args=${OCTET_CMAKE_ARGS:-}
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT

# compiles STDIN as C++20 with FLAGS...; succeeds when it links.
compiles() {
  cat >"$probe_dir/probe.cc"
  "$cxx" -std=c++20 "$probe_dir/probe.cc" -o "$probe_dir/probe" "$@" >/dev/null 2>&1
}
header() { printf '#include <%s>\n' "$1" | compiles -E; }  # preprocessing finds it
version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }
cmake_ok() {
  command -v cmake >/dev/null &&
    version_at_least "$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')" "$kMinCmake"
}
cxx20_ok() {
  command -v "$cxx" >/dev/null && compiles <<'EOF'
#include <bit>
#include <span>
int main() { unsigned v = 3; return std::bit_width(v) == 2 && std::span<unsigned>(&v, 1).size() == 1 ? 0 : 1; }
EOF
}
openmp_ok() { printf '#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n' | compiles -fopenmp; }
clang_major() { "$cxx" -dumpversion | cut -d. -f1; }
is_clang() { "$cxx" --version 2>/dev/null | grep -q clang; }
sanitizers_ok() { echo 'int main() { return 0; }' | compiles -fsanitize=address,undefined; }
mpi_ok() {  # the MPI C++ compiler wrapper and its header
  command -v mpicxx >/dev/null &&
    echo '#include <mpi.h>' | mpicxx -x c++ -E - >/dev/null 2>&1
}
libfuzzer_ok() {
  printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' |
    compiles -fsanitize=fuzzer
}

# Each requirement: "what|check|Debian package".
compiler_package=g++ openmp_package=libgomp1 runtime_package=
if is_clang; then
  compiler_package=clang openmp_package="libomp-$(clang_major)-dev"
  runtime_package="libclang-rt-$(clang_major)-dev"
elif [[ "$cxx" == *clang* ]]; then
  # No clang yet: Debian's default clang and the packages that follow its version.
  compiler_package=clang openmp_package=libomp-dev runtime_package=libclang-rt-dev
elif [[ "$cxx" == *g++* ]]; then
  runtime_package=$(basename "$cxx")  # g++ ships its sanitizer runtimes
fi
required=(
  "cmake >= $kMinCmake|cmake_ok|cmake"
  "make|command -v make|make"
  "a C++20 compiler ($cxx)|cxx20_ok|$compiler_package"
  "GoogleTest|header gtest/gtest.h|libgtest-dev"
  "GoogleMock|header gmock/gmock.h|libgmock-dev"
  "CLI11|header CLI/CLI.hpp|libcli11-dev"
  "nlohmann-json|header nlohmann/json.hpp|nlohmann-json3-dev"
  "DLPack (the C API's tensors)|header dlpack/dlpack.h|libdlpack-dev"
  "OpenMP ($cxx -fopenmp)|openmp_ok|$openmp_package"
)
[[ "$cmake_args" == *-DOCTET_SANITIZE=ON* || "$cmake_args" == *-DOCTET_FUZZ=ON* ]] &&
  required+=("ASan+UBSan runtimes ($cxx)|sanitizers_ok|$runtime_package")
[[ "$cmake_args" == *-DOCTET_FUZZ=ON* ]] &&
  required+=("libFuzzer ($cxx -fsanitize=fuzzer)|libfuzzer_ok|$runtime_package")
# Optional: "what|check|package|what is lost without it".
optional=(
  "Google Benchmark|header benchmark/benchmark.h|libbenchmark-dev|octet_bench is not built"
  "gnuplot|command -v gnuplot|gnuplot-nox|octet train writes no loss.png (metrics.jsonl has the numbers)"
  "ccache|command -v ccache|ccache|rebuilds recompile every file"
)
[[ "$cmake_args" == *-DOCTET_BUILD_BENCHMARKS=OFF* ]] && optional=("${optional[@]:1}")
# Wanted: "what|check|package|what is lost without it". Unlike the optional ones, a missing one
# sends setup to apt-get by itself; unlike the required ones, one apt-get cannot install is not
# fatal (e.g. a GPU machine without a package mirror).
wanted=()
[[ "$cmake_args" != *-DOCTET_WITH_MPI=OFF* ]] &&
  wanted+=("OpenMPI (mpicxx, mpi.h)|mpi_ok|libopenmpi-dev|no data parallelism: octet train runs one process, no octet_dist_tests"
           "mpirun|command -v mpirun|openmpi-bin|scripts/test.sh skips the data-parallel tests")

check() { eval "$1" >/dev/null 2>&1; }
missing_required=() missing_optional=() packages=()
for r in "${required[@]}"; do
  IFS='|' read -r what test package <<<"$r"
  check "$test" || { missing_required+=("$r"); packages+=("$package"); }
done
for w in "${wanted[@]}"; do
  IFS='|' read -r what test package lost <<<"$w"
  check "$test" || packages+=("$package")
done
# Optional packages only ride along when apt-get runs anyway: a machine that has everything
# required (e.g. cmake from pip, no Debian mirror) is not sent to apt-get for a plotting tool.
for o in "${optional[@]}"; do
  IFS='|' read -r what test package lost <<<"$o"
  check "$test" || { missing_optional+=("$o"); ((${#packages[@]})) && packages+=("$package"); }
done

if ((${#packages[@]})); then
  sudo_cmd=()
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo_cmd=(sudo)
  if command -v apt-get >/dev/null && { [ "$(id -u)" -eq 0 ] || ((${#sudo_cmd[@]})); }; then
    # One package may be named twice (e.g. a runtime for two checks).
    mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)
    echo "octet setup: installing ${packages[*]}"
    "${sudo_cmd[@]}" apt-get update -qq || true
    # Package by package, so one that this distribution lacks does not block the others.
    for p in "${packages[@]}"; do
      DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "$p" >/dev/null 2>&1 ||
        echo "octet setup: apt-get could not install $p"
    done
  fi
fi

failed=0
for r in "${missing_required[@]}"; do
  IFS='|' read -r what test package <<<"$r"
  if ! check "$test"; then
    echo "octet setup: missing $what (Debian package $package)" >&2
    failed=1
  fi
done
if ((failed)); then
  command -v cmake >/dev/null && echo "octet setup: found $(cmake --version | head -1) at $(command -v cmake)" >&2
  echo "octet setup: install the above (apt-get, pip install cmake, ...) and run again" >&2
  exit 1
fi
for o in "${wanted[@]}" "${missing_optional[@]}"; do
  IFS='|' read -r what test package lost <<<"$o"
  check "$test" || echo "octet setup: no $what (optional; Debian package $package): $lost"
done

# cuDNN attention's frontend headers, when there is a CUDA toolkit to build it with: optional, so a
# machine that cannot fetch them builds without that path (CMake's AUTO leaves it out).
if [[ -x /usr/local/cuda/bin/nvcc || -n "$(command -v nvcc)" ]] &&
  [[ "$cmake_args" != *-DOCTET_WITH_CUDA=OFF* && "$cmake_args" != *CUDNN_ATTENTION=OFF* ]]; then
  scripts/cudnn-frontend.sh >/dev/null 2>&1 ||
    echo "octet setup: no cudnn-frontend (pip or network failed): building without cuDNN attention"
fi

build_dir=${OCTET_BUILD_DIR:-build}
mkdir -p "$build_dir"
# shellcheck disable=SC2086  # OCTET_CMAKE_ARGS holds several arguments
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release $cmake_args >"$build_dir.configure.log" 2>&1 \
  || { cat "$build_dir.configure.log"; exit 1; }
grep -E "octet: CUDA backend" "$build_dir.configure.log" || true
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$build_dir" -j"$(nproc)" "${targets[@]}"
