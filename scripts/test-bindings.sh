#!/usr/bin/env bash
# Tests octet's bindings on the CPU (GPU cases skip themselves without a GPU):
#   1. the C API's test program, written in C (tests/capi/*.c);
#   2. a downstream CMake project linking the installed C API through find_package(octet);
#   3. the Python package's pytest suite (python/tests), loading the liboctet_c just built through
#      OCTET_C_LIBRARY instead of building the package again; tests needing PyTorch skip without it.
# OCTET_BINDINGS_PIP=1 also runs `pip install ./python` into a fresh venv and the suite against it
# (a full build of the library: minutes on 2 cores).
# Ends with one line "bindings: N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${OCTET_BUILD_DIR:-build}
scripts/setup.sh octet_c octet_capi_test || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0 failed=0 skipped=0
tally() {  # tally LOG: adds the counts of the last summary line a runner printed
  local line n
  line=$(grep -E '[0-9]+ (passed|failed)' "$1" | tail -1)
  n=$(grep -Eo '[0-9]+ passed' <<<"$line" | grep -Eo '[0-9]+'); passed=$((passed + ${n:-0}))
  n=$(grep -Eo '[0-9]+ failed' <<<"$line" | grep -Eo '[0-9]+'); failed=$((failed + ${n:-0}))
  n=$(grep -Eo '[0-9]+ skipped' <<<"$line" | grep -Eo '[0-9]+'); skipped=$((skipped + ${n:-0}))
}
step() {  # step NAME CMD...: runs a step; a failure without counts counts as one failed test
  echo "== $1"
  shift
  "$@" 2>&1 | tee "$work/log"
  local rc=${PIPESTATUS[0]}
  local before=$failed
  tally "$work/log"
  if ((rc != 0 && failed == before)); then failed=$((failed + 1)); fi
  return 0
}

step "C API test (C11)" "$build_dir/octet_capi_test"

downstream() {
  cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null &&
    cmake -S tests/capi/downstream -B "$work/downstream" -DCMAKE_PREFIX_PATH="$work/prefix" \
      >"$work/downstream.log" 2>&1 &&
    cmake --build "$work/downstream" >>"$work/downstream.log" 2>&1 &&
    "$work/downstream/downstream" && echo "1 passed, 0 failed" ||
    { cat "$work/downstream.log"; return 1; }
}
step "find_package(octet) from a downstream project" downstream

python=${PYTHON:-python3}
python_deps() {
  "$python" -c "import numpy, pytest" 2>/dev/null ||
    "$python" -m pip install -q "numpy>=1.23" "pytest>=7"
}
pytest_run() {  # pytest_run PYTHON [ENV...]
  local py=$1
  shift
  env "$@" "$py" -m pytest -q -p no:cacheprovider python/tests
}
if python_deps; then
  step "pytest (python/tests against $build_dir/liboctet_c.so)" \
    pytest_run "$python" OCTET_C_LIBRARY="$PWD/$build_dir/liboctet_c.so" PYTHONPATH="$PWD/python"
else
  echo "could not install numpy and pytest"
  failed=$((failed + 1))
fi

if [ "${OCTET_BINDINGS_PIP:-0}" = 1 ]; then
  pip_install() {
    "$python" -m venv "$work/venv" && "$work/venv/bin/pip" install -q "numpy>=1.23" "pytest>=7" &&
      local start=$SECONDS &&
      "$work/venv/bin/pip" install -q ./python &&
      echo "pip install ./python: $((SECONDS - start)) s" &&
      (cd "$work" && "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$OLDPWD/python/tests")
  }
  step "pip install ./python into a fresh venv, then pytest" pip_install
fi

echo "bindings: $passed passed, $failed failed, $skipped skipped"
((failed == 0))
