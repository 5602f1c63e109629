#!/usr/bin/env bash
# FP8 against BF16 for moe-16x2048's layout as it grows: more tokens a step (microbatches or
# larger ones) and wider experts. Each layout runs FP8 delayed then BF16, ROUNDS times (default
# 2), so that the two precisions take turns; one JSON line a run into $OUT/moe_layouts.jsonl
# (with "layout" and "round" added), then a table of the ratios (the median of the rounds).
#   scripts/bench-moe-layouts.sh [BUILD_DIR]     (after scripts/gpu-check.sh build)
# LAYOUTS picks layouts by name (default: all of those below). docs/PERFORMANCE.md, "The
# thirty-seventh session", has the first measurements and why the ratio stays below 1.4x.
# shellcheck source=scripts/device-env.sh
source "$(dirname "$0")/device-env.sh"

# One layout a line, in the order they run: its name, then its octet bench train flags. 40
# warm-up steps make the GEMM plans of the row counts the routing produces before the timed
# steps; with 4 microbatches a step, 12 do.
LAYOUTS_KNOWN="\
preset --steps 20 --warmup-steps 40
accum4 --accum 4 --steps 8 --warmup-steps 12
batch64 --batch 64 --steps 8 --warmup-steps 12
ffn7168-l2 --ffn 7168 --layers 2 --steps 20 --warmup-steps 40
ffn7168-l2-accum4 --ffn 7168 --layers 2 --accum 4 --steps 8 --warmup-steps 12
ffn7168-l2-batch64 --ffn 7168 --layers 2 --batch 64 --steps 8 --warmup-steps 12
ffn4096-accum4 --ffn 4096 --accum 4 --steps 8 --warmup-steps 12"
flags_of() {  # the flags of layout $1 (nothing when unknown)
  awk -v name="$1" '$1 == name { $1 = ""; print substr($0, 2) }' <<<"$LAYOUTS_KNOWN"
}
known=$(cut -d' ' -f1 <<<"$LAYOUTS_KNOWN" | paste -sd' ')
read -r -a layouts <<<"${LAYOUTS:-$known}"
for name in "${layouts[@]}"; do
  [[ -n "$(flags_of "$name")" ]] || { echo "unknown layout '$name'; known: $known" >&2; exit 2; }
done

results="$OUT/moe_layouts.jsonl"
: >"$results"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for name in "${layouts[@]}"; do
    read -r -a flags <<<"$(flags_of "$name")"
    for precision in fp8-delayed bf16; do
      json_line 180 "$OUT/moe_layouts_stderr.log" "\"error\":\"$name $precision: " \
        "$BUILD_DIR/octet" bench train --model moe-16x2048 --precision "$precision" "${flags[@]}" |
        sed "s/^{/{\"layout\":\"$name\",\"round\":$round,/" | tee -a "$results"
    done
  done
done

python3 - "$results" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'layout':20s} {'tokens/step':>11s} {'params':>9s} {'fp8 tok/s':>10s} {'bf16 tok/s':>10s} "
      f"{'fp8/bf16':>8s} {'peak GiB fp8/bf16':>18s}")
for layout in dict.fromkeys(r["layout"] for r in runs):
    got = {p: [r for r in runs if r["layout"] == layout and r.get("precision") == p and
               "tokens_per_s" in r] for p in ("fp8-delayed", "bf16")}
    if not got["fp8-delayed"] or not got["bf16"]:
        print(f"{layout:20s} (a run failed: see moe_layouts.jsonl)")
        continue
    fp8, bf16 = got["fp8-delayed"], got["bf16"]
    f = statistics.median(r["tokens_per_s"] for r in fp8)
    b = statistics.median(r["tokens_per_s"] for r in bf16)
    tokens = fp8[0]["batch"] * fp8[0]["seq"] * fp8[0]["accum"]
    print(f"{layout:20s} {tokens:11d} {fp8[0]['params'] / 1e6:8.1f}M {f:10.0f} {b:10.0f} "
          f"{f / b:8.3f} {fp8[0]['peak_gib']:8.2f} / {bf16[0]['peak_gib']:.2f}")
PY
