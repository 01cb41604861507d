"""DivergenceGuard: non-finite losses/gradients are dropped (or stop the run) without touching weights, optimiser
state, rank gates or rank masks; RankAdaptation never acts on a diverged step."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from comera_lightning import tensorize
from comera_lightning.callbacks import DivergenceError, DivergenceGuard, RankAdaptation
from comera_lightning.nn import tt_layers
from comera_lightning.optim import comera_parameter_groups


class Faulty(LightningModule):
    """A tensorized MLP that produces a fault at chosen batch indices.

    fault: ``"input"`` (NaN inputs: NaN loss and NaN gradients), ``"loss"`` (a NaN constant added to the loss:
    NaN loss, finite gradients), ``"grad"`` (finite loss, one gradient entry set to inf after backward).
    """

    def __init__(self, bad_batches=(), fault="input", bad_rank=None, lr=1e-2, lr_gates=5e-2):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
        tensorize(self.net, rank=8, min_features=16)
        self.bad_batches, self.fault, self.bad_rank = set(bad_batches), fault, bad_rank
        self.lr, self.lr_gates = lr, lr_gates
        self.losses = []

    def _faulty(self, batch_idx):
        return batch_idx in self.bad_batches and (self.bad_rank is None or self.global_rank == self.bad_rank)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.fault == "input" and self._faulty(batch_idx):
            x = x * float("nan")
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if self.fault == "loss" and self._faulty(batch_idx):
            loss = loss + torch.tensor(float("nan"))
        self.losses.append(float(loss.detach()))
        return loss

    def on_after_backward(self):
        if self.fault == "grad" and self._faulty(self.trainer.fit_loop.epoch_loop.batch_idx):
            first = next(p for p in self.parameters() if p.grad is not None)
            first.grad.view(-1)[0] = float("inf")

    def configure_optimizers(self):
        groups = comera_parameter_groups(self, lr_cores=self.lr, lr_gates=self.lr_gates, lr_other=self.lr)
        return torch.optim.AdamW(groups, weight_decay=0.01)


def loader(n=160, batch_size=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x.flip(1))), batch_size=batch_size)


def trainer(tmp_path, callbacks, max_steps=10, **kwargs):
    options = dict(
        max_steps=max_steps,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
    )
    options.update(kwargs)
    return Trainer(callbacks=callbacks, **options)


def state(model, optimizer):
    """Everything a step may touch: parameters, rank masks and buffers, AdamW moments and step counts."""
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(optimizer.state.values()):
        for k, v in s.items():
            out[f"opt{i}.{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
    return out


class Around(Callback):
    """Snapshots the model and optimiser just before and just after the batches it watches."""

    def __init__(self, batches):
        self.batches, self.before, self.after = set(batches), {}, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx in self.batches:
            self.before[batch_idx] = state(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx in self.batches:
            self.after[batch_idx] = state(pl_module, trainer.optimizers[0])


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True, msg=key)


def assert_finite_and_ranks_alive(model):
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    for _, layer in tt_layers(model):
        assert all(r > 1 for r in layer.active_ranks[1:-1]), layer.active_ranks


@pytest.mark.parametrize("guard_first", [True, False])
@pytest.mark.parametrize("fault", ["input", "grad"])
def test_skip_touches_nothing_and_training_goes_on(tmp_path, guard_first, fault):
    # gamma and lr_gates large so that a penalty step on a skipped step would visibly move the gates
    adaptation = RankAdaptation(gamma=1.0, truncate_every_n_steps=None, late_start_step=1000)  # tracks the loss
    guard, around = DivergenceGuard(action="skip"), Around([3, 4])
    callbacks = [guard, adaptation, around] if guard_first else [adaptation, guard, around]
    model = Faulty(bad_batches={3}, fault=fault, lr_gates=0.2)
    with pytest.warns(UserWarning, match=r"skipped global step 3 .*non-finite"):
        trainer(tmp_path, callbacks, gradient_clip_val=1.0).fit(model, loader())
    assert_same(around.before[3], around.after[3])  # weights, gates, masks, AdamW moments and step counts
    for key, value in around.after[4].items():  # the next, healthy step did update (the gates among others)
        if ".gates." in key:
            assert not torch.equal(value, around.before[4][key]), key
    assert guard.skipped_steps == 1 and guard.consecutive_skips == 0
    assert_finite_and_ranks_alive(model)
    assert math.isfinite(adaptation.loss_ema)
    if fault == "input":
        assert math.isnan(model.losses[3]) and all(math.isfinite(v) for i, v in enumerate(model.losses) if i != 3)


def test_without_guard_rank_adaptation_keeps_masks_instead_of_killing_ranks(tmp_path):
    adaptation = RankAdaptation(gamma=1.0, truncate_every_n_steps=2, min_dead_fraction=0.1)
    model = Faulty(bad_batches={2})
    with pytest.warns(UserWarning, match="rank gates are not finite after step 3"):
        trainer(tmp_path, [adaptation], max_steps=6).fit(model, loader())
    for _, layer in tt_layers(model):  # gates are NaN (the model is ruined) but no rank was switched off
        assert not all(torch.isfinite(g).all() for g in layer.gates)
        assert layer.active_ranks == layer.ranks
    assert adaptation.truncations == 0


def test_rank_adaptation_adds_no_penalty_to_a_dropped_or_nonfinite_step():
    model = Faulty()
    adaptation = RankAdaptation(gamma=1.0)
    optimizer = model.configure_optimizers()
    gates = [g for _, layer in tt_layers(model) for g in layer.gates]
    adaptation.on_before_optimizer_step(None, model, optimizer)  # no gradients at all: a dropped step
    assert all(g.grad is None for g in gates)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    adaptation.on_before_optimizer_step(None, model, optimizer)
    assert adaptation._nonfinite_steps == 1
    assert all(torch.isnan(g.grad).all() for g in gates)  # left as they were, nothing added or scaled


def test_stop_names_the_step_and_the_fix(tmp_path):
    model = Faulty(bad_batches={4}, fault="loss")
    with pytest.raises(DivergenceError, match=r"global step 4 \(epoch 0, batch 4\): a non-finite loss \(nan\)") as info:
        trainer(tmp_path, [DivergenceGuard(action="stop"), RankAdaptation()]).fit(model, loader())
    assert "lower the learning rates" in str(info.value) and "gradient_clip_val" in str(info.value)
    assert "check the data" in str(info.value)
    assert_finite_and_ranks_alive(model)


def test_gradient_fault_names_the_parameter(tmp_path):
    model = Faulty(bad_batches={1}, fault="grad")
    first = next(name for name, _ in model.named_parameters())  # the one Faulty sets to inf
    with pytest.raises(DivergenceError, match=rf"global step 1 .*: non-finite gradients \({re.escape(first)}\)"):
        trainer(tmp_path, [DivergenceGuard(action="stop")]).fit(model, loader())


def test_too_many_consecutive_skips_stop(tmp_path):
    guard = DivergenceGuard(action="skip", max_consecutive_skips=2)
    model = Faulty(bad_batches=set(range(2, 10)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(DivergenceError, match="3 optimizer steps in a row"):
            trainer(tmp_path, [guard]).fit(model, loader())
    assert guard.skipped_steps == 3
    assert_finite_and_ranks_alive(model)


def test_accumulation_skips_the_whole_step(tmp_path):
    guard, around = DivergenceGuard(), Around([2, 3])
    model = Faulty(bad_batches={2}, fault="loss")  # micro-batch 2 of the step made of batches 2 and 3
    with pytest.warns(UserWarning, match="skipped global step 1"):
        trainer(tmp_path, [guard, RankAdaptation(), around], max_steps=4, accumulate_grad_batches=2).fit(
            model, loader()
        )
    assert_same(around.before[2], around.after[3])
    assert guard.skipped_steps == 1


def test_bf16_mixed(tmp_path):
    guard, around = DivergenceGuard(), Around([3])
    model = Faulty(bad_batches={3})
    with pytest.warns(UserWarning, match="skipped global step 3"):
        trainer(tmp_path, [RankAdaptation(gamma=1.0), guard, around], precision="bf16-mixed").fit(model, loader())
    assert_same(around.before[3], around.after[3])
    assert guard.skipped_steps == 1
    assert_finite_and_ranks_alive(model)


def test_16_mixed_gradient_overflow_is_left_to_the_grad_scaler(tmp_path):
    """Gradient overflow is the GradScaler's (it skips the step and lowers its scale); a NaN loss is divergence."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    plugin = MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)
    guard, around = DivergenceGuard(), Around([2, 5])
    model = Faulty(bad_batches={2, 5}, fault="grad")
    trainer(tmp_path, [RankAdaptation(gamma=1.0), guard, around], plugins=[plugin]).fit(model, loader())
    assert guard.skipped_steps == 0  # not double-handled
    assert scaler.get_scale() == 2.0**6  # the scaler skipped both steps (and halved its scale each time)
    assert_same(around.before[2], around.after[2])
    assert_finite_and_ranks_alive(model)

    model = Faulty(bad_batches={3}, fault="loss")
    guard = DivergenceGuard()
    with pytest.warns(UserWarning, match=r"skipped global step 3 .*: a non-finite loss"):
        trainer(
            tmp_path,
            [RankAdaptation(), guard],
            plugins=[MixedPrecision(precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))],
        ).fit(model, loader())
    assert guard.skipped_steps == 1
    assert_finite_and_ranks_alive(model)


