#!/usr/bin/env bash
# How the cost of a training step grows: `octet bench train` tokens/s and peak memory (with its
# breakdown by kind) against sequence length and model size, FP8 delayed and BF16, at a fixed
# 8192 tokens a step (batch = 8192 / seq). Writes $OUT/scaling.jsonl (one line a run) and
# $OUT/scaling.md (the table for docs/PERFORMANCE.md).
#   scripts/bench-scaling.sh [BUILD_DIR]     (after scripts/gpu-check.sh build; ~6 min on an H200)
# MODELS (default "gpt2-124m gpt2-350m gpt2-1.5b"), SEQS (default "1024 2048 4096 8192"),
# PRECISIONS (default "fp8-delayed bf16"), STEPS (default 6) narrow or lengthen it.
# shellcheck source=scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
results="$OUT/scaling.jsonl"
: >"$results"
tokens=8192
for model in ${MODELS:-gpt2-124m gpt2-350m gpt2-1.5b}; do
  for seq in ${SEQS:-1024 2048 4096 8192}; do
    for precision in ${PRECISIONS:-fp8-delayed bf16}; do
      json_line 300 "$OUT/scaling_stderr.log" \
        "\"model\":\"$model\",\"seq\":$seq,\"precision\":\"$precision\",\"error\":\"" \
        "$BUILD_DIR/octet" bench train --model "$model" --precision "$precision" --vocab 50304 \
        --batch $((tokens / seq)) --seq "$seq" --steps "${STEPS:-6}" --warmup-steps 2 |
        tee -a "$results"
    done
  done
done
python3 - "$results" >"$OUT/scaling.md" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
print("| model | seq x batch | precision | tokens/s | peak GiB "
      "| weights, grads, moments, casts, workspace | activations |")
print("|---|---|---|---|---|---|---|")
for r in runs:
    if "error" in r:
        print(f"| {r['model']} | {r['seq']} | {r['precision']} | failed: {r['error'][:80]} | | | |")
        continue
    k = r.get("peak_by_kind_gib", {})
    held = ("weights", "gradients", "optimizer", "weight_casts", "workspace")
    static = sum(k.get(kind, 0) for kind in held)
    print(f"| {r['model']} | {r['seq']} x {r['batch']} | {r['precision']} | {r['tokens_per_s']:,.0f} "
          f"| {r['peak_gib']:.2f} | {static:.2f} | {k.get('activations', 0):.2f} |")
PY
cat "$OUT/scaling.md"
