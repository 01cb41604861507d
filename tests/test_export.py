"""Compact export: a truncated MaskedLM to safetensors and back, from a model and from a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from comera_lightning.export import (
    EXPORT_KEY,
    export_checkpoint,
    export_model,
    load_exported,
    read_export_metadata,
)
from comera_lightning.lit import MaskedLM
from comera_lightning.nn import tt_layers

VOCAB = 256
SMALL = dict(
    d_model=32,
    num_heads=2,
    d_ff=64,
    num_layers=1,
    max_len=12,
    dropout=0.0,
    layer_config=dict(rank=4, embedding_rank=4, min_features=16),
)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (4, 12), generator=g)
    labels = torch.full_like(ids, -100)
    chosen = torch.rand(ids.shape, generator=g) < 0.3
    chosen[0, 0] = True
    labels[chosen] = ids[chosen]
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


def _task(seed: int = 0) -> MaskedLM:
    torch.manual_seed(seed)
    return MaskedLM(vocab_size=VOCAB, **SMALL)


def _shrink(task: MaskedLM) -> None:
    """Switch slices off everywhere (gates scrambled so they matter) and truncate half the layers for good."""
    with torch.no_grad():
        for k, (_, layer) in enumerate(tt_layers(task)):
            for gate in layer.gates:
                gate.uniform_(0.5, 1.5)
            layer.remove_slices_(0, [0])
            if k % 2:
                layer.truncate_()


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.model(batch["input_ids"], batch["attention_mask"])


def _core_shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, framework="pt") as handle:
        names = handle.keys()  # a safetensors handle is not iterable
        return {k: tuple(handle.get_slice(k).get_shape()) for k in names if ".cores." in k}


def test_export_model_float64_round_trip(tmp_path):
    task = _task().double()
    _shrink(task)
    task.eval()
    path = export_model(task, tmp_path / "model.safetensors", {"run_id": "abc"})
    assert path == tmp_path / "model.safetensors"
    with safe_open(path, framework="pt") as handle:
        header = handle.metadata()
    assert header["run_id"] == "abc"
    record = json.loads(header[EXPORT_KEY])
    assert record == read_export_metadata(path)
    assert record["task"] == "comera_lightning.lit.mlm.MaskedLM"
    assert record["hparams"]["vocab_size"] == VOCAB and record["hparams"]["d_model"] == 32
    layers = {layer["name"]: layer for layer in record["tt_layers"]}
    assert set(layers) == {f"model.{name}" for name, _ in tt_layers(task.model)}
    shapes = _core_shapes(path)
    for name, layer in tt_layers(task):
        assert layers[name]["ranks"] == layer.active_ranks  # truncated in the file, not in the task
        assert [shapes[f"{name}.cores.{k}"][-1] for k in range(len(layer.cores))] == layer.active_ranks[1:]
        assert layers[name]["kind"] in ("linear", "embedding") and layers[name]["in_modes"]
    assert any(layer.ranks != layer.active_ranks for _, layer in tt_layers(task))  # the task kept its masks
    assert record["size"]["compression_ratio"] > 1

    loaded = load_exported(path)
    assert type(loaded) is MaskedLM and not loaded.training
    assert all(p.dtype == torch.float64 for p in loaded.parameters())
    assert [layer.ranks for _, layer in tt_layers(loaded)] == [layer.active_ranks for _, layer in tt_layers(task)]
    batch = _batch()
    torch.testing.assert_close(_logits(loaded, batch), _logits(task, batch), rtol=1e-12, atol=1e-12)


def test_export_checkpoint_after_training(tmp_path):
    task = _task()
    trainer = Trainer(
        max_steps=2,
        limit_val_batches=0,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(task, DataLoader([_batch(0), _batch(1)], batch_size=None))
    _shrink(task)
    ckpt = tmp_path / "run.ckpt"
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=True)["comera_task"] == "comera_lightning.lit.mlm.MaskedLM"

    out = export_checkpoint(ckpt, tmp_path / "export" / "model.safetensors")
    assert out.stat().st_size < ckpt.stat().st_size
    loaded = load_exported(out)
    task.eval()
    batch = _batch(2)
    torch.testing.assert_close(_logits(loaded, batch), _logits(task, batch), rtol=1e-5, atol=1e-5)

    # never replaced silently; replaced on request
    before = out.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_checkpoint(ckpt, out)
    assert out.read_bytes() == before
    export_checkpoint(ckpt, out, overwrite=True)
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary file left behind

    # a checkpoint that does not record its task: refused with the fix, accepted with task=
    legacy = torch.load(ckpt, weights_only=True)
    del legacy["comera_task"]
    torch.save(legacy, tmp_path / "legacy.ckpt")
    with pytest.raises(ValueError, match="pass task= the class path"):
        export_checkpoint(tmp_path / "legacy.ckpt", tmp_path / "legacy.safetensors")
    export_checkpoint(tmp_path / "legacy.ckpt", tmp_path / "legacy.safetensors", task="comera_lightning.lit.MaskedLM")
    torch.testing.assert_close(_logits(load_exported(tmp_path / "legacy.safetensors"), batch), _logits(task, batch))


def test_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out.safetensors")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a Lightning checkpoint"):
        export_checkpoint(tmp_path / "plain.pt", tmp_path / "out.safetensors")
    (tmp_path / "broken.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"cannot be read: .*truncated .*or not a PyTorch checkpoint at all"):
        export_checkpoint(tmp_path / "broken.ckpt", tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_exported(tmp_path / "missing.safetensors")
    save_file({"w": torch.zeros(2)}, tmp_path / "foreign.safetensors")
    with pytest.raises(ValueError, match="not a comera export"):
        load_exported(tmp_path / "foreign.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(ValueError, match="cannot be read as a safetensors file"):
        load_exported(tmp_path / "junk.safetensors")

    task = _task()
    with pytest.raises(ValueError, match="metadata key 'comera' is reserved by the export; choose another name"):
        export_model(task, tmp_path / "out.safetensors", {EXPORT_KEY: "x"})
    with pytest.raises(IsADirectoryError, match=r"is a folder; pass a file name such as model.safetensors"):
        export_model(task, tmp_path)


class Shared(torch.nn.Module):
    """A plain module (no hparams) whose TT layer is used twice."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(24, 24)
        self.again = self.fc

    def forward(self, x):
        return self.again(torch.tanh(self.fc(x)))


