"""``load_from_checkpoint``: one call to reload a model with comera layers, however they got there.

``MyModule.load_from_checkpoint(path)`` builds ``MyModule`` dense and then fails on the TT keys when the layers
were swapped by hand or by the :class:`~comera_lightning.callbacks.Tensorize` callback. The checkpoint records every
:func:`~comera_lightning.nn.tensorize` call in its state dict's metadata, so this loader builds the module, repeats
those calls (:func:`~comera_lightning.nn.tensorize_like`), and loads the weights; the layers adopt the checkpoint's
ranks as they load.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from .nn.tensorize import tensorize_like, tensorize_specs

__all__ = ["load_from_checkpoint"]

M = TypeVar("M", bound=nn.Module)


def load_from_checkpoint(
    module_class: type[M], path: str | Path, *, map_location: Any = "cpu", strict: bool = True, **init_kwargs: Any
) -> M:
    """An instance of ``module_class`` with the checkpoint's comera layers, ranks and weights.

    Works for a Lightning checkpoint (``fit``, ``ModelCheckpoint``) or a plain ``torch.save(model.state_dict())``, of
    a model tensorised by the :class:`~comera_lightning.callbacks.Tensorize` callback, in its own ``__init__`` or by
    hand. The file is read with ``torch.load(weights_only=True)``.

    Args:
        module_class: the class to build, e.g. the user's LightningModule.
        path: the checkpoint (local or any fsspec URL), or a sharded run's distributed checkpoint folder.
        map_location: where the tensors go (as ``torch.load``).
        strict: as ``load_state_dict``.
        init_kwargs: arguments for ``module_class``; a LightningModule's saved hyperparameters fill the rest
            (as in ``LightningModule.load_from_checkpoint``).

    Returns:
        The model, in the mode its constructor left it (train for a fresh ``nn.Module``).
    """
    import fsspec

    if Path(path).expanduser().is_dir():  # a sharded run's distributed checkpoint (FSDP2)
        from .utilities.checkpoint_io import read_checkpoint

        checkpoint = read_checkpoint(path, map_location=map_location)
    else:
        with fsspec.open(str(path), "rb") as handle:
            checkpoint = torch.load(handle, map_location=map_location, weights_only=True)
    lightning_checkpoint = isinstance(checkpoint, dict) and isinstance(checkpoint.get("state_dict"), dict)
    state_dict = checkpoint["state_dict"] if lightning_checkpoint else checkpoint
    if not isinstance(state_dict, dict):
        raise ValueError(f"{path} holds a {type(state_dict).__name__}, not a state dict or a Lightning checkpoint")
    model = module_class(**_init_arguments(module_class, checkpoint if lightning_checkpoint else {}, init_kwargs))
    specs = tensorize_specs(state_dict) or _callback_specs(checkpoint if lightning_checkpoint else {})
    configure_model = getattr(model, "configure_model", None)
    if lightning_checkpoint and callable(configure_model):
        configure_model()  # as Lightning's own loader: layers a module builds there must exist
    tensorize_like(model, state_dict, specs)
    on_load_checkpoint = getattr(model, "on_load_checkpoint", None)
    if lightning_checkpoint and callable(on_load_checkpoint):
        on_load_checkpoint(checkpoint)
    model.load_state_dict(state_dict, strict=strict)
    return model


def _init_arguments(module_class: type, checkpoint: dict[str, Any], init_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Saved hyperparameters overridden by ``init_kwargs``, kept to what ``__init__`` takes (unless ``**kwargs``).

    LightningCLI's own entries (``_class_path``, ``_instantiator``) are not arguments: a task that forwards
    ``**kwargs`` to its model would pass them on (the export's loader drops them alike).
    """
    saved = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if not str(k).startswith("_")}
    name = checkpoint.get("hparams_name")
    parameters = inspect.signature(module_class).parameters  # __init__'s, without self
    if name and name in parameters:  # ``save_hyperparameters(namespace)`` stores everything under one name
        saved = {name: saved}
    arguments = {**saved, **init_kwargs}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        arguments = {k: v for k, v in arguments.items() if k in parameters and k != "self"}
    return arguments


def _callback_specs(checkpoint: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The specs a :class:`~comera_lightning.callbacks.Tensorize` callback saved (a state dict stripped of its
    metadata still has them there)."""
    specs: dict[str, list[dict[str, Any]]] = {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if key.startswith("Tensorize") and isinstance(state, dict):
            for prefix, calls in (state.get("specs") or {}).items():
                specs.setdefault(prefix, []).extend(c for c in calls if c not in specs.get(prefix, []))
    return specs
