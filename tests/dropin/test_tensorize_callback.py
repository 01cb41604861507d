"""The Tensorize callback and the one-call reload, on a LightningModule written the way a user writes one (nothing
of this project in it), with the rank callbacks, ModelCheckpoint and FaultTolerance."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny import TinyRegressor
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from comera_lightning import load_from_checkpoint, tensorize, untensorize
from comera_lightning.callbacks import ContractionPlanner, RankAdaptation, RankMonitor, Tensorize
from comera_lightning.callbacks.fault_tolerance import FaultTolerance
from comera_lightning.nn import TTLinear, tt_layers


class UserModel(LightningModule):
    """A user's own module: an MLP, plain AdamW over all parameters, hyperparameters saved."""

    def __init__(self, width: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Mlp(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def loader(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return DataLoader(TensorDataset(x, torch.tanh(x.flip(-1))), batch_size=16)


def trainer(tmp_path, callbacks, max_steps: int, **kwargs) -> Trainer:
    return Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        **kwargs,
    )


def rank_callbacks():
    return [
        RankAdaptation(gamma=0.5, truncate_every_n_steps=4, min_dead_fraction=0.1),
        ContractionPlanner(),
        RankMonitor(log_every_n_steps=4, save_artifacts=False),
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A UserModel trained 12 steps under Tensorize + the rank callbacks, checkpointed by ModelCheckpoint and
    FaultTolerance."""
    tmp_path = tmp_path_factory.mktemp("fit")
    model = UserModel()
    callback = Tensorize(rank=16, min_features=32)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fault = FaultTolerance(every_n_steps=6, dirpath=str(tmp_path / "ft"))
    trainer(tmp_path, [callback, *rank_callbacks(), checkpoint, fault], max_steps=12).fit(model, loader())
    return model, callback, tmp_path


def test_callback_swaps_before_the_optimiser_and_ranks_shrink(trained):
    model, callback, _ = trained
    assert [r.name for r in callback.records] == ["net.0", "net.2"]
    assert all(isinstance(model.net[i], TTLinear) for i in (0, 2))
    optimised = {id(p) for group in model.trainer.optimizers[0].param_groups for p in group["params"]}
    assert all(id(c) in optimised for _, layer in tt_layers(model) for c in layer.cores)
    assert any(
        layer.ranks != [1, 4, 16, 4, 1] and layer.ranks != TTLinear(32, 64, 16).ranks for _, layer in tt_layers(model)
    ), "no truncation: the reload would not test adopting ranks"


@pytest.mark.parametrize("which", ["last.ckpt", "ft"])
def test_one_call_reload_of_the_callback_checkpoint(trained, which):
    model, _, tmp_path = trained
    path = tmp_path / "ckpt" / "last.ckpt" if which == "last.ckpt" else sorted((tmp_path / "ft").glob("*.ckpt"))[-1]
    saved = torch.load(path, weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("Tensorize"))
    assert state["arguments"]["rank"] == 16 and state["ranks"]["net.0"] == model.net[0].ranks
    loaded = load_from_checkpoint(UserModel, path)
    assert type(loaded) is UserModel and loaded.hparams.width == 64
    assert [layer.ranks for _, layer in tt_layers(loaded)] == [layer.ranks for _, layer in tt_layers(model)]
    x = torch.randn(5, 32)
    model.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x))
        untensorize(loaded)
        assert not tt_layers(loaded)
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-6)


def test_resume_rebuilds_the_checkpoint_structure(trained, tmp_path):
    _model, _, fit_path = trained
    path = fit_path / "ckpt" / "last.ckpt"
    saved_ranks = torch.load(path, weights_only=True)["callbacks"]
    resumed = UserModel()
    seen = []

    class Probe(RankAdaptation):  # the ranks the optimiser is built over: the checkpoint's
        def on_fit_start(self, trainer, pl_module):
            seen.append({n: layer.ranks for n, layer in tt_layers(pl_module)})
            super().on_fit_start(trainer, pl_module)

    trainer(
        tmp_path, [Tensorize(rank=16, min_features=32), Probe(gamma=0.5, truncate_every_n_steps=None)], max_steps=14
    ).fit(resumed, loader(), ckpt_path=path)
    assert resumed.trainer.global_step == 14
    state = next(v for k, v in saved_ranks.items() if k.startswith("Tensorize"))
    assert seen == [state["ranks"]]

    other = Tensorize(rank=8, min_features=32, include=r"net\.0")
    with pytest.raises(ValueError, match=r"made with tensorize\(rank=16.*this run's callback calls tensorize\(rank=8"):
        trainer(tmp_path, [other], max_steps=16).fit(UserModel(), loader(), ckpt_path=path)


def test_reload_when_tensorized_in_init_or_by_hand(tmp_path):
    own = TinyRegressor(rank=6)  # tensorises its own MLP in __init__
    trainer(
        tmp_path,
        [RankAdaptation(gamma=0.5, truncate_every_n_steps=4, min_dead_fraction=0.1)],
        max_steps=8,
        enable_checkpointing=False,
    ).fit(own, loader())
    own.trainer.save_checkpoint(tmp_path / "own.ckpt")
    x = torch.randn(3, 32)
    torch.testing.assert_close(load_from_checkpoint(TinyRegressor, tmp_path / "own.ckpt")(x), own(x))

    by_hand = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    tensorize(by_hand, rank=5, min_features=32, rank_threshold=0.05)
    by_hand[0].truncate_to_share_(0.5)
    torch.save(by_hand.state_dict(), tmp_path / "plain.pt")
    fresh = load_from_checkpoint(Mlp, tmp_path / "plain.pt")
    assert fresh[0].ranks == by_hand[0].ranks and fresh[0].rank_threshold == 0.05
    torch.testing.assert_close(fresh(x), by_hand(x))


def test_clear_error_without_a_record(tmp_path):
    model = nn.Sequential(nn.Linear(32, 64))
    tensorize(model, rank=4, min_features=32)
    plain = dict(model.state_dict())  # a plain dict: the metadata is gone
    torch.save(plain, tmp_path / "stripped.pt")
    with pytest.raises(ValueError, match=r"holds comera layers at \['0'\].*call tensorize\(\) with the arguments"):
        load_from_checkpoint(lambda: nn.Sequential(nn.Linear(32, 64)), tmp_path / "stripped.pt")


def test_callback_warns_when_nothing_qualifies(tmp_path):
    with pytest.warns(UserWarning, match="found no nn.Linear"):
        trainer(tmp_path, [Tensorize(min_features=1000)], max_steps=1, enable_checkpointing=False).fit(
            UserModel(), loader(16)
        )


def test_callback_takes_the_options_object_or_its_fields():
    from comera_lightning.nn import TensorizeOptions

    by_fields = Tensorize(rank=16, min_features=32, rank_threshold=0.05, init_std=0.1)
    options = TensorizeOptions(rank=16, min_features=32, rank_threshold=0.05, layer_kwargs={"init_std": 0.1})
    assert by_fields.options == options == Tensorize(options).options
    assert Tensorize(16, min_features=32).options == TensorizeOptions(rank=16, min_features=32)  # rank by position
    assert Tensorize(layer_kwargs={"learn_gates": False}).options.learn_gates is False
    # what the checkpoint state reports, as before the options object
    assert by_fields.arguments == dict(
        rank=16, min_features=32, include=None, exclude=None, linears=True, embeddings=True, embedding_rank=None,
        decompose=False,
    )  # fmt: skip
    assert by_fields.layer_kwargs == {"rank_threshold": 0.05, "init_std": 0.1}
    assert Tensorize(rank=16, min_features=32).state_key == (
        "Tensorize{'rank': 16, 'min_features': 32, 'include': None, 'exclude': None, 'linears': True, "
        "'embeddings': True, 'embedding_rank': None}"
    )
    with pytest.raises(TypeError, match=r"takes a TensorizeOptions or its fields by name, not both"):
        Tensorize(options, rank=8)
    with pytest.raises(ValueError, match="min_features must be >= 1, got 0"):
        Tensorize(min_features=0)
