"""CudaGraphs on the CPU: the skip path, refusals, and the whole capture/replay plumbing through the eager
replay backend (which re-runs captured functions, copies results into the static tensors, and raises
StaleGraphError where a real CUDA graph would silently replay old state)."""

from __future__ import annotations

import pytest
import torch
import torchmetrics
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from tiny import TinyRegressor, regression_loader

from comera_lightning.callbacks import CudaGraphs, RankAdaptation
from comera_lightning.callbacks import cuda_graphs as cg
from comera_lightning.callbacks.cuda_graph_backends import CudaGraphBackend
from comera_lightning.nn import tt_layers
from comera_lightning.rank_adaptation import after_truncation


class StaticRegressor(TinyRegressor):
    """TinyRegressor with a capture-safe step: no float(loss), the loss logged as a tensor."""

    def __init__(self, schedule: bool = False, **kwargs) -> None:
        super().__init__(**kwargs)
        self.schedule = schedule

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, on_step=True)
        self.log("constant", 3.0)
        return {"loss": loss, "scaled": 2 * loss.detach()}

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if not self.schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.3 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Record(Callback):
    """Per optimiser step: the step's outputs and the logged loss, as floats."""

    def __init__(self) -> None:
        self.losses, self.scaled, self.logged = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.scaled.append(float(outputs["scaled"]))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


