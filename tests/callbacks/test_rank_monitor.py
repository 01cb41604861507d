"""RankMonitor on a small plain LightningModule: metric keys, batching, rank changes, MLflow, CSV, state."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from comera_lightning.callbacks import RankAdaptation, ScheduledLateStage
from comera_lightning.callbacks.rank_monitor import RankMonitor, _truncation_steps, metric_safe_name, plot_rank_history
from comera_lightning.nn import tensorize, tt_layers


class PlainMLP(LightningModule):
    """Not one of ours: an MLP, optionally tensorized, with a plain optimiser."""

    def __init__(self, tensorized: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        if tensorized:
            tensorize(self.model, rank=4, min_features=16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def loader(n: int = 64, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, 32, generator=g), torch.randn(n, 4, generator=g)), batch_size=batch_size
    )


class RecordingLogger(Logger):
    """Counts log_metrics calls; each call is one (step, metrics) entry."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class StageReporter(Callback):
    """Stands in for RankAdaptation: another comera callback exposing comera_metrics()."""

    def comera_metrics(self) -> dict[str, float]:
        return {"comera/stage": 1, "comera/penalty": torch.tensor(0.25)}


class KillSlices(Callback):
    """At optimiser step ``at``, push two gates of bond 1 of the first layer below threshold and re-mask."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            _, layer = tt_layers(pl_module)[0]
            with torch.no_grad():
                layer.gates[0][:2] = 0.0
            layer.refresh_masks_()


def trainer(tmp_path: Path, callbacks, logger, max_steps: int, **kwargs) -> Trainer:
    options = dict(
        accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False
    )
    return Trainer(
        default_root_dir=tmp_path, max_steps=max_steps, callbacks=callbacks, logger=logger, **(options | kwargs)
    )


RANK_KEY = "rank/model.0/bond1"  # model.0 = TTLinear(32 -> 64) with ranks [1, 4, 4, 1]


def test_one_batched_call_per_event_with_all_keys(tmp_path):
    logger = RecordingLogger()
    monitor = RankMonitor(log_every_n_steps=5, save_artifacts=False)
    trainer(tmp_path, [StageReporter(), monitor], logger, max_steps=12).fit(PlainMLP(), loader())

    ours = [(s, m) for s, m in logger.calls if RANK_KEY in m]
    # start (0), every 5 steps, end (12): one call each, nothing split across calls
    assert [s for s, _ in ours] == [0, 5, 10, 12]
    assert len(ours) == len([c for c in logger.calls if any(k.startswith(("rank/", "params/")) for k in c[1])])
    expected = {
        "rank/model.0/bond1",
        "rank/model.0/bond2",
        "rank/model.2/bond1",
        "rank/model.2/bond2",
        "rank/model.2/bond3",
        "params/active",
        "params/allocated",
        "params/dense_equivalent",
        "compression_ratio",
        "comera/stage",
        "comera/penalty",
    }
    for _, metrics in ours:
        assert set(metrics) == expected
        assert all(isinstance(v, float) for v in metrics.values())
    _, metrics = ours[-1]
    assert metrics[RANK_KEY] == 4.0 and metrics["comera/stage"] == 1.0 and metrics["comera/penalty"] == 0.25
    assert metrics["params/dense_equivalent"] / metrics["params/active"] == pytest.approx(metrics["compression_ratio"])
    assert metrics["params/active"] == metrics["params/allocated"] < metrics["params/dense_equivalent"]
    assert monitor.history["steps"] == [0, 5, 10, 12]


def test_history_stays_bounded_over_a_long_run_and_keeps_the_rank_changes(tmp_path):
    # a long run at small scale: 100 logging events against a bound of 16
    monitor = RankMonitor(log_every_n_steps=1, save_artifacts=False, max_history_steps=16)
    trainer(tmp_path, [KillSlices(at=60), monitor], None, max_steps=100).fit(PlainMLP(), loader())
    history = monitor.history
    assert 8 <= len(history["steps"]) <= 16 and history["steps"][0] == 0 and history["steps"][-1] == 100
    assert history["steps"] == sorted(history["steps"])
    bond = history["layers"]["model.0"]
    assert bond["steps"] == [0, 60] and [r[1] for r in bond["active_ranks"]] == [4, 2]  # change points only
    assert len(history["params"]["steps"]) == 2
    with pytest.raises(ValueError, match="max_history_steps must be >= 2"):
        RankMonitor(max_history_steps=1)


def test_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    logger = RecordingLogger()
    trainer(
        tmp_path,
        [RankMonitor(log_every_n_steps=2, save_artifacts=False)],
        logger,
        max_steps=4,
        accumulate_grad_batches=3,
    ).fit(PlainMLP(), loader())
    assert [s for s, m in logger.calls if RANK_KEY in m] == [0, 2, 4]


def test_logged_ranks_decrease_when_slices_die(tmp_path):
    logger = RecordingLogger()
    monitor = RankMonitor(log_every_n_steps=4, save_artifacts=False)
    trainer(tmp_path, [KillSlices(at=6), monitor], logger, max_steps=12).fit(PlainMLP(), loader())

    series = {s: m for s, m in logger.calls if RANK_KEY in m}
    assert [series[s][RANK_KEY] for s in sorted(series)] == [4.0, 4.0, 2.0, 2.0]  # steps 0, 4, 8, 12
    assert series[8]["rank/model.0/bond2"] == 4.0  # only bond 1 lost slices
    assert series[8]["params/active"] < series[4]["params/active"]
    assert series[8]["params/allocated"] == series[4]["params/allocated"]  # masked, not truncated
    assert series[8]["compression_ratio"] > series[4]["compression_ratio"]
    # the history stores change points only
    assert monitor.history["layers"]["model.0"] == {"steps": [0, 8], "active_ranks": [[1, 4, 4, 1], [1, 2, 4, 1]]}
    assert monitor.ranks_at(7)["model.0"] == [1, 4, 4, 1] and monitor.ranks_at(100)["model.0"] == [1, 2, 4, 1]


def test_mlflow_metrics_and_artifacts(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(
        experiment_name="rank_monitor", tracking_uri=uri, artifact_location=(tmp_path / "artifacts").as_uri()
    )
    trainer(tmp_path, [KillSlices(at=3), RankMonitor(log_every_n_steps=5)], logger, max_steps=10).fit(
        PlainMLP(), loader()
    )

    client = MlflowClient(tracking_uri=uri)
    run_id = logger.run_id
    ranks = sorted((m.step, m.value) for m in client.get_metric_history(run_id, RANK_KEY))
    assert ranks == [(0, 4.0), (5, 2.0), (10, 2.0)]
    ratio = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "compression_ratio"))
    assert [s for s, _ in ratio] == [0, 5, 10] and ratio[1][1] > ratio[0][1]
    names = {a.path for a in client.list_artifacts(run_id, "comera")}
    assert names == {"comera/rank_evolution.png", "comera/rank_history.json"}
    local = Path(client.download_artifacts(run_id, "comera/rank_history.json", str(tmp_path / "dl")))
    payload = json.loads(local.read_text())
    assert payload["history"]["layers"]["model.0"]["active_ranks"][-1] == [1, 2, 4, 1]
    assert payload["final_size_report"]["layers"][0]["active_ranks"] == [1, 2, 4, 1]
    png = Path(client.download_artifacts(run_id, "comera/rank_evolution.png", str(tmp_path / "dl")))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "rank_history.json").exists()


def test_csv_logger_gets_files_in_its_log_dir(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    trainer(tmp_path, [RankMonitor(log_every_n_steps=3)], logger, max_steps=6).fit(PlainMLP(), loader())
    log_dir = Path(logger.log_dir)
    assert (log_dir / "rank_evolution.png").read_bytes()[:4] == b"\x89PNG"
    history = json.loads((log_dir / "rank_history.json").read_text())["history"]
    assert history["steps"] == [0, 3, 6]
    header = (log_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    assert RANK_KEY in header and "compression_ratio" in header


def test_no_logger_and_no_comera_layers(tmp_path):
    # no logger: no crash, artifacts in default_root_dir
    monitor = RankMonitor(log_every_n_steps=2)
    trainer(tmp_path / "a", [monitor], False, max_steps=3).fit(PlainMLP(), loader())
    assert (tmp_path / "a" / "rank_history.json").exists() and monitor.history["steps"] == [0, 2, 3]
    # on request, also from a trainer that holds no model: the history without a final size report
    bare = trainer(tmp_path / "b", [], False, max_steps=1)
    assert RankMonitor().write_artifacts(bare) == []  # empty history: nothing to write
    written = sorted(Path(p).name for p in monitor.write_artifacts(bare))
    assert written == ["rank_evolution.png", "rank_history.json"]
    assert json.loads((tmp_path / "b" / "rank_history.json").read_text())["final_size_report"] is None

    # no comera layers: one warning, nothing logged, no artifacts
    logger = RecordingLogger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "c", [RankMonitor(log_every_n_steps=1)], logger, max_steps=3).fit(
            PlainMLP(tensorized=False), loader()
        )
    assert len([w for w in caught if "no comera layers" in str(w.message)]) == 1
    assert not any(k.startswith(("rank/", "params/")) for _, m in logger.calls for k in m)
    assert not list((tmp_path / "c").rglob("rank_*"))


def test_state_dict_roundtrip_and_resume(tmp_path):
    first = RankMonitor(log_every_n_steps=4, save_artifacts=False)
    t1 = trainer(tmp_path, [KillSlices(at=2), first], False, max_steps=6)
    t1.fit(PlainMLP(), loader())
    ckpt = tmp_path / "mid.ckpt"
    t1.save_checkpoint(ckpt)

    path = tmp_path / "state.pt"
    torch.save(first.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    clone = RankMonitor()
    clone.load_state_dict(loaded)
    assert clone.state_dict() == first.state_dict()
    assert loaded["layers"]["model.0"]["active_ranks"][-1] == [1, 2, 4, 1]

    # resumed fit continues the history instead of starting over
    logger = RecordingLogger()
    second = RankMonitor(log_every_n_steps=4, save_artifacts=False)
    trainer(tmp_path, [second], logger, max_steps=10).fit(PlainMLP(), loader(), ckpt_path=ckpt)
    assert second.history["steps"] == [0, 4, 6, 8, 10]
    assert second.history["layers"]["model.0"]["steps"] == [0, 4]
    assert [s for s, m in logger.calls if RANK_KEY in m] == [6, 8, 10]
    assert {m[RANK_KEY] for s, m in logger.calls if RANK_KEY in m} == {2.0}

    # unknown state is ignored with a warning, not a crash
    with pytest.warns(UserWarning, match="not understood"):
        clone.load_state_dict({"something": "else"})


def test_names_plot_and_arguments(tmp_path):
    assert metric_safe_name("enc.layers.0:ffn(fc1)") == "enc.layers.0_ffn_fc1_"
    assert metric_safe_name("_orig_mod.model._orig_mod.0") == "model.0"
    with pytest.raises(ValueError, match="log_every_n_steps must be >= 1, got 0"):
        RankMonitor(log_every_n_steps=0)

    # many layers: the heatmap layout; few layers: one panel per layer
    layers = {
        f"encoder.{i}.fc{j}": {"steps": [0, 50], "active_ranks": [[1, 8, 8, 1], [1, 8 - i % 8, 4, 1]]}
        for i in range(30)
        for j in (1, 2)
    }
    history = {
        "steps": [0, 50, 100],
        "layers": layers,
        "params": {
            "steps": [0, 50],
            "active": [1000, 600],
            "allocated": [1000, 1000],
            "dense_equivalent": [9000, 9000],
        },
    }
    for n_layers, name in [(60, "many.png"), (3, "few.png")]:
        plot_rank_history(history | {"layers": dict(list(layers.items())[:n_layers])}, str(tmp_path / name))
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_two_processes_log_once_from_rank_zero(tmp_path):
    import csv

    logger = CSVLogger(tmp_path, name="csv", version=0)
    trainer(
        tmp_path,
        [KillSlices(at=3), RankMonitor(log_every_n_steps=2)],
        logger,
        max_steps=6,
        strategy="ddp_spawn",
        devices=2,
    ).fit(PlainMLP(), loader())
    log_dir = tmp_path / "csv" / "version_0"
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    assert [(int(r["step"]), float(r[RANK_KEY])) for r in rows] == [(0, 4.0), (2, 4.0), (4, 2.0), (6, 2.0)]
    history = json.loads((log_dir / "rank_history.json").read_text())["history"]
    assert history["layers"]["model.0"] == {"steps": [0, 4], "active_ranks": [[1, 4, 4, 1], [1, 2, 4, 1]]}
    assert (log_dir / "rank_evolution.png").exists()


def adaptation() -> RankAdaptation:
    """Late stage from step 5, truncation checks every 4 steps (the slices KillSlices(at=3) kills go at 4)."""
    return RankAdaptation(
        gamma=0.01,
        late_start_step=5,
        target_size_ratio=0.9,
        truncate_every_n_steps=4,
        late_stage=ScheduledLateStage(ramp_steps=2, cut_every_n_steps=1, importance="norm"),
    )


@pytest.mark.parametrize("monitor_first", [True, False])
def test_switch_and_truncations_recorded_at_their_steps(tmp_path, monitor_first):
    # either callback order: a truncation in RankAdaptation's on_train_batch_end is dated by its own step
    monitor = RankMonitor(log_every_n_steps=3, save_artifacts=False)
    callbacks = [monitor, adaptation()] if monitor_first else [adaptation(), monitor]
    trainer(tmp_path, [KillSlices(at=3), *callbacks], False, max_steps=10).fit(PlainMLP(), loader())
    events = monitor.history["events"]
    assert events["stage_switch"] == 5
    assert events["truncations"][0] == 4 and events["truncations"] == sorted(set(events["truncations"]))
    assert events["target_size"] > 0

    # the events travel in checkpoints; a history from before they were kept loads with none
    clone = RankMonitor()
    clone.load_state_dict(monitor.state_dict())
    assert clone.history["events"] == events
    old = {k: v for k, v in monitor.state_dict().items() if k != "events"}
    clone.load_state_dict(old)
    assert clone.history["events"] == {"stage_switch": None, "truncations": [], "target_size": None}


def test_picture_with_switch_and_truncations_reaches_mlflow(tmp_path):
    from matplotlib.image import imread
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(
        experiment_name="rank_picture", tracking_uri=uri, artifact_location=(tmp_path / "artifacts").as_uri()
    )
    trainer(tmp_path, [KillSlices(at=3), adaptation(), RankMonitor(log_every_n_steps=2)], logger, max_steps=10).fit(
        PlainMLP(), loader()
    )

    client = MlflowClient(tracking_uri=uri)
    names = {a.path for a in client.list_artifacts(logger.run_id, "comera")}
    assert names == {"comera/rank_evolution.png", "comera/rank_history.json"}
    history = json.loads(
        Path(client.download_artifacts(logger.run_id, "comera/rank_history.json", str(tmp_path / "dl"))).read_text()
    )["history"]
    assert history["events"]["stage_switch"] == 5 and 4 in history["events"]["truncations"]
    png = Path(client.download_artifacts(logger.run_id, "comera/rank_evolution.png", str(tmp_path / "dl")))
    image = imread(png)
    assert png.stat().st_size > 10_000 and image.shape[1] == 1200 and image.shape[0] > 300


def synthetic_history(blocks: int = 6, switch: int | None = 600, events: bool = True) -> dict:
    """A shrinking 6-block encoder (6 linears of 5 bonds per block), ranks halving by the end."""
    steps = list(range(0, 1001, 50))
    layers = {}
    for b in range(blocks):
        for j, kind in enumerate(
            ["attention.query", "attention.key", "attention.value", "attention.output", "fc1", "fc2"]
        ):
            change = [0, 200 + 40 * j, 700 + 20 * b]
            ranks = [[1, 30, 30, 30, 30, 30, 1], [1, 28 - b, 25, 30 - j, 22, 29, 1], [1, 12, 9 - b, 15, 10 - j, 14, 1]]
            layers[f"model.encoder.layers.{b}.{kind}"] = {"steps": change, "active_ranks": ranks}
    history = {
        "format_version": 1,
        "steps": steps,
        "layers": layers,
        "params": {
            "steps": [0, 300, 700, 800],
            "active": [9000, 7000, 4000, 4000],
            "allocated": [9000, 9000, 9000, 4000],
            "dense_equivalent": [90000] * 4,
        },
    }
    if events:
        history["events"] = {"stage_switch": switch, "truncations": [400, 800], "target_size": 4500.0}
    return history


def _drawn_marks(history, path, monkeypatch, **kwargs) -> list[tuple[list[float], list[float]]]:
    """Per panel of the saved figure: the steps of its dashed vertical lines and of its truncation triangles."""
    from matplotlib.figure import Figure

    saved = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (saved.append(fig), save(fig, *a, **k))[1])
    plot_rank_history(history, str(path), **kwargs)
    monkeypatch.undo()
    (figure,) = saved
    marks = []
    for axis in figure.axes:
        if not axis.get_lines() or axis.get_ylabel().startswith("compression"):
            continue  # the compression ratio's twin axis carries no marks
        vertical = [
            float(line.get_xdata()[0])
            for line in axis.get_lines()
            if line.get_linestyle() == "--" and len(set(line.get_xdata())) == 1
        ]
        triangles = [float(x) for line in axis.get_lines() if line.get_marker() == "v" for x in line.get_xdata()]
        marks.append((vertical, triangles))
    return marks


def test_plot_marks_switch_and_truncations(tmp_path, monkeypatch):
    import matplotlib

    backend = matplotlib.get_backend()
    path = tmp_path / "rank_evolution.png"
    marks = _drawn_marks(synthetic_history(), path, monkeypatch)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    assert matplotlib.get_backend() == backend  # Agg canvas of its own: pyplot's backend is left alone
    # both panels (sizes, rank heatmap) mark the switch at 600 with a dashed line and each truncation with a triangle
    assert marks == [([600.0], [400.0, 800.0])] * 2
    assert (
        _drawn_marks(synthetic_history(switch=None), tmp_path / "none.png", monkeypatch) == [([], [400.0, 800.0])] * 2
    )

    # truncations are the recorded ones; an allocated drop none explains (no RankAdaptation) is added
    assert _truncation_steps(synthetic_history()) == [400, 800]
    history = synthetic_history()
    history["events"]["truncations"] = [400]
    assert _truncation_steps(history) == [400, 800]
    assert _truncation_steps(synthetic_history(events=False)) == [800]
    # without a switch, without events, and with so many bonds that each layer gets one row
    plot_rank_history(synthetic_history(switch=None), str(tmp_path / "no_switch.png"))
    plot_rank_history(synthetic_history(events=False), str(tmp_path / "old.png"))
    plot_rank_history(synthetic_history(blocks=12), str(tmp_path / "per_layer.png"), max_bond_rows=100)
    for name in ("no_switch.png", "old.png", "per_layer.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
