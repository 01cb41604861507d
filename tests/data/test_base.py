"""ComeraDataModule: every data module takes and checks the shared loader options the same way, and serves its
rows through the same loaders (shuffled and resumable for training, in order otherwise, ``[]`` when empty, the
validation rows for test and predict unless a module holds out others)."""

from __future__ import annotations

import pytest
import torch

from comera_lightning.data import (
    CodeLMDataModule,
    CodeMLMDataModule,
    CodePairsDataModule,
    CriteoDataModule,
    MNLIDataModule,
    TextLMDataModule,
)
from comera_lightning.data.base import ComeraDataModule
from comera_lightning.data.common import EpochShuffleSampler, ResumableDataLoader, TensorDictDataset, identity_collate

#: the least each module needs to be constructed (construction reads no file)
MODULES = {
    "code_mlm": (CodeMLMDataModule, {}),
    "code_lm": (CodeLMDataModule, {}),
    "code_pairs": (CodePairsDataModule, {}),
    "mnli": (MNLIDataModule, {"data_dir": "mnli"}),
    "text_lm": (TextLMDataModule, {"files": "corpus/*.txt"}),
    "criteo": (CriteoDataModule, {"synthetic": True}),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_every_module_takes_the_shared_options_with_its_own_defaults(name):
    cls, kwargs = MODULES[name]
    dm = cls(**kwargs, batch_size=5, num_workers=0, seed=7)
    assert isinstance(dm, ComeraDataModule)
    assert (dm.batch_size, dm.num_workers, dm.seed) == (5, 0, 7)
    assert dm.hparams["batch_size"] == 5 and dm.hparams["seed"] == 7
    default = cls(**kwargs)
    assert default.cache_dir == (None if cls is CriteoDataModule else ".cache/comera")
    assert default.batch_size == (2048 if cls is CriteoDataModule else 32)
    assert default.train_dataset is None and default.val_dataset is None  # nothing read yet


@pytest.mark.parametrize("name", list(MODULES))
def test_every_module_refuses_a_bad_batch_size_or_worker_count_with_the_rule(name):
    cls, kwargs = MODULES[name]
    with pytest.raises(ValueError, match=r"batch_size (must be )?>= 1, got .*0"):
        cls(**kwargs, batch_size=0)
    with pytest.raises(ValueError, match="num_workers must be >= 0, got -1"):
        cls(**kwargs, num_workers=-1)


class _Rows(ComeraDataModule):
    """The smallest module on the base: ``n_train`` and ``n_val`` rows of one column."""

    _no_test_split = "there are two splits only"

    def __init__(self, n_train: int = 10, n_val: int = 4, batch_size: int = 3, seed: int = 0) -> None:
        super().__init__(batch_size, 0, seed, None)
        self.n_train, self.n_val = n_train, n_val
        self.setups: list[str | None] = []

    def setup(self, stage: str | None = None) -> None:
        self.setups.append(stage)
        self.train_dataset = TensorDictDataset(x=torch.arange(self.n_train))
        self.val_dataset = TensorDictDataset(x=100 + torch.arange(self.n_val))

    def _collate_fn(self, train: bool):
        return identity_collate


def _xs(loader) -> list[int]:
    return [int(x) for batch in loader for x in batch["x"]]


def test_the_loaders_set_up_on_first_use_and_serve_the_rows():
    dm = _Rows()
    train = dm.train_dataloader()
    assert dm.setups == ["fit"]
    assert isinstance(train, ResumableDataLoader) and isinstance(train.sampler, EpochShuffleSampler)
    assert sorted(_xs(train)) == list(range(10)) and _xs(train) != list(range(10))  # shuffled, every row once
    assert _xs(_Rows(seed=0).train_dataloader()) == _xs(train)  # the order is the seed's (and the epoch's)
    assert _xs(dm.val_dataloader()) == [100, 101, 102, 103]  # in order
    assert dm.setups == ["fit"]  # set up once


def test_test_and_predict_run_on_the_validation_rows_said_once(rank_zero_said):
    from comera_lightning.data import common

    messages = rank_zero_said(common)
    dm = _Rows()
    assert _xs(dm.test_dataloader()) == [100, 101, 102, 103]
    dm.test_dataloader()
    batches = list(dm.predict_dataloader())
    assert dm.setups == ["test"]
    assert [int(i) for b in batches for i in b["index"]] == [0, 1, 2, 3]  # the row numbers
    said = [m for m in messages if "runs on the validation examples" in m]
    assert said == [
        "_Rows: test runs on the validation examples (there are two splits only)",
        "_Rows: predict runs on the validation examples (there are two splits only)",
    ]


def test_a_split_without_rows_gives_no_loader():
    dm = _Rows(n_val=0)
    assert dm.val_dataloader() == [] and dm.test_dataloader() == [] and dm.predict_dataloader() == []
