"""FaultTolerance: periodic, atomically written step checkpoints that a killed run resumes from exactly.

A run killed at any instant (SIGKILL, pre-emption, a lost node) loses at most ``every_n_steps`` optimiser
steps: every ``every_n_steps`` steps the callback writes ``step=<global step>.ckpt`` into ``dirpath`` and
keeps the newest ``keep``. A checkpoint is written to a hidden temporary file in the same directory,
flushed and fsync'ed, then renamed over the final name (``os.replace``, atomic on POSIX), and the directory
is fsync'ed; a file that is not complete never carries a checkpoint's name. Lightning's own
``TorchCheckpointIO`` is not atomic in that sense (it writes through an fsspec transaction that stages the
file in the system temporary directory and ``shutil.move``s it into place, which degrades to a copy in
place when that directory is on another file system, and it never fsyncs), so the callback swaps a plain
``TorchCheckpointIO`` for :class:`AtomicCheckpointIO`: every checkpoint the trainer writes, ModelCheckpoint's
included, becomes atomic.

What a resumed run gets back, and from where:

* weights, TT ranks (layers adopt the checkpoint's core shapes), gates and masks: the module state;
* optimiser, LR scheduler, loop counters (epoch, step, batch in epoch): Lightning;
* RankAdaptation's stage/targets/loss EMA, RankMonitor's history: their own callback state;
* the data position inside the epoch and the MLM masking generator: the training loader's state
  (:class:`~comera_lightning.data.common.ResumableDataLoader`);
* the global random streams (torch CPU and CUDA, numpy, python ``random``) and the training collate
  functions' generators (``collate_fn.state_dict()``, e.g. the MLM masks), per process: this callback
  (the loader state holds rank zero's collate state only).
  They are captured when the checkpoint is written (after every other callback's ``on_train_batch_end``:
  this is a ``Checkpoint`` callback, which Lightning runs last) and put back in ``on_train_start``, after
  restoring, set-up and the sanity check, immediately before training continues.

Everything in the callback's state is a tensor or a primitive, so the checkpoints load with
``torch.load(weights_only=True)``. :func:`find_resume_checkpoint` picks the newest complete checkpoint of a
directory, skipping (with a warning naming it) any file that does not load that way.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

__all__ = [
    "AtomicCheckpointIO",
    "FaultTolerance",
    "atomic_save",
    "capture_rng_state",
    "checkpoint_files",
    "find_resume_checkpoint",
    "restore_rng_state",
]

CHECKPOINT_PATTERN = re.compile(r"^step=(\d+)\.ckpt$")
_TEMP_SUFFIX = ".tmp"
_WRITER_ONLY = -1  #: "world size" of a random state that holds the writing process's streams only


# ---------------------------------------------------------------------------------------------- atomic files
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` so that ``path`` is either absent/old or complete, never partial.

    The bytes go to a hidden ``.<name>.<random>.tmp`` file in the same directory, which is flushed and
    fsync'ed and then renamed onto ``path`` (``os.replace``); the directory is fsync'ed so the rename
    survives a power loss too. On any error the temporary file is removed; a SIGKILL can leave one behind,
    which no reader here takes for a checkpoint (see :func:`checkpoint_files`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _is_local(path: str | os.PathLike[str]) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local writes are atomic and durable (see :func:`atomic_save`).

    Remote URLs (``s3://`` ...) go through Lightning's fsspec path unchanged. Loading is Lightning's.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        atomic_save(checkpoint, str(path).removeprefix("file://"))


# ---------------------------------------------------------------------------------------------- random state
def capture_rng_state(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """This process's global random streams as a flat dict of tensors (safe for ``weights_only`` loading).

    Keys: ``torch`` (CPU generator), ``cuda`` (the generator of ``device`` when it is a CUDA device),
    ``numpy_keys``/``numpy_meta``/``numpy_gauss`` (the legacy ``np.random`` MT19937 state), ``python``/
    ``python_gauss`` (``random``'s MT state). Every key has the same shape in every process, so the dict
    can be all-gathered across DDP ranks.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    assert kind == "MT19937"
    version, words, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_meta": torch.tensor([int(pos), int(has_gauss)], dtype=torch.int64),
        "numpy_gauss": torch.tensor([float(gauss)], dtype=torch.float64),
        "python": torch.tensor([int(version), *words], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss_next is None else float(gauss_next)], dtype=torch.float64),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Put back what :func:`capture_rng_state` returned (keys that are missing are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"].detach().to("cpu", torch.uint8))
    if "numpy_keys" in state:
        pos, has_gauss = (int(v) for v in state["numpy_meta"].tolist())
        np.random.set_state(("MT19937", state["numpy_keys"].cpu().numpy().astype(np.uint32), pos, has_gauss,
                             float(state["numpy_gauss"].item())))
    if "python" in state:
        values = [int(v) for v in state["python"].tolist()]
        gauss = float(state["python_gauss"].item())
        random.setstate((values[0], tuple(values[1:]), None if gauss != gauss else gauss))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].detach().to("cpu", torch.uint8), device)


