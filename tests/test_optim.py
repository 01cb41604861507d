"""OptimConfig: one options object per task for the learning rates and schedule, stored plain in checkpoints."""

from itertools import pairwise

import pytest
import torch
from torch import nn

from comera_lightning.lit import CausalLM, ClickThrough, MaskedLM, SequenceClassification
from comera_lightning.nn import TTLinear
from comera_lightning.optim import OptimConfig, comera_parameter_groups

TINY_ENCODER = dict(vocab_size=64, d_model=16, num_heads=2, d_ff=32, num_layers=1, max_len=8)
TASKS = {
    "classification": (SequenceClassification, dict(TINY_ENCODER, num_classes=3)),
    "mlm": (MaskedLM, TINY_ENCODER),
    "causal_lm": (CausalLM, TINY_ENCODER),
    "ctr": (ClickThrough, dict(num_dense=3, table_sizes=[1000, 1200], embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[8])),
}


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(lr_gates=0.0), r"optim.lr_gates must be > 0"),
        (dict(schedule="step"), r"optim.schedule must be 'constant', 'linear' or 'cosine'"),
        (dict(warmup_steps=-1), r"optim.warmup_steps and optim.weight_decay must be >= 0"),
    ],
)
def test_bad_options_are_refused_with_their_name(bad, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**bad)


def test_a_mapping_is_checked_key_by_key():
    assert OptimConfig.of({"lr_gates": 0.2}) == OptimConfig(lr_gates=0.2)
    assert OptimConfig.of(None) == OptimConfig()
    with pytest.raises(ValueError, match=r"unknown optim option\(s\) \['lr_gate'\]"):
        OptimConfig.of({"lr_gate": 0.2})
    with pytest.raises(TypeError, match="optim must be a OptimConfig or a mapping"):
        OptimConfig.of(0.2)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_stores_optim_plain_rebuilds_from_it_and_refuses_flat_options(name, tmp_path):
    task_class, architecture = TASKS[name]
    task = task_class(**architecture, optim=OptimConfig(lr_cores=3e-3, lr_gates=0.2, warmup_steps=4))
    assert task.hparams["optim"] == OptimConfig(lr_cores=3e-3, lr_gates=0.2, warmup_steps=4).to_dict()
    path = tmp_path / "hparams.pt"
    torch.save({"hyper_parameters": dict(task.hparams)}, path)
    rebuilt = task_class(**torch.load(path, weights_only=True)["hyper_parameters"])  # plain values only
    assert rebuilt.optim == task.optim
    optimizer = rebuilt.configure_optimizers()["optimizer"]
    lrs = {group["name"]: group["initial_lr"] for group in optimizer.param_groups}
    assert lrs["gates"] == 0.2 and lrs["other"] == OptimConfig().lr_other
    with pytest.raises(
        ValueError,
        match=r"\['lr_gates'\] are optim options: pass them inside optim .*"
        r"--model.optim.lr_gates",
    ):
        task_class(**architecture, lr_gates=0.2)


def test_a_task_without_optim_takes_its_own_defaults_also_under_a_partial_override():
    assert MaskedLM(**TINY_ENCODER).optim == OptimConfig()
    ctr_task, ctr_architecture = TASKS["ctr"]
    assert ctr_task(**ctr_architecture).optim == OptimConfig(lr_cores=1e-3, lr_gates=1e-3, lr_other=1e-3)
    # one option on the command line keeps the task's other defaults
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    parser = ArgumentParser()
    parser.add_subclass_arguments(LightningModule, "model")
    config = parser.parse_args(
        ["--model=ClickThrough", "--model.table_sizes=[1000, 1200]", "--model.optim.lr_gates=0.2"]
    )
    task = parser.instantiate(config).model
    assert task.optim == OptimConfig(lr_cores=1e-3, lr_gates=0.2, lr_other=1e-3)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_ends_at_final_lr_ratio_of_the_peak(schedule):
    from comera_lightning.lit.base import warmup_decay_factor

    factors = [warmup_decay_factor(step, 10, 110, schedule, 0.1) for step in range(120)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)  # the linear warmup
    assert factors[10] == pytest.approx(1.0) and factors[110] == pytest.approx(0.1) == factors[119]
    assert all(a >= b for a, b in pairwise(factors[10:]))  # monotone decay
    midpoint = 0.55 if schedule == "linear" else 0.1 + 0.9 * 0.5  # both halfway between 1 and 0.1
    assert factors[60] == pytest.approx(midpoint)
    assert warmup_decay_factor(110, 10, 110, schedule) == pytest.approx(0.0)  # the default decays to zero


