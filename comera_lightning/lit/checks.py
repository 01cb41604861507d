"""Early, clear failures for bad input around the tasks: checkpoint files, output folders, token ids.

Each check names the problem and the fix, and none of them writes, moves or deletes anything.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..nn.base import capturing_graph
from ..nn.tensorize import tt_layers

__all__ = ["check_checkpoint_file", "check_id_ranges", "check_output_dirs", "check_state_dict_fits"]

#: ``ckpt_path`` values Lightning resolves itself (not files)
_CKPT_KEYWORDS = {"best", "last", "hpc", "registry"}
_TT_RANK_KEY = re.compile(r"(cores|gates)\.\d+|rank_mask_\d+")
_FIX_CKPT = (
    "pass --ckpt_path a .ckpt file written by `comera fit` (runs/<experiment>/<run>/checkpoints/), e.g. "
    "an earlier checkpoint or last.ckpt"
)


def check_checkpoint_file(path: str | os.PathLike[str]) -> None:
    """Fail with a clear message when ``path`` is not a readable Lightning checkpoint; read-only.

    Lightning's own keywords (``best``, ``last``, ``hpc``, ``registry...``), URLs and directories (sharded
    checkpoints) are left to Lightning. A file is loaded with ``weights_only=True`` (memory-mapped) and must
    be a dict with ``state_dict`` and ``pytorch-lightning_version``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is empty, corrupt or truncated, or a PyTorch file that is not a Lightning checkpoint.
    """
    text = os.fspath(path)
    if text in _CKPT_KEYWORDS or text.startswith("registry:") or "://" in text:
        return
    file = Path(text).expanduser()
    if file.is_dir():
        return
    if not file.exists():
        raise FileNotFoundError(f"checkpoint {text!r} does not exist; {_FIX_CKPT}")
    size = file.stat().st_size
    if size == 0:
        raise ValueError(f"checkpoint {text!r} is empty (0 bytes): the save or copy was interrupted; {_FIX_CKPT}")
    is_zip = zipfile.is_zipfile(file)
    try:
        content = torch.load(file, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as err:  # every failure to read means the same to the user
        first = (str(err).strip().splitlines() or [""])[0][:200]
        if not is_zip:
            reason = (
                "it is not a zip archive as torch.save writes: the file is truncated (an interrupted save or "
                "copy), corrupt, or not a PyTorch checkpoint at all"
            )
        elif "weights only load failed" in str(err).lower() and "unsupported global" in str(err).lower():
            reason = (
                "it holds Python objects that are not allowed when loading with weights_only=True (a "
                "comera checkpoint holds tensors and primitives only): it was not written by `comera fit`"
            )
        else:
            reason = "its content is damaged (a corrupt or partially overwritten file)"
        raise ValueError(
            f"checkpoint {text!r} ({size:,} bytes) cannot be read: {reason} [{type(err).__name__}: {first}]; "
            f"{_FIX_CKPT}"
        ) from err
    if not isinstance(content, Mapping) or "state_dict" not in content or "pytorch-lightning_version" not in content:
        if isinstance(content, Mapping):
            keys = sorted(map(str, content))
            held = f"a dict with keys {keys[:6]}{' ...' if len(keys) > 6 else ''}"
        else:
            held = f"a {type(content).__name__}"
        raise ValueError(
            f"checkpoint {text!r} is a PyTorch file but not a Lightning checkpoint: it holds {held}, not the "
            f"'state_dict' and 'pytorch-lightning_version' of a checkpoint; {_FIX_CKPT} (plain weights can be "
            f"loaded in Python with model.load_state_dict)"
        )


def check_state_dict_fits(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Fail clearly when ``state_dict`` (a checkpoint's) belongs to a different architecture than ``module``.

    The ranks of TT layers may differ (the layers adopt a truncated checkpoint's ranks; they check their modes
    themselves), every other key and shape must match.

    Raises:
        ValueError: with the missing, unexpected and mismatched keys (a few of each) and the fix.
    """
    prefixes = tuple(f"{name}." for name, _ in tt_layers(module))

    def rank_adaptive(key: str) -> bool:
        return any(key.startswith(p) and _TT_RANK_KEY.fullmatch(key[len(p) :]) for p in prefixes)

    own = module.state_dict()
    missing = [k for k in own if k not in state_dict and not rank_adaptive(k)]
    missing += [f"{p}cores.*" for p in prefixes if f"{p}cores.0" not in state_dict]
    unexpected = [k for k in state_dict if k not in own and not rank_adaptive(k)]
    reshaped = [
        f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in state_dict
        and not rank_adaptive(k)
        and torch.is_tensor(state_dict[k])
        and tuple(state_dict[k].shape) != tuple(own[k].shape)
    ]
    if not (missing or unexpected or reshaped):
        return
    problems = []
    for label, keys in (
        ("missing from the checkpoint", missing),
        ("not in this model", unexpected),
        ("with other shapes (checkpoint vs model)", reshaped),
    ):
        if keys:
            problems.append(f"{len(keys)} {label}, e.g. {', '.join(keys[:3])}")
    raise ValueError(
        f"the checkpoint does not fit this {type(module).__name__}: it is from a different architecture "
        f"({'; '.join(problems)}). Build the model with the options the checkpoint was trained with (its "
        f"config; comera restores the model's hyper-parameters from a checkpoint that has them) or train a new one"
    )