# ---------------------------------------------------------------------------------------------- finding checkpoints
def _step_of(path: Path) -> int:
    match = CHECKPOINT_PATTERN.match(path.name)
    return int(match.group(1)) if match else -1


def checkpoint_files(dirpath: str | os.PathLike[str]) -> list[Path]:
    """This callback's complete-by-name checkpoints in ``dirpath`` (``step=<n>.ckpt``), newest first.

    Hidden and temporary files never match. Newest is the highest step, then the latest modification.
    """
    folder = Path(dirpath)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = CHECKPOINT_PATTERN.match(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path.stat().st_mtime_ns, path))
    return [path for *_, path in sorted(found, key=lambda t: (t[0], t[1]), reverse=True)]


def _check_loadable(path: Path) -> None:
    """Raise unless ``path`` loads with ``weights_only=True`` and looks like a Lightning training checkpoint."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    keys = checkpoint.keys() if isinstance(checkpoint, dict) else ()
    missing = [k for k in ("state_dict", "loops", "global_step") if k not in keys]
    if missing:
        raise ValueError(f"not a resumable Lightning checkpoint (no {', '.join(missing)})")


def find_resume_checkpoint(dirpath: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint in ``dirpath`` that loads with ``torch.load(weights_only=True)``, or ``None``.

    Candidates are :func:`checkpoint_files`; one that fails to load (truncated, corrupt, or holding
    anything but tensors and primitives) is skipped with a warning that names it. The load uses ``mmap``,
    so checking a large checkpoint reads little more than its index.
    """
    for path in checkpoint_files(dirpath):
        try:
            _check_loadable(path)
        except Exception as error:  # noqa: BLE001  (any failure means: not this one)
            warnings.warn(f"FaultTolerance: skipping checkpoint {str(path)!r}, it does not load with "
                          f"weights_only=True: {type(error).__name__}: {error}", stacklevel=2)
            continue
        return path
    return None


