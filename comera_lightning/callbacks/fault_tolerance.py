"""FaultTolerance: periodic step checkpoints that a killed run resumes from exactly.

A Lightning ``ModelCheckpoint`` writes ``step=<global step>.ckpt`` every ``every_n_steps`` optimiser steps
and keeps the newest ``keep`` (``monitor="step", mode="max"``). This subclass adds what Lightning lacks:

* atomic, fsync'ed writes (:class:`~comera_lightning.utilities.checkpoint_io.AtomicCheckpointIO` replaces a plain
  ``TorchCheckpointIO``, so every checkpoint the trainer writes is atomic);
* every process's random streams (torch CPU/CUDA, numpy, ``random``, the training collate functions'
  generators), all-gathered in ``state_dict`` and put back in ``on_train_start``. ``Trainer.save_checkpoint``
  builds the checkpoint on every process, which makes the gather safe;
* pruning at the start of fit, so a later resume finds this run's newest state: a fresh run removes the
  folder's step checkpoints, a resumed one those its restored state does not track (an abandoned
  continuation, orphans of a kill); stale temporary files go too;
* MLflow tags on a resumed run, and :func:`find_resume_checkpoint` (the newest checkpoint that loads with
  ``torch.load(weights_only=True)``, skipping with a warning any that does not);
* pre-emption: on SIGTERM or SIGUSR1 (what SLURM, Kubernetes and spot machines send before they take a
  machine back) the step in flight finishes, a step checkpoint is written at once and the process exits with
  ``128 + signal number`` (143 for SIGTERM) instead of Lightning's 0, so a scheduler sees that the run did not
  finish. Under SLURM with auto-requeue, the requeue signal also requeues the job.

Why not Lightning's own signal handling: on SIGTERM it stops at the end of the step with exit code 0 and
saves nothing (``OnExceptionCheckpoint`` would save, but during validation too, where a mid-evaluation
checkpoint does not resume exactly), and its SLURM handler saves inside the signal handler, in the middle of
whatever step is running. Here the handler only records the signal; the save happens where the periodic
checkpoints are written (after the optimiser step, ``on_train_batch_end``), so the pre-emption checkpoint
resumes exactly like them. A second signal during the save only records again, and the write is atomic.

The rest of a resume is Lightning's (weights, optimiser, scheduler, loops), the callbacks' own state, and
the training loader's (:class:`~comera_lightning.data.common.ResumableDataLoader`: the position in the epoch).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from ..utilities.atomic import TEMP_SUFFIX
from ..utilities.checkpoint_io import AtomicCheckpointIO
from ..utilities.internals import RemovalPolicyCheckpoint

__all__ = [
    "FaultTolerance",
    "capture_rng_state",
    "checkpoint_files",
    "find_resume_checkpoint",
    "requeue_slurm_job",
    "restore_rng_state",
]

CHECKPOINT_PATTERN = re.compile(r"^step=(\d+)\.ckpt$")


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
        np.random.set_state(
            (
                "MT19937",
                state["numpy_keys"].cpu().numpy().astype(np.uint32),
                pos,
                has_gauss,
                float(state["numpy_gauss"].item()),
            )
        )
    if "python" in state:
        values = [int(v) for v in state["python"].tolist()]
        gauss = float(state["python_gauss"].item())
        random.setstate((values[0], tuple(values[1:]), None if gauss != gauss else gauss))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].detach().to("cpu", torch.uint8), device)


# ---------------------------------------------------------------------------------------------- finding checkpoints
def checkpoint_files(dirpath: str | os.PathLike[str]) -> list[Path]:
    """The step checkpoints in ``dirpath`` (``step=<n>.ckpt``), newest (highest step, then latest) first.

    Hidden and temporary files never match.
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
        except Exception as error:
            warnings.warn(
                f"FaultTolerance: skipping checkpoint {str(path)!r}, it does not load with "
                f"weights_only=True: {type(error).__name__}: {error}",
                stacklevel=2,
            )
            continue
        return path
    return None


