#!/usr/bin/env bash
# gpu-profile.sh: where a training step's device time goes, on the device machine, in one call.
#
#   scripts/gpu-profile.sh [BUILD_DIR]        (after scripts/gpu-check.sh build)
#
# For each precision in PRECISIONS (default "fp8-delayed bf16") at MODEL (default gpt2-1.5b), 8 x 1024
# tokens, vocab 50304:
#   - the unprofiled rate: octet bench train (median tokens/s, peak memory) -> rates.jsonl;
#   - the op profile: octet bench train --profile (device ms per op and step) -> profile_<p>.txt.
# Then, with NCU=1 (default), Nsight Compute over one step of a 2-layer model of MODEL's widths (the
# same per-layer kernels and shapes): per kernel its duration, DRAM and SM throughput, achieved
# occupancy and registers -> ncu_<first precision>.csv. The op profiler's window is the CUDA
# profiler's capture range, so ncu sees only that step.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-gpu}"
OUT="${OUT:-./out}"
MODEL="${MODEL:-gpt2-1.5b}"
PRECISIONS="${PRECISIONS:-fp8-delayed bf16}"
NCU="${NCU:-1}"
mkdir -p "$OUT"
shape=(--model "$MODEL" --vocab 50304 --batch 8 --seq 1024)
octet="$BUILD_DIR/octet"

for p in $PRECISIONS; do
  timeout 150 "$octet" bench train "${shape[@]}" --precision "$p" --steps 8 --warmup-steps 3 \
    2>>"$OUT/profile_stderr.log" | grep '^{' | tee -a "$OUT/rates.jsonl"
  timeout 150 "$octet" bench train "${shape[@]}" --precision "$p" --steps 4 --warmup-steps 2 \
    --profile >/dev/null 2>"$OUT/profile_$p.txt"
  echo "== $p profile (largest ops)"
  head -n 25 "$OUT/profile_$p.txt"
  tail -n 2 "$OUT/profile_$p.txt"
done

if [[ "$NCU" == 1 ]]; then
  ncu_bin="$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null || true)"
  first="${PRECISIONS%% *}"
  if [[ -z "$ncu_bin" ]]; then
    echo "gpu-profile: ncu not found" >&2
  else
    metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    metrics+=,sm__throughput.avg.pct_of_peak_sustained_elapsed
    metrics+=,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
    metrics+=,launch__grid_size,launch__block_size,dram__bytes.sum
    timeout 240 "$ncu_bin" --profile-from-start off --clock-control none --cache-control none \
      --csv --metrics "$metrics" "$octet" bench train "${shape[@]}" --layers 2 \
      --precision "$first" --steps 1 --warmup-steps 2 --profile >"$OUT/ncu_$first.csv" \
      2>>"$OUT/profile_stderr.log"
    echo "== ncu: $(grep -c '"gpu__time_duration.sum"' "$OUT/ncu_$first.csv") kernels profiled"
  fi
fi
