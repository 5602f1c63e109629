#!/usr/bin/env bash
# convergence.sh: every FP8 recipe against BF16 (docs/CONVERGENCE.md), on the CPU.
#
#   scripts/convergence.sh [BUILD_DIR] [OUT_DIR]      (defaults: build, runs/convergence)
#
# Trains the tiny model STEPS steps (default 300) for each data set (the builtin corpus, and a
# text file made of octet's own sources and docs) and each precision, with one seed and data
# order. Prints the markdown table of docs/CONVERGENCE.md (final train loss = mean of the last 20
# steps; val loss over 16 val batches at the end), writes it to OUT_DIR/table.md, and plots the
# loss curves to OUT_DIR/convergence.png when gnuplot is installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD="${1:-build}"
OUT="${2:-runs/convergence}"
STEPS="${STEPS:-300}"
PRECISIONS=(bf16 fp8-delayed fp8-current fp8-block fp8-mxfp8)
LAST=20  # train steps averaged for the final train loss: single steps are noisy

[ -x "$BUILD/octet" ] || { echo "convergence.sh: no $BUILD/octet; build first" >&2; exit 2; }
mkdir -p "$OUT"
corpus="$OUT/corpus.txt"
cat src/*.cc src/*/*.cc src/*/*/*.cc src/*/*/*.cu include/octet/*/*.h docs/*.md >"$corpus" \
  2>/dev/null || true
[ -s "$corpus" ] || { echo "convergence.sh: could not build the text corpus" >&2; exit 2; }

declare -A NAME=([builtin]=builtin ["text:$corpus"]=text)
for data in builtin "text:$corpus"; do
  for p in "${PRECISIONS[@]}"; do
    run="$OUT/${NAME[$data]}-$p"
    echo "== ${NAME[$data]} $p" >&2
    "$BUILD/octet" train --device cpu --precision "$p" --data "$data" --steps "$STEPS" --seed 7 \
      --out "$run" --eval-batches 16 --fp8-stats-every 0 >"$run.log" 2>&1
  done
done

# One row per run: mean of the last $LAST train losses, and the final val loss.
summary() {
  awk -v last="$LAST" '
    /"val_loss"/ { match($0, /"val_loss":[-0-9.eE+]+/); val = substr($0, RSTART + 11, RLENGTH - 11) }
    /"loss"/ && !/"val_loss"/ { match($0, /"loss":[-0-9.eE+]+/); l[n++] = substr($0, RSTART + 7, RLENGTH - 7) }
    END { s = 0; k = 0; for (i = n - last; i < n; ++i) if (i >= 0) { s += l[i]; ++k }
          printf "%.4f %.4f\n", s / k, val }' "$1"
}
{
  echo "| data | precision | final train loss | vs BF16 | val loss | vs BF16 |"
  echo "|---|---|---|---|---|---|"
  for name in builtin text; do
    read -r base_train base_val < <(summary "$OUT/$name-bf16/metrics.jsonl")
    for p in "${PRECISIONS[@]}"; do
      read -r train val < <(summary "$OUT/$name-$p/metrics.jsonl")
      if [ "$p" = bf16 ]; then
        echo "| $name | $p | $train | — | $val | — |"
      else
        awk -v n="$name" -v p="$p" -v t="$train" -v v="$val" -v bt="$base_train" -v bv="$base_val" \
          'BEGIN { printf "| %s | %s | %s | %+.2f%% | %s | %+.2f%% |\n", n, p, t, 100 * (t / bt - 1), v, 100 * (v / bv - 1) }'
      fi
    done
  done
} | tee "$OUT/table.md"

if command -v gnuplot >/dev/null; then
  for name in builtin text; do
    for p in "${PRECISIONS[@]}"; do
      grep -v val_loss "$OUT/$name-$p/metrics.jsonl" |
        sed -E 's/.*"step":([0-9]+),"loss":([-0-9.eE+]+).*/\1 \2/' >"$OUT/$name-$p.dat"
    done
  done
  gnuplot <<EOF
set terminal pngcairo size 1200,480
set output "$OUT/convergence.png"
set multiplot layout 1,2
set xlabel "step"; set ylabel "train loss"; set key top right
set title "builtin corpus"
plot for [p in "${PRECISIONS[*]}"] "$OUT/builtin-".p.".dat" using 1:2 with lines title p
set title "text file (octet's sources)"
plot for [p in "${PRECISIONS[*]}"] "$OUT/text-".p.".dat" using 1:2 with lines title p
unset multiplot
EOF
  echo "plot: $OUT/convergence.png" >&2
fi
