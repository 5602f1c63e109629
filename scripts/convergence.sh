#!/usr/bin/env bash
# convergence.sh: every FP8 recipe against BF16 on real text (docs/CONVERGENCE.md); fails when a
# recipe's final val loss is more than MAX_GAP_PCT (default 1) percent above BF16's.
#
#   scripts/convergence.sh cpu|gpu [BUILD_DIR] [OUT_DIR]   (defaults: build, runs/convergence-MODE)
#
# For each corpus of scripts/corpora.sh (fortunes, vimdoc: ~2.5 MB of English text each, from
# Debian packages, byte-level), each precision and each seed of SEEDS (weights and data order):
#   cpu: the tiny layout, STEPS (default 600) steps of 16 x 64 tokens: about a minute a run on 2
#        cores, 30 runs;
#   gpu: the GPT-2 124M layout, STEPS (default 1500) steps of 16 x 512 tokens, on cuda.
# Writes OUT_DIR/table.md (final train loss = mean of the last 50 logged steps; val loss over
# EVAL_BATCHES val batches at the end; each the mean over the seeds, with every seed's val loss;
# the gap of the means to BF16's and a verdict per recipe), and, with gnuplot,
# OUT_DIR/convergence-<corpus>.png: each recipe's seed-mean loss curve and its gap over BF16's.
#
# Why several seeds: the final val loss of one seed moves by about as much as the 1% under test
# (GPU, BF16 alone, seeds 7/8/9 on vimdoc: 1.3129, 1.3322, 1.3340; CPU, seed 7 on vimdoc: the four
# FP8 recipes from -0.79% to +1.38%; docs/CONVERGENCE.md). A one-seed verdict would pass or fail by
# the draw.
#
# Environment: SEEDS (default "7 8 9"), STEPS, PRECISIONS (default: bf16 and the four FP8
# recipes), CORPORA (default: fortunes vimdoc), CORPUS_DIR (default .corpora), MAX_GAP_PCT
# (default 1), EVAL_BATCHES (default 32), EXTRA_ARGS (more `octet train` flags, e.g. "--unfuse
# norm-cast" to bisect), KEEP_DONE=1 (keep the runs in OUT_DIR that already ended, with their final
# val loss, and train only the rest: a check cut short by a time limit continues where it stopped),
# REPORT_ONLY=1 (train nothing: the table and plots of the runs already in OUT_DIR, e.g. runs
# brought back from the GPU machine, whose gnuplot-less image cannot plot them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE="${1:-}"
case "$MODE" in
  cpu) MODEL=tiny DEVICE=cpu SEQ=64 DEFAULT_STEPS=600 DEFAULT_SEEDS="7 8 9" ;;
  gpu) MODEL=gpt2-124m DEVICE=cuda SEQ=512 DEFAULT_STEPS=1500 DEFAULT_SEEDS="7 8 9" ;;
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
read -r -a SEEDS <<<"${SEEDS:-$DEFAULT_SEEDS}"
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

# run_done DIR: the run ended (its metrics hold the val loss of step STEPS).
run_done() {
  python3 - "$1/metrics.jsonl" "$STEPS" <<'PY' 2>/dev/null
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
sys.exit(0 if any(j.get("step") == int(sys.argv[2]) and "val_loss" in j for j in lines) else 1)
PY
}

