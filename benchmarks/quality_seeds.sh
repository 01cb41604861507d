#!/usr/bin/env bash
# The seeded quality study of docs/results.md ("Quality: rank adaptation that keeps accuracy"): every run of
# quality_study.py, on two lanes of one torch thread each (a 2-core machine), then the aggregates.
#   . .venv/bin/activate && bash benchmarks/quality_seeds.sh [out-dir]     # about 2 hours on 2 cores
# Seeds per part: MLM_SEEDS, PAIR_SEEDS, WIDE_SEEDS (default "0 1 2"; WIDE_SEEDS="" skips the d_model 512 part).
# Each run writes its JSON as it goes (*.partial.json), so a cut-off study keeps what finished; a failed run
# is reported in its lane's log and the lane goes on with the next one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/quality_seeds}
mkdir -p "$OUT"
python -c "import torch, comera_lightning" || { echo "activate the project's environment first"; exit 2; }
Q="python benchmarks/quality_study.py --threads 1 --out-dir $OUT"

# one study over its seeds; the research code's late stage (comera-paper) for seed 0 only: it went to the
# floor on every trial
lane() {
  local study=$1 seeds=$2
  for seed in $seeds; do
    methods="dense comera"
    [ "$seed" = 0 ] && methods="dense comera comera-paper"
    $Q --study "$study" --protocol steps --methods $methods --seed "$seed" --tag "_s$seed" \
      || echo "FAILED: $study seed $seed"
  done
}

# the width where a CoMERA step is clearly cheaper, at the same wall-clock for both (matched protocol)
lane_wide() {
  for seed in ${WIDE_SEEDS-0 1 2}; do
    $Q --study mlm --d-model 512 --batch-size 16 --steps 500 --val-every 100 --target-compression 50 \
       --protocol matched --methods dense comera --seed "$seed" --tag "_d512_s$seed" || echo "FAILED: d512 seed $seed"
  done
}

lane mlm "${MLM_SEEDS:-0 1 2}" > "$OUT/lane_mlm.log" 2>&1 &
lane pairs "${PAIR_SEEDS:-0 1 2}" > "$OUT/lane_pairs.log" 2>&1 &
wait
if [ -n "${WIDE_SEEDS-0 1 2}" ]; then lane_wide > "$OUT/lane_wide.log" 2>&1; fi

S="python benchmarks/quality_seeds.py"
$S "$OUT"/quality_mlm_s?.json --protocol steps --out "$OUT/mlm_steps"
$S "$OUT"/quality_pairs_s?.json --protocol steps --out "$OUT/pairs_steps"
ls "$OUT"/quality_mlm_d512_s?.json >/dev/null 2>&1 && \
  $S "$OUT"/quality_mlm_d512_s?.json --protocol matched --out "$OUT/mlm_d512_matched"
