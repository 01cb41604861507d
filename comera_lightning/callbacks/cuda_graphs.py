"""CudaGraphs (experimental): capture the whole training step (forward, backward, optimiser step) in CUDA graphs.

Small TT factors make many small kernels; on a GPU their launch overhead, not their FLOPs, can bound a
CoMERA step. A CUDA graph records the kernels of one step once and replays them with one launch.

The first route to CUDA graphs is torch's own: ``torch.compile(model, mode="reduce-overhead")`` (for
example in ``LightningModule.configure_model``) compiles the forward and backward and replays them as
CUDA graphs. ``TTLinear`` and ``TTEmbedding`` compile without graph breaks (host-side checks and id
deduplication are skipped while tracing, contraction plans are resolved outside the graph), and
:class:`~comera_lightning.callbacks.ContractionPlanner` works under it.

This callback is the experimental second route: it captures the optimiser step too, for any
LightningModule trained with automatic optimisation, without changing it. It has not been run on a GPU
yet (it warns so at setup); ``benchmarks/bench_cuda_graphs.py`` is the prepared first run. Its capture
backends live in :mod:`comera_lightning.callbacks.cuda_graph_backends`.

How a step runs (``backend="cuda"``), inside Lightning's own loop and hooks:

1. ``training_step`` is swapped for a function that copies the batch into static input buffers and
   replays graph 1 (``training_step`` + ``loss.backward()``, captured with the gradients set to ``None``
   so the backward *writes* fresh gradients into static tensors each replay). It returns clones of the
   static outputs; ``self.log`` calls made inside ``training_step`` are recorded at capture and re-issued
   after every replay with that step's values.
2. Lightning then runs, eagerly, everything it runs between backward and the optimiser step:
   ``on_before_backward``/``on_after_backward``, ``on_before_optimizer_step`` of the module and of every
   callback (RankAdaptation adds its penalty gradient here, DivergenceGuard drops bad steps) and gradient
   clipping. They see the real gradients and must change them in place (``add_``, ``mul_``,
   ``clip_grad_norm_`` do); ``backward`` and ``optimizer_zero_grad`` are no-ops while the callback is active.
3. The torch optimiser's ``step`` is swapped for a replay of graph 2 (``optimizer.step()``; Adam/AdamW
   with ``capturable=True``, the learning rate a 0-dim device tensor that LR schedulers ``fill_`` in place).
   When a hook replaced or dropped a gradient tensor, that one step runs the optimiser eagerly instead,
   which treats ``None`` gradients exactly as eager training does.

So the captured part is the whole step except the hooks between backward and the optimiser step, which
keep their Python logic (RankAdaptation's decisions need host values).

Never a stale graph: before every replay a fingerprint of everything the graphs read by address or bake
in as constants is compared with the one taken at capture: parameter and buffer storages and shapes,
optimiser state tensors, every non-tensor hyperparameter of the param groups, the optimiser object, the
layers' ``contraction_plan``. A physical truncation (new parameter storages, sliced AdamW state, new
mask buffers), a restored checkpoint (new state tensors and groups) or a float learning rate that
changed all differ, and the graphs are dropped and re-captured after ``warmup_steps`` eager steps (real
training steps, on the capture stream). :meth:`CudaGraphs.invalidate` (or
:func:`invalidate_cuda_graphs`) does the same on request.

Supported, checked at fit start (anything else raises with the reason and the fix): automatic
optimisation, one optimiser (Adam/AdamW/any torch optimiser with a ``capturable`` option, or SGD),
no gradient accumulation, a single device (no DDP/FSDP), precision ``32-true``, ``bf16-mixed``,
``bf16-true``/``16-true`` or ``64-true`` (``16-mixed``'s GradScaler synchronises with the host and cannot
be captured), ``backward``/``optimizer_zero_grad`` not overridden. Batches of another shape than the
captured one (a short last batch) run eagerly (or raise, ``shape_change="error"``).

What the captured ``training_step`` must be (a CUDA graph runs kernels, not Python): only tensor ops on
the batch and the parameters, no host synchronisation (``.item()``, ``float(t)``, printing tensors,
boolean-mask indexing, ``torch.unique``/``nonzero``, data-dependent Python branches), no dependence on
``batch_idx`` or other Python values that change between steps, no torchmetrics objects logged. A host
synchronisation fails the capture with :class:`CudaGraphCaptureError`, which says so. Random ops
(dropout) replay with fresh random numbers, but not the same ones as eager mode.

After fit the optimiser keeps ``capturable=True`` and tensor learning rates; checkpoints are written with
plain float learning rates and ``capturable=False`` so an eager run on any device loads them.

On a machine without CUDA (or when training on the CPU) the callback is inactive: it warns once and
training runs eagerly (``backend="cuda"`` makes that an error). ``backend="replay"`` runs the same
plumbing on any device with an eager stand-in for the graph backend; it has no speed benefit and exists
to test and debug the plumbing without a GPU. Everything but the thin CUDA backend is tested that way.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from typing_extensions import override

from ..utilities.internals import buffer_slots, carry_scheduler_mark, record_optimizer_step, trainer_callbacks
from .cuda_graph_backends import (
    CudaGraphBackend,
    CudaGraphCaptureError,
    Graph,
    GraphBackend,
    ReplayBackend,
    StaleGraphError,
)

__all__ = ["CudaGraphCaptureError", "CudaGraphs", "StaleGraphError", "invalidate_cuda_graphs"]


# --- helpers ---------------------------------------------------------------------------------------------
def _tensors(data: Any) -> list[Tensor]:
    """Tensor leaves of a (nested) batch or output, in a fixed traversal order."""
    found: list[Tensor] = []
    apply_to_collection(data, Tensor, found.append)
    return found


def _refill(template: Any, values: Sequence[Tensor]) -> Any:
    """``template`` with its tensor leaves replaced, in order, by ``values``."""
    it = iter(values)
    return apply_to_collection(template, Tensor, lambda _: next(it))


def _signature(tensors: Sequence[Tensor]) -> tuple:
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return None


def _autocast_without_cache(device_type: str) -> contextlib.AbstractContextManager:
    # Autocast caches the low-precision copies of the weights; a graph that captured a cache hit would keep
    # replaying the copy of the weights from capture time. Nest an autocast of the same kind without the cache.
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)


def _backward_context(device_type: str) -> contextlib.AbstractContextManager:
    # Lightning runs backward outside autocast; the step runs inside its autocast context, so leave it here.
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


_SUPPORTED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


class _Watch:
    """The per-step staleness check, cheap enough to run twice a step (tens of microseconds for a six-layer
    encoder; :meth:`CudaGraphs.graph_key` builds the same fingerprint from scratch in milliseconds).

    Recorded at capture, by identity where a replacement means a new address (optimiser state and its
    containers, param-group tensors, buffers), by storage address for parameters (truncation swaps ``.data``),
    by value for Python constants (hyperparameters, contraction plans, train mode). Not seen: a per-parameter
    state dict swapped for a new one inside the same ``optimizer.state`` (torch and this project only ever replace
    the whole container, on ``load_state_dict``, or entries, on truncation); ``graph_key`` does see it."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        self.training = module.training
        self.state, self.groups = optimizer.state, optimizer.param_groups
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.ptrs = [p.data_ptr() for p in self.params]
        self.group_lists = [(group, group["params"], len(group["params"]), len(group)) for group in self.groups]
        self.group_tensors = [
            (g, k, v) for g in self.groups for k, v in g.items() if k != "params" and torch.is_tensor(v)
        ]
        self.constant_keys = [
            [k for k, v in g.items() if k != "params" and not torch.is_tensor(v)] for g in self.groups
        ]
        self.constants = [tuple(g[k] for k in keys) for g, keys in zip(self.groups, self.constant_keys, strict=True)]
        self.state_dicts = [st for p in self.params if (st := optimizer.state.get(p)) is not None]
        self.n_state = len(optimizer.state)
        self.state_sizes = [len(st) for st in self.state_dicts]
        self.state_values = [v for st in self.state_dicts for v in st.values()]
        self.buffer_keys = buffer_slots(module)
        self.buffer_values = [d[name] for d, name in self.buffer_keys]
        self.plans = [(m, m.contraction_plan) for m in module.modules() if hasattr(m, "contraction_plan")]

    def unchanged(self) -> bool:
        opt = self.optimizer
        if opt.state is not self.state or opt.param_groups is not self.groups or self.module.training != self.training:
            return False
        if any(
            g["params"] is not params or len(params) != n or len(g) != size for g, params, n, size in self.group_lists
        ):
            return False
        if [p.data_ptr() for p in self.params] != self.ptrs:
            return False
        if len(opt.state) != self.n_state or [len(st) for st in self.state_dicts] != self.state_sizes:
            return False
        if not all(map(operator.is_, [v for st in self.state_dicts for v in st.values()], self.state_values)):
            return False
        if any(g.get(k) is not v for g, k, v in self.group_tensors):
            return False
        # tuple equality tries identity first: unchanged floats cost nothing
        if any(
            tuple(g.get(k) for k in keys) != values
            for g, keys, values in zip(self.groups, self.constant_keys, self.constants, strict=True)
        ):
            return False
        if not all(map(operator.is_, [d.get(name) for d, name in self.buffer_keys], self.buffer_values)):
            return False
        return all(m.contraction_plan == plan for m, plan in self.plans)