# ---------------------------------------------------------------------------------------------- callback
class FaultTolerance(Checkpoint):
    """Write a resumable checkpoint every ``every_n_steps`` optimiser steps, atomically, keeping ``keep``.

    Resume with ``trainer.fit(..., ckpt_path=find_resume_checkpoint(dirpath), weights_only=True)`` (the
    ``comera`` CLI: ``comera fit ... --resume auto``). At the start of fit the directory's step checkpoints
    that are not part of this run's history are removed: all of them for a fresh run (no ``ckpt_path``),
    those of a later step than the restored one for a resumed run (an abandoned continuation, or files that
    did not load); so a later resume always finds this run's newest state. Stale temporary files go too.

    Being a ``Checkpoint`` callback it runs after every other callback's ``on_train_batch_end`` (a state
    saved halfway through another callback's step-end work could not be resumed exactly); like any
    ``Checkpoint`` it cannot be combined with ``Trainer(enable_checkpointing=False)``, and Lightning then
    adds no default ``ModelCheckpoint`` (the ``comera`` CLI adds one when the config has none).

    Args:
        every_n_steps: checkpoint interval in optimiser steps (the most work a kill can lose); 0 disables
            writing (the random-state restore on resume still works).
        dirpath: where the step checkpoints go; ``None`` is ``<trainer.default_root_dir>/fault_tolerance``.
            Use a directory that is the same for every launch of one experiment.
        keep: how many of the newest step checkpoints to keep (>= 1).
        atomic_io: replace the trainer's plain ``TorchCheckpointIO`` by :class:`AtomicCheckpointIO` so that
            every checkpoint it writes is atomic.
    """

    def __init__(self, every_n_steps: int = 100, dirpath: str | None = None, keep: int = 2,
                 atomic_io: bool = True) -> None:
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0 disables), got {every_n_steps}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.every_n_steps = int(every_n_steps)
        self.dirpath = dirpath
        self.keep = int(keep)
        self.atomic_io = atomic_io
        self.last_checkpoint: Path | None = None
        self.resumed_from: dict[str, Any] | None = None  #: {"step", "run_id"} of the checkpoint resumed from
        self._last_step = -1
        self._snapshot: dict[str, Any] | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._current_run_id: str | None = None
        self._restored_step = -1

    # --- paths ---------------------------------------------------------------------------------------
    def resolve_dirpath(self, trainer: Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath is not None else Path(trainer.default_root_dir) / "fault_tolerance"

    def checkpoint_path(self, trainer: Trainer, step: int) -> Path:
        return self.resolve_dirpath(trainer) / f"step={step:09d}.ckpt"

    # --- hooks ---------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.atomic_io and type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if self.dirpath is None:  # identical on every rank: the default root dir is
            self.dirpath = str(self.resolve_dirpath(trainer))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = self.resolve_dirpath(trainer)
        if not trainer.is_global_zero or not folder.is_dir():
            return
        for tmp in folder.glob(f".step=*{_TEMP_SUFFIX}"):  # left behind by a killed writer
            tmp.unlink(missing_ok=True)
        if not self.every_n_steps or (trainer.ckpt_path is not None and self._restored_step < 0):
            return
        # a fresh run drops every old step checkpoint, a resumed one those newer than its starting point (an
        # abandoned continuation, or files that did not load): a later resume must find this run's newest
        start = -1 if trainer.ckpt_path is None else self._restored_step
        stale = [path for path in checkpoint_files(folder) if _step_of(path) > start]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            rank_zero_info(f"FaultTolerance: removed {len(stale)} step checkpoint(s) newer than step {start} "
                           f"from {folder}: {', '.join(p.name for p in stale)}")

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._restored_step = int(checkpoint.get("global_step", -1))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = trainer.global_step  # restored by now (it is not yet in on_fit_start)
        self._current_run_id = self._run_id(trainer) if trainer.is_global_zero else None
        if self._pending_rng is not None:
            self._restore_rng(trainer, self._pending_rng)
            self._pending_rng = None
        if self.resumed_from is not None:
            self._tag_resumed_run(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:  # gradient accumulation: no optimiser step happened
            return
        self._last_step = step
        if self.every_n_steps and step % self.every_n_steps == 0:
            self.save(trainer)

    # --- saving --------------------------------------------------------------------------------------
    def save(self, trainer: Trainer) -> Path:
        """Write ``step=<global step>.ckpt`` now (every rank must call this) and prune old ones."""
        path = self.checkpoint_path(trainer, trainer.global_step)
        self._snapshot = self._gather_rng(trainer)
        try:
            trainer.save_checkpoint(path, weights_only=False)  # atomic through AtomicCheckpointIO; ends with a barrier
        finally:
            self._snapshot = None
        if trainer.is_global_zero:
            if not isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO):
                rank_zero_warn("FaultTolerance: the trainer's checkpoint IO is not AtomicCheckpointIO; a kill "
                               "while writing can leave a partial file (resume skips files that do not load)")
            for old in checkpoint_files(path.parent)[self.keep:]:
                old.unlink(missing_ok=True)
        self.last_checkpoint = path
        return path

    @staticmethod
    def _collate_fns(trainer: Trainer) -> list[Any]:
        """Collate functions of the training loaders that keep random state in this process."""
        try:
            loaders = trainer.train_dataloader
        except Exception:  # noqa: BLE001  (no training loader yet)
            return []
        if isinstance(loaders, dict):
            loaders = list(loaders.values())
        elif not isinstance(loaders, (list, tuple)):
            loaders = [loaders]
        found = []
        for loader in loaders:
            collate = getattr(loader, "collate_fn", None)
            if getattr(loader, "num_workers", 0) == 0 and callable(getattr(collate, "state_dict", None)) \
                    and callable(getattr(collate, "load_state_dict", None)):
                found.append(collate)
        return found

    def _gather_rng(self, trainer: Trainer) -> dict[str, Any]:
        """Every process's random streams (global ones and its training collate functions'), by rank."""
        device = trainer.strategy.root_device
        local = capture_rng_state(device)
        for i, collate in enumerate(self._collate_fns(trainer)):
            local.update({f"collate{i}.{k}": v for k, v in collate.state_dict().items() if torch.is_tensor(v)})
        world = trainer.world_size
        if world == 1:
            return {"world_size": 1, "ranks": [local]}
        # all-gather every tensor (on the strategy's device, as NCCL wants), then split by rank; the keys and
        # shapes are the same in every process
        gathered = {k: trainer.strategy.all_gather(v.to(device)).cpu() for k, v in sorted(local.items())}
        ranks = [{k: v[r].clone() for k, v in gathered.items()} for r in range(world)]
        return {"world_size": world, "ranks": ranks}

    def _restore_rng(self, trainer: Trainer, rng: dict[str, Any]) -> None:
        ranks = rng.get("ranks") or []
        rank, saved_world = trainer.global_rank, int(rng.get("world_size", len(ranks)))
        if saved_world == _WRITER_ONLY and ranks:  # written by another callback: the writing process's streams
            if trainer.world_size > 1:
                rank_zero_warn("FaultTolerance: this checkpoint was not written by FaultTolerance and holds the random "
                               "state of rank 0 only; the other ranks continue from the seed")
            if rank != 0:
                return
        elif saved_world != trainer.world_size or rank >= len(ranks):
            rank_zero_warn(f"FaultTolerance: the checkpoint's random state is from {len(ranks)} process(es), this "
                           f"run has {trainer.world_size}; random streams continue from the seed instead")
            return
        state = ranks[rank]
        restore_rng_state(state, trainer.strategy.root_device)
        for i, collate in enumerate(self._collate_fns(trainer)):
            prefix = f"collate{i}."
            part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if part:
                collate.load_state_dict({"rank": getattr(collate, "rank", rank), **part})

    def _run_id(self, trainer: Trainer) -> str | None:
        for logger in trainer.loggers:
            run_id = getattr(logger, "run_id", None)
            if isinstance(run_id, str):
                return run_id
        return None

    def _tag_resumed_run(self, trainer: Trainer) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            run_id = getattr(logger, "run_id", None)
            if isinstance(run_id, str) and hasattr(experiment, "set_tag"):
                assert self.resumed_from is not None
                experiment.set_tag(run_id, "comera.resumed_from_step", str(self.resumed_from["step"]))
                if self.resumed_from.get("run_id"):
                    experiment.set_tag(run_id, "comera.resumed_from_run", str(self.resumed_from["run_id"]))

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        rng = self._snapshot
        if rng is None:  # a checkpoint someone else triggered (ModelCheckpoint): this process's streams only
            rng = {"world_size": _WRITER_ONLY, "ranks": [capture_rng_state()]}
        return {"version": 1, "step": self._last_step, "run_id": self._current_run_id, "rng": rng}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rng = state_dict.get("rng")
        self._pending_rng = rng if isinstance(rng, dict) else None
        self.resumed_from = {"step": state_dict.get("step"), "run_id": state_dict.get("run_id")}
