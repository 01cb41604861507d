"""Tensorize: CoMERA from the trainer side, on a LightningModule whose code knows nothing of it.

Like Lightning's ``ModelPruning``, the callback changes the model: at ``setup``, before optimisers exist and before a
checkpoint is restored, it calls :func:`~comera_lightning.nn.tensorize` on the LightningModule with its own
arguments, so ``configure_optimizers`` sees the TT cores and gates, and a resumed checkpoint's ranks load into the
new layers (each layer adopts smaller, truncated cores). The arguments travel in the checkpoint twice: in the
module's state-dict metadata, where :func:`comera_lightning.load_from_checkpoint` finds them, and in this callback's
state with the layers' ranks. A resumed fit rebuilds the structure the checkpoint holds (also layers swapped by hand
besides the callback's); a callback given other arguments than the checkpoint was made with stops the restore with
an error naming both.

Usage::

    trainer = Trainer(callbacks=[Tensorize(rank=16, min_features=64), RankAdaptation(), RankMonitor()])
    # any LightningCLI:  --trainer.callbacks+=comera_lightning.callbacks.Tensorize --trainer.callbacks.rank=16
    # or the fragment:   --config callbacks/tensorize.yaml

Under ``strategy="ddp_spawn"`` the layers are swapped in the worker processes: the model object in the launching
process stays dense after ``fit`` (Lightning loads the workers' weights into it non-strictly); reload the
checkpoint with :func:`comera_lightning.load_from_checkpoint` instead. ``strategy="ddp"`` has no such gap.
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from ..nn.tensorize import (
    TensorizeOptions,
    TensorizeRecord,
    tensorize_like,
    tensorize_options,
    tensorize_specs,
    tt_layers,
)

__all__ = ["Tensorize"]


# tensorize()'s arguments the callback reports by name (its checkpoint state's "arguments"); the rest are layer
# arguments ("layer_kwargs")
_NAMED = ("rank", "min_features", "include", "exclude", "linears", "embeddings", "embedding_rank", "decompose")


class Tensorize(Callback):
    """Replace a LightningModule's large ``nn.Linear`` / ``nn.Embedding`` by comera layers at setup.

    Args:
        options: what to replace and how, as for :func:`~comera_lightning.nn.tensorize`
            (``include``/``exclude`` match names relative to the LightningModule, e.g. ``"model\\.layers"``);
            a rank in its place is ``rank`` (``Tensorize(16)``, as ``tensorize(model, 16)``).
        kwargs: or the options by name, as :func:`~comera_lightning.nn.tensorize` takes them
            (``Tensorize(rank=16, min_features=64)``, the form YAML and the command line use); a name
            :class:`~comera_lightning.nn.TensorizeOptions` has no field for is a layer constructor argument
            (``Tensorize(init_std=0.02)``, or ``layer_kwargs={"init_std": 0.02}``).
    """

    def __init__(self, options: TensorizeOptions | None = None, **kwargs: Any) -> None:
        if options is not None and not isinstance(options, TensorizeOptions):
            kwargs["rank"] = options  # Tensorize(16): the rank by position, as tensorize(model, 16)
            options = None
        given = tensorize_options(**kwargs)
        if options is not None and _changed(given):  # a CLI passes every field, at its default where not set
            raise TypeError(
                f"Tensorize takes a TensorizeOptions or its fields by name, not both (got {sorted(_changed(given))})"
            )
        #: what the callback swaps, and how
        self.options: TensorizeOptions = given if options is None else options
        #: what the swaps of this run did, one record per replaced module
        self.records: list[TensorizeRecord] = []
        self._module: LightningModule | None = None
        self._hook: RemovableHandle | None = None

    @property
    def arguments(self) -> dict[str, Any]:
        """The options that select the modules, and their ranks."""
        return {name: getattr(self.options, name) for name in _NAMED}

    @property
    def layer_kwargs(self) -> dict[str, Any]:
        """The other options that differ from their defaults, and the layer constructor arguments."""
        changed = _changed(self.options)
        extra = changed.pop("layer_kwargs", {})
        return {**{k: v for k, v in changed.items() if k not in _NAMED}, **extra}

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            **{k: v for k, v in self.arguments.items() if k != "decompose"}, **self.layer_kwargs
        )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._module = pl_module
        records = self.options.apply(pl_module)
        self.records += records
        if not records and not tt_layers(pl_module):
            warnings.warn(
                f"{type(self).__name__} found no nn.Linear / nn.Embedding in {type(pl_module).__name__} with both "
                f"sides >= min_features={self.options.min_features} matching include={self.options.include!r}"
                f" / exclude={self.options.exclude!r}; lower min_features or widen include",
                UserWarning,
                stacklevel=2,
            )
        if self._hook is None:
            # a checkpoint restore loads the module's state dict right after setup and before the optimisers
            self._hook = pl_module.register_load_state_dict_pre_hook(self._before_load)

    def _before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load pre-hook on the LightningModule: give it whatever else the incoming state dict's layers need."""
        if prefix or module is not self._module:
            return
        recorded = tensorize_specs(state_dict)
        mine = tensorize_specs(module).get("", [])
        theirs = recorded.get("", [])
        differ = [spec for spec in mine if spec not in theirs]
        if recorded and differ:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint was made with tensorize({_describe(theirs)}) on the "
                f"LightningModule, this run's callback calls tensorize({_describe(differ)}); resume with the "
                f"arguments the checkpoint was made with, or load its weights with "
                f"comera_lightning.load_from_checkpoint and start a new fit"
            )
        if not recorded and self.records:
            raise ValueError(
                f"{type(self).__name__}: the checkpoint holds a dense model, but the layers were swapped at setup, "
                f"before it loads; build the model, load the dense checkpoint into it, and fit it without ckpt_path "
                f"(decompose=True starts the TT layers from those weights)"
            )
        self.records += tensorize_like(module, state_dict, recorded)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @override
    def state_dict(self) -> dict[str, Any]:
        layers = tt_layers(self._module) if self._module is not None else []
        return {
            "arguments": dict(self.arguments),
            # a weights_only load refuses arbitrary objects: those are kept by name
            "layer_kwargs": {
                k: v if isinstance(v, (type(None), bool, int, float, str, list, tuple, torch.dtype)) else repr(v)
                for k, v in self.layer_kwargs.items()
            },
            "specs": tensorize_specs(self._module) if self._module is not None else {},
            "ranks": {name: layer.ranks for name, layer in layers},
        }


def _changed(options: TensorizeOptions) -> dict[str, Any]:
    """The fields of ``options`` that differ from their defaults (``layer_kwargs`` when not empty)."""
    defaults = TensorizeOptions()
    return {
        f.name: getattr(options, f.name)
        for f in fields(TensorizeOptions)
        if getattr(options, f.name) != getattr(defaults, f.name)
    }


def _describe(specs: list[dict[str, Any]]) -> str:
    return (
        "; ".join(
            ", ".join(
                f"{k}={v!r}"
                for k, v in {**spec, **spec.get("layer_kwargs", {})}.items()
                if k != "layer_kwargs" and v is not None
            )
            for spec in specs
        )
        or "nothing"
    )