class CudaGraphs(Callback):
    """Capture forward, backward and optimiser step in CUDA graphs; re-capture whenever the state they
    read changed (truncation, restore, a changed hyperparameter). See the module docstring for the design.

    Experimental: unverified on a GPU (it warns once at setup). Try ``torch.compile(mode="reduce-overhead")``
    first.

    Args:
        backend: ``"auto"``: CUDA graphs when training on a CUDA device, otherwise inactive with a one-time
            warning; ``"cuda"``: the same but an error where CUDA graphs are impossible; ``"replay"``: the eager
            stand-in backend on any device (tests and debugging, no speed-up).
        warmup_steps: eager training steps (on the capture stream) before each capture, at the start and after
            every invalidation; they are real steps, not extra ones. At least 1 (optimiser state must exist).
        tensor_lr: turn the learning rates into 0-dim device tensors so LR schedulers update the captured
            step in place; with False every change of a float learning rate forces a re-capture.
        shape_change: what a batch of another shape than the captured one does: ``"eager"`` (that step runs
            eagerly, graphs kept) or ``"error"``.
    """

    def __init__(
        self,
        backend: Literal["auto", "cuda", "replay"] = "auto",
        warmup_steps: int = 3,
        tensor_lr: bool = True,
        shape_change: Literal["eager", "error"] = "eager",
    ) -> None:
        if backend not in ("auto", "cuda", "replay"):
            raise ValueError(f"backend must be 'auto', 'cuda' or 'replay', got {backend!r}")
        if warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be >= 1 (the optimiser state must exist before capture), got {warmup_steps}"
            )
        if shape_change not in ("eager", "error"):
            raise ValueError(f"shape_change must be 'eager' or 'error', got {shape_change!r}")
        self.backend = backend
        self.warmup_steps = warmup_steps
        self.tensor_lr = tensor_lr
        self.shape_change = shape_change
        # counters (per fit)
        self.captures = 0  # captures of the forward+backward graph
        self.step_captures = 0  # captures of the optimiser-step graph
        self.replays = 0  # steps whose forward+backward was a replay
        self.step_replays = 0  # optimiser steps that were a replay
        self.eager_steps = 0  # warm-up and fallback steps
        self.invalidations: list[str] = []
        self._backend: GraphBackend | None = None
        self._inactive_reason: str | None = None
        self._warned_experimental = False
        self._warned_inactive = False
        self._warned_shape = False
        self._warned_often = False
        self._reset_graphs()
        self._module: LightningModule | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._original_step: Callable[..., Any] | None = None
        self._saved_step: Callable[..., Any] | None = None
        self._device_type = "cpu"
        self._mode: str | None = None

    # --- state --------------------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True while steps go through the graph backend (fit on a supported setup)."""
        return self._backend is not None

    def pool_idle_bytes(self) -> int:
        """Bytes the captured graphs' private memory pool holds beyond live tensors: the replayed step's
        intermediates, which ``torch.cuda.max_memory_allocated`` misses (0 on the replay backend or inactive)."""
        return self._backend.pool_idle_bytes() if self._backend is not None else 0

    def _reset_graphs(self) -> None:
        self._graph_fb: Graph | None = None
        self._graph_step: Graph | None = None
        self._static_inputs: list[Tensor] = []
        self._static_batch: Any = None
        self._input_signature: tuple | None = None
        self._output_template: Any = None
        self._n_outputs = 0
        self._log_records: list[tuple[str, Any, dict[str, Any], int | None]] = []
        self._grad_params: list[torch.nn.Parameter] = []
        self._static_grads: list[Tensor] = []
        self._watch: _Watch | None = None
        self._warmup_left = self.warmup_steps
        self._prepared = False

    def invalidate(self, reason: str = "requested") -> None:
        """Drop the graphs; the next steps warm up eagerly and capture again. Safe to call at any time."""
        if self._graph_fb is None and self._graph_step is None:
            self._warmup_left = self.warmup_steps  # a capture pending: warm up afresh on the new state
            self._prepared = False
            return
        self.invalidations.append(reason)
        rank_zero_info(f"CudaGraphs: graphs dropped ({reason}); re-capturing after {self.warmup_steps} eager steps")
        if len(self.invalidations) == 5 and not self._warned_often:
            rank_zero_warn(
                f"CudaGraphs: the graphs were re-captured 5 times (last: {reason}); frequent re-captures "
                "cost more than they save. A float learning rate changed by a scheduler (use Adam/AdamW "
                "with tensor_lr=True) or Python state changing every step are typical causes",
                category=UserWarning,
            )
            self._warned_often = True
        # the gradients stay (the next eager step replaces them): invalidated between the backward and the optimiser
        # step (a hook changed what the graphs read, or called this), the step then runs eagerly on them
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        self._reset_graphs()
        if self._backend is not None:
            self._backend.release()

    # --- setup checks ---------------------------------------------------------------------------------------
    def _select_backend(self, trainer: Trainer) -> GraphBackend | None:
        if self.backend == "replay":
            return ReplayBackend()
        device = trainer.strategy.root_device
        if not torch.cuda.is_available():
            reason = "no CUDA device is available (this torch build or machine has none)"
        elif device.type != "cuda":
            reason = f"training runs on {device.type!r}, not on a CUDA device"
        else:
            return CudaGraphBackend(device)
        if self.backend == "cuda":
            raise RuntimeError(
                f"CudaGraphs(backend='cuda') cannot capture: {reason}. Train on a CUDA device "
                "(--trainer.accelerator gpu) or use backend='auto' to run eagerly where CUDA is "
                "missing"
            )
        self._inactive_reason = reason
        return None

    def check_supported(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Raise a ValueError naming the problem and the fix when the setup cannot run a captured step."""
        problems = []
        if not pl_module.automatic_optimization:
            problems.append(
                "manual optimisation is not supported: the callback captures Lightning's automatic "
                "step; capture your own step with torch.cuda.graph instead"
            )
        if len(trainer.optimizers) != 1:
            problems.append(
                f"exactly one optimiser is supported, configure_optimizers returned {len(trainer.optimizers)}"
            )
        else:
            optimizer = trainer.optimizers[0]
            if not ("capturable" in optimizer.defaults or isinstance(optimizer, torch.optim.SGD)):
                problems.append(
                    f"{type(optimizer).__name__} has no capturable mode; use AdamW/Adam (capturable) or SGD"
                )
        if trainer.accumulate_grad_batches != 1:
            problems.append(
                f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches}) is not "
                "supported: use a larger batch instead"
            )
        if not isinstance(trainer.strategy, SingleDeviceStrategy):
            problems.append(
                f"strategy {type(trainer.strategy).__name__} is not supported: only single-device training "
                "is captured (DDP's gradient hooks run during backward); use devices=1"
            )
        plugin = trainer.precision_plugin
        if (
            type(plugin) not in _SUPPORTED_PRECISION
            or getattr(plugin, "scaler", None) is not None
            or getattr(plugin, "precision", None) == "16-mixed"
        ):
            problems.append(
                f"precision {getattr(plugin, 'precision', type(plugin).__name__)!r} is not supported: fp16 "
                "mixed precision's GradScaler checks for overflow on the host, which a graph cannot do; "
                "use precision='bf16-mixed' or '32-true'"
            )
        for hook in ("backward", "optimizer_zero_grad"):
            if is_overridden(hook, pl_module, LightningModule):
                problems.append(
                    f"the LightningModule overrides {hook}(), which the captured step replaces; remove the "
                    "override (gradients are written fresh every step)"
                )
        if problems:
            raise ValueError(
                "CudaGraphs cannot capture this training setup:\n- "
                + "\n- ".join(problems)
                + "\nRemove the CudaGraphs callback to train eagerly."
            )

    # --- Lightning hooks ----------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not self._warned_experimental:
            rank_zero_warn(
                "CudaGraphs is experimental and unverified on a GPU (benchmarks/bench_cuda_graphs.py is "
                "its first real run); torch.compile(model, mode='reduce-overhead') is the supported route "
                "to CUDA graphs.",
                category=UserWarning,
            )
            self._warned_experimental = True
        self._backend = self._select_backend(trainer)
        if self._backend is None and not self._warned_inactive:
            rank_zero_warn(
                f"CudaGraphs is inactive: {self._inactive_reason}. Training runs eagerly, without CUDA "
                "graphs (pass backend='cuda' to make this an error).",
                category=UserWarning,
            )
            self._warned_inactive = True

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._backend is not None:
            self.check_supported(trainer, pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._backend is None:
            return
        self.captures = self.step_captures = self.replays = self.step_replays = self.eager_steps = 0
        self.invalidations = []
        self._device_type = trainer.strategy.root_device.type
        self._install(pl_module, trainer.optimizers[0])
        rank_zero_info(
            f"CudaGraphs: capturing the training step with the {self._backend.name} backend after "
            f"{self.warmup_steps} eager steps"
        )

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._uninstall()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._uninstall()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._uninstall()

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # keep checkpoints loadable by an eager run on any device: plain float learning rates, capturable off
        if not self.active:
            return
        for state in checkpoint.get("optimizer_states", []):
            for group in state.get("param_groups", []):
                if torch.is_tensor(group.get("lr")):
                    group["lr"] = float(group["lr"])
                if group.get("capturable"):
                    group["capturable"] = False

    def comera_metrics(self) -> dict[str, float]:
        """Counters for RankMonitor: captures, replays, eager steps, invalidations."""
        if not self.active:
            return {}
        return {
            "cuda_graphs/captures": float(self.captures),
            "cuda_graphs/replays": float(self.replays),
            "cuda_graphs/eager_steps": float(self.eager_steps),
            "cuda_graphs/invalidations": float(len(self.invalidations)),
        }

    # --- driving the step without a Trainer (benchmarks) -----------------------------------------------------
    def attach(self, module: LightningModule, optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
        """Install the captured step on ``module``/``optimizer`` outside a Trainer: afterwards one call of
        ``module.training_step(batch, batch_idx)`` (inside the autocast context the run uses) followed by
        ``optimizer.step()`` is one training step, eager for the first ``warmup_steps``, then replayed.
        No checks, no hooks between backward and step, no logging (``self.log`` needs a Trainer).
        :meth:`detach` undoes it. Used by ``benchmarks/bench_cuda_graphs.py`` to time the bare step."""
        device = torch.device(device)
        if self.backend == "replay":
            self._backend = ReplayBackend()
        elif device.type == "cuda" and torch.cuda.is_available():
            self._backend = CudaGraphBackend(device)
        else:
            raise RuntimeError(
                f"CudaGraphs.attach: CUDA graphs need a CUDA device, got {device} (backend='replay' "
                "runs the plumbing eagerly anywhere)"
            )
        self._device_type = device.type
        self._install(module, optimizer)

    def detach(self) -> None:
        """Undo :meth:`attach`: the module's and optimiser's own methods are back, the graphs dropped."""
        self._uninstall()
        self._backend = None

    # --- installing the step ------------------------------------------------------------------------------
    def _install(self, pl_module: LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self._uninstall()
        self._module, self._optimizer = pl_module, optimizer
        self._original_training_step = pl_module.training_step
        _shadow(pl_module, "training_step", self._training_step)  # instance attributes shadow the class's hooks
        _shadow(pl_module, "backward", _no_op)
        _shadow(pl_module, "optimizer_zero_grad", _no_op)
        self._saved_step = optimizer.__dict__.get("step")  # e.g. an LR scheduler's step counter wrapper
        self._original_step = optimizer.step

        def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            return self._optimizer_step(closure, **kwargs)

        carry_scheduler_mark(step, self._original_step)  # keeps the LR scheduler's order check quiet
        _shadow(optimizer, "step", step)
        self._reset_graphs()

    def _uninstall(self) -> None:
        module, optimizer = self._module, self._optimizer
        if module is not None:
            for name in ("training_step", "backward", "optimizer_zero_grad"):
                module.__dict__.pop(name, None)
        if optimizer is not None:
            optimizer.__dict__.pop("step", None)
            if self._saved_step is not None:
                _shadow(optimizer, "step", self._saved_step)
            self._saved_step = None
        if module is not None or optimizer is not None:
            self._drop_graphs()  # the last step's gradients stay readable, as in eager training
        self._module = self._optimizer = None

    # --- the fingerprint of everything a graph bakes in ----------------------------------------------------
    def graph_key(self) -> tuple:
        """What the captured graphs read by address or hold as constants, built from scratch (milliseconds).

        (Not ``state_key``: that is the Callback property Lightning keys a callback's checkpoint state by.)

        The replay backend compares it on every replay (an independent check of the fast per-step
        :class:`_Watch`); also handy to debug unexpected re-captures.
        """
        module, optimizer = self._module, self._optimizer
        assert module is not None and optimizer is not None
        items: list[Any] = [id(optimizer), id(optimizer.state), id(optimizer.param_groups), module.training]
        for group in optimizer.param_groups:
            for key, value in group.items():
                if key != "params":
                    items.append((key, value.data_ptr() if torch.is_tensor(value) else value))
            for param in group["params"]:
                items.append((id(param), param.data_ptr(), param.shape))
                state = optimizer.state.get(param)
                if state:
                    items.extend((k, v.data_ptr() if torch.is_tensor(v) else v) for k, v in state.items())
        for buffer in module.buffers():
            items.append((buffer.data_ptr(), buffer.shape))
        for submodule in module.modules():
            plan = getattr(submodule, "contraction_plan", None)
            if plan is not None:
                items.append((id(submodule), plan))
        return tuple(items)

    def _check_key(self) -> None:
        if self._watch is not None and not self._watch.unchanged():
            self.invalidate("parameters, buffers, optimiser state or hyperparameters changed")

    # --- the step -----------------------------------------------------------------------------------------
    def _training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        assert self._backend is not None and self._module is not None and self._optimizer is not None
        self._check_key()
        if not self._prepared:
            self._backend.prepare_optimizer(self._optimizer, self.tensor_lr)
            self._prepared = True
        inputs = _tensors(batch)
        if self._graph_fb is not None and _signature(inputs) != self._input_signature:
            if self.shape_change == "error":
                raise ValueError(
                    f"CudaGraphs: a batch with tensors {[tuple(t.shape) for t in inputs]} differs from "
                    f"the captured {[tuple(s[0]) for s in self._input_signature or ()]}; use "
                    "drop_last=True (or shape_change='eager')"
                )
            if not self._warned_shape:
                rank_zero_warn(
                    "CudaGraphs: a batch of another shape than the captured one runs eagerly (e.g. a "
                    "short last batch; drop_last=True avoids it)",
                    category=UserWarning,
                )
                self._warned_shape = True
            return self._eager_forward_backward(batch, args, kwargs)
        if self._graph_fb is None and self._warmup_left > 0:
            self._warmup_left -= 1
            return self._eager_forward_backward(batch, args, kwargs)
        if self._graph_fb is None:
            # again right before capture: a restore during warm-up may have brought back non-capturable groups
            self._backend.prepare_optimizer(self._optimizer, self.tensor_lr)
            self._capture_forward_backward(batch, inputs, args, kwargs)
        else:
            with torch.no_grad():
                for static, value in zip(self._static_inputs, inputs, strict=True):
                    static.copy_(value, non_blocking=True)
        assert self._graph_fb is not None
        self._graph_fb.replay()
        self.replays += 1
        self._mode = "graph"
        for param, grad in zip(self._grad_params, self._static_grads, strict=True):
            if param.grad is not grad:
                param.grad = grad
        outputs = self._graph_fb.outputs
        for name, value, options, index in self._log_records:
            self._module.log(name, outputs[index].clone() if index is not None else value, **options)
        return _refill(self._output_template, [t.clone() for t in outputs[: self._n_outputs]])

    def _eager_forward_backward(self, batch: Any, args: tuple, kwargs: dict) -> Any:
        assert self._backend is not None and self._module is not None
        self._mode = "eager"
        self.eager_steps += 1
        with self._backend.stream():
            for param in self._params():
                param.grad = None
            output = self._original_training_step(batch, *args, **kwargs)
            loss = _loss_of(output)
            if loss is not None:
                with _backward_context(self._device_type):
                    loss.backward()
        return output

    def _params(self) -> list[torch.nn.Parameter]:
        assert self._optimizer is not None
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def _capture_forward_backward(self, batch: Any, inputs: list[Tensor], args: tuple, kwargs: dict) -> None:
        assert self._backend is not None and self._module is not None
        module = self._module
        with torch.no_grad():
            self._static_inputs = [t.detach().clone() for t in inputs]
        self._static_batch = _refill(batch, self._static_inputs)
        self._input_signature = _signature(self._static_inputs)
        params = self._params()
        for param in params:
            param.grad = None  # before capture, so backward allocates them from the graph's pool (and writes them)
        meta: dict[str, Any] = {}

        def forward_backward() -> list[Tensor]:
            # Python here runs once per capture on CUDA (every replay on the replay backend): no host values
            for param in params:
                param.grad = None
            records: list[tuple[str, Any, dict[str, Any]]] = []

            def record_log(name: str, value: Any, *log_args: Any, **options: Any) -> None:
                if log_args:
                    raise TypeError("CudaGraphs: pass self.log options by keyword inside a captured training_step")
                if not (torch.is_tensor(value) or isinstance(value, (int, float, bool))):
                    raise CudaGraphCaptureError(
                        f"CudaGraphs: self.log({name!r}, <{type(value).__name__}>) cannot be "
                        "captured; log a tensor (update torchmetrics outside training_step)"
                    )
                records.append((name, value, options))

            _shadow(module, "log", record_log)
            try:
                with _autocast_without_cache(self._device_type):
                    output = self._original_training_step(self._static_batch, *args, **kwargs)
            finally:
                module.__dict__.pop("log", None)
            loss = _loss_of(output)
            if loss is None:
                raise CudaGraphCaptureError(
                    "CudaGraphs: training_step returned no loss; a captured step cannot be "
                    "skipped. Return the loss tensor (or a dict with 'loss')"
                )
            with _backward_context(self._device_type):
                loss.backward()
            out_tensors = [t.detach() for t in _tensors(output)]
            log_tensors = [v.detach() for _, v, _ in records if torch.is_tensor(v)]
            grad_params = [p for p in params if p.grad is not None]
            meta.update(output=output, records=records, n_outputs=len(out_tensors), grad_params=grad_params)
            return [*out_tensors, *log_tensors, *(p.grad for p in grad_params if p.grad is not None)]

        preserve = list(module.buffers())
        graph = self._backend.capture(forward_backward, preserve, self.graph_key)
        self._graph_fb = graph
        self.captures += 1
        n_out = self._n_outputs = meta["n_outputs"]
        self._output_template = meta["output"]
        index = n_out
        self._log_records = []
        for name, value, options in meta["records"]:
            if torch.is_tensor(value):
                self._log_records.append((name, None, options, index))
                index += 1
            else:
                self._log_records.append((name, value, options, None))
        self._grad_params = meta["grad_params"]
        self._static_grads = graph.outputs[index:]
        assert self._optimizer is not None
        self._watch = _Watch(module, self._optimizer)

    def _optimizer_step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        assert self._original_step is not None and self._backend is not None and self._optimizer is not None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # training_step (replay or eager) + Lightning's eager hooks and clipping
        mode, self._mode = self._mode, None
        unchanged = mode == "graph" and self._watch is not None and self._watch.unchanged()
        if (
            mode == "graph"
            and self._graph_step is None
            and self._graph_fb is not None
            and self._grads_static()
            and unchanged
        ):
            self._capture_step()
        if mode == "graph" and self._graph_step is not None and self._grads_static():
            if unchanged:
                self._graph_step.replay()
                self.step_replays += 1
                record_optimizer_step(self._optimizer)  # what the LR scheduler's step wrapper would have recorded
                return loss
            self.invalidate("a hook changed parameters, optimiser state or hyperparameters within the step")
        # warm-up, fallback, or a hook replaced/dropped gradients: exactly the eager optimiser step
        with self._backend.stream():
            self._original_step(**kwargs)
        return loss

    def _grads_static(self) -> bool:
        if len(self._grad_params) != sum(1 for p in self._params() if p.grad is not None):
            return False
        return all(p.grad is g for p, g in zip(self._grad_params, self._static_grads, strict=True))

    def _capture_step(self) -> None:
        assert self._backend is not None and self._optimizer is not None and self._original_step is not None
        optimizer, step = self._optimizer, self._original_step
        preserve: list[Tensor] = list(self._params())
        for state in optimizer.state.values():
            preserve.extend(v for v in state.values() if torch.is_tensor(v))

        def optimizer_step() -> list[Tensor]:
            step()
            return []

        grads = self._params()

        def key() -> tuple:  # the step graph also reads the gradients by address
            return self.graph_key(), tuple(id(p.grad) for p in grads)

        self._graph_step = self._backend.capture(optimizer_step, preserve, key)
        self.step_captures += 1


def _shadow(owner: object, name: str, value: Any) -> None:
    """Set ``owner.name`` on the instance, in front of the class's method (``_uninstall`` pops it again)."""
    vars(owner)[name] = value


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def invalidate_cuda_graphs(trainer: Trainer, reason: str) -> None:
    """Tell every :class:`CudaGraphs` callback of ``trainer`` that captured state is stale (e.g. after a
    physical truncation); harmless when there is none. The fingerprint check finds such changes anyway."""
    for callback in trainer_callbacks(trainer):
        if isinstance(callback, CudaGraphs):
            callback.invalidate(reason)
