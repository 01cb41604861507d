"""The shared machinery of TTLinear / TTEmbedding (comera_lightning.nn.base, .distributed): where gates and masks
live, what a subclass gets by default, the checkpoint shape checks and their messages, plain factor lists, and
sharded (DTensor) values."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from helpers.nn_reference import F64, reference_embedding_table, reference_linear_weight
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from comera_lightning.nn import TTEmbedding, TTLinear
from comera_lightning.nn.base import TTLayer
from comera_lightning.nn.distributed import full_tensor

LAYERS = {
    "linear": lambda **kw: TTLinear(24, 12, 4, in_modes=[2, 3, 4], out_modes=[3, 4], **kw),
    "embedding": lambda **kw: TTEmbedding(24, 8, 4, vocab_modes=[2, 3, 4], dim_modes=[2, 2, 2], **kw),
}


# --- gates and masks ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", LAYERS)
def test_gates_are_float32_and_gates_and_masks_live_on_the_cores_device(kind):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F64)  # the cores take the default dtype; the gates stay float32 whatever it is
    try:
        layer = LAYERS[kind](device="meta")
    finally:
        torch.set_default_dtype(previous)
    assert all(c.device.type == "meta" and c.dtype == F64 for c in layer.cores)
    assert [(g.device.type, g.dtype) for g in layer.gates] == [("meta", torch.float32)] * layer.num_bonds
    assert [(m.device.type, m.dtype) for m in layer.rank_masks] == [("meta", torch.bool)] * layer.num_bonds


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_masks_reset_to_new_ranks_are_all_active_on_the_layers_device(device):
    layer = LAYERS["linear"](device=device)
    ranks = [1, 2, 3, 2, 1, 1]
    with torch.no_grad():  # what a sharded cut does: it resizes the parameters itself, then resets the masks
        for k, core in enumerate(layer.cores):
            core.data = core.data.new_zeros(ranks[k], core.shape[1], ranks[k + 1])
        for k, gate in enumerate(layer.gates):
            gate.data = gate.data.new_ones(ranks[k + 1])
    layer.reset_masks_to_ranks_(ranks[1:-1])
    assert layer.ranks == ranks
    assert [(m.device.type, m.dtype, tuple(m.shape)) for m in layer.rank_masks] == [
        (device, torch.bool, (r,)) for r in ranks[1:-1]
    ]
    if device == "cpu":
        assert layer.active_ranks == ranks


def test_a_layer_without_bonds_has_nothing_to_reset_or_cut():
    layer = TTEmbedding(20, 6, 4, vocab_modes=[20], dim_modes=[6], dtype=F64)  # one core: no bond, no gate
    assert layer.ranks == [1, 1] and layer.num_bonds == 0
    layer.reset_masks_after_truncation_()
    assert layer.truncate_() == [] and layer.rank_masks == [] and layer.ranks == [1, 1]
    ids = torch.tensor([0, 7, 19])
    torch.testing.assert_close(layer(ids), reference_embedding_table(layer)[ids], rtol=1e-12, atol=1e-12)


# --- what a subclass gets ---------------------------------------------------------------------------------------
class _Chain(TTLayer):
    """The least a subclass does: its cores through ``_init_train``, without the optional arguments."""

    def __init__(self) -> None:
        super().__init__()
        self._init_train([torch.randn(1, 3, 2, dtype=F64), torch.randn(2, 5, 1, dtype=F64)], 0.01, [1, 3, 1])

    @property
    def dense_parameters(self) -> int:
        return 15


def test_a_subclass_defaults_to_the_standard_parameterization_with_unit_lr_scales():
    layer = _Chain()
    assert layer.parameterization == "standard"
    assert layer.lr_scales == [1.0, 1.0]
    assert layer.ranks == [1, 2, 1] and layer.active_ranks == [1, 2, 1]
    assert layer.allocated_parameters() == 3 * 2 + 2 * 5


def test_to_empty_without_recursion_leaves_the_cores_and_gates_alone():
    torch.manual_seed(0)
    layer = LAYERS["linear"](dtype=F64)
    cores = [(c.data_ptr(), c.detach().clone()) for c in [*layer.cores, *layer.gates]]
    bias = layer.bias.data_ptr()
    layer.to_empty(device="cpu", recurse=False)  # the layer's own tensors (bias, masks) only
    assert layer.bias.data_ptr() != bias
    for param, (pointer, value) in zip([*layer.cores, *layer.gates], cores, strict=True):
        assert param.data_ptr() == pointer
        torch.testing.assert_close(param.detach(), value, rtol=0, atol=0)


# --- checkpoints -----------------------------------------------------------------------------------------------
def _model(in_modes: list[int]) -> nn.Module:
    return nn.Sequential(OrderedDict(proj=TTLinear(24, 12, 4, in_modes=in_modes, out_modes=[3, 4], dtype=F64)))


def test_loading_cores_of_other_modes_names_the_core_and_both_mode_sizes():
    model, other = _model([2, 3, 4]), _model([2, 4, 3])
    with pytest.raises(
        ValueError,
        match=r"checkpoint core proj\.cores\.1 has mode sizes \(4,\) but this layer has \(3,\): the checkpoint is "
        r"from a different architecture; build the model with the modes the checkpoint was trained with",
    ):
        model.load_state_dict(other.state_dict())


def test_check_core_shapes_without_a_prefix_names_the_bare_core():
    layer, other = _model([2, 3, 4]).proj, _model([2, 4, 3]).proj
    assert layer.check_core_shapes([tuple(c.shape) for c in layer.cores]) == layer.ranks
    with pytest.raises(ValueError, match=r"^checkpoint core cores\.1 has mode sizes \(4,\) but this layer has \(3,\)"):
        layer.check_core_shapes([tuple(c.shape) for c in other.cores])


# --- factors from tensorly or a plain list -------------------------------------------------------------------------
def test_from_tensorly_takes_a_plain_list_of_factors():
    torch.manual_seed(0)
    linear = LAYERS["linear"](dtype=F64)
    rebuilt = TTLinear.from_tensorly([c.detach().numpy() for c in linear.cores], 3, in_features=24, out_features=12)
    assert (rebuilt.in_modes, rebuilt.out_modes, rebuilt.ranks) == ([2, 3, 4], [3, 4], linear.ranks)
    torch.testing.assert_close(reference_linear_weight(rebuilt), reference_linear_weight(linear), rtol=1e-12, atol=0)
    embedding = LAYERS["embedding"](dtype=F64)
    again = TTEmbedding.from_tensorly([c.detach() for c in embedding.cores])
    assert (again.vocab_modes, again.dim_modes, again.ranks) == ([2, 3, 4], [2, 2, 2], embedding.ranks)
    torch.testing.assert_close(
        reference_embedding_table(again), reference_embedding_table(embedding), rtol=1e-12, atol=0
    )


# --- sharded values -------------------------------------------------------------------------------------------------
@pytest.fixture
def one_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already set up")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_full_tensor_of_a_sharded_value_is_the_plain_whole_value(one_process_group):
    value = torch.randn(4, 3, dtype=F64)
    sharded = distribute_tensor(value, one_process_group, [Shard(0)])
    whole = full_tensor(sharded)
    assert not isinstance(whole, DTensor)
    torch.testing.assert_close(whole, value, rtol=0, atol=0)


def test_the_layers_default_ranks_and_lookup():
    # rank 30 for a linear and 32 for an embedding where the modes allow it; an embedding looks up every id as given
    def bonds(layer: TTLinear | TTEmbedding) -> list[int]:
        return [int(core.shape[-1]) for core in layer.cores[:-1]]

    linear = TTLinear(1024, 1024, in_modes=[32, 32], out_modes=[32, 32])
    embedding = TTEmbedding(1024, 1024, vocab_modes=[32, 32], dim_modes=[32, 32])
    assert bonds(linear) == [30, 30, 30] and bonds(embedding) == [32]
    assert embedding.deduplicate is False
    from_linear, _ = TTLinear.from_linear(nn.Linear(1024, 1024), in_modes=[32, 32], out_modes=[32, 32])
    from_embedding, _ = TTEmbedding.from_embedding(nn.Embedding(1024, 1024), vocab_modes=[32, 32], dim_modes=[32, 32])
    assert bonds(from_linear) == [30, 30, 30] and bonds(from_embedding) == [32]