def requeue_slurm_job() -> None:
    """Put this SLURM job (or array task) back into the queue (``scontrol requeue``), as Lightning's SLURM
    handler does; a failure is reported, not raised."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job:
        rank_zero_warn("FaultTolerance: cannot requeue, SLURM_JOB_ID is not set")
        return
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    except OSError as error:
        rank_zero_warn(f"FaultTolerance: `scontrol requeue {job}` failed: {error}; resubmit the job by hand")
        return
    if result.returncode == 0:
        rank_zero_info(f"FaultTolerance: requeued SLURM job {job}")
    else:
        rank_zero_warn(
            f"FaultTolerance: `scontrol requeue {job}` failed ({result.returncode}): "
            f"{result.stderr.strip()}; resubmit the job by hand"
        )


# ---------------------------------------------------------------------------------------------- callback
class FaultTolerance(RemovalPolicyCheckpoint):
    """Write a resumable checkpoint every ``every_n_steps`` optimiser steps, atomically, keeping ``keep``.

    Resume with ``trainer.fit(..., ckpt_path=find_resume_checkpoint(dirpath), weights_only=True)`` (the
    ``comera`` CLI: ``comera fit ... --resume auto``). Like any ``ModelCheckpoint`` it runs after the other
    callbacks' ``on_train_batch_end`` and cannot be combined with ``Trainer(enable_checkpointing=False)``;
    when it is the first checkpoint callback it is ``trainer.checkpoint_callback`` (the ``comera`` CLI puts
    a user ``ModelCheckpoint`` first). Its state, under the key ``FaultTolerance``, is in every checkpoint
    the trainer writes, so resuming from any of them restores the random streams.

    Args:
        every_n_steps: checkpoint interval in optimiser steps (the most work a kill can lose); 0 disables
            writing (the random-state restore on resume still works).
        dirpath: where the step checkpoints go; ``None`` is ``<trainer.default_root_dir>/fault_tolerance``.
            Use a folder that is the same for every launch of one experiment.
        keep: how many of the newest step checkpoints to keep (>= 1).
        atomic_io: replace the trainer's plain ``TorchCheckpointIO`` by
            :class:`~comera_lightning.utilities.checkpoint_io.AtomicCheckpointIO`.
        signals: the signals that pre-empt the run (names): the step in flight finishes, a step checkpoint is
            written and the process exits with ``128 + signal number``; ``[]`` leaves signals to Lightning.
            Under SLURM with auto-requeue (Lightning's default there) the requeue signal is always one of
            them, and after its save global rank 0 requeues the job (``scontrol requeue``).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        dirpath: str | None = None,
        keep: int = 2,
        atomic_io: bool = True,
        signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
    ) -> None:
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0 disables), got {every_n_steps}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        known = {s.name for s in signal.Signals}
        unknown = [name for name in signals if str(name).upper() not in known]
        if unknown:
            raise ValueError(f"signals: unknown signal name(s) {unknown}; use names such as SIGTERM, SIGUSR1")
        # save_on_train_epoch_end: never defer a step checkpoint to the end of a validation
        super().__init__(
            dirpath=dirpath,
            filename="step={step:09d}",
            monitor="step",
            mode="max",
            save_top_k=keep,
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_steps,
            every_n_epochs=0,
            save_on_train_epoch_end=True,
        )
        self.every_n_steps = int(every_n_steps)
        self.keep = int(keep)
        self.atomic_io = atomic_io
        self.resumed_from: dict[str, Any] | None = None  #: {"step", "run_id"} of the checkpoint resumed from
        self._trainer: Trainer | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._current_run_id: str | None = None
        self._restored_step: int | None = None
        self.signals = [signal.Signals[str(name).upper()] for name in signals]
        self.received_signal: int | None = None  #: the pre-empting signal this process received, if any
        self._previous_handlers: dict[int, Any] = {}
        self._step_at_batch_start = -1

    @property
    @override
    def state_key(self) -> str:
        return type(self).__qualname__

    # --- hooks ---------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dirpath is None:  # identical on every rank: the default root dir is
            self.dirpath = os.path.realpath(Path(trainer.default_root_dir) / "fault_tolerance")
        with warnings.catch_warnings():  # a resumed run's folder is not empty, by design
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)
        self._trainer = trainer
        if stage == "fit" and self.atomic_io and type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        folder = self._folder()
        if not trainer.is_global_zero or not folder.is_dir():
            return
        for tmp in folder.glob(f".step=*{TEMP_SUFFIX}"):  # left behind by a killed writer
            tmp.unlink(missing_ok=True)
        if not self.every_n_steps or (trainer.ckpt_path is not None and self._restored_step is None):
            return  # off, or resumed from a checkpoint without this callback's state: leave the files alone
        # what the restored state tracks is this run's history; anything else (a fresh run's predecessors,
        # an abandoned continuation, files that did not load) would mislead a later resume
        tracked = set()
        if trainer.ckpt_path is not None:
            tracked = {Path(p).resolve() for p in [*self.best_k_models, trainer.ckpt_path]}
        stale = [path for path in checkpoint_files(folder) if path.resolve() not in tracked]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            rank_zero_info(
                f"FaultTolerance: removed {len(stale)} step checkpoint(s) that are not this run's "
                f"from {folder}: {', '.join(p.name for p in stale)}"
            )

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._restored_step = None
        if self.state_key in checkpoint.get("callbacks", {}):
            self._restored_step = int(checkpoint.get("global_step", -1))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._install_signal_handlers(trainer)
        self._current_run_id = self._run_id(trainer) if trainer.is_global_zero else None
        if self._pending_rng is not None:
            self._restore_rng(trainer, self._pending_rng)
            self._pending_rng = None
        if self.resumed_from is not None:
            self._tag_resumed_run(trainer)

    # --- pre-emption ----------------------------------------------------------------------------------
    def _preemption_signals(self, trainer: Trainer) -> list[signal.Signals]:
        wanted = list(self.signals)
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
            wanted.append(signal.Signals(environment.requeue_signal))
        return list(dict.fromkeys(wanted))

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # only record: a signal handler runs between two bytecodes of whatever is running (a step, a save)
        if self.received_signal is None:
            self.received_signal = signum

    def _install_signal_handlers(self, trainer: Trainer) -> None:
        # after Lightning's own (registered just before the loops run), which are put back at teardown
        self.received_signal = None
        for signum in self._preemption_signals(trainer):
            try:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread: signals cannot be handled here
                return

    def _restore_signal_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self._previous_handlers or trainer.global_step == self._step_at_batch_start:
            return  # not handling signals, or an accumulation micro-batch: no optimiser step yet
        # every process decides together (a signal may reach the ranks at different steps)
        if not trainer.strategy.reduce_boolean_decision(self.received_signal is not None, all=False):
            return
        self._preempt(trainer)

    def _preempt(self, trainer: Trainer) -> None:
        signum = self.received_signal or signal.SIGTERM  # another rank's signal: exit as it does
        self.save_now(trainer)
        path = self.best_model_path or None  # monitor "step", mode "max": the newest step checkpoint
        name = signal.Signals(signum).name
        code = 128 + int(signum)
        environment = getattr(trainer.strategy, "cluster_environment", None)
        requeue = (
            isinstance(environment, SLURMEnvironment)
            and environment.auto_requeue
            and signum == environment.requeue_signal
        )
        if trainer.is_global_zero:
            where = f"wrote the step checkpoint {path}" if path else "no checkpoint folder"
            rank_zero_info(
                f"FaultTolerance: received {name}; finished step {trainer.global_step}, "
                f"{where}; exiting with code {code}. Resume with `comera fit ... --resume auto` "
                "(or Trainer.fit(..., ckpt_path=find_resume_checkpoint(dirpath)))."
            )
            if requeue:
                requeue_slurm_job()
        raise SIGTERMException(code)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_signal_handlers()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore_signal_handlers()

    @override
    def should_remove(self, trainer: Trainer, previous: str, current: str) -> bool:
        # ModelCheckpoint never removes the file a run resumed from; here it is an old step like any other
        return previous != current and Path(previous).resolve().parent == self._folder().resolve()

    def _folder(self) -> Path:
        """``dirpath``, which :meth:`setup` sets when it was ``None``."""
        if self.dirpath is None:
            raise RuntimeError("FaultTolerance has no folder before Trainer.fit sets it up")
        return Path(self.dirpath)

    # --- random state --------------------------------------------------------------------------------
    @staticmethod
    def _collate_fns(trainer: Any) -> list[Any]:
        """Collate functions of the training loaders that keep random state in this process."""
        try:
            loaders = trainer.train_dataloader
        except Exception:
            return []
        if isinstance(loaders, dict):
            loaders = list(loaders.values())
        elif not isinstance(loaders, (list, tuple)):
            loaders = [loaders]
        found = []
        for loader in loaders:
            collate = getattr(loader, "collate_fn", None)
            if (
                getattr(loader, "num_workers", 0) == 0
                and callable(getattr(collate, "state_dict", None))
                and callable(getattr(collate, "load_state_dict", None))
            ):
                found.append(collate)
        return found

    def _gather_rng(self) -> dict[str, Any]:
        """Every process's random streams (global ones and its training collate functions'), by rank."""
        trainer = self._trainer
        if trainer is None:  # not attached to a trainer: this process's streams only
            return {"world_size": 1, "ranks": [capture_rng_state()]}
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
        return {"world_size": world, "ranks": [{k: v[r].clone() for k, v in gathered.items()} for r in range(world)]}

    def _restore_rng(self, trainer: Trainer, rng: dict[str, Any]) -> None:
        ranks = rng.get("ranks") or []
        rank = trainer.global_rank
        if len(ranks) != trainer.world_size:
            rank_zero_warn(
                f"FaultTolerance: the checkpoint's random state is from {len(ranks)} process(es), this "
                f"run has {trainer.world_size}; random streams continue from the seed instead"
            )
            return
        state = ranks[rank]
        restore_rng_state(state, trainer.strategy.root_device)
        for i, collate in enumerate(self._collate_fns(trainer)):
            prefix = f"collate{i}."
            part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            if part:
                collate.load_state_dict({"rank": getattr(collate, "rank", rank), **part})

    # --- MLflow tags ---------------------------------------------------------------------------------
    @staticmethod
    def _run_id(trainer: Trainer) -> str | None:
        for logger in trainer.loggers:
            run_id = getattr(logger, "run_id", None)
            if isinstance(run_id, str):
                return run_id
        return None

    def _tag_resumed_run(self, trainer: Trainer) -> None:
        if not trainer.is_global_zero:
            return
        assert self.resumed_from is not None
        for logger in trainer.loggers:
            set_tag = getattr(getattr(logger, "experiment", None), "set_tag", None)  # an MlflowClient's
            run_id = getattr(logger, "run_id", None)
            if isinstance(run_id, str) and callable(set_tag):
                set_tag(run_id, "comera.resumed_from_step", str(self.resumed_from["step"]))
                if self.resumed_from.get("run_id"):
                    set_tag(run_id, "comera.resumed_from_run", str(self.resumed_from["run_id"]))

    # --- state ---------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "version": 2, "run_id": self._current_run_id, "rng": self._gather_rng()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "best_model_path" in state_dict:  # absent from version 1 states
            super().load_state_dict(state_dict)
        rng = state_dict.get("rng")
        self._pending_rng = rng if isinstance(rng, dict) else None
        step = self._restored_step if self._restored_step is not None else state_dict.get("step")
        self.resumed_from = {"step": step, "run_id": state_dict.get("run_id")}
