#!/usr/bin/env bash
# convergence.sh: every FP8 recipe against BF16 on real text (docs/CONVERGENCE.md); fails when a
# recipe's final val loss is more than MAX_GAP_PCT (default 1) percent above BF16's.
#
#   scripts/convergence.sh cpu|gpu [BUILD_DIR] [OUT_DIR]   (defaults: build, runs/convergence-MODE)
#
# For each corpus of scripts/corpora.sh (fortunes, vimdoc: ~2.5 MB of English text each, from
# Debian packages, byte-level) and each precision, with one seed and data order:
#   cpu: the tiny layout, STEPS (default 600) steps of 16 x 64 tokens: a few minutes on 2 cores;
#   gpu: the GPT-2 124M layout, STEPS (default 1500) steps of 16 x 512 tokens, on cuda.
# Writes OUT_DIR/table.md (final train loss = mean of the last 50 logged steps; val loss over
# EVAL_BATCHES val batches at the end; the gap to BF16 and a verdict per recipe), and, with
# gnuplot, OUT_DIR/convergence-<corpus>.png: each recipe's loss curve and its gap over BF16's.
#
# Environment: STEPS, PRECISIONS (default: bf16 and the four FP8 recipes), CORPORA (default:
# fortunes vimdoc), CORPUS_DIR (default .corpora), MAX_GAP_PCT (default 1), EVAL_BATCHES
# (default 32), EXTRA_ARGS (more `octet train` flags, e.g. "--unfuse norm-cast" to bisect),
# REPORT_ONLY=1 (train nothing: the table and plots of the runs already in OUT_DIR, e.g. runs
# brought back from the GPU machine, whose gnuplot-less image cannot plot them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE="${1:-}"
case "$MODE" in
  cpu) MODEL=tiny DEVICE=cpu SEQ=64 DEFAULT_STEPS=600 ;;
  gpu) MODEL=gpt2-124m DEVICE=cuda SEQ=512 DEFAULT_STEPS=1500 ;;
  *)
    echo "usage: scripts/convergence.sh cpu|gpu [BUILD_DIR] [OUT_DIR]" >&2
    exit 2
    ;;
esac
BUILD="${2:-build}"
OUT="${3:-runs/convergence-$MODE}"
STEPS="${STEPS:-$DEFAULT_STEPS}"
read -r -a PRECISIONS <<<"${PRECISIONS:-bf16 fp8-delayed fp8-current fp8-block fp8-mxfp8}"
read -r -a CORPORA <<<"${CORPORA:-fortunes vimdoc}"
MAX_GAP_PCT="${MAX_GAP_PCT:-1}"
EVAL_BATCHES="${EVAL_BATCHES:-32}"
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
LAST=50  # logged train steps averaged for the final train loss: single steps are noisy

[ "${PRECISIONS[0]}" = bf16 ] || { echo "convergence.sh: PRECISIONS must start with bf16" >&2; exit 2; }
if [ -n "${REPORT_ONLY:-}" ]; then
  CORPORA_TO_TRAIN=()
else
  [ -x "$BUILD/octet" ] || { echo "convergence.sh: no $BUILD/octet; build first" >&2; exit 2; }
  CORPUS_DIR="$(scripts/corpora.sh "${CORPUS_DIR:-.corpora}")"
  CORPORA_TO_TRAIN=("${CORPORA[@]}")
fi
mkdir -p "$OUT"

for corpus in "${CORPORA_TO_TRAIN[@]}"; do
  for p in "${PRECISIONS[@]}"; do
    run="$OUT/$corpus-$p"
    echo "== $corpus $p ($MODEL, $STEPS steps, $DEVICE)" >&2
    rm -rf "$run"
    "$BUILD/octet" train --device "$DEVICE" --model "$MODEL" --precision "$p" \
      --data "text:$CORPUS_DIR/$corpus.txt" --steps "$STEPS" --batch 16 --seq "$SEQ" --seed 7 \
      --out "$run" --eval-batches "$EVAL_BATCHES" --fp8-stats-every 0 --log-every 100 \
      "${EXTRA[@]}" >"$run.log" 2>&1 || { echo "convergence.sh: $run failed (see $run.log)" >&2; exit 1; }
  done
