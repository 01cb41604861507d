"""CoMERA under FSDP2: sharded models whose ranks shrink while they train.

Lightning's ``ModelParallelStrategy`` runs FSDP2 (``fully_shard``) on the model that ``configure_model`` shards.
Two pieces make CoMERA work under it:

* :func:`shard_model`, the one call for ``configure_model``: one ``fully_shard`` per transformer block, embedding
  table and head (and TT layer outside a block) on the strategy's data-parallel mesh; nothing without a mesh (DDP,
  one device), so the same module runs everywhere. The project's tasks call it; a user's module adds it.
* :class:`FSDP2Strategy`, the strategy that owns the reshard a cut needs. A physical cut changes the cores' and
  gates' shapes, which FSDP2 fixed when it sharded them: the strategy gathers each affected parameter, slices it,
  shards the smaller tensor afresh, and moves the optimiser's moments along (gathered, sliced, resharded), so the
  memory a cut frees is freed on every process during training. A sharded checkpoint folder (Lightning's
  distributed checkpoint) loads into a model built at its initial ranks: before loading, the strategy reads the
  checkpoint's core shapes and resizes the layers the same way.

Rank adaptation itself (penalty, masks, decisions) works on the full values of the tiny gate vectors, which every
process gathers alike (:mod:`comera_lightning.nn.distributed`), so all processes decide the same; the cut itself is
:func:`comera_lightning.rank_adaptation.cuts.cut_sharded_`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn
from typing_extensions import override

from ..nn.base import TruncationRecord, TTLayer
from ..nn.tensorize import tt_layers
from ..rank_adaptation.cuts import cut_sharded_
from ..tt.rank import CoreSelection
from .resharding import (
    as_parameter_like,
    default_shard_units,
    fully_shard_model,
    replace_in_optimizers_,
    reshard_parameters_,
)

__all__ = ["FSDP2Strategy", "checkpoint_shapes", "data_parallel_mesh", "shard_model"]


def data_parallel_mesh(module: LightningModule) -> Any | None:
    """The data-parallel device mesh of the module's ``ModelParallelStrategy``, or None outside one."""
    mesh = getattr(module, "_device_mesh", None)  # LightningModule.device_mesh, without its error outside a trainer
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"CoMERA shards with FSDP2 only (data parallel); this ModelParallelStrategy asks for tensor parallelism of "
            f"size {mesh['tensor_parallel'].size()}. Use comera_lightning.strategies.FSDP2Strategy() (all processes "
            "data parallel), or ModelParallelStrategy(data_parallel_size=<processes>, tensor_parallel_size=1)"
        )
    return mesh["data_parallel"] if "data_parallel" in names else mesh


