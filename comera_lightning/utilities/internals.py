"""The private names of Lightning and torch that this package relies on, one small function or class each.

The rest of the package uses public API of Lightning, Fabric, MLflow and torch, with two exceptions in ``nn/base.py``
(the TT layers cannot import from ``training/``): ``Module._load_from_state_dict``, the override point torch documents
for custom state-dict loading, and the inference cache's stamp, which reads ``Tensor._version`` (the in-place
counter autograd keeps; torch has no public one) and the ``_parameters`` / ``_buffers`` registries directly, as
the cheapest walk over a layer's tensors on every cached call (not measured against the public iterators). What
is here has no public equivalent; each entry says what it touches, why, and what to look at when an upgrade
breaks it. Checked against lightning 2.6.6 and torch 2.13.0 (mlflow 3.17.2: nothing private is used).

* ``ModelCheckpoint._should_remove_checkpoint`` (Lightning): :class:`RemovalPolicyCheckpoint`, for
  ``training.fault_tolerance``;
* ``ModelCheckpoint._monitor_candidates``, ``_save_topk_checkpoint`` and ``_last_global_step_saved`` (Lightning):
  :meth:`RemovalPolicyCheckpoint.save_now`, the pre-emption save of ``training.fault_tolerance``;
* ``DataLoader._index_sampler`` (torch.utils.data): :class:`IndexSamplerHook`, for ``data.common``;
* ``_hparams_initial`` of a module or datamodule (Lightning; ``HyperparametersMixin``, read only to log them):
  :func:`rename_logged_hparams`, for ``cli``;
* ``MLFlowLogger.__init__`` making its MlflowClient through ``mlflow.tracking.MlflowClient`` and storing it as
  ``_mlflow_client`` (Lightning): :func:`mlflow_logger_without_client`, for ``training.loggers``;
* ``torch._dynamo.utils.counters["frames"]`` (torch; the counter torch's own tests read) and
  ``Module._compiled_call_impl`` (torch.nn, set by ``Module.compile``): :func:`compiled_frame_count` and
  :func:`compiled_before`, for ``training.compile``;
* ``Module._buffers`` (torch.nn): :func:`buffer_slots`, for ``training.cuda_graphs``;
* ``_wrapped_by_lr_sched`` on ``optimizer.step`` (torch.optim.lr_scheduler): :func:`carry_scheduler_mark`, for
  ``training.cuda_graphs``;
* ``optimizer._opt_called`` (torch.optim.lr_scheduler): :func:`record_optimizer_step`, for ``training.cuda_graphs``;
* FSDP2's per-parameter state (``FSDPModule._get_fsdp_state``, ``FSDPParamGroup.fsdp_params``, ``FSDPParam``;
  torch.distributed.fsdp._fully_shard): :func:`reshard_fsdp_parameters_`, for
  :mod:`comera_lightning.strategies.resharding`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from typing_extensions import override

__all__ = [
    "IndexSamplerHook",
    "RemovalPolicyCheckpoint",
    "buffer_slots",
    "carry_scheduler_mark",
    "compiled_before",
    "compiled_frame_count",
    "mlflow_logger_without_client",
    "record_optimizer_step",
    "rename_logged_hparams",
    "reshard_fsdp_parameters_",
]


# --- Lightning ------------------------------------------------------------------------------------------
class RemovalPolicyCheckpoint(ModelCheckpoint):
    """A ModelCheckpoint whose choice to delete a superseded checkpoint file is :meth:`should_remove`.

    Lightning decides in the private ``ModelCheckpoint._should_remove_checkpoint(trainer, previous,
    current)`` (called for the top-k, last and best files alike), which among others never deletes the file
    the run resumed from; there is no public option for that.
    """

    def should_remove(self, trainer: Trainer, previous: str, current: str) -> bool:
        """Whether ``previous``, superseded by ``current``, is deleted (default: Lightning's choice)."""
        return super()._should_remove_checkpoint(trainer, previous, current)

    @override
    def _should_remove_checkpoint(self, trainer: Trainer, previous: str, current: str) -> bool:
        return self.should_remove(trainer, previous, current)

    def save_now(self, trainer: Trainer) -> bool:
        """Write this callback's top-k checkpoint for the current step now, off its schedule (every process
        must call it, as for any checkpoint); ``False`` when one was already written at this step.

        Lightning saves only on its ``every_n_*`` schedule; its top-k bookkeeping (file name, which old file
        to delete) lives in the private ``_monitor_candidates`` / ``_save_topk_checkpoint``, and
        ``_last_global_step_saved`` is the step it last wrote.
        """
        if self._last_global_step_saved == trainer.global_step:
            return False
        self._save_topk_checkpoint(trainer, self._monitor_candidates(trainer))
        self._last_global_step_saved = trainer.global_step
        return True


# --- torch ----------------------------------------------------------------------------------------------
class IndexSamplerHook(DataLoader):
    """A DataLoader whose iterators draw their indices from :meth:`wrap_index_sampler`'s result.

    Every DataLoader iterator (single- and multi-process) takes its indices from the private property
    ``DataLoader._index_sampler`` (the batch sampler, or the sampler without automatic batching) when it is
    created; wrapping it is the one place that changes which batches an epoch yields without changing the
    ``sampler``/``batch_sampler`` that Lightning inspects and re-creates under DDP.
    """

    def wrap_index_sampler(self, index_sampler: Any) -> Any:
        """What this loader's next iterator draws from, given the DataLoader's own index sampler."""
        return index_sampler

    @property
    @override
    def _index_sampler(self) -> Any:
        return self.wrap_index_sampler(super()._index_sampler)


def trainer_callbacks(trainer: Trainer) -> list[Callback]:
    """``trainer.callbacks``: Lightning sets it in its callback connector, where type checkers do not see it."""
    return trainer.callbacks  # type: ignore[attr-defined]


def rename_logged_hparams(owner: Any, renames: dict[str, str]) -> None:
    """Log ``owner``'s hyperparameters ``renames`` under new keys. Lightning reads ``_hparams_initial`` only to log
    the model's and the data's hyperparameters as one set (checkpoints keep ``hparams``, which is untouched)."""
    logged = owner._hparams_initial
    for old, new in renames.items():
        logged[new] = logged.pop(old)


@contextmanager
def mlflow_logger_without_client() -> Iterator[None]:
    """``MLFlowLogger`` built inside gets no MlflowClient (``_mlflow_client`` is None; set it before the first
    ``experiment``). Its ``__init__`` makes one at once, and MLflow 3's client opens its store, so a sqlite URI
    created the database file in every process, on every node, though only rank 0 logs.

    ``mlflow.tracking`` is imported whole first, so no MLflow module imported inside sees the stand-in; MLFlowLogger
    imports the name inside ``__init__``. Upgrade check: ``MLFlowLogger.__init__`` still ends with
    ``self._mlflow_client = MlflowClient(tracking_uri)`` and uses it nowhere else."""
    import mlflow.tracking

    made_by_init = mlflow.tracking.MlflowClient
    mlflow.tracking.MlflowClient = lambda *args, **kwargs: None  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        mlflow.tracking.MlflowClient = made_by_init  # type: ignore[misc]


def compiled_frame_count() -> int:
    """How many Python frames ``torch.compile`` has compiled in this process: it grows on a compiled module's first
    call, so an unchanged count after a step means its forward never ran (torch has no public count)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


def compiled_before(module: torch.nn.Module) -> bool:
    """Whether ``Module.compile`` was already called on ``module`` (torch may then run it from its cache, compiling
    no new frame)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def buffer_slots(module: torch.nn.Module) -> list[tuple[dict[str, torch.Tensor | None], str]]:
    """``(buffer dict, name)`` of every buffer of ``module`` and its submodules, ``None`` entries included.

    ``Module._buffers`` is the dict a buffer lives in; ``slot[0].get(slot[1])`` reads one in a dict lookup,
    which keeps :class:`~comera_lightning.callbacks.cuda_graphs.CudaGraphs`' per-step staleness check in tens of
    microseconds (``getattr(module, name)`` goes through ``Module.__getattr__``, and ``named_buffers`` skips
    ``None``).
    """
    return [(m._buffers, name) for m in module.modules() for name in m._buffers]


def carry_scheduler_mark(step: Callable[..., Any], original: Callable[..., Any]) -> None:
    """Mark ``step``, which replaces ``original`` as ``optimizer.step``, as the LR scheduler's wrapper if
    ``original`` was.

    torch's ``LRScheduler`` wraps ``optimizer.step`` in a function marked ``_wrapped_by_lr_sched``; its first
    ``step()`` warns that ``optimizer.step()`` was overridden when the mark is missing, and a scheduler created
    later does not wrap a marked function again.
    """
    if hasattr(original, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def record_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Record that ``optimizer`` stepped, as the LR scheduler's ``optimizer.step`` wrapper does
    (``optimizer._opt_called``; without it the scheduler's first ``step()`` warns that it was called before
    ``optimizer.step()``), for a step that replayed a CUDA graph instead of calling the wrapper."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def reshard_fsdp_parameters_(
    root: torch.nn.Module, new_values: dict[torch.nn.Parameter, torch.Tensor]
) -> dict[torch.nn.Parameter, torch.nn.Parameter]:
    """Give parameters that ``fully_shard`` manages new full values, of other shapes; returns old -> new parameter.

    FSDP2 fixes a parameter's shape, padding and sharding when ``fully_shard`` runs (one ``FSDPParam`` per
    parameter, kept in the module's ``FSDPParamGroup``) and has no public way to change it. This builds a fresh
    ``FSDPParam`` from the new value with the old one's module, mesh and mixed-precision settings, as
    ``fully_shard`` would, and puts it in the old one's place (it sets the new sharded ``nn.Parameter`` on the
    module); the buffers FSDP2 allocates per step follow the new sizes. Call it on every process, between
    steps, with the same values. Parameters not managed by FSDP2 are left alone (not in the result). If an
    upgrade breaks it: compare with ``FSDPParamGroup.__init__`` and ``FSDPParam.__init__``.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    mapping: dict[torch.nn.Parameter, torch.nn.Parameter] = {}
    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for i, old in enumerate(group.fsdp_params):
                value = new_values.get(old.sharded_param)
                if value is None:
                    continue
                old._post_load_hook_handle.remove()
                new = FSDPParam(
                    torch.nn.Parameter(value, requires_grad=old.sharded_param.requires_grad),
                    old._module_info,
                    old.mesh_info,
                    old.post_forward_mesh_info,
                    old.device,
                    None,
                    old.mp_policy,
                    group.offload_policy,
                )
                new._param_fqn = old._param_fqn
                new.init_dtype_attrs(group.mp_policy)
                group.fsdp_params[i] = new
                mapping[old.sharded_param] = new.sharded_param
    return mapping
