"""The per-core parameterisation (``mup``): fan-ins, init scales, rate multipliers, and the coordinate check.

The coordinate check asks whether a layer's output, and its change in a step, keep their size as the model widens: a
``width -> 4 width -> width`` MLP of TT layers (rank width / 8) or low-rank ``A B`` layers (rank width / 4) trains a
few AdamW steps on a fixed batch. Flat rows keep muP's promise; a row that grows with the width is a rate that has to
shrink as the model widens. ``python -m tests.tt.test_parameterization`` prints the table in docs/parameterization.md.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from comera_lightning.models import LayerConfig, LayerFactory
from comera_lightning.nn import TTEmbedding, TTLinear, tensorize
from comera_lightning.optim import comera_parameter_groups
from comera_lightning.tt import init_cores, tt_to_dense, ttm_to_dense
from comera_lightning.tt.parameterization import MUP_BASE_FAN_IN, core_fan_ins, mup_init_stds, mup_lr_scales

F64 = torch.float64
WIDTHS = (128, 256, 512, 1024)
KINDS = ("tt", "low-rank")


def rms(t: torch.Tensor) -> float:
    return float(t.detach().pow(2).mean().sqrt())


def test_fan_ins_of_a_tt_linear_and_a_ttm_embedding_by_hand():
    # input cores read r_{k-1} * m_k numbers, output cores r_{k-1}; an embedding core only its incoming rank
    linear = [(1, 4, 3), (3, 8, 5), (5, 6, 2), (2, 7, 1)]
    assert core_fan_ins(linear, 2) == [4, 24, 5, 2]
    embedding = [(1, 10, 4, 6), (6, 20, 8, 1)]
    assert core_fan_ins(embedding, 0) == [1, 6]
    with pytest.raises(ValueError, match=r"num_input_cores must be in \[0, 2\]"):
        core_fan_ins(embedding, 3)


def test_fan_ins_accept_both_ends_of_the_input_core_range():
    # [0, len]: every core an output core, or every core an input core (each reads r_{k-1} * m_k)
    linear = [(1, 4, 3), (3, 8, 5), (5, 6, 1)]
    assert core_fan_ins(linear, 0) == [1, 3, 5]
    assert core_fan_ins(linear, 3) == [4, 24, 30]


def test_init_stds_and_rate_multipliers_follow_the_fan_in():
    assert mup_init_stds([4, 100], scale=3.0) == pytest.approx([0.5, 0.3])
    # scale multiplies the last core's std only (not the second's), and leaves every std at 1 / sqrt(f) by default
    assert mup_init_stds([4, 100, 16], scale=3.0) == pytest.approx([0.5, 0.1, 0.75])
    assert mup_init_stds([4, 100, 16]) == pytest.approx([0.5, 0.1, 0.25])
    # at or below the base fan-in a core learns at the group's rate; above it, proportionally slower
    assert mup_lr_scales([1, MUP_BASE_FAN_IN, 4 * MUP_BASE_FAN_IN]) == [1.0, 1.0, 0.25]
    with pytest.raises(ValueError, match="base must be >= 1"):
        mup_lr_scales([4], base=0)
    # the smallest base is allowed: a fan-in of 1 learns at the full rate, one of 4 at a quarter
    assert mup_lr_scales([1, 4], base=1) == [1.0, 0.25]


def test_init_cores_takes_one_std_or_one_per_core():
    shapes = [(1, 4, 3), (3, 5, 1)]
    with pytest.raises(ValueError, match=r"either std .* or stds"):
        init_cores(shapes, 0.1, stds=[0.1, 0.1])
    with pytest.raises(ValueError, match="stds gives 1 stds for 2 cores"):
        init_cores(shapes, stds=[0.1])
    cores = init_cores(shapes, stds=[2.0, 0.5], dtype=F64, generator=torch.Generator().manual_seed(0))
    assert [c.shape for c in cores] == [torch.Size(s) for s in shapes]


@pytest.mark.parametrize(("in_features", "out_features", "rank"), [(256, 1024, 16), (1024, 256, 64), (96, 120, 8)])
def test_a_mup_linear_keeps_the_rms_of_its_input(in_features, out_features, rank):
    torch.manual_seed(0)
    layer = TTLinear(in_features, out_features, rank, parameterization="mup", dtype=F64, bias=False)
    x = torch.randn(512, in_features, dtype=F64)
    # the chain of fan-in-scaled cores is Kaiming's init of the whole weight: Var W = 1 / M
    assert rms(layer(x)) == pytest.approx(1.0, rel=0.25)
    assert float(layer.weight_dense().std()) == pytest.approx(1 / math.sqrt(math.prod(layer.in_modes)), rel=0.25)


def test_init_std_sets_the_weight_std_under_mup_too():
    torch.manual_seed(0)
    layer = TTLinear(512, 512, 32, parameterization="mup", init_std=0.01, dtype=F64)
    assert float(layer.weight_dense().std()) == pytest.approx(0.01, rel=0.2)
    table = TTEmbedding(4096, 256, 16, parameterization="mup", init_std=0.5, dtype=F64)
    assert float(ttm_to_dense(list(table.cores)).std()) == pytest.approx(0.5, rel=0.2)


def test_a_mup_embedding_has_unit_entries_and_its_first_core_learns_at_the_full_rate():
    torch.manual_seed(0)
    table = TTEmbedding(4096, 256, 32, parameterization="mup", dtype=F64)
    assert float(ttm_to_dense(list(table.cores)).std()) == pytest.approx(1.0, rel=0.2)
    assert table.lr_scales[0] == 1.0


def test_standard_is_the_default_and_changes_nothing():
    torch.manual_seed(3)
    default = TTLinear(64, 128, 8)
    torch.manual_seed(3)
    standard = TTLinear(64, 128, 8, parameterization="standard")
    assert default.parameterization == "standard" and default.lr_scales == [1.0] * len(default.cores)
    for a, b in zip(default.cores, standard.cores, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the reconstructed weight keeps the paper's Glorot std
    assert float(tt_to_dense(list(default.cores), 2).std()) == pytest.approx(math.sqrt(1 / 192), rel=0.3)


def test_an_unknown_parameterization_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"parameterization must be one of \['standard', 'mup'\], got 'mu-p'"):
        TTLinear(64, 64, 8, parameterization="mu-p")
    with pytest.raises(ValueError, match=r"layer_config.parameterization must be one of"):
        LayerConfig(parameterization="muP")


def test_parameter_groups_carry_the_multipliers_and_gates_are_never_decayed():
    model = nn.Sequential(TTLinear(1024, 1024, 64, parameterization="mup"), TTLinear(64, 64, 4))
    groups = comera_parameter_groups(model, lr_cores=0.02, lr_gates=5e-3, lr_other=1e-3, weight_decay=0.1)
    by_name = {g["name"]: g for g in groups}
    rates = {id(p): g["lr"] for g in groups for p in g["params"]}
    layer = model[0]
    for core, scale in zip(layer.cores, layer.lr_scales, strict=True):
        assert rates[id(core)] == pytest.approx(0.02 * scale)
    assert min(layer.lr_scales) < 1.0  # the wide input cores learn slower
    assert by_name["cores"]["lr"] == 0.02 and all(
        id(c) in {id(p) for p in by_name["cores"]["params"]} for c in model[1].cores
    )
    assert by_name["gates"]["weight_decay"] == 0.0 and by_name["other"]["weight_decay"] == 0.1
    every = [p for g in groups for p in g["params"]]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))


def test_the_multipliers_survive_a_rank_cut_and_a_reload():
    torch.manual_seed(0)
    layer = TTLinear(512, 512, 32, parameterization="mup")
    scales = layer.lr_scales
    with torch.no_grad():
        for gate in layer.gates:
            gate[len(gate) // 2 :] = 0.0
    layer.refresh_masks_()
    layer.truncate_()
    assert layer.ranks != [1, 32, 32, 32, 32, 32, 1] and layer.lr_scales == scales
    fresh = TTLinear(512, 512, 32, parameterization="mup")
    fresh.load_state_dict(layer.state_dict())
    assert fresh.ranks == layer.ranks and fresh.lr_scales == scales


def test_layer_config_and_tensorize_build_mup_layers():
    factory = LayerFactory(LayerConfig(parameterization="mup", rank=8))
    assert factory.linear("fc", 256, 256).parameterization == "mup"
    assert factory.embedding("emb", 1000, 64).parameterization == "mup"
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    tensorize(model, rank=8, parameterization="mup")
    assert [m.parameterization for m in model if isinstance(m, TTLinear)] == ["mup", "mup"]


def coordinate_check(parameterization: str, kind: str, width: int, lr: float = 1e-2) -> dict[str, float]:
    """RMS of the hidden and output activations at init and of their change after 3 AdamW steps at ``lr``."""
    torch.manual_seed(0)
    low_rank = kind == "low-rank"
    rank = width // 4 if low_rank else width // 8
    up_modes = {"in_modes": [width], "out_modes": [4 * width]} if low_rank else {}
    down_modes = {"in_modes": [4 * width], "out_modes": [width]} if low_rank else {}
    up = TTLinear(width, 4 * width, rank, parameterization=parameterization, **up_modes)
    down = TTLinear(4 * width, width, rank, parameterization=parameterization, **down_modes)
    model = nn.Sequential(up, nn.GELU(), down)
    x, target = torch.randn(256, width), torch.randn(256, width)
    optimizer = torch.optim.AdamW(comera_parameter_groups(model, lr, lr, lr), weight_decay=0.0)
    with torch.no_grad():
        hidden0, out0 = up(x), model(x)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()
    with torch.no_grad():
        hidden1, out1 = up(x), model(x)
    changes = {"hidden_change": rms(hidden1 - hidden0), "output_change": rms(out1 - out0)}
    return {"hidden": rms(hidden0), "output": rms(out0), **changes}


def spread(values: list[float]) -> float:
    return max(values) / min(values)


@pytest.mark.parametrize("kind", KINDS)
def test_coordinate_check_is_flat_within_2x_from_width_128_to_1024_under_mup(kind):
    rows = [coordinate_check("mup", kind, w) for w in WIDTHS]
    for key in ("hidden", "output", "hidden_change", "output_change"):
        values = [r[key] for r in rows]
        assert spread(values) < 2.0, (key, values)
        assert min(values) > 0.1, (key, values)  # Theta(1): flat, not flat because it vanished


def test_under_the_standard_parameterisation_the_low_rank_update_grows_with_the_width():
    changes = [coordinate_check("standard", "low-rank", w)["output_change"] for w in WIDTHS]
    assert changes == sorted(changes) and spread(changes) > 4.0, changes


def coordinate_table() -> str:
    """The markdown table of every (parameterisation, layer kind, quantity) across the widths, with its spread."""
    widths = " | ".join(f"d {w}" for w in WIDTHS)
    lines = [f"| parameterisation | layers | RMS of | {widths} | largest / smallest |"]
    lines.append("|---" * (4 + len(WIDTHS)) + "|")
    torch.set_num_threads(1)
    for parameterization in ("standard", "mup"):
        for kind in KINDS:
            checks = [coordinate_check(parameterization, kind, w) for w in WIDTHS]
            for key in ("output", "hidden_change", "output_change"):
                values = [c[key] for c in checks]
                cells = [parameterization, kind, key.replace("_", " "), *(f"{v:.3f}" for v in values)]
                lines.append("| " + " | ".join([*cells, f"{spread(values):.2f}x"]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(coordinate_table())