class TruncateAt(Callback):
    """Kill half the slices of every bond at one step and remove them physically (as RankAdaptation does)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        for _, layer in tt_layers(pl_module):
            after_truncation(trainer, layer.truncate_to_share_(0.5))


class BeforeStepAt(Callback):
    """At one step, in on_before_optimizer_step (after the gradients, before the step): drop every gradient
    ("drop"), replace each by a new tensor ("replace"), change eps ("eps"), or invalidate the graphs."""

    def __init__(self, step: int, action: str) -> None:
        self.step, self.action = step, action

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step != self.step:
            return
        if self.action == "invalidate":
            cg.invalidate_cuda_graphs(trainer, "test")
        for group in optimizer.param_groups:
            if self.action == "eps":
                group["eps"] = 1e-6
            for p in group["params"]:
                if p.grad is not None and self.action in ("drop", "replace"):
                    p.grad = None if self.action == "drop" else p.grad * 0.5


def _trainer(tmp_path, callbacks, max_steps=10, **kwargs) -> Trainer:
    options = dict(
        max_steps=max_steps,
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


def _fit(tmp_path, callbacks, model=None, loader=None, **kwargs):
    model = model if model is not None else StaticRegressor()
    record = Record()
    trainer = _trainer(tmp_path, [*callbacks, record], **kwargs)
    trainer.fit(model, loader if loader is not None else regression_loader())
    return model, record, trainer


def _assert_same_parameters(a: LightningModule, b: LightningModule, **tolerance) -> None:
    named_b = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert p.shape == named_b[name].shape, name
        torch.testing.assert_close(p, named_b[name], msg=lambda m, name=name: f"{name}: {m}", **tolerance)


def test_inactive_on_cpu_warns_once_and_trains_eagerly(tmp_path):
    graphs = CudaGraphs()  # backend auto
    with (
        pytest.warns(UserWarning, match="CudaGraphs is inactive: .*(no CUDA|not on a CUDA).*runs eagerly"),
        pytest.warns(UserWarning, match="experimental and unverified on a GPU.*reduce-overhead"),
    ):
        model, record, _ = _fit(tmp_path, [graphs], max_steps=4)
    plain, plain_record, _ = _fit(tmp_path, [], max_steps=4)
    assert not graphs.active and graphs.captures == 0 and graphs.comera_metrics() == {}
    assert "training_step" not in model.__dict__
    _assert_same_parameters(model, plain, rtol=0, atol=0)
    assert record.losses == plain_record.losses


def test_forced_cuda_backend_without_cuda_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match=r"backend='cuda'\) cannot capture: .*accelerator gpu"):
        _fit(tmp_path, [CudaGraphs(backend="cuda")], max_steps=2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        CudaGraphs(warmup_steps=0)
    with pytest.raises(ValueError, match="backend must be"):
        CudaGraphs(backend="tpu")
    with pytest.raises(ValueError, match="shape_change"):
        CudaGraphs(shape_change="pad")


@pytest.mark.parametrize("schedule", [False, True])
def test_replayed_training_equals_eager_training(tmp_path, schedule):
    graphs = CudaGraphs(backend="replay", warmup_steps=2)
    model, record, trainer = _fit(tmp_path, [graphs], model=StaticRegressor(schedule=schedule), max_steps=8)
    plain, plain_record, plain_trainer = _fit(tmp_path, [], model=StaticRegressor(schedule=schedule), max_steps=8)
    # a tensor learning rate takes a slightly different code path in AdamW: equal to float32 rounding
    _assert_same_parameters(model, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record.losses, plain_record.losses, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(record.scaled, [2 * v for v in record.losses])
    torch.testing.assert_close(record.logged, record.losses)  # self.log re-issued with each replay's value
    assert float(trainer.callback_metrics["constant"]) == 3.0
    assert (graphs.eager_steps, graphs.captures, graphs.step_captures) == (2, 1, 1)
    assert graphs.replays == 6 and graphs.step_replays == 6
    assert graphs.invalidations == []  # the scheduler fills the tensor lr in place: no re-capture
    if schedule:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        assert torch.is_tensor(lr)
        torch.testing.assert_close(float(lr), plain_trainer.optimizers[0].param_groups[0]["lr"])
    assert "training_step" not in model.__dict__  # uninstalled; the scheduler's own step wrapper is back
    assert hasattr(trainer.optimizers[0].step, "_wrapped_by_lr_sched") == schedule


def test_truncation_triggers_exactly_one_recapture_and_training_stays_exact(tmp_path):
    def callbacks():  # RankAdaptation's penalty gradient runs eagerly between the two graphs
        return [RankAdaptation(gamma=0.5, truncate_every_n_steps=None), TruncateAt(step=5)]

    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    model, record, _ = _fit(tmp_path, [*callbacks(), graphs], max_steps=10)
    plain, plain_record, _ = _fit(tmp_path, callbacks(), max_steps=10)
    assert [layer.ranks for _, layer in tt_layers(model)] == [layer.ranks for _, layer in tt_layers(plain)]
    assert any(r < 8 for _, layer in tt_layers(model) for r in layer.ranks[1:-1])  # it really shrank
    _assert_same_parameters(model, plain, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(record.losses, plain_record.losses, rtol=1e-5, atol=1e-7)
    assert graphs.captures == 2 and graphs.step_captures == 2
    assert len(graphs.invalidations) == 1 and "changed" in graphs.invalidations[0]
    # steps: 1 warm-up, capture at 2, replays to 5, truncation, 1 warm-up (6), capture at 7, replays to 10
    assert graphs.eager_steps == 2 and graphs.replays == 8


def test_without_the_fingerprint_check_a_stale_graph_would_be_replayed(tmp_path, monkeypatch):
    monkeypatch.setattr(CudaGraphs, "_check_key", lambda self: None)
    with pytest.raises(cg.StaleGraphError, match="changed since capture"):
        _fit(tmp_path, [TruncateAt(step=3), CudaGraphs(backend="replay", warmup_steps=1)], max_steps=6)


def test_replaced_optimizer_state_is_detected(tmp_path):
    class CloneState(Callback):  # as a checkpoint restore does: same values, new tensors
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                optimizer = trainer.optimizers[0]
                for state in optimizer.state.values():
                    state["exp_avg"] = state["exp_avg"].clone()

    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    model, _, _ = _fit(tmp_path, [CloneState(), graphs], max_steps=8)
    plain, _, _ = _fit(tmp_path, [], max_steps=8)
    assert graphs.captures == 2 and len(graphs.invalidations) == 1
    _assert_same_parameters(model, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("action", ["drop", "replace"])
def test_hooks_that_drop_or_replace_gradients_get_an_eager_optimizer_step(tmp_path, action):
    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    model, _, _ = _fit(tmp_path, [BeforeStepAt(4, action), graphs], max_steps=8)
    plain, _, _ = _fit(tmp_path, [BeforeStepAt(4, action)], max_steps=8)
    _assert_same_parameters(model, plain, rtol=1e-5, atol=1e-6)
    assert graphs.captures == 1 and graphs.invalidations == []
    assert graphs.step_replays == 8 - 1 - 1  # the warm-up step and the touched step ran the optimiser eagerly


def test_explicit_invalidation_recaptures(tmp_path):
    class Invalidate(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                cg.invalidate_cuda_graphs(trainer, "test")

    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    _fit(tmp_path, [Invalidate(), graphs], max_steps=8)
    assert graphs.captures == 2 and graphs.invalidations == ["test"]


@pytest.mark.parametrize("action", ["eps", "invalidate"])
def test_invalidation_between_backward_and_step_keeps_that_steps_gradients(tmp_path, action):
    # the graphs are dropped mid-step; that step's optimiser step runs eagerly on its gradients, not on none
    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    model, _, _ = _fit(tmp_path, [BeforeStepAt(4, action), graphs], max_steps=8)
    plain, _, _ = _fit(tmp_path, [BeforeStepAt(4, action)] if action == "eps" else [], max_steps=8)
    _assert_same_parameters(model, plain, rtol=1e-5, atol=1e-6)
    assert graphs.captures == 2 and len(graphs.invalidations) == 1


def test_short_last_batch_runs_eagerly_or_raises(tmp_path):
    loader = regression_loader(n=80, batch_size=32)  # batches of 32, 32, 16 per epoch
    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    with pytest.warns(UserWarning, match="another shape"):
        model, _, _ = _fit(tmp_path, [graphs], loader=loader, max_steps=9)
    plain, _, _ = _fit(tmp_path, [], loader=regression_loader(n=80, batch_size=32), max_steps=9)
    _assert_same_parameters(model, plain, rtol=1e-5, atol=1e-6)
    assert graphs.captures == 1 and graphs.eager_steps == 1 + 3  # warm-up + the short batch of each epoch
    with pytest.raises(ValueError, match="drop_last=True"):
        _fit(
            tmp_path,
            [CudaGraphs(backend="replay", warmup_steps=1, shape_change="error")],
            loader=regression_loader(n=80, batch_size=32),
            max_steps=9,
        )


def test_bf16_mixed_replay_equals_eager(tmp_path):
    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    model, record, _ = _fit(tmp_path, [graphs], max_steps=5, precision="bf16-mixed")
    plain, plain_record, _ = _fit(tmp_path, [], max_steps=5, precision="bf16-mixed")
    assert graphs.replays == 4
    _assert_same_parameters(model, plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(record.losses, plain_record.losses, rtol=1e-4, atol=1e-6)


def test_unsupported_setups_are_refused_at_fit_start(tmp_path):
    with pytest.raises(ValueError, match=r"(?s)gradient accumulation.*precision '16-mixed'.*bf16-mixed"):
        _fit(
            tmp_path,
            [CudaGraphs(backend="replay")],
            max_steps=2,
            accumulate_grad_batches=2,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        )

    class Manual(StaticRegressor):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            loss = torch.nn.functional.mse_loss(self(batch[0]), batch[1])
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()

    with pytest.raises(ValueError, match="manual optimisation"):
        _fit(tmp_path, [CudaGraphs(backend="replay")], model=Manual(), max_steps=2)

    class LBFGSModel(StaticRegressor):
        def configure_optimizers(self):
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match="LBFGS has no capturable mode"):
        _fit(tmp_path, [CudaGraphs(backend="replay")], model=LBFGSModel(), max_steps=2)

    class OwnBackward(StaticRegressor):
        def backward(self, loss, *args, **kwargs):
            loss.backward()

    with pytest.raises(ValueError, match=r"overrides backward\(\)"):
        _fit(tmp_path, [CudaGraphs(backend="replay")], model=OwnBackward(), max_steps=2)


def test_capture_refuses_a_step_without_loss_and_torchmetrics_logging(tmp_path):
    class NoLoss(StaticRegressor):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(cg.CudaGraphCaptureError, match="returned no loss"):
        trainer = _trainer(tmp_path, [CudaGraphs(backend="replay", warmup_steps=1)], max_steps=3)
        trainer.fit(NoLoss(), regression_loader())

    class LogsMetric(StaticRegressor):
        def __init__(self):
            super().__init__()
            self.metric = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            output = super().training_step(batch, batch_idx)
            self.metric.update(output["loss"].detach())
            self.log("metric", self.metric)
            return output

    with pytest.raises(cg.CudaGraphCaptureError, match="cannot be captured; log a tensor"):
        _fit(tmp_path, [CudaGraphs(backend="replay", warmup_steps=1)], model=LogsMetric(), max_steps=3)


def test_checkpoints_keep_plain_float_learning_rates(tmp_path):
    graphs = CudaGraphs(backend="replay", warmup_steps=1)
    _model, _, trainer = _fit(tmp_path, [graphs], model=StaticRegressor(schedule=True), max_steps=4)
    assert torch.is_tensor(trainer.optimizers[0].param_groups[0]["lr"])
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    groups = torch.load(path, weights_only=True)["optimizer_states"][0]["param_groups"]
    assert all(isinstance(group["lr"], float) and not group.get("capturable") for group in groups)
    # an eager run resumes from it
    resumed = _trainer(tmp_path, [], max_steps=6)
    resumed.fit(StaticRegressor(schedule=True), regression_loader(), ckpt_path=path)
    assert resumed.global_step == 6


def test_selectable_by_short_name_in_the_comera_cli():
    from comera_lightning.cli import ComeraCLI

    args = {
        "model": {
            "class_path": "MaskedLM",
            "init_args": {"vocab_size": 64, "d_model": 32, "num_heads": 2, "d_ff": 64, "num_layers": 1, "max_len": 16},
        },
        "data": {"class_path": "CodeMLMDataModule", "init_args": {"vocab_size": 64, "seq_len": 16}},
        "trainer": {
            "logger": False,
            "enable_checkpointing": False,
            "callbacks": [{"class_path": "CudaGraphs", "init_args": {"backend": "replay"}}],
        },
    }
    cli = ComeraCLI(args=args, run=False)
    found = [c for c in cli.trainer.callbacks if isinstance(c, CudaGraphs)]
    assert len(found) == 1 and found[0].backend == "replay"


def test_benchmark_on_cpu_writes_a_skip_record(tmp_path, capsys):
    from benchmarks import bench_cuda_graphs

    assert bench_cuda_graphs.main(["--out-dir", str(tmp_path)]) == 0
    assert "no CUDA device: skipped" in capsys.readouterr().out
    import json

    payload = json.loads((tmp_path / "cuda_graphs.json").read_text())
    assert payload["skipped"] and "no CUDA device" in payload["reason"]


def test_benchmark_replay_dry_run_checks_identity(tmp_path):
    from benchmarks import bench_cuda_graphs

    result = bench_cuda_graphs.compare_training(
        bench_cuda_graphs.TINY, steps=10, precision="32-true", device="cpu", backend="replay"
    )
    # 3 warm-up steps, capture, replay, truncation at step 5, 3 warm-up steps, capture, replay
    assert result["graphs"]["captures"] == 2 and result["graphs"]["invalidations"] == 1, result["graphs"]
    # the tensor learning rate rounds differently in the 7th digit; the attention key bias (zero true gradient)
    # turns that into different Adam noise updates: hence the global-norm criterion, well inside here
    assert result["identical"] and result["update_rel_diff"] <= result["tolerance"]["update_rel"]
    assert len(result["losses"]["graphs"]) == 10 and result["loss_rel_diff"] <= 1e-5


def test_a_changing_float_learning_rate_forces_recaptures_and_a_warning(tmp_path):
    graphs = CudaGraphs(backend="replay", warmup_steps=1, tensor_lr=False)
    with pytest.warns(UserWarning, match="re-captured 5 times .*tensor_lr=True"):
        model, _, _ = _fit(tmp_path, [graphs], model=StaticRegressor(schedule=True), max_steps=14)
    plain, _, _ = _fit(tmp_path, [], model=StaticRegressor(schedule=True), max_steps=14)
    _assert_same_parameters(model, plain, rtol=1e-6, atol=1e-7)
    assert len(graphs.invalidations) >= 5 and graphs.replays == graphs.captures  # each capture replayed once


def test_cuda_backend_prepares_optimizers_without_needing_a_gpu():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    adamw = torch.optim.AdamW([{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.2}])
    sgd = torch.optim.SGD(params, lr=0.3, momentum=0.9)
    backend = CudaGraphBackend.__new__(CudaGraphBackend)  # no stream: prepare_optimizer needs none
    backend.prepare_optimizer(adamw, tensor_lr=True)
    backend.prepare_optimizer(sgd, tensor_lr=True)
    assert all(g["capturable"] for g in adamw.param_groups)
    assert [float(g["lr"]) for g in adamw.param_groups] == pytest.approx([0.1, 0.2])
    assert all(torch.is_tensor(g["lr"]) and g["lr"].dtype == torch.float32 for g in adamw.param_groups)
    assert sgd.param_groups[0]["lr"] == 0.3  # SGD would call .item() on a tensor lr: kept a float


def test_cuda_pool_idle_bytes_count_only_the_graphs_pool_blocks_no_tensor_holds(monkeypatch):
    # a replay allocates nothing, so max_memory_allocated misses the step's intermediates in the graph pool
    segments = [
        {"segment_pool_id": (0, 7), "total_size": 8 << 20, "allocated_size": 3 << 20},
        {"segment_pool_id": (0, 7), "total_size": 2 << 20, "allocated_size": 0},
        {"segment_pool_id": (0, 0), "total_size": 64 << 20, "allocated_size": 1 << 20},
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    backend = CudaGraphBackend.__new__(CudaGraphBackend)  # no stream: the pool's accounting needs none
    backend._pool = None
    assert backend.pool_idle_bytes() == 0  # nothing captured yet
    backend._pool = (0, 7)
    assert backend.pool_idle_bytes() == 7 << 20
    graphs = CudaGraphs(backend="replay")
    assert graphs.pool_idle_bytes() == 0  # inactive
    graphs._backend = backend
    assert graphs.pool_idle_bytes() == 7 << 20
    backend.release()
    assert graphs.pool_idle_bytes() == 0


def test_the_fast_check_sees_what_the_full_fingerprint_sees():
    model = StaticRegressor()
    optimizer = model.configure_optimizers()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    graphs = CudaGraphs(backend="replay")
    graphs._module, graphs._optimizer = model, optimizer
    changes = [
        lambda: optimizer.param_groups[0].__setitem__("lr", 0.5),
        lambda: optimizer.state[optimizer.param_groups[0]["params"][0]].__setitem__(
            "exp_avg", optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"].clone()
        ),
        lambda: optimizer.load_state_dict(optimizer.state_dict()),
        lambda: setattr(next(model.parameters()), "data", next(model.parameters()).data.clone()),
        lambda: after_truncation(_FakeTrainer(optimizer), _truncate_half(model)),
        lambda: model.eval(),
        lambda: next(layer for _, layer in tt_layers(model)).set_contraction_plan("dense"),
    ]
    for change in changes:
        watch, key = cg._Watch(model, optimizer), graphs.graph_key()
        assert watch.unchanged() and graphs.graph_key() == key
        change()
        assert not watch.unchanged() and graphs.graph_key() != key
    model.train()


class _FakeTrainer:
    def __init__(self, optimizer):
        self.optimizers = [optimizer]
        self.strategy = None


def _truncate_half(model):
    layer = next(layer for _, layer in tt_layers(model))
    with torch.no_grad():
        layer.gates[0][: layer.gates[0].numel() // 2] = 0.0
    layer.refresh_masks_()
    return layer.truncate_()


def test_benchmark_report_renders_a_gpu_runs_identity_and_timing():
    from benchmarks import bench_cuda_graphs

    check = {
        "precision": "bf16-mixed",
        "backend": "cuda",
        "identical": False,
        "update_rel_diff": 0.2,
        "loss_rel_diff": 0.01,
        "tolerance": {"update_rel": 0.05, "loss_rel": 0.02},
        "graphs": {"captures": 2, "invalidations": 1},
        "loop_step_s": {"eager": 0.03, "graphs": 0.02},
    }
    timing = {
        "precision": "bf16-mixed",
        "batch": 1,
        "speedup": 1.5,
        "paired_speedups": [1.4, 1.6],
        "timing": {"median_s": {"eager": 0.003, "graphs": 0.002}},
        "peak_memory_bytes": {"eager": 2**20, "graphs": 2**21},
        "noise": "5/5",
    }
    text = bench_cuda_graphs.report([check], [timing])
    assert "| bf16-mixed | 2.0e-01 / 1.0e-02 | NO (tol 0.05 / 0.02) | 2 / 1 | 1.50x |" in text
    assert "| bf16-mixed | 1 | 3.00 | 2.00 | 1.50x | 1.40-1.60 | 1.00 / 2.00 | 5/5 |" in text
