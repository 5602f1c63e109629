#!/usr/bin/env bash
# Runs tests under many seeds to find inputs that break them (a one-off exploration; CI runs the
# fixed default seeds). Run i uses OCTET_TEST_SEED=i (i = FIRST..FIRST+RUNS-1), so any failure
# it finds replays with that setting. Uses an existing build (build-cpu/ by default).
#
#   scripts/seed-sweep.sh [RUNS] [GTEST_FILTER]
#
# RUNS defaults to 50; the filter defaults to the CPU cases of the parity suites in tests/ops,
# tests/fp8 and tests/nn (GPU cases would only skip). Runs at low priority (nice NICE, default 19).
# Environment: OCTET_BUILD_DIR (default build-cpu), FIRST (default 1).
# Prints each failing test with its seed setting, then "seed sweep: R runs, F failed runs,
# T test runs" (exit 1 when any run failed).
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-50}
binary="${OCTET_BUILD_DIR:-build-cpu}/octet_tests"
first=${FIRST:-1}
[ -x "$binary" ] || { echo "seed sweep: no $binary (build it first)" >&2; exit 2; }

default_filter() {
  # Every suite defined in those directories; instantiated (TEST_P) suites carry a prefix.
  grep -ohE '^(TEST|TEST_F|TEST_P|TYPED_TEST)\(\w+' tests/ops/*.cc tests/fp8/*.cc tests/nn/*.cc |
    sed -E 's/^TEST_P\((\w+)/*\/\1.*/; s/^\w+\((\w+)/\1.*/' | sort -u | paste -sd: -
}
filter=${2:-"$(default_filter)-*cuda*:*Cuda*:*CUDA*"}

log_dir=$(mktemp -d)
trap 'rm -rf "$log_dir"' EXIT
failed_runs=0 test_runs=0 start=$(date +%s)
for ((seed = first; seed < first + runs; ++seed)); do
  log="$log_dir/$seed.log"
  OCTET_TEST_SEED=$seed nice -n "${NICE:-19}" "$binary" --gtest_brief=1 --gtest_filter="$filter" >"$log" 2>&1
  status=$?
  n=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log")
  test_runs=$((test_runs + ${n:-0}))
  if ((status != 0)); then
    failed_runs=$((failed_runs + 1))
    sed -n 's/^\[  FAILED  \] \([^ ]*\.[^ ]*\) (.*/  FAILED \1 with OCTET_TEST_SEED='"$seed"'/p' "$log"
    [ -n "$n" ] || { echo "  run with OCTET_TEST_SEED=$seed exited $status:"; tail -5 "$log"; }
  fi
  echo "seed $seed: exit $status, ${n:-?} tests, $(($(date +%s) - start)) s so far" >&2
done
echo "seed sweep: $runs runs, $failed_runs failed runs, $test_runs test runs ($(($(date +%s) - start)) s)"
((failed_runs == 0))