def test_every_schedule_and_both_ends_of_final_lr_ratio_are_accepted():
    for schedule in ("constant", "linear", "cosine"):
        assert OptimConfig(schedule=schedule).schedule == schedule
    assert OptimConfig(final_lr_ratio=0.0).final_lr_ratio == 0.0
    assert OptimConfig(final_lr_ratio=1.0).final_lr_ratio == 1.0  # no decay


def test_parameter_groups_default_to_the_papers_rates_in_a_fixed_order():
    model = nn.Sequential(TTLinear(1024, 1024, 64, parameterization="mup"), TTLinear(64, 64, 4), nn.Linear(64, 64))
    assert sorted(set(model[0].lr_scales)) == [0.25, 1.0]
    groups = comera_parameter_groups(model)
    # a checkpoint's optimiser state is matched to the groups by position: cores by falling multiplier (each group
    # recording it), then the gates (never decayed), then the rest
    assert [g["name"] for g in groups] == ["cores", "cores*0.25", "gates", "other"]
    assert [g.get("lr_scale") for g in groups] == [1.0, 0.25, None, None]
    assert [g["lr"] for g in groups] == pytest.approx([1e-4, 0.25e-4, 1e-3, 5e-5])
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0, 0.0, 0.0]


def test_final_lr_ratio_outside_zero_one_is_refused():
    with pytest.raises(ValueError, match=r"final_lr_ratio .* in \[0, 1\]; got 1.5"):
        OptimConfig(final_lr_ratio=1.5)


def test_weight_decay_shrinks_cores_and_other_parameters_but_never_the_gates():
    torch.manual_seed(0)
    task = MaskedLM(**TINY_ENCODER, optim=OptimConfig(lr_cores=0.1, lr_gates=0.1, lr_other=0.1, weight_decay=0.5))
    optimizer = task.configure_optimizers()
    names = {id(p): name for name, p in task.named_parameters()}
    before = {name: p.detach().clone() for name, p in task.named_parameters()}
    assert any(".gates." in name for name in before) and any(".cores." in name for name in before)
    for p in task.parameters():
        p.grad = torch.zeros_like(p)  # a step of decay alone: AdamW moves a parameter by lr * weight_decay * p
    optimizer.step()
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names[id(p)]
            decayed = before[name] if ".gates." in name else before[name] * (1 - 0.1 * 0.5)
            torch.testing.assert_close(p.detach(), decayed, rtol=1e-6, atol=0, msg=name)


def test_a_frozen_parameter_is_in_no_group():
    # a part the user froze (a pretrained encoder, say) stays out of the optimiser: unfreezing it later does not
    # quietly train it with stale moments, and AdamW keeps no state for it
    model = nn.Sequential(nn.Linear(8, 8), TTLinear(8, 8, rank=2), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    grouped = {id(p) for group in comera_parameter_groups(model) for p in group["params"]}
    assert not any(id(p) in grouped for p in model[0].parameters())
    assert all(id(p) in grouped for p in [*model[1].parameters(), *model[2].parameters()])


def test_the_options_default_to_the_papers_setup():
    # AdamW at 1e-4 (cores), 1e-3 (gates), 5e-5 (the rest), no decay, no warmup, constant rates
    assert OptimConfig() == OptimConfig(
        lr_cores=1e-4, lr_gates=1e-3, lr_other=5e-5, weight_decay=0.0, warmup_steps=0, schedule="constant"
    )
    assert OptimConfig().final_lr_ratio == 0.0
