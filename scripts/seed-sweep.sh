#!/usr/bin/env bash
# Runs tests under many seeds to find inputs that break them (a one-off exploration; CI runs the
# fixed default seeds). One process, --gtest_repeat=RUNS with OCTET_TEST_SEED=FIRST: iteration i
# uses seed FIRST + i, so each failure it finds replays with the setting it prints. Uses an
# existing build (build-cpu/ by default).
#
#   scripts/seed-sweep.sh [RUNS] [GTEST_FILTER]
#
# RUNS defaults to 50; the filter defaults to the CPU cases of the suites in tests/ops,
# tests/fp8 and tests/nn (GPU cases would only skip). Runs at low priority (nice NICE, default 19).
# Environment: OCTET_BUILD_DIR (default build-cpu), FIRST (default 1), NICE.
# Prints each failing test with its seed setting, then "seed sweep: R seeds, F failed test runs,
# T test runs" (exit 1 when any failed).
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-50}
binary="${OCTET_BUILD_DIR:-build-cpu}/octet_tests"
[ -x "$binary" ] || { echo "seed sweep: no $binary (build it first)" >&2; exit 2; }

default_filter() {
  # Every suite defined in those directories; instantiated (TEST_P) suites carry a prefix.
  grep -ohE '^(TEST|TEST_F|TEST_P|TYPED_TEST)\(\w+' tests/ops/*.cc tests/fp8/*.cc tests/nn/*.cc |
    sed -E 's/^TEST_P\((\w+)/*\/\1.*/; s/^\w+\((\w+)/\1.*/' | sort -u | paste -sd: -
}
filter=${2:-"$(default_filter)-*cuda*:*Cuda*:*CUDA*"}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
OCTET_TEST_SEED=${FIRST:-1} nice -n "${NICE:-19}" "$binary" --gtest_brief=1 --gtest_repeat="$runs" \
  --gtest_filter="$filter" >"$log" 2>&1
status=$?
# A failed test prints "[   SEED   ] Suite.Test seed S (OCTET_TEST_SEED=K replays it)".
grep -F '[   SEED   ]' "$log" | sed 's/^\[   SEED   \] /  FAILED /'
failures=$(grep -cF '[   SEED   ]' "$log")
tests=$(sed -n 's/^\[==========\] \([0-9]*\) tests\{0,1\} from .* ran\..*/\1/p' "$log" |
  awk '{ n += $1 } END { print n + 0 }')
if ((status != 0 && failures == 0)); then
  echo "seed sweep: octet_tests exited $status; the end of its output:"
  tail -20 "$log"
  failures=1
fi
echo "seed sweep: $runs seeds from ${FIRST:-1}, $failures failed test runs, $tests test runs" \
  "($(($(date +%s) - start)) s)"
((failures == 0))