def shard_model(module: LightningModule, units: Iterable[str] | None = None) -> list[str]:
    """FSDP2-shard ``module`` when it runs under ``ModelParallelStrategy``; call it from ``configure_model``.

    Args:
        module: the LightningModule (``self`` in ``configure_model``).
        units: names of the submodules to shard one by one (as ``named_modules()`` gives them); default: every
            entry of an ``nn.ModuleList`` (transformer blocks), then every TT layer, ``nn.Embedding`` and
            ``nn.Linear`` outside those. The module itself is sharded last, for the rest.

    Returns:
        the sharded units; empty under DDP or on one device (no mesh), and when already sharded.
    """
    mesh = data_parallel_mesh(module)
    if mesh is None:
        return []
    if units is None:
        units = default_shard_units(module, leaf_types=(TTLayer, nn.Embedding, nn.Linear))
    return fully_shard_model(module, mesh, units)


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model state in a checkpoint: a distributed checkpoint folder (its metadata;
    no tensor is read) or a ``.ckpt`` file (memory-mapped)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not Path(path).is_dir():
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("state_dict", {})
        return {key: tuple(value.shape) for key, value in state.items() if torch.is_tensor(value)}
    prefix = "state_dict."
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        key[len(prefix) :]: tuple(value.size)
        for key, value in metadata.items()
        if key.startswith(prefix) and isinstance(value, TensorStorageMetadata)
    }


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` for CoMERA: FSDP2 over all processes, physical rank cuts resharded, sharded
    checkpoints with changed ranks loaded.

    Args:
        data_parallel_size: processes that shard the model; ``"auto"``: all of them (nodes x devices).
        tensor_parallel_size: must stay 1 (CoMERA's TT layers have no tensor-parallel plan).
        save_distributed_checkpoint: must stay True (checkpoints are folders: every process writes its shards).
        process_group_backend, timeout: as ``ModelParallelStrategy``.

    The LightningModule must shard itself in ``configure_model`` (:func:`shard_model`; the project's tasks do).
    """

    strategy_name = "comera_fsdp2"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not save_distributed_checkpoint:
            raise ValueError(
                "FSDP2Strategy saves distributed checkpoints (a folder per checkpoint, each process writing its "
                "shards); for one file, consolidate one with comera_lightning.utilities.checkpoint_io.read_checkpoint "
                "or export the model with `comera export`"
            )
        if tensor_parallel_size not in (1, "auto"):
            raise ValueError(
                f"FSDP2Strategy shards data parallel only: tensor_parallel_size must be 1, got {tensor_parallel_size}"
            )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            **kwargs,
        )

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    # --- cuts ----------------------------------------------------------------------------------------
    def truncate_layers_(self, layers: Sequence[TTLayer], min_dead_fraction: float) -> TruncationRecord:
        """Remove the masked slices of every layer with at least ``min_dead_fraction`` of some bond masked, resharding
        the resized parameters and their optimiser state; returns ``(old parameter, selection)`` pairs."""
        return cut_sharded_(layers, min_dead_fraction, self._resize)

    def _resize(self, new_values: dict[nn.Parameter, torch.Tensor], convert: Any) -> None:
        """Reshard parameters to new full values; ``convert(old, state)`` gives each moment's new full value."""
        assert self.model is not None
        mapping = reshard_parameters_(self.model, new_values)
        replace_in_optimizers_(
            self.optimizers, mapping, lambda old, new, value: as_parameter_like(convert(old, value), new)
        )
        for layer in {id(m): m for m in self.model.modules() if isinstance(m, TTLayer)}.values():
            layer.clear_inference_cache()

    # --- checkpoints ---------------------------------------------------------------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # the model was sharded at its initial ranks; a checkpoint saved after cuts (sharded, or a .ckpt file of a
        # DDP or one-process run) has smaller cores
        path = Path(self.broadcast(checkpoint_path))
        self.adopt_checkpoint_ranks_(checkpoint_shapes(path))
        if path.is_dir():
            return super().load_checkpoint(path, weights_only=weights_only)
        return self._load_full_checkpoint(path, weights_only)

    def _load_full_checkpoint(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """A ``.ckpt`` file of a DDP or one-process run into the sharded model and optimisers.

        Such a file numbers the optimiser state by the optimiser's parameter groups (CoMERA's: cores, gates, the
        rest); Lightning's own loader would number it by ``model.parameters()`` and give moments to the wrong
        parameters, so the state is keyed by parameter names here, in the groups' order.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None and self.lightning_module is not None
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(
            self.model, checkpoint.pop("state_dict"), options=StateDictOptions(full_state_dict=True, strict=strict)
        )
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", []), strict=False):
            set_optimizer_state_dict(
                self.model,
                optimizer,
                optim_state_dict=self._named(optimizer, state),
                options=StateDictOptions(full_state_dict=True, strict=strict),
            )
        return checkpoint

    def _named(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        """An optimiser state dict numbered by ``optimizer``'s parameter groups, keyed by parameter names instead."""
        assert self.model is not None
        names = {id(p): name for name, p in self.model.named_parameters()}
        ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        return {
            "state": {ordered[i]: value for i, value in state["state"].items()},
            "param_groups": [
                {**group, "params": [ordered[i] for i in group["params"]]} for group in state["param_groups"]
            ],
        }

    def adopt_checkpoint_ranks_(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Resize (and reshard) every TT layer whose cores have other shapes in ``shapes`` (a checkpoint's), so the
        checkpoint's tensors load into it; values are left for the load to fill."""
        assert self.lightning_module is not None
        record = TruncationRecord()
        new_values: dict[nn.Parameter, torch.Tensor] = {}
        resized = []
        for name, layer in tt_layers(self.lightning_module):
            found = [shapes.get(f"{name}.cores.{k}") for k in range(len(layer.cores))]
            incoming = [tuple(s) for s in found if s is not None]
            if len(incoming) < len(found) or incoming == [tuple(c.shape) for c in layer.cores]:
                continue
            ranks = layer.check_core_shapes(incoming, f"{name}.")
            for core, shape in zip(layer.cores, incoming, strict=True):
                new_values[core] = torch.zeros(shape, dtype=core.dtype, device=core.device)
            for gate, rank in zip(layer.gates, ranks[1:-1], strict=True):
                new_values[gate] = torch.ones(rank, dtype=gate.dtype, device=gate.device)
            record.extend((p, CoreSelection(None, None)) for p in [*layer.cores, *layer.gates])
            resized.append((layer, ranks))
        if not record:
            return
        # a checkpoint loads both the weights and the optimiser state: the fresh state here is only a placeholder
        self._resize(new_values, lambda old, value: torch.zeros_like(new_values[old]))
        for layer, ranks in resized:
            layer.reset_masks_to_ranks_(ranks[1:-1])


if FSDP2Strategy.strategy_name not in StrategyRegistry:  # ``--trainer.strategy comera_fsdp2`` on any LightningCLI
    StrategyRegistry.register(
        FSDP2Strategy.strategy_name,
        FSDP2Strategy,
        description="FSDP2 over all processes, with CoMERA's rank cuts resharded",
    )
