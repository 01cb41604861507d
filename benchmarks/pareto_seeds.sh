#!/usr/bin/env bash
# The equal-size (Pareto) study of docs/results.md: pareto_study.py for the masked-LM on two corpora (the standard
# library, and SQLAlchemy's installed sources: a corpus the project never tuned on) and for the decoder LM, on two
# lanes of one torch thread each (a 2-core machine), then the aggregates (tables, plots) per task and corpus.
#   . .venv/bin/activate && bash benchmarks/pareto_seeds.sh [out-dir]     # about 1 h 45 min on 2 cores
# STDLIB_SEEDS (default "0 1 2"), SQLA_SEEDS ("0 1") and LM_SEEDS ("0") pick the seeds, WIDTHS ("256") the wider
# full models (seed 0, stdlib); every MLM run is 1200 steps (MLM_STEPS), every decoder run 1000 (LM_STEPS). Seed 0 of each corpus adds the one-seed diagnostics (a layer floor
# of 1, the low-rank MLM head, the smallest dense and low-rank points). Reruns skip the points already in a seed's
# JSON, so a cut-off study resumes where it stopped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/pareto}
mkdir -p "$OUT"
python -c "import torch, comera_lightning" || { echo "activate the project's environment first"; exit 2; }
MLM_POINTS="dense:128 comera:5 comera:10 comera:20 comera:50 comera:20:floor=0.5 comera:50:floor=0.5 dense:48 dense:32
 dense:16 dense:8 lowrank:24 lowrank:16 lowrank:8 lowrank:4"
SEED0_POINTS="comera:20:floor=1 comera:20:head=64 dense:4 lowrank:2"
LM_POINTS="dense:128 comera:5 comera:10 comera:20 dense:64 dense:32 dense:16 lowrank:24 lowrank:16 lowrank:8 dense:8
 lowrank:4"
P="python benchmarks/pareto_study.py --threads 1 --out-dir $OUT"

mlm() {  # corpus seed
  local extra=""; [ "$2" = 0 ] && extra=$SEED0_POINTS
  $P --task mlm --corpus "$1" --seed "$2" --steps "${MLM_STEPS:-1200}" --points $MLM_POINTS $extra \
    >> "$OUT/log_mlm_${1#site:}_s$2.txt" 2>&1 || echo "FAILED: mlm $1 seed $2"
}
lm() {
  $P --task lm --seed "$1" --steps "${LM_STEPS:-1000}" --points $LM_POINTS >> "$OUT/log_lm_stdlib_s$1.txt" 2>&1 \
    || echo "FAILED: lm seed $1"
}

width() {  # d_model: the full dense model and CoMERA cut from it, seed 0 (free compression against width)
  $P --task mlm --corpus stdlib --seed 0 --steps "${MLM_STEPS:-1200}" --d-model "$1" \
    --points "dense:$1" comera:5 comera:10 comera:20 >> "$OUT/log_mlm_stdlib_d$1_s0.txt" 2>&1 \
    || echo "FAILED: mlm width $1"
}

stdlib=(${STDLIB_SEEDS-0 1 2})
lane_a() {
  for s in "${stdlib[@]:0:2}"; do mlm stdlib "$s"; done
  for d in ${WIDTHS-256}; do width "$d"; done
}
lane_b() {
  local seeds=(${SQLA_SEEDS-0 1})
  [ ${#seeds[@]} -gt 0 ] && mlm site:sqlalchemy "${seeds[0]}"
  for s in ${LM_SEEDS-0}; do lm "$s"; done
  for s in "${seeds[@]:1}"; do mlm site:sqlalchemy "$s"; done
  for s in "${stdlib[@]:2}"; do mlm stdlib "$s"; done
}
lane_a & lane_b & wait

A="python benchmarks/pareto_study.py --aggregate"
ls "$OUT"/pareto_mlm_stdlib_s?.json >/dev/null 2>&1 && $A "$OUT"/pareto_mlm_stdlib_s?.json --out "$OUT/mlm_stdlib" \
  --title "MLM, standard library: accuracy vs active parameters"
ls "$OUT"/pareto_mlm_sqlalchemy_s?.json >/dev/null 2>&1 && $A "$OUT"/pareto_mlm_sqlalchemy_s?.json \
  --out "$OUT/mlm_sqlalchemy" --title "MLM, SQLAlchemy sources: accuracy vs active parameters"
ls "$OUT"/pareto_lm_stdlib_s?.json >/dev/null 2>&1 && $A "$OUT"/pareto_lm_stdlib_s?.json --out "$OUT/lm_stdlib" \
  --title "Decoder LM, standard library: perplexity vs active parameters"
for d in ${WIDTHS-256}; do
  ls "$OUT"/pareto_mlm_stdlib_d${d}_s?.json >/dev/null 2>&1 && $A "$OUT"/pareto_mlm_stdlib_d${d}_s?.json \
    --out "$OUT/mlm_stdlib_d$d" --title "MLM, standard library, d_model $d"
done
exit 0
