#!/usr/bin/env bash
# bisect-delayed.sh: where does fp8-delayed lose to BF16? One corpus, one seed; BF16 once, then
# fp8-delayed as it ships and with one thing changed at a time: each fused cast switched off
# (bitwise the same arithmetic, so any change in the loss names a broken fusion), all of them off,
# and the recipe's knobs (a short history, most_recent, a margin), which change the arithmetic on
# purpose. Prints one table of final val losses and gaps to BF16.
#
#   scripts/bisect-delayed.sh cpu|gpu [BUILD_DIR] [OUT_DIR]   (defaults: build, runs/bisect-MODE)
#
# Environment: STEPS (gpu 1500, cpu 600), CORPUS (fortunes), CORPUS_DIR (.corpora), STATS_EVERY
# (FP8 statistics into each run's metrics.jsonl every N steps; default 0, never), LOG_EVERY (100), VARIANTS
# (default: every one below, by name).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODE="${1:-}"
case "$MODE" in
  cpu) MODEL=tiny DEVICE=cpu SEQ=64 DEFAULT_STEPS=600 ;;
  gpu) MODEL=gpt2-124m DEVICE=cuda SEQ=512 DEFAULT_STEPS=1500 ;;
  *)
    echo "usage: scripts/bisect-delayed.sh cpu|gpu [BUILD_DIR] [OUT_DIR]" >&2
    exit 2
    ;;
esac
BUILD="${2:-build}"
OUT="${3:-runs/bisect-$MODE}"
STEPS="${STEPS:-$DEFAULT_STEPS}"
CORPUS="${CORPUS:-fortunes}"
CORPUS_DIR="$(scripts/corpora.sh "${CORPUS_DIR:-.corpora}")"
declare -A ARGS=(
  [bf16]="--precision bf16"
  [delayed]="--precision fp8-delayed"
  [no-norm-cast]="--precision fp8-delayed --unfuse norm-cast"
  [no-activation-cast]="--precision fp8-delayed --unfuse activation-cast"
  [no-activation-grad-cast]="--precision fp8-delayed --unfuse activation-grad-cast"
  [no-bias-grad]="--precision fp8-delayed --unfuse bias-grad"
  [no-optimizer-cast]="--precision fp8-delayed --unfuse optimizer-cast"
  [unfused]="--precision fp8-delayed --unfuse all"
  [history16]="--precision fp8-delayed --amax-history 16"
  [most-recent]="--precision fp8-delayed --amax-algo most_recent"
  [current]="--precision fp8-current"
)
ORDER=(bf16 delayed no-norm-cast no-activation-cast no-activation-grad-cast no-bias-grad
  no-optimizer-cast unfused history16 most-recent current)
read -r -a VARIANTS <<<"${VARIANTS:-${ORDER[*]}}"
[ "${VARIANTS[0]}" = bf16 ] || VARIANTS=(bf16 "${VARIANTS[@]}")
[ -x "$BUILD/octet" ] || { echo "bisect-delayed.sh: no $BUILD/octet; build first" >&2; exit 2; }
mkdir -p "$OUT"

val_of() { sed -n 's/.*"val_loss":\([-0-9.eE+]*\).*/\1/p' "$1/metrics.jsonl" | tail -1; }
echo "| variant | flags | val loss | vs BF16 |"
echo "|---|---|---|---|"
for v in "${VARIANTS[@]}"; do
  [ -n "${ARGS[$v]:-}" ] || { echo "bisect-delayed.sh: unknown variant $v" >&2; exit 2; }
  run="$OUT/$v"
  rm -rf "$run"
  # shellcheck disable=SC2086
  "$BUILD/octet" train --device "$DEVICE" --model "$MODEL" ${ARGS[$v]} --steps "$STEPS" \
    --data "text:$CORPUS_DIR/$CORPUS.txt" --batch 16 --seq "$SEQ" --seed 7 --out "$run" \
    --eval-batches 32 --fp8-stats-every "${STATS_EVERY:-0}" --log-every "${LOG_EVERY:-100}" >"$run.log" 2>&1 ||
    { echo "bisect-delayed.sh: $v failed (see $run.log)" >&2; exit 1; }
  val=$(val_of "$run")
  [ "$v" = bf16 ] && base=$val
  awk -v v="$v" -v f="${ARGS[$v]}" -v x="$val" -v b="$base" \
    'BEGIN { printf "| %s | `%s` | %.4f | %+.2f%% |\n", v, f, x, 100 * (x / b - 1) }'
done | tee "$OUT/table.md"
