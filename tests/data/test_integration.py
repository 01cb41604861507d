"""The data modules under worker processes, jsonargparse (LightningCLI) and DDP (ddp_spawn)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from comera_lightning.data import CodeMLMDataModule, CriteoDataModule, MNLIDataModule


def test_workers_give_the_same_validation_batches(stdlib_dm, stdlib_cache, stdlib_kw):
    dm = CodeMLMDataModule(cache_dir=str(stdlib_cache), **{**stdlib_kw, "num_workers": 2})
    dm.setup("fit")
    with_workers = list(dm.val_dataloader())
    in_process = list(stdlib_dm.val_dataloader())
    assert len(with_workers) == len(in_process)
    for a, b in zip(with_workers, in_process, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (16, 64) and (batch["labels"] != -100).any()


def test_constructors_are_jsonargparse_friendly(tmp_path):
    from jsonargparse import ArgumentParser

    for cls, args in [
        (CodeMLMDataModule, ["--data.max_files", "3", "--data.root", str(tmp_path)]),
        (MNLIDataModule, ["--data.data_dir", str(tmp_path), "--data.max_train_samples", "10"]),
        (CriteoDataModule, ["--data.synthetic", "true", "--data.table_sizes", "[" + ",".join(["5"] * 26) + "]"]),
    ]:
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, "data")
        cfg = parser.parse_args(args)
        dm = cls(**cfg.data.as_dict())
        assert isinstance(dm, cls)
    assert dm.table_sizes == [5] * 26


class TinyMLM(pl.LightningModule):
    """Module level, so ddp_spawn can pickle it."""

    def __init__(self, vocab: int):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.out = torch.nn.Linear(8, vocab)

    def training_step(self, batch, _):
        logits = self.out(self.emb(batch["input_ids"]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        self.log("rows", float(len(batch["input_ids"])), reduce_fx="sum", sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.1)


def _fit_ddp(tmp_path, cache, kw):
    dm = CodeMLMDataModule(cache_dir=str(cache), **kw)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    model = TinyMLM(dm.vocab_size)
    before = model.emb.weight.detach().clone()
    trainer.fit(model, datamodule=dm)
    assert not torch.equal(before, model.emb.weight)  # rank 0's trained weights came back
    return trainer


@pytest.mark.slow
def test_ddp_spawn_fit_on_a_fresh_cache(tmp_path, stdlib_kw):
    # prepare_data trains the tokenizer in the main process; both ranks load it in setup
    trainer = _fit_ddp(tmp_path, tmp_path / "cache", stdlib_kw)
    assert trainer.callback_metrics["rows"] == 2 * stdlib_kw["batch_size"]  # both ranks trained on full batches
    assert len(list((tmp_path / "cache").glob("tokenizers/code-*/tokenizer.json"))) == 1
