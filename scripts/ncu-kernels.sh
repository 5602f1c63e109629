#!/usr/bin/env bash
# ncu-kernels.sh: Nsight Compute's view of single kernels inside octet_bench's benchmarks, for the
# memory-bound kernels whose rate is below their target: where each one's time goes (DRAM and SM
# throughput, occupancy, issue-slot use, warp stall reasons).
#
#   scripts/ncu-kernels.sh [BUILD_DIR]        (after octet_bench is built there)
#
# CASES (default below) is a list of BENCH_REGEX@KERNEL_REGEX@LABEL triples: for each, ncu profiles
# one launch (after LAUNCH_SKIP, default 5, warm launches) of the kernels matching KERNEL_REGEX
# while octet_bench runs the benchmarks matching BENCH_REGEX. Writes $OUT/ncu_<label>.txt (ncu's
# section text) and prints a summary line per case. Clocks are left alone (--clock-control none).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-gpu}"
OUT="${OUT:-./out}"
mkdir -p "$OUT"
bench="$BUILD_DIR/octet_bench"
ncu_bin="$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)"
[[ -n "$ncu_bin" ]] || { echo "ncu-kernels: ncu not found" >&2; exit 1; }
[[ -x "$bench" ]] || { echo "ncu-kernels: no $bench (build octet_bench first)" >&2; exit 1; }

default_cases=(
  "mem/quantize_both/block_1x128@quantize_tile_kernel@quantize_1x128"
  "mem/quantize_both/block_128x128@quantize_tile_kernel@quantize_128x128"
  "mem/quantize_both/mxfp8@quantize_tile_kernel@quantize_mxfp8"
  "mem/cast_transpose_amax@quantize_tile_kernel@cast_transpose"
  "mem/dequantize@dequantize_kernel@dequantize"
  "moe/combine@combine_kernel@moe_combine"
  "moe/scaled_activation_cast@scaled_activation_cast_kernel@moe_activation_cast"
  "moe/scaled_activation_backward@scaled_activation_backward_kernel@moe_activation_backward"
)
read -r -a cases <<<"${CASES:-${default_cases[*]}}"
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
  --section LaunchStats --section SchedulerStats --section WarpStateStats
  --section ComputeWorkloadAnalysis)

# The value and unit of ncu's metric $1 in the report $report.
pick() { grep -m1 -E "^\s*$1 " "$report" | awk '{print $NF, $(NF-1)}'; }

for c in "${cases[@]}"; do
  IFS=@ read -r filter kernel label <<<"$c"
  report="$OUT/ncu_$label.txt"
  timeout 120 "$ncu_bin" --clock-control none -k "regex:$kernel" \
    --launch-skip "${LAUNCH_SKIP:-5}" --launch-count 1 "${sections[@]}" \
    "$bench" --benchmark_filter="$filter" --benchmark_repetitions=1 >"$report" 2>&1
  rc=$?
  # One line: the kernel's duration, DRAM and SM throughput, achieved occupancy, issue use.
  echo "ncu $label (rc $rc): duration $(pick Duration), dram $(pick 'DRAM Throughput')," \
    "memory $(pick 'Memory Throughput'), sm $(pick 'Compute \(SM\) Throughput')," \
    "occupancy $(pick 'Achieved Occupancy'), issue slots $(pick 'Issue Slots Busy')"
done
