#!/usr/bin/env bash
# Builds the libFuzzer targets of the file readers (fuzz/: safetensors checkpoints, llm.c .bin
# shards, text sources) with clang, ASan and UBSan into build-fuzz/, and runs each for SECONDS
# (default 60) from its seed corpus fuzz/corpus/<target>/. Fails on any crash, sanitizer report,
# leak, hang (> 10 s on one input), exception other than octet::Error or multi-line error.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     TARGET: safetensors bin_shard text_source
#
# New interesting inputs go to build-fuzz/corpus/<target>/ (kept between runs, so longer runs
# build on earlier ones); a crashing input is saved as build-fuzz/artifacts/<target>-crash-*
# and replays with: build-fuzz/fuzz_<target> build-fuzz/artifacts/<target>-crash-...
# The last line is "fuzz: N targets, E executions, no crash" (or what failed).
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(safetensors bin_shard text_source)
build=${OCTET_FUZZ_BUILD_DIR:-build-fuzz}

# setup.sh checks for clang's libFuzzer and sanitizer runtimes (Debian: libclang-rt-N-dev) and
# OpenMP (libomp-N-dev), installing them with apt-get when missing.
CXX=${OCTET_FUZZ_CXX:-clang++} OCTET_BUILD_DIR=$build \
  OCTET_CMAKE_ARGS="-DOCTET_FUZZ=ON -DOCTET_WITH_CUDA=OFF -DOCTET_BUILD_TESTS=OFF -DOCTET_BUILD_BENCHMARKS=OFF" \
  scripts/setup.sh "${targets[@]/#/fuzz_}" || exit 1

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
mkdir -p "$build/artifacts"
total=0 failed=()
for target in "${targets[@]}"; do
  corpus="$build/corpus/$target"
  log="$build/fuzz_$target.log"
  mkdir -p "$corpus"
  options=(-max_total_time="$seconds" -timeout=10 -print_final_stats=1
           -artifact_prefix="$build/artifacts/$target-")
  [ -f "fuzz/$target.dict" ] && options+=(-dict="fuzz/$target.dict")
  # The first directory receives new inputs; the committed seeds are only read.
  "$build/fuzz_$target" "${options[@]}" "$corpus" "fuzz/corpus/$target" >"$log" 2>&1
  status=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\)/\1/p' "$log" | tail -1)
  total=$((total + ${runs:-0}))
  if ((status != 0)); then
    failed+=("$target")
    tail -40 "$log"
    echo "fuzz_$target: FAILED (exit $status) after ${runs:-?} executions; see $log and $build/artifacts/"
  else
    echo "fuzz_$target: ${runs:-?} executions in ${seconds} s, corpus $(ls "$corpus" | wc -l) + $(ls "fuzz/corpus/$target" | wc -l) seeds, no crash"
  fi
done
if ((${#failed[@]})); then
  echo "fuzz: ${#targets[@]} targets, $total executions, FAILED: ${failed[*]}"
  exit 1
fi
echo "fuzz: ${#targets[@]} targets, $total executions, no crash"
