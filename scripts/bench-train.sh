#!/usr/bin/env bash
# Training throughput and peak memory on the GPU: octet (FP8 delayed, BF16) against the PyTorch
# peer (bench/peers/gpt2_torch.py: bf16 autocast, SDPA, fused AdamW, eager and torch.compile) at
# the same GPT-2 shapes. One JSON line per run into $OUT/train_bench.jsonl.
#   scripts/bench-train.sh [BUILD_DIR]      (after scripts/gpu-check.sh build)
# PEER_MODE=compile|eager|both (default both) picks the PyTorch peer's modes; MODELS (default
# "gpt2-124m gpt2-1.5b") the sizes; OCTET_RUNS (default "fp8-delayed bf16") octet's runs, each a
# precision optionally followed by octet flags joined with '+', e.g.
# "fp8-delayed fp8-delayed+--unfuse+input-recast bf16"; SHAPES (default "8x1024") the batch x
# sequence shapes each model runs at, e.g. MODELS=gpt2-124m SHAPES=32x1024.
# shellcheck source=scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"
results="$OUT/train_bench.jsonl"
: >"$results"
run() {  # run SECONDS COMMAND...: one JSON line (or an error line) appended to the results
  local limit=$1; shift
  json_line "$limit" "$OUT/bench_train_stderr.log" "\"error\":\"$*: " "$@" | tee -a "$results"
}
for model in ${MODELS:-gpt2-124m gpt2-1.5b}; do
  for shape in ${SHAPES:-8x1024}; do
    batch=${shape%x*} seq=${shape#*x}
    for octet_run in ${OCTET_RUNS:-fp8-delayed bf16}; do
      read -r -a flags <<<"${octet_run//+/ }"
      run 150 "$BUILD_DIR/octet" bench train --model "$model" --precision "${flags[@]}" \
        --vocab 50304 --batch "$batch" --seq "$seq" --steps 10 --warmup-steps 3
    done
    run 240 python3 bench/peers/gpt2_torch.py --model "$model" --batch "$batch" --seq "$seq" \
      --steps 10 --warmup 3 --mode "${PEER_MODE:-both}"
  done
done
