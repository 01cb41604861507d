"""Compact export of a trained comera model: a safetensors file loadable without the training checkpoint.

A checkpoint holds optimiser moments, loop state and TT cores still allocated at their ranks before the
last truncation (masked slices are zero but stored). The export holds only the model's state dict with
every TT layer physically truncated to its active ranks, plus, in the safetensors metadata, a JSON record
(key ``"comera"``) of the task's class path, its hyper-parameters and every TT layer's modes and ranks.
:func:`load_exported` rebuilds the task from that record; the TT layers adopt the smaller core shapes
while loading (``TTLayer._load_from_state_dict``).

Loading imports the recorded class: load only files you trust, as with any checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import pkgutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .nn.base import TTLayer
from .nn.builder import TTLayerOptions, build_tt_layer, layer_shape
from .nn.embedding import TTEmbedding
from .nn.linear import TTLinear
from .nn.tensorize import size_report
from .utilities.atomic import atomic_write

__all__ = [
    "EXPORT_KEY",
    "TOKENIZER_KEY",
    "export_checkpoint",
    "export_model",
    "load_exported",
    "load_exported_tokenizer",
    "read_export_metadata",
]

EXPORT_KEY = "comera"
"""Safetensors metadata key of the export's JSON record."""
TOKENIZER_KEY = "tokenizer"
"""Safetensors metadata key of the tokenizer.json the model was trained with (when the export carries one)."""
_FORMAT_VERSION = 1
_CHECKPOINT_TASK_KEY = "comera_task"  # written by ComeraTask.on_save_checkpoint