done

# The table, and the verdicts: one row per run (mean of the last $LAST train losses, final val).
python3 - "$OUT" "$LAST" "$MAX_GAP_PCT" "$MODEL" "$STEPS" "${PRECISIONS[*]}" "${CORPORA[*]}" <<'PY'
import json, os, sys
out, last, max_gap, model, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
precisions, corpora = sys.argv[6].split(), sys.argv[7].split()

def summary(run):
    losses, val = [], None
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if "loss" in j:
                losses.append((j["step"], j["loss"]))
            if "val_loss" in j:
                val = j["val_loss"]
    tail = [l for _, l in losses[-last:]]
    with open(os.path.join(out, run + ".dat"), "w") as f:
        for s, l in losses:
            f.write(f"{s} {l}\n")
    return sum(tail) / len(tail), val, dict(losses)

def write_gap(run, base):
    """Trailing 50-step means of the loss and of BF16's, as a percent gap, per step."""
    _, _, mine = summary(run)
    steps = sorted(s for s in mine if s in base)
    with open(os.path.join(out, run + ".gap"), "w") as f:
        for i, s in enumerate(steps):
            window = steps[max(0, i - 49): i + 1]
            a = sum(mine[t] for t in window) / len(window)
            b = sum(base[t] for t in window) / len(window)
            f.write(f"{s} {100 * (a / b - 1)}\n")

rows = ["| corpus | precision | final train loss | vs BF16 | val loss | vs BF16 | verdict |",
        "|---|---|---|---|---|---|---|"]
failed = []
for corpus in corpora:
    base_train, base_val, base_curve = summary(f"{corpus}-bf16")
    for p in precisions:
        train, val, _ = summary(f"{corpus}-{p}")
        write_gap(f"{corpus}-{p}", base_curve)
        if p == "bf16":
            rows.append(f"| {corpus} | {p} | {train:.4f} | — | {val:.4f} | — | baseline |")
            continue
        gap = 100 * (val / base_val - 1)
        ok = gap <= max_gap
        if not ok:
            failed.append(f"{corpus} {p}: val {val:.4f} is {gap:+.2f}% from BF16's {base_val:.4f}")
        rows.append(f"| {corpus} | {p} | {train:.4f} | {100 * (train / base_train - 1):+.2f}% | "
                    f"{val:.4f} | {gap:+.2f}% | {'ok' if ok else 'FAIL'} |")
text = "\n".join(rows) + "\n"
text += (f"\n{model}, {steps} steps; pass: every FP8 val loss within {max_gap:g}% of BF16's: "
         + ("yes" if not failed else "NO") + "\n")
for f in failed:
    text += f"  FAILED {f}\n"
open(os.path.join(out, "table.md"), "w").write(text)
sys.stdout.write(text)
open(os.path.join(out, "verdict"), "w").write("fail\n" if failed else "pass\n")
PY

if command -v gnuplot >/dev/null; then
  for corpus in "${CORPORA[@]}"; do
    gnuplot <<EOF
set terminal pngcairo size 1200,480
set output "$OUT/convergence-$corpus.png"
set multiplot layout 1,2 title "$corpus corpus, $MODEL, $STEPS steps"
set xlabel "step"; set ylabel "train loss"; set key top right; set logscale y
plot for [p in "${PRECISIONS[*]}"] "$OUT/$corpus-".p.".dat" using 1:2 with lines title p
unset logscale y
set ylabel "train loss vs BF16 (%, trailing 50-step means)"; set key top right
set yrange [-5:10]
plot for [p in "${PRECISIONS[*]}"] "$OUT/$corpus-".p.".gap" using 1:2 with lines title p, 0 notitle lc "black" dt 2
unset multiplot
EOF
    echo "plot: $OUT/convergence-$corpus.png" >&2
  done
else
  echo "convergence.sh: gnuplot not installed: no plots (apt-get install gnuplot-nox)" >&2
fi

[ "$(cat "$OUT/verdict")" = pass ]
