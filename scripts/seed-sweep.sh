#!/usr/bin/env bash
# Runs tests under many seeds to find inputs that break them (a one-off exploration; CI runs the
# fixed default seeds). One process, --gtest_repeat=RUNS with OCTET_TEST_SEED=FIRST: iteration i
# uses seed FIRST + i, so each failure it finds replays with the setting it prints. Uses an
# existing build (build-cpu/ by default).
#
#   scripts/seed-sweep.sh [RUNS] [GTEST_FILTER]
#
# RUNS defaults to 50; the filter defaults to the CPU cases of the suites in tests/ops,
# tests/fp8 and tests/nn (GPU cases would only skip), or with GPU=1 to their CUDA cases (a test
# name or suite with "cuda" in it) less the exhaustive FP8 format sweeps, whose inputs are not
# drawn. Runs at low priority (nice NICE, default 19).
# Environment: OCTET_BUILD_DIR (default build-cpu), FIRST (default 1), NICE, GPU, DEADLINE (seconds;
# the sweep stops there and reports the seeds it finished; default none).
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
# The CUDA cases of the same suites: "Suite.*cuda*" per suite, the whole suite when its name says
# CUDA.
cuda_filter() {
  default_filter | tr ':' '\n' | while read -r suite; do
    case "$suite" in
      *[Cc]uda* | *CUDA*) echo "$suite" ;;
      *) echo "${suite}cuda*" ;;
    esac
  done | paste -sd: -
}
if [ -n "${GPU:-}" ]; then
  filter=${2:-"$(cuda_filter)-*FormatExhaustive*"}
else
  filter=${2:-"$(default_filter)-*cuda*:*Cuda*:*CUDA*"}
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
OCTET_TEST_SEED=${FIRST:-1} timeout "${DEADLINE:-0}" nice -n "${NICE:-19}" "$binary" --gtest_brief=1 \
  --gtest_repeat="$runs" --gtest_filter="$filter" >"$log" 2>&1
status=$?
finished=$(grep -c '^\[==========\] [0-9]* tests\{0,1\} from .* ran\.' "$log")
if ((status == 124)); then
  echo "seed sweep: stopped at the ${DEADLINE} s deadline after $finished of $runs seeds"
  runs=$finished status=0
fi
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
