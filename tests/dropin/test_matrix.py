"""The drop-in compatibility matrix: tensorize() on common building blocks, in every mode a user runs them.

Every model is tensorised at full rank from its own dense weights (``decompose=True``, float64), so the TT model
computes the dense model's function exactly (up to rounding) and each cell compares outputs with the dense model,
never "it ran". The table of docs/own-model.md is rendered from ``MODES``, ``KINDS`` and ``FAILS`` and checked here.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch._dynamo as dynamo
from helpers.dropin_models import KINDS, MIN_FEATURES, TinyLM, Wrapped, build, dummy_loader, example, forward
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from comera_lightning import load_from_checkpoint, tensorize, tensorize_like, untensorize
from comera_lightning.callbacks import RankAdaptation, Tensorize
from comera_lightning.nn import tt_layers

FULL = 10**6  # clamped to the full rank of each layer's modes
PAGE = Path(__file__).resolve().parents[2] / "docs" / "own-model.md"  # where the table is shown

MODES = {
    "train": "train",
    "eval": "eval",
    "no_grad": "eval, `no_grad`",
    "inference_mode": "eval, `inference_mode`",
    "bf16": "bf16 autocast",
    "compile": "`torch.compile`",
    "deepcopy": "`deepcopy`",
    "pickle": "pickle",
    "state_dict": "`state_dict` round trip",
    "resume": "`fit(ckpt_path=...)`",
    "reload": "`load_from_checkpoint`",
    "untensorize": "`untensorize()`",
    "ddp": "DDP, 2 processes",
}
NAMES = {
    "encoder": "`nn.TransformerEncoder`",
    "encoder_seq_first": "`nn.TransformerEncoder`, seq first",
    "decoder": "`nn.TransformerDecoder`",
    "decoder_seq_first": "`nn.TransformerDecoder`, seq first",
    "transformer": "`nn.Transformer`",
    "transformer_seq_first": "`nn.Transformer`, seq first",
    "mha_block": "block around `nn.MultiheadAttention`",
    "mlp": "`nn.Sequential` MLP",
    "lightning": "a user's LightningModule",
    "llama": "HF Llama (SDPA)",
    "bert": "HF BERT (SDPA)",
    "gpt2": "HF GPT-2 (SDPA)",
}
#: cells that do not work, with the reason and the error the user gets
FAILS: dict[tuple[str, str], str] = {}
#: cells not run: 2-process DDP runs on the LightningModule (the same layers as the other torch rows)
NOT_RUN = {(kind, "ddp") for kind in KINDS if kind != "lightning"}


def tensorized(kind: str) -> tuple[nn.Module, nn.Module]:
    """(the dense model, the same model tensorised at full rank from its dense weights)."""
    dense = build(kind)
    model = copy.deepcopy(dense)
    assert tensorize(model, rank=FULL, min_features=MIN_FEATURES, decompose=True)
    return dense, model


def same(a: torch.Tensor, b: torch.Tensor, **tolerance) -> None:
    torch.testing.assert_close(a, b, **(tolerance or dict(rtol=1e-7, atol=1e-9)))


def eval_outputs(model: nn.Module, kind: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return forward(model, kind, example(kind))


def check_generate(model: nn.Module, dense: nn.Module, kind: str) -> None:
    if kind in ("llama", "gpt2"):
        ids = example(kind)[0][:, :3]
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kwargs), dense.generate(ids, **kwargs))


def compile_breaks_in_comera(model: nn.Module, kind: str) -> list[str]:
    dynamo.reset()
    explained = dynamo.explain(lambda *x: forward(model, kind, x))(*example(kind))
    return [
        str(r.reason)
        for r in explained.break_reasons
        if any("comera_lightning" in frame.filename for frame in r.user_stack)
    ]


# --- the modes that need no trainer ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_train(kind):
    dense, model = tensorized(kind)
    inputs = example(kind)
    outs = []
    for m in (dense, model):
        m.train()
        out = forward(m, kind, inputs)
        out.sum().backward()
        outs.append(out)
    same(outs[1], outs[0])
    grads = dict(model.named_parameters())  # the parameters tensorize() kept dense get the same gradients
    names = [(name, id(p)) for name, p in dense.named_parameters(remove_duplicate=False)]
    tied = {i for _, i in names if sum(j == i for _, j in names) > 1}  # untied by tensorize: gradients split
    for name, p in dense.named_parameters():
        if name in grads and p.grad is not None and id(p) not in tied:
            same(grads[name].grad, p.grad, msg=name)


@pytest.mark.parametrize("context", ["eval", "no_grad", "inference_mode"])
@pytest.mark.parametrize("kind", KINDS)
def test_eval(kind, context):
    dense, model = tensorized(kind)
    ctx = {"eval": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[context]
    dense.eval(), model.eval()
    with ctx():
        same(forward(model, kind, example(kind)), forward(dense, kind, example(kind)))
        if context == "no_grad":
            check_generate(model, dense, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast(kind):
    dense, model = tensorized(kind)
    dense.float().eval(), model.float().eval()
    inputs = example(kind, torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = forward(model, kind, inputs), forward(dense, kind, inputs)
    # no dtype check: under CPU autocast torch's dense encoder takes its fused path (bf16 out), the TT one does not
    same(out.float(), ref.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("kind", KINDS)
def test_compile(kind):
    """Every TT layer compiled in place with fullgraph=True (a graph break raises), forward and backward in the
    model; the whole model through torch.compile for the MLP (the TT layers trace the same in any model)."""
    dense, model = tensorized(kind)
    dynamo.reset()
    for _, layer in tt_layers(model):
        layer.compile(fullgraph=True, backend="eager")
    outs = []
    with dynamo.config.patch(recompile_limit=64):  # one compiled graph per layer instance
        for m in (dense.train(), model.train()):
            out = forward(m, kind, example(kind))
            out.sum().backward()
            outs.append(out)
    same(outs[1], outs[0])
    if kind == "mlp":
        assert compile_breaks_in_comera(tensorized(kind)[1].train(), kind) == []


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", KINDS)
def test_copies(kind, how):
    dense, model = tensorized(kind)
    eval_outputs(model, kind)  # fill the inference cache: copies must not carry it
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    same(eval_outputs(copied, kind), eval_outputs(dense, kind))
    assert [n for n, _ in tt_layers(copied)] == [n for n, _ in tt_layers(model)]


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip(kind):
    _dense, model = tensorized(kind)
    for _, layer in tt_layers(model)[:1]:  # one layer with smaller ranks: loading adopts them
        layer.truncate_to_share_(0.5)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = build(kind)
    tensorize_like(fresh, state)
    fresh.load_state_dict(state)
    same(eval_outputs(fresh, kind), eval_outputs(model, kind))
    assert [layer.ranks for _, layer in tt_layers(fresh)] == [layer.ranks for _, layer in tt_layers(model)]


@pytest.mark.parametrize("kind", KINDS)
def test_untensorize(kind):
    dense, model = tensorized(kind)
    untensorize(model)
    assert not tt_layers(model)
    same(eval_outputs(model, kind), eval_outputs(dense, kind), rtol=1e-7, atol=1e-8)
    check_generate(model, dense, kind)


# --- the modes with a trainer: the Tensorize callback on the user's LightningModule ------------------------------
def _module(kind: str):
    return TinyLM() if kind == "lightning" else Wrapped(kind)


def _loader(kind: str):
    if kind == "lightning":  # the same batch every step: a resumed run sees what the uninterrupted one saw
        batch = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader([batch] * 8, batch_size=None)
    return dummy_loader()


def _trainer(root: Path, callbacks: list[Callback], max_steps: int, **kwargs) -> Trainer:
    options = dict(
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
    )
    return Trainer(max_steps=max_steps, callbacks=callbacks, **{**options, **kwargs})


def _tensorize_callback() -> Tensorize:
    return Tensorize(rank=FULL, min_features=MIN_FEATURES, decompose=True)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Per kind, once: 3 steps under Tensorize with a checkpoint after step 2 (an uninterrupted run)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            root = tmp_path_factory.mktemp(kind)
            module = _module(kind)
            every = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)
            _trainer(root, [_tensorize_callback(), every], 3, enable_checkpointing=True).fit(module, _loader(kind))
            module.trainer.save_checkpoint(root / "final.ckpt")
            cache[kind] = module, root
        return cache[kind]

    return get


def _outputs(module, kind: str) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        return module(*example(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_resume(kind, fitted, tmp_path):
    full, root = fitted(kind)
    resumed = _module(kind)
    _trainer(tmp_path, [_tensorize_callback()], 3).fit(
        resumed, _loader(kind), ckpt_path=root / "ckpt" / "epoch=0-step=2.ckpt"
    )
    same(_outputs(resumed, kind), _outputs(full, kind), rtol=1e-6, atol=1e-8)
    dense = copy.deepcopy(full)
    untensorize(dense)
    same(_outputs(resumed, kind), _outputs(dense, kind), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", KINDS)
def test_reload(kind, fitted):
    full, root = fitted(kind)
    loaded = load_from_checkpoint(type(full), root / "final.ckpt")
    assert type(loaded) is type(full) and tt_layers(loaded)
    same(_outputs(loaded, kind), _outputs(full, kind))
    untensorize(loaded)
    same(_outputs(loaded, kind), _outputs(full, kind), rtol=1e-6, atol=1e-8)


class _Snapshot(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        torch.save(
            {k: v.detach().clone() for k, v in pl_module.state_dict().items()},
            self.path / f"rank{trainer.global_rank}.pt",
        )


@pytest.mark.slow
def test_ddp_two_processes(tmp_path):
    callbacks = [
        Tensorize(rank=8, min_features=MIN_FEATURES),
        RankAdaptation(gamma=0.5, truncate_every_n_steps=2, min_dead_fraction=0.1),
        _Snapshot(tmp_path),
        ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True),
    ]
    _trainer(tmp_path, callbacks, 4, strategy="ddp_spawn", devices=2, enable_checkpointing=True).fit(
        TinyLM(), _loader("lightning")
    )
    first, second = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert first.keys() == second.keys() and any(".cores." in k for k in first)
    for key in first:
        torch.testing.assert_close(first[key], second[key], rtol=0, atol=0, msg=key)
    loaded = load_from_checkpoint(TinyLM, tmp_path / "ckpt" / "last.ckpt")
    dense = copy.deepcopy(loaded)
    untensorize(dense)
    same(_outputs(loaded, "lightning"), _outputs(dense, "lightning"), rtol=1e-6, atol=1e-8)


# --- the docs' table ----------------------------------------------------------------------------------------------
def render_matrix() -> str:
    """The table of docs/own-model.md: model x mode, ✔, ✘ (with a footnote), or – (not run)."""
    lines = ["| model | " + " | ".join(MODES.values()) + " |", "|---" * (len(MODES) + 1) + "|"]
    notes = []
    for kind in KINDS:
        cells = []
        for mode in MODES:
            if (kind, mode) in FAILS:
                notes.append(FAILS[kind, mode])
                cells.append(f"✘ ({len(notes)})")
            else:
                cells.append("–" if (kind, mode) in NOT_RUN else "✔")
        lines.append(f"| {NAMES[kind]} | " + " | ".join(cells) + " |")
    lines += [""] + [f"({i}) {note}" for i, note in enumerate(notes, 1)]
    lines.append("– not run: DDP runs on the LightningModule row, whose layers the other torch rows share.")
    return "\n".join(lines)


def test_the_docs_show_the_matrix():
    text = PAGE.read_text()
    found = re.search(r"<!-- dropin-matrix -->\n(.*?)\n<!-- /dropin-matrix -->", text, re.S)
    assert found, "docs/own-model.md lacks the <!-- dropin-matrix --> block"
    assert found.group(1).strip() == render_matrix().strip(), (
        "docs/own-model.md's matrix is out of date; paste:\n" + render_matrix()
    )
