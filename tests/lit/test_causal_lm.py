"""CausalLM: next-token loss and perplexity, generate(), and fit with the three CoMERA callbacks and a truncation,
then the truncated checkpoint reloaded into a full-rank task."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.code_tree import small_source_tree
from lightning.pytorch import Trainer
from torch.nn import functional as F

from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, RankMonitor
from comera_lightning.data import CodeLMDataModule
from comera_lightning.lit import CausalLM
from comera_lightning.nn import tt_layers
from comera_lightning.optim import OptimConfig

TINY = dict(
    vocab_size=400,
    d_model=32,
    num_heads=4,
    d_ff=48,
    num_layers=2,
    max_len=32,
    layer_config=dict(rank=8, embedding_rank=8, min_features=16),
)


@pytest.fixture
def datamodule(tmp_path) -> CodeLMDataModule:
    return CodeLMDataModule(
        root=str(small_source_tree(tmp_path / "src")),
        vocab_size=400,
        seq_len=32,
        batch_size=8,
        val_fraction=0.25,
        cache_dir=str(tmp_path / "cache"),
        num_prompts=2,
        prompt_len=6,
    )


def test_loss_is_next_token_cross_entropy_and_labels_default_to_the_shift():
    torch.manual_seed(0)
    task = CausalLM(**TINY)
    ids = torch.randint(0, 400, (2, 10))
    labels = CausalLM.next_token_labels(ids)
    assert torch.equal(labels[:, :-1], ids[:, 1:]) and (labels[:, -1] == -100).all()
    logits, got = task._logits_and_labels({"input_ids": ids})
    assert torch.equal(got, labels)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 400), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(task._cross_entropy(logits, got), expected)
    with pytest.raises(IndexError, match=r"outside \[0, 400\).*set model.vocab_size to at least the tokenizer's size"):
        task._logits_and_labels({"input_ids": torch.full((1, 4), 400)})


def test_generate_greedy_topk_eos_and_reproducible_sampling():
    torch.manual_seed(0)
    task = CausalLM(**TINY).train()
    prompt = torch.randint(0, 400, (2, 5))
    out = task.generate(prompt, 6, temperature=0.0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    assert task.training  # the mode is restored
    ids = prompt.clone()  # reference: argmax of the full forward, token by token
    for _ in range(6):
        ids = torch.cat([ids, task.model.eval()(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, ids)
    assert torch.equal(task.generate(prompt, 6, top_k=1), out)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = task.generate(prompt, 8, top_k=5, temperature=1.0, generator=g1)
    assert torch.equal(a, task.generate(prompt, 8, top_k=5, temperature=1.0, generator=g2))
    # top-k: the first sampled token is among the 5 most likely
    top5 = task.model(prompt)[:, -1].topk(5).indices
    assert all(a[i, 5] in top5[i] for i in range(2))
    eos = int(out[0, 5])
    stopped = task.generate(prompt[:1], 6, temperature=0.0, eos_id=eos)
    assert stopped.shape == (1, 6) and stopped[0, -1] == eos  # all sequences finished: stop early
    assert task.generate(prompt[0], 2).shape == (1, 7)  # a 1-D prompt is one sequence
    long_prompt = torch.randint(0, 400, (1, 40))  # beyond max_len: the last max_len tokens are the window
    assert task.generate(long_prompt, 2, temperature=0.0).shape == (1, 42)


@pytest.mark.parametrize("prompt_len", [5, 40])
def test_generate_with_the_cache_samples_what_the_full_re_run_samples_float64(prompt_len):
    torch.manual_seed(0)
    task = CausalLM(**TINY).double()
    prompt = torch.randint(0, 400, (2, prompt_len))  # max_len is 32: within the context and past it
    greedy = task.generate(prompt, 12, temperature=0.0)
    assert torch.equal(greedy, task.generate(prompt, 12, temperature=0.0, use_cache=False))
    sampled = [
        task.generate(
            prompt, 12, top_k=20, temperature=1.0, generator=torch.Generator().manual_seed(5), use_cache=use_cache
        )
        for use_cache in (True, False)
    ]
    assert torch.equal(*sampled)


@pytest.mark.slow
def test_fit_with_the_three_callbacks_truncates_validates_tests_predicts_and_reloads(datamodule, tmp_path, capsys):
    torch.manual_seed(0)
    task = CausalLM(
        **TINY,
        optim=OptimConfig(lr_cores=5e-3, lr_other=5e-3, lr_gates=0.2, warmup_steps=2, schedule="cosine"),
        generate_max_new_tokens=4,
        generate_top_k=3,
        generate_temperature=1.0,
    )
    adaptation = RankAdaptation(
        gamma=1.0, late_start_step=6, target_compression=3.0, truncate_every_n_steps=6, min_dead_fraction=0.1
    )
    trainer = Trainer(
        max_steps=24,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,  # RankMonitor's picture goes there
        enable_model_summary=False,
        limit_val_batches=2,
        val_check_interval=12,
        callbacks=[adaptation, ContractionPlanner(verbose=False), RankMonitor(log_every_n_steps=4)],
    )
    trainer.fit(task, datamodule=datamodule)
    assert adaptation.truncations >= 1
    metrics = trainer.callback_metrics
    assert math.isfinite(float(metrics["train/loss"]))
    torch.testing.assert_close(metrics["val/perplexity"], metrics["val/loss"].exp(), rtol=1e-4, atol=1e-4)
    shrunk = {name: layer.ranks for name, layer in tt_layers(task)}
    assert any(max(r) < 8 for r in shrunk.values()), shrunk

    tested = trainer.test(task, datamodule=datamodule, verbose=False)[0]
    assert tested["test/perplexity"] == pytest.approx(math.exp(tested["test/loss"]), rel=1e-4)
    predictions = trainer.predict(task, datamodule=datamodule)
    samples = [s for batch in predictions for s in batch]
    assert len(samples) == 2 and all(len(s["generated_ids"]) == 4 and isinstance(s["completion"], str) for s in samples)
    assert "--- continuation:" in capsys.readouterr().out

    # a fresh full-rank task adopts the checkpoint's truncated ranks and reproduces the logits
    path = tmp_path / "end.ckpt"
    trainer.save_checkpoint(path)
    reloaded = CausalLM.load_from_checkpoint(path, weights_only=True)
    assert {name: layer.ranks for name, layer in tt_layers(reloaded)} == shrunk
    assert reloaded.generate_max_new_tokens == 64  # sampling options are not part of the checkpoint
    ids = datamodule.val_dataset.tensors["input_ids"][:2].long()
    task.eval(), reloaded.eval()
    torch.testing.assert_close(reloaded.model(ids), task.model(ids), rtol=1e-5, atol=1e-5)


def test_layer_config_is_stored_plain_and_flat_options_are_refused_with_the_fix(tmp_path):
    from comera_lightning.models import LayerConfig

    task = CausalLM(**dict(TINY, layer_config=LayerConfig(rank=8, min_features=16, layer_ranks={"lm_head": 12})))
    assert task.hparams["layer_config"] == LayerConfig(rank=8, min_features=16, layer_ranks={"lm_head": 12}).to_dict()
    assert max(task.model.lm_head.ranks) == 12 and max(task.model.layers[0].mlp.up_proj.ranks) == 8
    path = tmp_path / "hparams.pt"
    torch.save({"hyper_parameters": dict(task.hparams)}, path)
    rebuilt = CausalLM(**torch.load(path, weights_only=True)["hyper_parameters"])  # plain values only
    assert rebuilt.model.lm_head.ranks == task.model.lm_head.ranks
    flat = {k: v for k, v in TINY.items() if k != "layer_config"}
    with pytest.raises(ValueError, match=r"\['rank'\] are layer_config options: pass them inside layer_config"):
        CausalLM(**flat, rank=8)
