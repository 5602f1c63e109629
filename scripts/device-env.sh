# shellcheck shell=bash
# Sourced first by the scripts that run on the GPU machine after `scripts/gpu-check.sh build`
# (bench-train.sh, bench-scaling.sh, bench-dp.sh, gpu-multi.sh): strict mode, the repository root
# as the working directory, BUILD_DIR (the caller's first argument, default build-gpu) and OUT
# (default ./out, created).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck disable=SC2034  # read by the sourcing script
BUILD_DIR="${1:-build-gpu}"
OUT="${OUT:-./out}"
mkdir -p "$OUT"

# json_line SECONDS LOG ERROR_PREFIX COMMAND...: the JSON line that COMMAND prints within SECONDS
# (its stderr into LOG); when it printed none, {ERROR_PREFIX<LOG's last line>"}, ERROR_PREFIX
# being the error line's fields up to its message (e.g. "error":"), so every run leaves a line.
json_line() {
  local limit=$1 log=$2 prefix=$3 line
  shift 3
  line=$(timeout "$limit" "$@" 2>"$log" | grep '^{')
  [[ -n "$line" ]] || line="{$prefix$(tail -n 1 "$log" | tr -d '"\\')\"}"
  echo "$line"
}
