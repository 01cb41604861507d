"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for any model: which modules to shard, and parameters that
change shape in the middle of training.

FSDP2 shards every parameter of a sharded module on dim 0 across the data-parallel processes and holds it as a
``DTensor``; a module's parameters are gathered just before its forward and freed after it. One ``fully_shard``
per transformer block (and per embedding table and head) keeps only one block's full weights alive at a time.
Nothing here knows of tensor trains: :mod:`comera_lightning.strategies` builds CoMERA's cuts on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..utilities.internals import reshard_fsdp_parameters_

__all__ = [
    "as_parameter_like",
    "default_shard_units",
    "fully_shard_model",
    "replace_in_optimizers_",
    "reshard_parameters_",
    "unsharded_class",
]


def default_shard_units(
    model: nn.Module, leaf_types: Sequence[type[nn.Module]] = (nn.Embedding, nn.Linear)
) -> list[str]:
    """Names of the modules to shard one by one, deepest first: every entry of an ``nn.ModuleList`` (transformer
    blocks, DLRM's tables and MLP layers), every module of ``leaf_types`` outside those (embeddings, heads), and every
    other module that holds parameters of its own (norms).

    Each parameter then belongs to the smallest such module whose forward uses it, so the model works when its
    training step calls submodules directly (``self.model.encoder(...)``) rather than the root's forward, which
    is the only place FSDP2 gathers the root's own parameters. A module whose parameters are shared with modules
    outside it (tied embeddings and heads) is left to its parent, as FSDP2 refuses a parameter in two units.
    """
    leaves = tuple(leaf_types)
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1

    def self_contained(module: nn.Module, recurse: bool = True) -> bool:
        inside: dict[int, int] = {}
        for _, p in module.named_parameters(recurse=recurse, remove_duplicate=False):
            inside[id(p)] = inside.get(id(p), 0) + 1
        return bool(inside) and all(uses[i] == n for i, n in inside.items())

    def within(name: str, units: list[str]) -> bool:
        return any(name == u or name.startswith(u + ".") for u in units)

    modules = dict(model.named_modules())
    units: list[str] = []
    for name, module in modules.items():
        if isinstance(module, nn.ModuleList) and not within(name, units):
            units += [f"{name}.{child}" if name else child for child, m in module.named_children() if self_contained(m)]
    for name, module in modules.items():
        if name and not within(name, units) and isinstance(module, leaves) and self_contained(module):
            units.append(name)
    for name, module in modules.items():
        lists = isinstance(module, (nn.ParameterList, nn.ParameterDict))  # their parameters serve the parent's forward
        if name and not lists and not within(name, units) and self_contained(module, recurse=False):
            units.append(name)  # a norm, or a module with parameters of its own besides its units
    return sorted(units, key=lambda n: -n.count("."))  # FSDP2 shards a module's children before the module


def fully_shard_model(model: nn.Module, mesh: DeviceMesh, units: Iterable[str] | None = None) -> list[str]:
    """``fully_shard`` each unit of ``model`` (names; default :func:`default_shard_units`), then the model itself
    for what is left; returns the units. Already sharded models are left as they are."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(model, FSDPModule):
        return []
    names = default_shard_units(model) if units is None else list(units)
    modules = dict(model.named_modules())
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(
            f"fully_shard_model: no submodule named {unknown} in {type(model).__name__}; name units "
            f"as model.named_modules() does, e.g. {list(modules)[1:4]}"
        )
    for name in names:
        fully_shard(modules[name], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return names


def unsharded_class(module: nn.Module) -> type:
    """The module's own class: ``fully_shard`` changes it to a subclass of ``FSDPModule`` made on the fly."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))


def as_parameter_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor, identical on every process) sharded as ``like`` is, or itself if ``like`` is plain."""
    if isinstance(like, DTensor):
        return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    return value


def reshard_parameters_(
    model: nn.Module, new_values: dict[nn.Parameter, torch.Tensor]
) -> dict[nn.Parameter, nn.Parameter]:
    """Replace sharded parameters of ``model`` by new full values, of other shapes; returns old -> new parameter.

    The new parameters are sharded as ``fully_shard`` would shard them and sit where the old ones were (so
    ``module.weight`` and ``ParameterList`` entries see them); optimisers still hold the old objects: pass the
    result to :func:`replace_in_optimizers_`. Gradients are dropped. A collective: call it on every process at
    the same point, between steps, with identical values. Every key must be a parameter ``fully_shard`` manages.
    """
    mapping = reshard_fsdp_parameters_(model, new_values)
    missing = [tuple(p.shape) for p in new_values if p not in mapping]
    if missing:
        raise ValueError(
            f"reshard_parameters_: {len(missing)} parameters (shapes {missing[:4]}) are not sharded by "
            "fully_shard in this model; shard the model first (comera_lightning.strategies.shard_model)"
        )
    return mapping


def replace_in_optimizers_(
    optimizers: Iterable[torch.optim.Optimizer],
    mapping: dict[nn.Parameter, nn.Parameter],
    convert_state: Callable[[nn.Parameter, nn.Parameter, torch.Tensor], torch.Tensor],
) -> None:
    """Point optimisers at the new parameters of ``mapping`` (old -> new), moving each parameter's state with it.

    ``convert_state(old, new, value)`` turns every per-parameter state tensor shaped like ``old`` (AdamW's moments)
    into one shaped and sharded like ``new``; other state (AdamW's ``step``) moves unchanged.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(p, p) for p in group["params"]]
        for old, new in mapping.items():
            state = optimizer.state.pop(old, None)
            if not state:
                continue
            optimizer.state[new] = {
                key: convert_state(old, new, value)
                if torch.is_tensor(value) and value.dim() == old.dim() and value.shape == old.shape
                else value
                for key, value in state.items()
            }