def check_output_dirs(trainer: Any) -> None:
    """Fail before training when a folder the run will write to cannot be written; creates nothing.

    Checks ``trainer.default_root_dir``, the log dir and the ``dirpath`` of every callback that has one
    (ModelCheckpoint and the like). A folder that does not exist yet is checked at its nearest existing
    parent. Decided on global rank zero and broadcast, so every process fails alike.

    Raises:
        PermissionError: a folder (or the parent it would be created in) is not writable.
        NotADirectoryError: the path runs through a regular file.
    """
    log_dir = trainer.log_dir  # a collective under DDP: every process asks
    problem: tuple[str, str] | None = None
    if trainer.is_global_zero:
        folders: list[tuple[str, str]] = [("trainer.default_root_dir", str(trainer.default_root_dir))]
        for callback in trainer.callbacks:
            dirpath = getattr(callback, "dirpath", None)
            if isinstance(dirpath, (str, os.PathLike)):
                folders.append((f"the {type(callback).__name__} dirpath", os.fspath(dirpath)))
        if isinstance(log_dir, (str, os.PathLike)):
            folders.append(("the log dir", os.fspath(log_dir)))
        for what, folder in folders:
            problem = _unwritable(what, folder)
            if problem is not None:
                break
    problem = trainer.strategy.broadcast(problem, src=0)
    if problem is not None:
        kind, message = problem
        raise (NotADirectoryError if kind == "file" else PermissionError)(message)


def _unwritable(what: str, folder: str) -> tuple[str, str] | None:
    if "://" in folder:  # remote file systems (s3://, ...) are not checked
        return None
    path = Path(folder).expanduser().absolute()
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    fix = (
        f"point {what} at a writable folder (e.g. --trainer.default_root_dir for the comera CLI) or make "
        f"{str(existing)!r} writable; nothing was written or deleted"
    )
    if not existing.is_dir():
        return "file", f"{what} {folder!r} cannot be created: {str(existing)!r} is a file, not a folder; {fix}"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" (it would be created in {str(existing)!r})"
        return "access", f"{what} {folder!r} is not writable{where}; {fix}"
    return None


def check_id_ranges(checks: Sequence[tuple[str, torch.Tensor, int, str]]) -> None:
    """Fail clearly when integer ids fall outside ``[0, upper)``; one host sync for all checks.

    Args:
        checks: ``(what, ids, upper, fix)``: a name for the message, the ids, the exclusive upper bound and
            what to change. Empty tensors are skipped.

    Skipped while a graph is recorded (``torch.compile`` tracing or a CUDA-graph capture: eager steps
    checked the same kind of batches; a graph cannot sync with the host).

    Raises:
        IndexError: naming the offending id, the allowed range and the fix.
    """
    if capturing_graph():
        return
    live = [(what, ids, upper, fix) for what, ids, upper, fix in checks if ids.numel()]
    if not live:
        return
    extremes = torch.stack([v.long() for _, ids, _, _ in live for v in (ids.min(), ids.max())]).tolist()
    for k, (what, _, upper, fix) in enumerate(live):
        low, high = extremes[2 * k], extremes[2 * k + 1]
        if low < 0 or high >= upper:
            bad = low if low < 0 else high
            raise IndexError(f"{what} holds {int(bad)}, outside [0, {upper}); {fix}")
