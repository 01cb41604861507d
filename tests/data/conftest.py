"""Shared fixtures of the data-module tests: one stdlib corpus module, trained once per session."""

from __future__ import annotations

import pytest
import torch

from comera_lightning.data import CodeMLMDataModule

#: small settings that keep the stdlib tests fast (about 30 files, a 1000-token BPE)
STDLIB_KW = dict(max_files=30, vocab_size=1000, seq_len=64, batch_size=16, val_fraction=0.1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture(scope="session")
def stdlib_kw() -> dict:
    return dict(STDLIB_KW)


@pytest.fixture(scope="session")
def stdlib_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("comera-cache")


@pytest.fixture(scope="session")
def stdlib_dm(stdlib_cache) -> CodeMLMDataModule:
    """The first instance on an empty cache: it trains the tokenizer and encodes the corpus."""
    dm = CodeMLMDataModule(cache_dir=str(stdlib_cache), **STDLIB_KW)
    dm.prepare_data()
    dm.setup("fit")
    return dm
