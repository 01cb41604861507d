#!/usr/bin/env bash
# The floor job's smoke run: the quickstart config made tiny, with the rank callbacks, through
# fit -> validate -> resumed fit -> export -> load_exported, in a scratch folder. Run it in an environment
# with comera_lightning installed (.ci/run builds one with the lowest declared versions). Exits non-zero,
# naming the step, when a command fails or an expected output is missing.
set -euo pipefail
work=$(mktemp -d "${TMPDIR:-/tmp}/comera-floor.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"
export MLFLOW_TRACKING_URI="sqlite:///$work/mlflow.db"

step() { echo "floor smoke: $*"; }
fail() { echo "floor smoke FAILED: $*" >&2; exit 1; }

python - <<'PY' || fail "importing the stack"
from importlib.metadata import version
names = ["torch", "lightning", "torchmetrics", "tensorly", "mlflow", "jsonargparse", "numpy", "comera_lightning"]
print("floor smoke: " + ", ".join(f"{name} {version(name)}" for name in names))
PY

# RankAdaptation acts within a few steps (as tests/cli/test_cli.py's _callbacks_config)
cat > callbacks.yaml <<'YAML'
trainer:
  callbacks:
    - class_path: RankAdaptation
      init_args: {late_start_step: 4, truncate_every_n_steps: 4, min_dead_fraction: 0.1, target_compression: 3.0}
    - class_path: ContractionPlanner
    - class_path: RankMonitor
      init_args: {log_every_n_steps: 4}
    - class_path: ModelCheckpoint
      init_args: {save_last: true}
YAML
# tests/cli/test_cli.py's TINY_ENCODER, TINY_TRAINER and the code corpora's data overrides
tiny=(--config quickstart --config callbacks.yaml
      --model.d_model=32 --model.num_heads=2 --model.d_ff=64 --model.num_layers=1 --model.max_len=16
      --model.vocab_size=512 --model.layer_config.rank=4 --model.layer_config.embedding_rank=4
      --model.layer_config.min_features=16 --data.vocab_size=512 --data.seq_len=16 --data.batch_size=8
      --data.max_files=15 --data.max_sequences=400 --data.val_fraction=0.2
      --trainer.limit_train_batches=6 --trainer.limit_val_batches=2 --trainer.val_check_interval=null
      --trainer.enable_progress_bar=false --trainer.enable_model_summary=false
      --trainer.accelerator=cpu --trainer.devices=1)

step "fit, 6 steps"
comera fit "${tiny[@]}" --trainer.max_steps=6 --trainer.max_epochs=1 2>&1 | tee fit.log || fail "comera fit"
grep -q "comera: trained 6 steps" fit.log || fail "fit did not report 6 trained steps"
grep -q "compression .*x: .* active parameters" fit.log || fail "fit reported no compression (TT layers, rank callbacks)"
shopt -s nullglob
checkpoints=(runs/*/*/checkpoints/last.ckpt)
[ ${#checkpoints[@]} -eq 1 ] || fail "expected one runs/*/*/checkpoints/last.ckpt, found ${#checkpoints[@]}"
ckpt=${checkpoints[0]}
[ -s "$(dirname "$(dirname "$ckpt")")/model.safetensors" ] || fail "fit wrote no model.safetensors next to $ckpt"

step "validate $ckpt"
comera validate "${tiny[@]}" --ckpt_path "$ckpt" 2>&1 | tee validate.log || fail "comera validate"
grep -q "val/" validate.log || fail "validate printed no val/ metrics"

step "fit resumed from $ckpt to 12 steps"
comera fit "${tiny[@]}" --trainer.max_steps=12 --trainer.max_epochs=2 --ckpt_path "$ckpt" 2>&1 | tee resumed.log \
    || fail "resumed comera fit"
grep -q "Restored all states from the checkpoint" resumed.log || fail "the fit did not resume from $ckpt"
grep -q "comera: trained 12 steps" resumed.log || fail "the resumed fit did not reach step 12"

resumed=(runs/*/*/checkpoints/last.ckpt)
[ ${#resumed[@]} -eq 2 ] || fail "the resumed fit wrote no checkpoint of its own (found ${resumed[*]})"
[ "${resumed[0]}" != "$ckpt" ] && ckpt=${resumed[0]} || ckpt=${resumed[1]}

step "export $ckpt"
comera export --ckpt_path "$ckpt" --out model.safetensors || fail "comera export"
[ -s model.safetensors ] || fail "comera export wrote no model.safetensors"
python - <<'PY' || fail "load_exported"
from comera_lightning.export import load_exported
task = load_exported("model.safetensors")
print(f"floor smoke: load_exported -> {type(task).__name__}")
PY
step "TextLMDataModule on JSON lines and Parquet (pyarrow, tokenizers and numpy at their floors)"
python - <<'PY' || fail "TextLMDataModule"
import json, pathlib
import pyarrow as pa, pyarrow.parquet as pq
from comera_lightning.data import TextLMDataModule
docs = [f"document {i}: " + " ".join(f"word{(i * j) % 97}" for j in range(200)) for i in range(40)]
pathlib.Path("text").mkdir()
pathlib.Path("text/a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:20]))
pq.write_table(pa.table({"text": docs[20:]}), "text/b.parquet")
dm = TextLMDataModule(files=["text/*.jsonl", "text/*.parquet"], vocab_size=400, seq_len=16, batch_size=4,
                      val_fraction=0.2)
dm.prepare_data()
dm.setup("fit")
batch = next(iter(dm.train_dataloader()))
assert tuple(batch["input_ids"].shape) == (4, 16) and len(dm.val_dataset) > 0
print(f"floor smoke: TextLMDataModule -> {len(dm.train_dataset)} training rows")
PY
step "all steps passed"
