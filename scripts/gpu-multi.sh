#!/usr/bin/env bash
# gpu-multi.sh: what a machine with several GPUs checks in one call (issue 14), after
# `scripts/gpu-check.sh build` on it (carry .carry as for gpu-check):
#   1. octet_tests' cases that need two GPUs (a device guard restoring the ambient device, GEMM
#      operands on two GPUs refused, a Linear stack split over two GPUs = one GPU bitwise, modules
#      and the GPT model on cuda:1 with the current device left at 0, the GPT model and
#      `octet train --device cuda:0,1` split over both = one GPU bitwise, the gradient norm over
#      several devices); they skip on one GPU;
#   2. octet_dist_tests under `mpirun -np N`, one GPU a rank (NCCL collectives against the CPU
#      reference, bucketed data-parallel training bitwise the single reduction);
#   3. scripts/bench-dp.sh: one process against N, with and without ZeRO-1 (350M and 1.5B FP8);
#   4. the model split over cuda:0,1 against cuda:0 alone (`octet bench train`, 350M and 1.5B FP8);
#   5. 2 ranks each splitting the model (cuda:0,1 per rank on 4 GPUs, cuda:0,0 on 2) against 2
#      unsplit ranks: bitwise the same checkpoint.
# Writes $OUT/multi.log and $OUT/multi-summary.txt (also printed); exits 1 when a part failed.
#   scripts/gpu-multi.sh [BUILD_DIR]
# MULTI_FILTER replaces part 1's gtest filter; DIST_TIMEOUT (300) and DP_TIMEOUT (420) bound
# parts 2 and 3; BENCH_DP=0 leaves part 3 out, BENCH_SPLIT=0 part 4. GPUS overrides the count nvidia-smi gives (with
# DEVICE=cpu and bench-dp.sh's other variables: a smoke run on a machine without GPUs, where
# part 1 skips and parts 2 and 3 run on CPU ranks).
# shellcheck source=scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
log="$OUT/multi.log"
summary="$OUT/multi-summary.txt"
: >"$log"
gpus=${GPUS:-$(nvidia-smi --list-gpus 2>/dev/null | wc -l)}
{
  echo "octet gpu-multi  $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | xargs)
  echo "gpus: $gpus ($names)"
  echo "commit: $(cat .carry/commit 2>/dev/null || echo unknown)"
} >"$summary"
status=0
if ((gpus < 2)); then
  echo "result: not run: needs 2 or more GPUs, $gpus visible" >>"$summary"
  cat "$summary"
  exit 1
fi
tally() {  # gtest's closing counts in log $1, on one line
  grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test|^\[  SKIPPED \]' "$1" | tr '\n' ' '
}
part() {  # part NAME SECONDS COMMAND...: runs it into its own log, appends its tally to the summary
  local name=$1 limit=$2 rc part_log="$OUT/multi-$1.log"
  shift 2
  echo "=== $name: $*" >>"$log"
  timeout "$limit" "$@" >"$part_log" 2>&1
  rc=$?
  cat "$part_log" >>"$log"
  echo "$name: $(tally "$part_log")exit $rc" >>"$summary"
  rm -f "$part_log"
  ((rc == 0)) || status=1
}
mpi=(mpirun -np "$gpus")
[[ "${DEVICE:-cuda}" == cpu ]] && mpi+=(--oversubscribe)
[[ $(id -u) -eq 0 ]] && mpi+=(--allow-run-as-root)
part two-gpu-tests 300 "$BUILD_DIR/octet_tests" --gtest_brief=1 --gtest_color=no \
  --gtest_filter="${MULTI_FILTER:-DeviceGuard.*:GemmCudaDevices.*:RecomputeSplit.*:*Placement*:GPTSplit.*:*TrainerSplit*:OptimizerDevices.*}"
part dist-tests "${DIST_TIMEOUT:-300}" "${mpi[@]}" "$BUILD_DIR/octet_dist_tests" --gtest_brief=1 \
  --gtest_color=no
if [[ "${BENCH_DP:-1}" != 0 ]]; then
  echo "=== bench-dp" >>"$log"
  OUT="$OUT" RANKS="$gpus" timeout "${DP_TIMEOUT:-420}" scripts/bench-dp.sh "$BUILD_DIR" >>"$log" 2>&1 ||
    status=1
  if [[ -s "$OUT/dp_bench.md" ]]; then
    echo "data parallelism (scripts/bench-dp.sh):" >>"$summary"
    sed 's/^/  /' "$OUT/dp_bench.md" >>"$summary"
  else
    echo "data parallelism: no table (multi.log)" >>"$summary"
  fi
fi
if [[ "${BENCH_SPLIT:-1}" != 0 && "${DEVICE:-cuda}" != cpu ]]; then
  echo "model split over 2 GPUs (octet bench train, fp8-delayed, 8 x 1024, 10 steps after 3):" \
    >>"$summary"
  for model in ${SPLIT_MODELS:-gpt2-350m gpt2-1.5b}; do
    for devices in cuda:0 cuda:0,1; do
      echo "=== split bench $model $devices" >>"$log"
      line=$(timeout 300 "$BUILD_DIR/octet" bench train --device "$devices" --model "$model" \
        --precision fp8-delayed --batch 8 --seq 1024 --steps 10 --warmup-steps 3 2>>"$log" |
        tee -a "$log" | grep -o '"tokens_per_s":[0-9.]*\|"peak_gib":[0-9.]*' | tr '\n' ' ')
      [[ -n "$line" ]] || status=1
      echo "  $model --device $devices: ${line:-failed (multi.log)}" >>"$summary"
    done
  done
fi
if [[ "${DEVICE:-cuda}" != cpu ]]; then
  # 5. Data parallelism over split models: 2 ranks, each splitting its model in two stages (on 4
  # GPUs over two GPUs each, cuda:0,1 and cuda:2,3; on 2 GPUs both stages on the rank's GPU),
  # against 2 unsplit ranks: the checkpoints' tensors must be the same bytes.
  stages=$( ((gpus >= 4)) && echo cuda:0,1 || echo cuda:0,0)
  two=("${mpi[@]}")
  two[2]=2  # mpirun -np 2
  dp_split() {  # dp_split OUT_NAME DEVICE
    timeout 300 "${two[@]}" "$BUILD_DIR/octet" train --device "$2" \
      --model gpt2-124m --layers 4 --precision fp8-delayed --batch 4 --seq 256 --accum 2 \
      --steps 6 --out "$OUT/dp-split/$1" >>"$log" 2>&1
  }
  if dp_split whole cuda && dp_split split "$stages" &&
    python3 - "$OUT/dp-split/whole/checkpoint-000006.safetensors" \
      "$OUT/dp-split/split/checkpoint-000006.safetensors" >>"$log" 2>&1 <<'PY'
import json, struct, sys
def tensors(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    return {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
differ = [k for k in a if a[k] != b.get(k)]
print(f"{len(a)} tensors, {len(differ)} differ: {differ[:5]}")
sys.exit(1 if differ or a.keys() != b.keys() else 0)
PY
  then
    echo "data parallelism over split models (2 ranks x --device $stages): bitwise 2 unsplit ranks" >>"$summary"
  else
    echo "data parallelism over split models (2 ranks x --device $stages): FAILED (multi.log)" >>"$summary"
    status=1
  fi
fi
echo "result: $( ((status == 0)) && echo OK || echo FAILED)" >>"$summary"
cat "$summary"
exit "$status"
