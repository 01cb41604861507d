#!/usr/bin/env bash
# The equal-size (Pareto) study of docs/results.md: pareto_study.py for the masked-LM on two corpora (the standard
# library and SQLAlchemy's installed sources, a corpus the project never tuned on) and the decoder LM, on two lanes
# of one torch thread each (a 2-core machine), then the aggregates (tables, plots) per task and corpus.
#   . .venv/bin/activate && bash benchmarks/pareto_seeds.sh [out-dir]     # about 2 hours on 2 cores
# MLM_STEPS / LM_STEPS set the run length (default 1200 / 1000); SEEDS the MLM seeds (default "0 1 2"),
# LM_SEEDS the decoder's (default "0 1"). Reruns skip the points already in a seed's JSON (resume).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/pareto}
mkdir -p "$OUT"
python -c "import torch, comera_lightning" || { echo "activate the project's environment first"; exit 2; }
MLM_POINTS="dense:128 comera:5 comera:10 comera:20 comera:50 comera:20:floor=0.5 comera:50:floor=0.5 comera:20:floor=1
 comera:20:head=64 dense:48 dense:32 dense:16 dense:8 dense:4 lowrank:24 lowrank:16 lowrank:8 lowrank:4 lowrank:2"
LM_POINTS="dense:128 comera:5 comera:10 comera:20 comera:20:floor=0.5 dense:64 dense:32 dense:16 dense:8 lowrank:24
 lowrank:16 lowrank:8 lowrank:4"
P="python benchmarks/pareto_study.py --threads 1 --out-dir $OUT"
MLM="$P --task mlm --steps ${MLM_STEPS:-1200} --points $(echo $MLM_POINTS)"
LM="$P --task lm --steps ${LM_STEPS:-1000} --points $(echo $LM_POINTS)"
SEEDS=${SEEDS:-0 1 2}
LM_SEEDS=${LM_SEEDS-0 1}
set -- $SEEDS
first=$1; shift
rest="$*"
{
  echo "$MLM --corpus stdlib --seed $first > $OUT/log_mlm_stdlib_s$first.txt 2>&1"
  echo "$MLM --corpus site:sqlalchemy --seed $first > $OUT/log_mlm_sqlalchemy_s$first.txt 2>&1"
  for s in $LM_SEEDS; do [ "$s" = 0 ] && echo "$LM --seed 0 > $OUT/log_lm_stdlib_s0.txt 2>&1"; done
  for s in $rest; do
    echo "$MLM --corpus stdlib --seed $s > $OUT/log_mlm_stdlib_s$s.txt 2>&1"
    echo "$MLM --corpus site:sqlalchemy --seed $s > $OUT/log_mlm_sqlalchemy_s$s.txt 2>&1"
  done
  for s in $LM_SEEDS; do [ "$s" != 0 ] && echo "$LM --seed $s > $OUT/log_lm_stdlib_s$s.txt 2>&1"; done
} > "$OUT/jobs.txt"
# two lanes pull the jobs in order; a failed job is reported and the lane goes on
xargs -P 2 -I{} sh -c '{} || echo "FAILED: {}"' < "$OUT/jobs.txt"

A="python benchmarks/pareto_study.py --aggregate"
$A "$OUT"/pareto_mlm_stdlib_s?.json --out "$OUT/mlm_stdlib" --title "MLM, standard library: accuracy vs active parameters"
$A "$OUT"/pareto_mlm_sqlalchemy_s?.json --out "$OUT/mlm_sqlalchemy" \
  --title "MLM, SQLAlchemy sources: accuracy vs active parameters"
ls "$OUT"/pareto_lm_stdlib_s?.json >/dev/null 2>&1 && $A "$OUT"/pareto_lm_stdlib_s?.json --out "$OUT/lm_stdlib" \
  --title "Decoder LM, standard library: perplexity vs active parameters"