for corpus in "${CORPORA_TO_TRAIN[@]}"; do
  for seed in "${SEEDS[@]}"; do
    for p in "${PRECISIONS[@]}"; do
      run="$OUT/$corpus-$p-s$seed"
      if [ -n "${KEEP_DONE:-}" ] && run_done "$run"; then
        echo "== $corpus $p seed $seed: done before, kept" >&2
        continue
      fi
      echo "== $corpus $p seed $seed ($MODEL, $STEPS steps, $DEVICE)" >&2
      rm -rf "$run"
      "$BUILD/octet" train --device "$DEVICE" --model "$MODEL" --precision "$p" \
        --data "text:$CORPUS_DIR/$corpus.txt" --steps "$STEPS" --batch 16 --seq "$SEQ" \
        --seed "$seed" --out "$run" --eval-batches "$EVAL_BATCHES" --eval-every $((STEPS / 6)) \
        --fp8-stats-every 0 --log-every 100 "${EXTRA[@]}" >"$run.log" 2>&1 ||
        { echo "convergence.sh: $run failed (see $run.log)" >&2; exit 1; }
      # Only the metrics are kept: a 124M checkpoint is 1.5 GB a run.
      rm -f "$run"/*.safetensors
    done
  done
done

# The table, and the verdicts: one row per recipe, the means over the seeds (mean of the last
# $LAST train losses of each run, final val loss of each run).
python3 - "$OUT" "$LAST" "$MAX_GAP_PCT" "$MODEL" "$STEPS" "${PRECISIONS[*]}" "${CORPORA[*]}" \
  "${SEEDS[*]}" <<'PY'
import json, os, sys
out, last, max_gap, model, steps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
precisions, corpora, seeds = sys.argv[6].split(), sys.argv[7].split(), sys.argv[8].split()
mean = lambda xs: sum(xs) / len(xs)

def run_summary(run):
    """(mean of the last train losses, final val loss, {step: train loss}) of one run."""
    losses, val = [], None
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if "loss" in j:
                losses.append((j["step"], j["loss"]))
            if "val_loss" in j:
                val = j["val_loss"]  # the last evaluation: the final one
    return mean([l for _, l in losses[-last:]]), val, dict(losses)

def recipe_summary(corpus, p):
    """Seed means: train loss, val loss, every seed's val loss, and the mean curve (written to
    <corpus>-<p>.dat for the plot)."""
    runs = [run_summary(f"{corpus}-{p}-s{seed}") for seed in seeds]
    steps_all = sorted(set.intersection(*(set(c) for _, _, c in runs)))
    curve = {s: mean([c[s] for _, _, c in runs]) for s in steps_all}
    with open(os.path.join(out, f"{corpus}-{p}.dat"), "w") as f:
        for s in steps_all:
            f.write(f"{s} {curve[s]}\n")
    return mean([t for t, _, _ in runs]), mean([v for _, v, _ in runs]), [v for _, v, _ in runs], curve

def write_gap(corpus, p, mine, base):
    """Trailing 50-step means of the seed-mean loss and of BF16's, as a percent gap, per step."""
    steps_common = sorted(s for s in mine if s in base)
    with open(os.path.join(out, f"{corpus}-{p}.gap"), "w") as f:
        for i, s in enumerate(steps_common):
            window = steps_common[max(0, i - 49): i + 1]
            a = mean([mine[t] for t in window])
            b = mean([base[t] for t in window])
            f.write(f"{s} {100 * (a / b - 1)}\n")

n = len(seeds)
rows = [f"| corpus | precision | final train loss | vs BF16 | val loss | vs BF16 | val loss per seed "
        f"({', '.join(seeds)}) | verdict |", "|---|---|---|---|---|---|---|---|"]
failed, spreads = [], []
for corpus in corpora:
    base_train, base_val, base_vals, base_curve = recipe_summary(corpus, "bf16")
    spreads.append(f"{corpus} {100 * (max(base_vals) - min(base_vals)) / base_val:.2f}%")
    for p in precisions:
        train, val, vals, curve = recipe_summary(corpus, p)
        write_gap(corpus, p, curve, base_curve)
        per_seed = ", ".join(f"{v:.4f}" for v in vals)
        if p == "bf16":
            rows.append(f"| {corpus} | {p} | {train:.4f} | — | {val:.4f} | — | {per_seed} | baseline |")
            continue
        gap = 100 * (val / base_val - 1)
        ok = gap <= max_gap
        if not ok:
            failed.append(f"{corpus} {p}: val {val:.4f} is {gap:+.2f}% from BF16's {base_val:.4f}")
        rows.append(f"| {corpus} | {p} | {train:.4f} | {100 * (train / base_train - 1):+.2f}% | "
                    f"{val:.4f} | {gap:+.2f}% | {per_seed} | {'ok' if ok else 'FAIL'} |")
text = "\n".join(rows) + "\n"
text += (f"\n{model}, {steps} steps, {'mean of seeds ' + ', '.join(seeds) if n > 1 else 'seed ' + seeds[0]}"
         f"; BF16's own val spread over the seeds (max - min): {', '.join(spreads)}"
         f"; pass: every FP8 val loss within {max_gap:g}% of BF16's: "
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
set multiplot layout 1,2 title "$corpus corpus, $MODEL, $STEPS steps, mean of seeds ${SEEDS[*]}"
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
