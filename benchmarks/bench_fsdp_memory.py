"""What FSDP2 saves per process: bytes of parameters, gradients and AdamW state of a CoMERA masked-LM, with 2
processes (``FSDP2Strategy``, gloo on the CPU) against 1 (no sharding), before and after a cut that halves every
TT bond (masked, then physically removed and resharded, as RankAdaptation does).

The model is the quickstart's (d_model 128, 2 encoder layers, d_ff 512, vocabulary 2048, TT rank 32) on random
tokens. Counted on every process: the tensors it keeps between steps (its shards; FSDP2 gathers one block's
parameters at a time during forward and backward, which is not counted). Bytes, not time: any machine gives the
same numbers. Writes ``fsdp_memory.json``.

    python -m benchmarks.bench_fsdp_memory [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader, Dataset

from benchmarks import harness
from comera_lightning.lit import MaskedLM
from comera_lightning.nn.tensorize import tt_layers
from comera_lightning.rank_adaptation import after_truncation
from comera_lightning.rank_adaptation.objectives import truncate_dead_slices_
from comera_lightning.strategies import FSDP2Strategy

CUT_AFTER_STEP = 2  # measured before the optimiser step of step 2 and of step 4 (after the cut)
VOCAB, SEQ, BATCH = 2048, 64, 8


class _RandomTokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(4, VOCAB, (SEQ,), generator=g)
        labels = torch.full((SEQ,), -100)
        labels[::7] = ids[::7]
        return {"input_ids": ids, "labels": labels}


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class _Count(Callback):
    """Counts this process's bytes before the optimiser steps of two steps, and halves every bond in between."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, int]] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step = trainer.global_step
        if step not in (CUT_AFTER_STEP - 1, CUT_AFTER_STEP + 1):
            return
        params = list(pl_module.parameters())
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        self.rows["before cut" if step < CUT_AFTER_STEP else "after cut"] = {
            "parameters": sum(_local_bytes(p) for p in params),
            "gradients": sum(_local_bytes(p.grad) for p in params),
            "optimiser state": sum(_local_bytes(v) for v in state),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != CUT_AFTER_STEP:
            return
        layers = [layer for _, layer in tt_layers(pl_module)]
        for layer in layers:
            for bond, rank in enumerate(layer.ranks[1:-1]):
                layer.remove_slices_(bond, range(max(1, rank // 2), rank))
        if isinstance(trainer.strategy, FSDP2Strategy):
            trainer.strategy.truncate_layers_(layers, min_dead_fraction=0.01)
        else:
            after_truncation(trainer, truncate_dead_slices_(layers, min_dead_fraction=0.01))


def measure(processes: int, out: Path) -> None:
    """One run with ``processes`` processes; each writes its counts to ``out/<processes>.<rank>.json``."""
    torch.manual_seed(0)
    model = MaskedLM(
        vocab_size=VOCAB,
        d_model=128,
        num_heads=4,
        d_ff=512,
        num_layers=2,
        max_len=SEQ,
        layer_config={"rank": 32, "embedding_rank": 32, "min_features": 64},
    )
    count = _Count()
    strategy = FSDP2Strategy() if processes > 1 else "auto"
    trainer = Trainer(
        accelerator="cpu",
        devices=processes,
        strategy=strategy,
        max_steps=CUT_AFTER_STEP + 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[count],
    )
    trainer.fit(model, DataLoader(_RandomTokens(), batch_size=BATCH))
    (out / f"{processes}.{trainer.global_rank}.json").write_text(json.dumps(count.rows))


def main(argv: list[str] | None = None) -> int:
    """Run 1 and 2 processes, print the table, write ``fsdp_memory.json``."""
    parser = harness.bench_parser(__doc__)
    # internal: one measured run with this many processes, into this folder
    parser.add_argument("--processes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--into", type=Path, default=None, help=argparse.SUPPRESS)
    args = harness.parse(parser, argv)
    if args.processes is not None:  # one measured run (the second process of a run comes through here too)
        measure(args.processes, args.into)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        env = harness.child_env(OMP_NUM_THREADS="1")
        for processes in (1, 2):
            command = harness.module_command(__spec__.name, "--processes", str(processes), "--into", tmp)
            subprocess.run(command, check=True, env=env, cwd=tmp)
        runs = {name.name: json.loads(name.read_text()) for name in sorted(Path(tmp).glob("*.json"))}
    one = runs["1.0.json"]
    rows, payload = [], {"processes": {}}
    for moment in ("before cut", "after cut"):
        single = sum(one[moment].values())
        for rank in (0, 1):
            counts = runs[f"2.{rank}.json"][moment]
            total = sum(counts.values())
            payload["processes"].setdefault(f"2 processes, rank {rank}", {})[moment] = counts
            rows.append(
                [
                    moment,
                    f"2 processes, rank {rank}",
                    *(harness.mib(v) for v in counts.values()),
                    harness.mib(total),
                    f"{total / single:.3f}",
                ]
            )
        payload["processes"].setdefault("1 process", {})[moment] = one[moment]
        rows.append(
            [moment, "1 process", *(harness.mib(v) for v in one[moment].values()), harness.mib(single), "1.000"]
        )
    markdown = harness.table(["", "run", "parameters", "gradients", "AdamW state", "total", "of 1 process"], rows)
    print(markdown)
    payload["settings"] = {
        "model": "MaskedLM d_model 128, 2 layers, d_ff 512, vocabulary 2048, TT rank 32",
        "cut": "every bond halved after step 2",
        "machine": harness.machine_info(),
    }
    harness.emit(Path(args.out_dir) / "fsdp_memory.json", payload, markdown=markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
