#!/usr/bin/env bash
# Builds octet and runs the whole test suite. GPU cases skip themselves without a GPU.
# Ends with one line "N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh octet_tests || exit 1
build_dir=${OCTET_BUILD_DIR:-build}
log="$build_dir/test.log"
"$build_dir/octet_tests" --gtest_brief=1 "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
count() { sed -n "s/^\[  $1 *\] \([0-9]*\) tests\{0,1\}.*/\1/p" "$log" | head -1; }
passed=$(count PASSED); failed=$(count FAILED); skipped=$(count SKIPPED)
echo "${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
exit "$status"
