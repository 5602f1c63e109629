#!/usr/bin/env bash
# Builds octet and runs the whole test suite. GPU cases skip themselves without a GPU.
# Arguments go to octet_tests (e.g. --gtest_filter=...). Then, when the build has MPI, the
# data-parallel tests (octet_dist_tests) run under mpirun on 2 ranks (OCTET_DIST_RANKS; 0 skips
# them). The counts come from the runs' JSON reports (build/test.json, build/dist-test.json): the
# failed tests are listed, and the last line is always "N passed, N failed, N skipped". The exit
# code is octet_tests' own, or the dist tests' when octet_tests passed.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh octet_tests || exit 1
build_dir=${OCTET_BUILD_DIR:-build}
log="$build_dir/test.log"
report="$build_dir/test.json"
rm -f "$report"
"$build_dir/octet_tests" --gtest_brief=1 --gtest_output="json:$report" "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}

# The data-parallel tests: every rank runs every test (rank 0 reports). A rank that fails alone
# could leave the others waiting in a collective, so the run has a deadline.
readonly kDistDeadline=300  # seconds; the suite takes well under a minute on 2 cores
dist_report="$build_dir/dist-test.json"
dist_status=0
rm -f "$dist_report"
if [ -x "$build_dir/octet_dist_tests" ] && command -v mpirun >/dev/null && [ "${OCTET_DIST_RANKS:-2}" -gt 0 ]; then
  echo "octet_dist_tests on ${OCTET_DIST_RANKS:-2} MPI ranks:"
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} timeout "$kDistDeadline" \
    mpirun --allow-run-as-root --oversubscribe -np "${OCTET_DIST_RANKS:-2}" \
    "$build_dir/octet_dist_tests" --gtest_brief=1 --gtest_output="json:$dist_report" 2>&1 |
    tee -a "$log"
  dist_status=${PIPESTATUS[0]}
  if [ ! -s "$dist_report" ]; then
    echo "octet_dist_tests exited with status $dist_status without writing $dist_report"
    [ "$dist_status" -eq 0 ] && dist_status=1
  fi
  [ "$status" -eq 0 ] && status=$dist_status
fi

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
' "$report" $([ -s "$dist_report" ] && echo "$dist_report"))
read -r passed failed skipped <<<"$(tail -1 <<<"$counts")"
sed '$d' <<<"$counts"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
  # A failure outside any test case (e.g. a suite's set-up) fails the run without failing a case.
  echo "octet_tests exited with status $status although no test case failed; see $log"
  failed=1
fi
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
