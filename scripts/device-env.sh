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
