#!/usr/bin/env bash
# Builds octet and runs the whole test suite. GPU cases skip themselves without a GPU.
# Arguments go to octet_tests (e.g. --gtest_filter=...). The counts come from the run's JSON
# report (build/test.json): the failed tests are listed, and the last line is always
# "N passed, N failed, N skipped". The exit code is octet_tests' own.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh octet_tests || exit 1
build_dir=${OCTET_BUILD_DIR:-build}
log="$build_dir/test.log"
report="$build_dir/test.json"
rm -f "$report"
"$build_dir/octet_tests" --gtest_brief=1 --gtest_output="json:$report" "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

if [ ! -s "$report" ]; then
  # No report: the binary died (a crash, an abort, a kill) before gtest could write one.
  echo "octet_tests exited with status $status without writing $report; see $log"
  echo "0 passed, $((status != 0)) failed, 0 skipped"
  exit "$status"
fi

# gtest's JSON report prints one test case per object at a fixed indentation (8 spaces for the
# braces, 10 for its keys); a case failed when it has a "failures" array, whatever its result.
counts=$(awk '
  function value(line) { sub(/^[^:]*: "/, "", line); sub(/",?$/, "", line); gsub(/\\\//, "/", line); return line }
  /^          "name": /      { name = value($0) }
  /^          "classname": / { suite = value($0) }
  /^          "status": /    { status = value($0) }
  /^          "result": /    { result = value($0) }
  /^          "failures": \[/ { failed_case = 1 }
  /^        }/ {
    if (status == "RUN") {
      if (failed_case) { failed++; print "FAILED " suite "." name }
      else if (result == "SKIPPED") skipped++
      else passed++
    }
    name = suite = status = result = ""; failed_case = 0
  }
  END { printf "%d %d %d\n", passed, failed, skipped }
' "$report")
read -r passed failed skipped <<<"$(tail -1 <<<"$counts")"
sed '$d' <<<"$counts"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  # A failure outside any test case (e.g. a suite's set-up) fails the run without failing a case.
  echo "octet_tests exited with status $status although no test case failed; see $log"
  failed=1
fi
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