class _Snapshot(Callback):
    def __init__(self, folder):
        self.folder = folder

    def on_fit_end(self, trainer, pl_module):
        guard = next(c for c in trainer.callbacks if isinstance(c, DivergenceGuard))
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save({"state": state, "skipped": guard.skipped_steps}, self.folder / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow
def test_ddp_processes_take_the_same_decision(tmp_path):
    # only process 1 sees a NaN loss, and its gradients stay finite: without the all-reduced verdict process 0
    # would step and process 1 would not, and the replicas would drift apart
    model = Faulty(bad_batches={2}, fault="loss", bad_rank=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(
            tmp_path,
            [DivergenceGuard(), RankAdaptation(gamma=1.0), _Snapshot(tmp_path)],
            max_steps=4,
            strategy="ddp_spawn",
            devices=2,
        ).fit(model, loader())
    first, second = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert first["skipped"] == second["skipped"] == 1
    for key in first["state"]:
        torch.testing.assert_close(first["state"][key], second["state"][key], rtol=0, atol=0, msg=key)


def test_arguments_and_state():
    with pytest.raises(ValueError, match="action must be 'skip' or 'stop'"):
        DivergenceGuard(action="ignore")
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        DivergenceGuard(max_consecutive_skips=-1)
    with pytest.raises(ValueError, match="check_loss or check_gradients"):
        DivergenceGuard(check_loss=False, check_gradients=False)
    guard = DivergenceGuard()
    guard.skipped_steps, guard.consecutive_skips = 5, 2
    restored = DivergenceGuard()
    restored.load_state_dict(guard.state_dict())
    assert (restored.skipped_steps, restored.consecutive_skips) == (5, 2)
    assert guard.comera_metrics() == {"comera/skipped_steps": 5.0}


def test_cli_resolves_the_short_name(tmp_path, monkeypatch):
    from comera_lightning.cli import ComeraCLI

    monkeypatch.setattr("sys.argv", ["comera"])
    cli = ComeraCLI(
        args=[
            "--model=SequenceClassification",
            "--model.vocab_size=64",
            "--model.d_model=16",
            "--model.num_heads=2",
            "--model.d_ff=32",
            "--model.num_layers=1",
            "--model.max_len=8",
            "--data=MNLIDataModule",
            f"--data.data_dir={tmp_path}",
            "--data.vocab_size=64",
            "--trainer.logger=false",
            "--trainer.callbacks+=DivergenceGuard",
            "--trainer.callbacks.action=stop",
        ],
        run=False,
    )
    guard = next(c for c in cli.trainer.callbacks if isinstance(c, DivergenceGuard))
    assert guard.action == "stop"