def export_model(
    module: nn.Module,
    path: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
    *,
    overwrite: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``module``'s state dict, TT cores at their active ranks, to a safetensors file.

    ``module`` itself is not changed (masked slices are removed from copies of the TT layers).

    Args:
        module: a comera task (LightningModule; its ``hparams`` are recorded) or any ``nn.Module``.
        path: the ``.safetensors`` file to write (parent folders are created).
        metadata: extra string entries for the safetensors header (e.g. a run id); ``"comera"`` and
            ``"format"`` are reserved.
        overwrite: replace an existing file; without it an existing file is refused.
        tokenizer: the tokenizer.json the model was trained with (a data module's ``tokenizer_file``); the export
            carries it, so :func:`load_exported_tokenizer` can turn text into the model's token ids.

    Returns:
        The path written.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ValueError: a hyper-parameter is not JSON-serialisable, or ``metadata`` is not ``str -> str`` or uses
            a reserved key.
    """
    out = _check_output(path, overwrite)
    header = {"format": "pt"}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"metadata must map str to str (safetensors headers hold strings), got {key!r}: {value!r}")
        if key in (EXPORT_KEY, TOKENIZER_KEY, "format"):
            raise ValueError(f"metadata key {key!r} is reserved by the export; choose another name")
        header[key] = value
    state, layers = _active_state_dict(module)
    record = {
        "version": _FORMAT_VERSION,
        "task": _class_path(type(module)),
        "hparams": _json_hparams(module),
        "tt_layers": layers,
        "size": {k: v for k, v in size_report(module).as_dict().items() if k != "layers"},
    }
    header[EXPORT_KEY] = json.dumps(record)
    if tokenizer is not None:
        header[TOKENIZER_KEY] = _tokenizer_text(tokenizer)
    try:
        with atomic_write(out, overwrite=overwrite) as tmp:
            save_file(state, str(tmp), metadata=header)
    except FileExistsError:  # appeared while writing: refused like one that was there before
        _check_output(out, overwrite)
        raise
    return out


def export_checkpoint(
    ckpt_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    task: str | None = None,
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
    tokenizer: str | os.PathLike[str] | None = None,
) -> Path:
    """Export a Lightning checkpoint written by a comera task (see :func:`export_model`).

    The task is rebuilt from the class path the checkpoint records (``checkpoint["comera_task"]``, or
    the ``_class_path`` LightningCLI stores among the hyper-parameters) and its hyper-parameters, then the
    state dict is loaded (loaded with ``weights_only=True``).

    Args:
        ckpt_path: a ``.ckpt`` file, or the folder of a sharded run's distributed checkpoint (FSDP2).
        out_path: the ``.safetensors`` file to write.
        task: the task's class path (e.g. ``"comera_lightning.lit.MaskedLM"``), for checkpoints that do not
            record it; takes precedence over the recorded one.
        metadata, overwrite: as in :func:`export_model`.

    Raises:
        FileNotFoundError: the checkpoint does not exist.
        FileExistsError: ``out_path`` exists and ``overwrite`` is False (checked before loading anything).
        ValueError: the checkpoint is unreadable or not a Lightning checkpoint, or its task class is unknown.
    """
    from .lit.checks import check_checkpoint_file  # here: loading an export needs no Lightning
    from .utilities.checkpoint_io import read_checkpoint

    check_checkpoint_file(ckpt_path)
    if not Path(ckpt_path).expanduser().exists():
        raise ValueError(f"export_checkpoint needs a checkpoint file or folder, got {os.fspath(ckpt_path)!r}")
    _check_output(out_path, overwrite)
    checkpoint = read_checkpoint(ckpt_path)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    class_path = task or checkpoint.get(_CHECKPOINT_TASK_KEY) or hparams.get("_class_path")
    if not class_path:
        raise ValueError(
            f"checkpoint {os.fspath(ckpt_path)!r} does not record its task class (no {_CHECKPOINT_TASK_KEY!r} key: "
            f"it was written before comera recorded it, or not by a comera task); pass task= the class path, "
            f"e.g. task='comera_lightning.lit.MaskedLM'"
        )
    module = _build(class_path, hparams)
    _load_state(module, checkpoint["state_dict"])
    return export_model(module, out_path, metadata, overwrite=overwrite, tokenizer=tokenizer)


def load_exported(
    path: str | os.PathLike[str],
    model: nn.Module | None = None,
    *,
    map_location: str | torch.device = "cpu",
) -> nn.Module:
    """Rebuild the model of an export written by :func:`export_model`, in eval mode.

    Args:
        path: the ``.safetensors`` file.
        model: load into this module instead of rebuilding the recorded class (it must have the same
            architecture; TT layers adopt the exported ranks). Its parameters are replaced by the file's
            tensors, which keep their dtype.

    A recorded TT layer that the rebuilt model holds as a plain ``nn.Linear`` / ``nn.Embedding`` (a model
    passed through ``tensorize()`` after construction) is swapped for a TT layer with the recorded modes.
        map_location: device of the returned model.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a safetensors file or not a comera export, or the class cannot be rebuilt.
    """
    record = read_export_metadata(path)
    if model is None:
        model = _build(record["task"], record.get("hparams"))
    _retensorize(model, record["tt_layers"])
    model.to(map_location)
    _load_state(model, load_file(Path(path).expanduser(), device=str(torch.device(map_location))))
    return model.eval()


def load_exported_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The ``tokenizers.Tokenizer`` an export carries (written with ``export_model(..., tokenizer=)``, as ``comera
    fit`` does for its text tasks)."""
    with safe_open(str(Path(path).expanduser()), framework="pt") as handle:
        text = (handle.metadata() or {}).get(TOKENIZER_KEY)
    if text is None:
        raise ValueError(
            f"{os.fspath(path)} carries no tokenizer (it was exported without one, or from a task without text); "
            f"load the tokenizer.json it was trained with: tokenizers.Tokenizer.from_file(<path>)"
        )
    from tokenizers import Tokenizer

    return Tokenizer.from_str(text)


def _tokenizer_text(tokenizer: str | os.PathLike[str]) -> str:
    path = Path(tokenizer).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
        from tokenizers import Tokenizer

        Tokenizer.from_str(text)
    except Exception as err:  # unreadable, not UTF-8, or not a tokenizer (tokenizers raises plain Exceptions)
        raise ValueError(
            f"tokenizer {os.fspath(tokenizer)!r} is not a readable tokenizer.json [{type(err).__name__}: {err}]; pass "
            f"the file the data module trained or loaded (its tokenizer_file)"
        ) from err
    return text


def read_export_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON record of an export: ``version``, ``task``, ``hparams``, ``tt_layers``, ``size``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a safetensors file or not a comera export.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"export {os.fspath(path)!r} does not exist; write one with export_model or "
            f"export_checkpoint (`comera export`)"
        )
    try:
        with safe_open(file, framework="pt") as handle:
            header = handle.metadata() or {}
    except Exception as err:
        raise ValueError(
            f"{os.fspath(path)!r} cannot be read as a safetensors file (truncated, corrupt or another "
            f"format) [{type(err).__name__}: {err}]"
        ) from err
    if EXPORT_KEY not in header:
        raise ValueError(
            f"{os.fspath(path)!r} is a safetensors file but not a comera export (no {EXPORT_KEY!r} "
            f"metadata); load its tensors with safetensors.torch.load_file and model.load_state_dict"
        )
    return json.loads(header[EXPORT_KEY])


def _active_state_dict(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The state dict with every TT layer truncated to its active ranks, and a description of those layers."""
    state = module.state_dict()
    layers: list[dict[str, Any]] = []
    truncated: dict[int, TTLayer] = {}
    for name, layer in module.named_modules(remove_duplicate=False):  # a shared layer under every name
        if not isinstance(layer, TTLayer):
            continue
        if id(layer) not in truncated:
            small = layer
            if not all(bool(mask.all()) for mask in layer.rank_masks):
                small = copy.deepcopy(layer)
                small.truncate_()
            truncated[id(layer)] = small
        small = truncated[id(layer)]
        if small is not layer:
            state.update(small.state_dict(prefix=f"{name}." if name else ""))
        layers.append(_describe(name, small))
    return _plain_tensors(state), layers


def _describe(name: str, layer: TTLayer) -> dict[str, Any]:
    if isinstance(layer, (TTLinear, TTEmbedding)):
        kind, shape, (in_modes, out_modes) = layer_shape(layer)
    else:
        kind, shape, in_modes, out_modes = type(layer).__name__, None, [], []
    return {
        "name": name,
        "kind": kind,
        "shape": None if shape is None else list(shape),
        "in_modes": list(in_modes),
        "out_modes": list(out_modes),
        "ranks": layer.ranks,
        "rank_threshold": layer.rank_threshold,
    }


def _retensorize(model: nn.Module, layers: list[dict[str, Any]]) -> None:
    """Swap for TT layers the dense modules a model built them from (``tensorize()`` after construction)."""
    replaced: dict[int, nn.Module] = {}
    for entry in layers:
        name, dense = entry["name"], model.get_submodule(entry["name"])
        if id(dense) in replaced:
            model.set_submodule(name, replaced[id(dense)])
            continue
        kind = entry["kind"]
        if (kind, type(dense)) not in (("linear", nn.Linear), ("embedding", nn.Embedding)):
            continue  # already a TT layer (the model builds its own), or something the state dict will refuse
        options = TTLayerOptions(rank=entry["ranks"][1:-1], rank_threshold=entry["rank_threshold"])
        like: dict[str, Any] = dict(dtype=dense.weight.dtype, device=dense.weight.device)
        if kind == "linear":
            like["bias"] = dense.bias is not None
        else:
            like["padding_idx"] = dense.padding_idx
        modes = (entry["in_modes"], entry["out_modes"])
        layer, _ = build_tt_layer(kind, tuple(entry["shape"]), options, modes=modes, **like)
        model.set_submodule(name, layer)
        replaced[id(dense)] = layer


def _plain_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, detached tensors, none sharing storage with another (safetensors refuses shared ones)."""
    plain, seen = {}, set()
    for key, value in state.items():
        tensor = value.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen and tensor.numel():
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        plain[key] = tensor
    return plain


def _json_hparams(module: nn.Module) -> dict[str, Any] | None:
    hparams = getattr(module, "hparams", None)
    if hparams is None:
        return None
    # LightningCLI's bookkeeping keys (_instantiator, _class_path) are not constructor arguments
    plain = {k: v for k, v in dict(hparams).items() if not str(k).startswith("_")}
    for key, value in plain.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"hyper-parameter {key!r} of {type(module).__name__} ({type(value).__name__}) cannot be written as "
                f"JSON, so the export could not rebuild the task; pass plain values (numbers, strings, lists, "
                f"dicts) to the task's constructor"
            ) from err
    return plain


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _build(class_path: str, hparams: Mapping[str, Any] | None) -> nn.Module:
    """Import ``class_path`` (an ``nn.Module`` subclass) and call it with ``hparams``."""
    try:
        cls = pkgutil.resolve_name(class_path)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"cannot import the task class {class_path!r} [{type(err).__name__}: {err}]; install the "
            f"package that defines it, or pass the class path explicitly"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{class_path!r} is not an nn.Module class, so it cannot be rebuilt")
    kwargs = {k: v for k, v in (hparams or {}).items() if not str(k).startswith("_")}
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(
            f"cannot rebuild {class_path} from the recorded hyper-parameters {sorted(kwargs)} "
            f"[{err}]; build the model yourself and pass it as model="
        ) from err


def _load_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    # assign=True keeps the stored dtypes (a float64 model stays float64) and skips a copy; TT layers
    # adopt the stored core shapes in their _load_from_state_dict
    module.load_state_dict(state, strict=True, assign=True)


def _check_output(path: str | os.PathLike[str], overwrite: bool) -> Path:
    out = Path(path).expanduser()
    if out.is_dir():
        raise IsADirectoryError(
            f"export path {os.fspath(path)!r} is a folder; pass a file name such as model.safetensors"
        )
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"export path {os.fspath(path)!r} exists; pass overwrite=True to replace it, or "
            f"choose another path; nothing was written"
        )
    return out