def test_plain_module_with_a_shared_layer(tmp_path):
    from comera_lightning.nn import tensorize

    model = Shared().double()
    tensorize(model, rank=4, min_features=8)
    _shrink(model)
    path = export_model(model, tmp_path / "shared.safetensors")
    record = read_export_metadata(path)
    assert record["hparams"] is None and [layer["name"] for layer in record["tt_layers"]] == ["fc", "again"]
    x = torch.randn(3, 24, dtype=torch.float64)
    for loaded in (load_exported(path), load_exported(path, _fresh_shared())):
        assert loaded.fc is loaded.again
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-12, atol=1e-12)

    class Local(Shared):
        pass

    local = Local().double()
    export_model(local, tmp_path / "local.safetensors")
    with pytest.raises(
        ValueError,
        match=r"cannot import the task class .*; install the package that defines it, or pass the class path",
    ):
        load_exported(tmp_path / "local.safetensors")


def _fresh_shared() -> Shared:
    from comera_lightning.nn import tensorize

    model = Shared()
    tensorize(model, rank=4, min_features=8)
    return model


def _run_on_text_block() -> str:
    """The python block of docs/export.md's "Running an export on text"."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    section = page.split("## Running an export on text", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "docs/export.md lost its run-on-text example"
    return match.group(1)


def test_the_export_carries_the_tokenizer_and_the_docs_example_generates_text(tmp_path, monkeypatch, capsys):
    from comera_lightning.data.tokenizer import train_bpe_tokenizer
    from comera_lightning.export import load_exported_tokenizer
    from comera_lightning.lit import CausalLM

    texts = ["def read_config(path):\n    return open(path).read()\n", "import os\nprint(os.getcwd())\n"] * 20
    tokenizer = train_bpe_tokenizer(texts, 300)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    task = CausalLM(
        vocab_size=300, d_model=32, num_heads=2, d_ff=64, num_layers=1, max_len=64,
        layer_config={"rank": 4, "embedding_rank": 4, "min_features": 16},
    )  # fmt: skip
    export_model(task, tmp_path / "model.safetensors", tokenizer=tmp_path / "tokenizer.json")
    loaded = load_exported_tokenizer(tmp_path / "model.safetensors")
    assert loaded.encode("def f(x):").ids == tokenizer.encode("def f(x):").ids
    monkeypatch.chdir(tmp_path)
    exec(compile(_run_on_text_block(), "docs/export.md", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    assert printed.startswith("def read_config(path):")  # the prompt, then 24 generated tokens as text


def test_an_export_without_a_tokenizer_says_how_to_load_one(tmp_path):
    from comera_lightning.export import load_exported_tokenizer

    path = export_model(_task(), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"carries no tokenizer .* tokenizers\.Tokenizer\.from_file"):
        load_exported_tokenizer(path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"is not a readable tokenizer\.json .* pass the file the data module"):
        export_model(_task(), tmp_path / "other.safetensors", tokenizer=tmp_path / "bad.json")
    assert not (tmp_path / "other.safetensors").exists()
