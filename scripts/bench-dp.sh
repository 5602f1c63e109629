#!/usr/bin/env bash
# Data-parallel scaling: `octet bench train` in one process against `mpirun -np N` at the same
# tokens per rank (batch x seq each; accum = 1 alone, N under mpirun), the latter with and without
# ZeRO-1. One JSON line per run into $OUT/dp_bench.jsonl, and $OUT/dp_bench.md: tokens/s of the
# group, its ratio to one process, rank 0's peak memory, its AdamW moments, and its masters plus
# moments against the same ranks without ZeRO (issue 14's ZeRO-1 memory target).
#   scripts/bench-dp.sh [BUILD_DIR]     (after scripts/gpu-check.sh build, on a machine with N GPUs)
# RANKS (default: the GPUs nvidia-smi lists, at least 2), MODELS (default "gpt2-350m gpt2-1.5b"),
# PRECISION (fp8-delayed), DEVICE (cuda; cpu for a smoke run), BATCH (8), SEQ (1024), STEPS (10),
# MODEL_FLAGS (extra octet flags, e.g. a small --layers/--dim for a CPU smoke run).
# shellcheck source=scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
results="$OUT/dp_bench.jsonl"
: >"$results"
device="${DEVICE:-cuda}"
if [[ -z "${RANKS:-}" ]]; then
  RANKS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
  ((RANKS >= 2)) || RANKS=2
fi
mpi=(mpirun -np "$RANKS")
[[ $(id -u) -eq 0 ]] && mpi+=(--allow-run-as-root)
[[ "$device" == cpu ]] && mpi+=(--oversubscribe)
read -r -a model_flags <<<"${MODEL_FLAGS:-}"
run() {  # run LAUNCH... -- ACCUM OCTET_FLAGS...: one JSON line (or an error line) appended
  local launch=()
  while [[ "$1" != -- ]]; do launch+=("$1"); shift; done
  shift
  local accum=$1; shift
  json_line 300 "$OUT/dp_bench_stderr.log" "\"model\":\"$model\",\"error\":\"" \
    env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${launch[@]}" "$BUILD_DIR/octet" bench train \
    --device "$device" --model "$model" --precision "${PRECISION:-fp8-delayed}" --vocab 50304 \
    --batch "${BATCH:-8}" --seq "${SEQ:-1024}" --accum "$accum" --steps "${STEPS:-10}" \
    --warmup-steps 3 "${model_flags[@]}" "$@" | tee -a "$results"
}
for model in ${MODELS:-gpt2-350m gpt2-1.5b}; do
  run -- 1
  run "${mpi[@]}" -- "$RANKS"
  run "${mpi[@]}" -- "$RANKS" --zero 1
done
python3 - "$results" >"$OUT/dp_bench.md" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
columns = ["model", "ranks", "zero", "tokens/s", "vs one process", "peak GiB (rank 0)",
           "moments GiB (rank 0)", "masters + moments GiB (the rank with most)", "vs without ZeRO"]
print("| " + " | ".join(columns) + " |")
print("|" + "---|" * len(columns))
alone, unsharded = {}, {}
for r in runs:
    if "error" in r:
        print(f"| {r['model']} |" + " |" * (len(columns) - 2) + f" failed: {r['error'][:80]} |")
        continue
    kinds = r["peak_by_kind_gib"]
    held = r["masters_and_moments_max_gib"]  # ZeRO-1's target: masters and moments per GPU
    if r["world_size"] == 1:
        alone[r["model"]] = r["tokens_per_s"]
    elif r["zero"] == 0:
        unsharded[r["model"]] = held
    base = alone.get(r["model"])
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
    whole = unsharded.get(r["model"])
    shrink = f"{held / whole:.3f}x" if r["zero"] == 1 and whole else ""
    print(f"| {r['model']} | {r['world_size']} | {r['zero']} | {r['tokens_per_s']:,.0f} | {ratio} "
          f"| {r['peak_gib']:.2f} | {kinds['optimizer']:.2f} | {held:.2f} | {shrink} |")
PY
cat "$OUT/dp_bench.md"
