"""Shared machinery of the comera layers: cores, rank gates, masks, truncation and checkpoint resizing."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..tt import rank as tt_rank
from ..tt.cores import keep_grad_layout
from .distributed import full_tensor, is_sharded, write_full_

__all__ = [
    "TTLayer",
    "TruncationRecord",
    "capturing_graph",
    "cuda_graph_capturing",
    "reusing_inference_factors",
]

T = TypeVar("T")

_optimizer_steps = 0  # steps taken by any torch optimiser in this process: part of the inference cache's stamp


def _count_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


# fused optimiser kernels (``Adam(fused=True)`` and the like) update parameters without bumping their version
# counters; counting steps keeps a layer trained in eval mode from serving factors of the weights before the step
register_optimizer_step_post_hook(_count_optimizer_step)


def capturing_graph() -> bool:
    """True while a graph is being recorded: ``torch.compile`` tracing, or a CUDA graph capture.

    Code that a graph runs must be shape-static and free of host syncs, so layers and tasks skip
    data-dependent shapes (id deduplication, boolean-mask selection) and host-side input checks (an
    eager call, or the eager warm-up steps before a capture, ran them).
    """
    return torch.compiler.is_compiling() or cuda_graph_capturing()


def cuda_graph_capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph (part of :func:`capturing_graph`)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class TruncationRecord(list):
    """``[(parameter, CoreSelection), ...]`` for every parameter a truncation resized.

    The parameters keep their identity (only ``.data`` changes), so optimiser param groups stay valid;
    slice their optimiser state with :func:`comera_lightning.tt.select_rank_slices` and the selection.
    """


class _InferenceEntry(NamedTuple):
    """What :meth:`TTLayer._inference_cached` keeps: the value, the stamp it was built under, and references
    that keep the stamp's tensor ids and storage addresses from being reused while the entry lives."""

    stamp: tuple
    value: Any
    pinned: tuple


class TTLayer(nn.Module):
    """Base of :class:`TTLinear` and :class:`TTEmbedding`: a gated tensor train with a rank mask.

    Subclasses call :meth:`_init_train` with their core shapes and implement ``dense_parameters`` and
    ``mode_sizes`` (the flattened non-rank size of every core).

    Inference cache: in eval mode with autograd off (``torch.no_grad()`` / ``torch.inference_mode()``, as in
    generation and validation) a layer keeps what its forward merges from the gated cores (the merged halves)
    and reuses it while the cores, gates and masks stay unchanged, so a call costs its batch products only.
    The cache holds about ``r * (in + out)`` elements per layer (the merged halves), is not part of the
    ``state_dict``, is dropped by ``train()``, ``.to()``, loading, truncation, deepcopy and pickling, and is
    never used or filled while autograd records or a graph is being compiled or captured. Set
    ``layer.inference_cache = False`` to merge on every call.
    """

    cores: nn.ParameterList
    gates: nn.ParameterList
    max_ranks: list[int]
    rank_threshold: float
    #: reuse the merged, gated factors across eval-mode forwards without autograd (see the class docstring)
    inference_cache: bool = True
    _inference_entry: _InferenceEntry | None = None  # a class default: layers pickled before it existed load
    # inside reusing_inference_factors: the (key, value) checked on the layer's first call, served unchecked
    _reusing_factors: bool = False
    _trusted_entry: tuple[Hashable, Any] | None = None
    #: how the cores were initialised and learn (:mod:`comera_lightning.tt.parameterization`); class defaults, so
    #: layers pickled before the option existed load as ``standard``
    parameterization: str = "standard"
    _lr_scales: tuple[float, ...] = ()

    def _init_train(
        self,
        cores: Sequence[torch.Tensor],
        threshold: float,
        max_ranks: Sequence[int],
        parameterization: str = "standard",
        lr_scales: Sequence[float] | None = None,
    ) -> None:
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"rank_threshold must be in [0, 1) (gates start at 1), got {threshold}")
        self.parameterization = parameterization
        self._lr_scales = tuple(float(s) for s in lr_scales) if lr_scales is not None else ()
        self.rank_threshold = float(threshold)
        self.max_ranks = list(max_ranks)
        self.cores = nn.ParameterList([nn.Parameter(c) for c in cores])
        bond_ranks = [c.shape[-1] for c in cores[:-1]]
        device = cores[0].device
        self.gates = nn.ParameterList(
            [nn.Parameter(torch.ones(r, dtype=torch.float32, device=device)) for r in bond_ranks]
        )
        for k, r in enumerate(bond_ranks):
            self.register_buffer(f"rank_mask_{k}", torch.ones(r, dtype=torch.bool, device=device))

    # --- views ---------------------------------------------------------------------------------------
    @property
    def num_bonds(self) -> int:
        return len(self.gates)

    @property
    def rank_masks(self) -> list[torch.Tensor]:
        """Boolean active mask of every internal bond."""
        return [getattr(self, f"rank_mask_{k}") for k in range(self.num_bonds)]

    @property
    def mode_sizes(self) -> list[int]:
        """Non-rank size of each core (``s_k``, or ``v_k * e_k`` for TTM cores)."""
        return [math.prod(c.shape[1:-1]) for c in self.cores]

    @property
    def ranks(self) -> list[int]:
        """Current (allocated) ranks ``[1, r_1, ..., 1]``; shrink only through :meth:`truncate_`."""
        return [1] + [int(c.shape[-1]) for c in self.cores]

    @property
    def active_ranks(self) -> list[int]:
        """Ranks counting only active (unmasked) slices."""
        return [1] + [int(m.sum()) for m in self.rank_masks] + [1]

    def active_parameters(self) -> int:
        """Parameters of the train restricted to active slices (what truncation would leave)."""
        return tt_rank.train_parameter_count(self.mode_sizes, self.active_ranks)

    def allocated_parameters(self) -> int:
        """Core parameters currently stored (before truncation this includes masked slices)."""
        return tt_rank.train_parameter_count(self.mode_sizes, self.ranks)

    def slice_parameters(self) -> list[float]:
        """Parameters one active slice of each internal bond holds (the weighted rank penalty's bond weights)."""
        return tt_rank.bond_weights(self.mode_sizes, self.active_ranks)

    def minimum_parameters(self) -> int:
        """Parameters left with every bond at rank 1: the floor of rank adaptation."""
        return tt_rank.minimum_train_size(self.mode_sizes)

    @property
    def dense_parameters(self) -> int:  # pragma: no cover - abstract
        """Parameters of the dense layer this train replaces (excluding bias)."""
        raise NotImplementedError

    def gated_cores(self) -> list[torch.Tensor]:
        """Cores with the masked gates folded into their trailing rank index (differentiable); the cores'
        gradients arrive in their own layout, as DDP wants them."""
        # sharded parameters (FSDP2, outside its forward) are combined with the masks as their full values
        return tt_rank.apply_gates(
            [keep_grad_layout(full_tensor(core)) for core in self.cores],
            [full_tensor(gate) for gate in self.gates],
            self.rank_masks,
        )

    # --- inference cache -----------------------------------------------------------------------------
    def _serves_from_cache(self) -> bool:
        """Whether this forward may use the inference cache: enabled, eval mode, autograd off, no graph capture.

        A forward with autograd on drops the cache: weights are being trained, and an update the stamp cannot
        see (a replayed CUDA graph, a custom kernel) must not leave old factors behind for the next eval call.
        """
        if torch.is_grad_enabled():
            if self._inference_entry is not None and not capturing_graph():
                self._inference_entry = self._trusted_entry = None
            return False
        return self.inference_cache and not self.training and not capturing_graph()

    def _inference_cached(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()``, or its result from an earlier call under the same ``key`` and the same cores, gates and
        masks. Call it only when :meth:`_serves_from_cache` holds.

        The stamp is, for every tensor the merge reads, (identity, ``_version``, ``data_ptr``, shape), the count of
        optimiser steps taken in the process, and the subclass's ``key`` (what else the
        result depends on: the compute dtype, autocast). ``_version`` catches every in-place change that
        autograd tracks (``copy_`` by ``load_state_dict``, foreach/for-loop optimiser steps, gate zeroing, mask
        refreshes, also under ``no_grad``/``inference_mode``); the step count catches fused optimiser steps,
        which do not bump it; identity catches a replaced tensor (a new mask buffer,
        ``load_state_dict(assign=True)``); ``data_ptr`` and shape catch ``param.data = ...``, which keeps the
        version counter (truncation, ``.to()``, which also clear the cache themselves): a new dtype or device
        means new storage, and the entry pins the old one so its address cannot be reused. The entry holds the
        stamped tensors and their old storages so that no id or address is reused while it lives. Only
        ``param.data.<op>_()`` in eval mode, which bypasses the version counter, goes unseen: call
        :meth:`clear_inference_cache` after such a change. ``train()``, ``.to()``, loading, truncation and any
        forward with autograd on also clear it.
        """
        trusted = self._trusted_entry
        if trusted is not None and trusted[0] == key:
            return trusted[1]
        # the registries, not the ParameterList / property views: this runs on every cached call
        tensors = tuple(
            t
            for t in (*self.cores._parameters.values(), *self.gates._parameters.values(), *self._buffers.values())
            if t is not None
        )
        try:
            stamp = (key, _optimizer_steps, tuple((id(t), t._version, t.data_ptr(), t.shape) for t in tensors))
        except RuntimeError:  # inference tensors (made under inference_mode) have no version counter
            return build()
        entry = self._inference_entry
        if entry is not None and entry.stamp == stamp:
            value = entry.value
        else:
            self._inference_entry = None  # the old value is garbage before the new one is built
            value = build()
            self._inference_entry = _InferenceEntry(stamp, value, (tensors, tuple(t.detach() for t in tensors)))
        if self._reusing_factors:
            self._trusted_entry = (key, value)
        return value

    def clear_inference_cache(self) -> None:
        """Drop the merged factors kept for inference; the next eval forward without autograd merges again."""
        self._inference_entry = None
        self._trusted_entry = None

    def train(self, mode: bool = True) -> TTLayer:
        if mode:
            self.clear_inference_cache()
        return super().train(mode)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TTLayer:
        # .to() / .cuda() / .double() swap ``param.data``: dtype and device are in the stamp, but clearing
        # here also frees the old device's copy at once
        self.clear_inference_cache()
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict[str, Any]:
        # deepcopy and pickling: the copy merges afresh rather than carrying tensors stamped for the original
        state = super().__getstate__()
        state.pop("_inference_entry", None)
        state.pop("_trusted_entry", None)
        return state

    # --- rank adaptation -----------------------------------------------------------------------------
    @torch.no_grad()
    def refresh_masks_(self, threshold: float | None = None) -> list[int]:
        """Switch off every slice whose gate magnitude is <= threshold; returns the active ranks.

        Dead slices stay dead. Decisions depend only on the gate values, so processes holding identical
        parameters (DDP) reach identical masks.
        """
        threshold = self.rank_threshold if threshold is None else threshold
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1) (gates start at 1), got {threshold}")
        for gate, mask in zip(self.gates, self.rank_masks, strict=True):
            mask.copy_(tt_rank.refresh_mask(full_tensor(gate.detach()), mask, threshold))
        return self.active_ranks

    @torch.no_grad()
    def remove_slices_(self, bond: int, indices: Sequence[int]) -> None:
        """Switch off the given slices of one bond (gate zeroed, masked) for good; a bond keeps at least one.

        The layer's function changes (unlike :meth:`truncate_`); physical removal happens at the next
        :meth:`truncate_`.
        """
        if not 0 <= bond < self.num_bonds:
            raise ValueError(f"bond must be in [0, {self.num_bonds}), got {bond}")
        mask = self.rank_masks[bond]
        index = torch.as_tensor(list(indices), dtype=torch.long, device=mask.device)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= mask.numel()):
            raise ValueError(
                f"slice indices {list(indices)} out of range for bond {bond} of rank {mask.numel()}; indices must be "
                f"in [0, {mask.numel()})"
            )
        remaining = mask.clone()
        remaining[index] = False
        if not bool(remaining.any()):
            raise ValueError(
                f"removing slices {list(indices)} would leave bond {bond} without an active slice; keep at least one"
            )
        gate = full_tensor(self.gates[bond].detach()).clone()
        gate[index] = 0.0
        write_full_(self.gates[bond], gate)
        mask.copy_(remaining)

    @torch.no_grad()
    def truncate_(self) -> TruncationRecord:
        """Physically remove masked slices from cores, gates and masks; the function is unchanged.

        Parameters are resized in place (same objects), their ``.grad`` sliced alike. Returns what was
        selected so callers can slice optimiser state the same way.
        """
        record = self.truncation_plan()
        if not record:
            return record
        if any(is_sharded(param) for param, _ in record):
            raise RuntimeError(
                "this layer's parameters are sharded (FSDP2): a cut changes their shapes, which needs the model "
                "resharded; train with comera_lightning.strategies.FSDP2Strategy, whose truncate_layers_() does it "
                "(RankAdaptation calls it)"
            )
        self.clear_inference_cache()
        for param, selection in record:
            _resize_parameter(param, selection)
        self.reset_masks_after_truncation_()
        return record

    def truncation_plan(self) -> TruncationRecord:
        """What :meth:`truncate_` would cut, changing nothing: ``(parameter, selection)`` for every core and gate
        (empty when no slice is masked)."""
        record = TruncationRecord()
        if all(bool(m.all()) for m in self.rank_masks):
            return record
        core_sel, gate_sel = tt_rank.truncate_train(self.rank_masks, len(self.cores))
        record.extend([*zip(self.cores, core_sel, strict=True), *zip(self.gates, gate_sel, strict=True)])
        return record

    def reset_masks_after_truncation_(self) -> None:
        """Masks of all-active slices at the new ranks, once the masked slices were removed from the
        parameters (:meth:`truncate_` calls it; so does a sharded cut, which resizes the parameters itself)."""
        self.reset_masks_to_ranks_([int(mask.sum()) for mask in self.rank_masks])

    @torch.no_grad()
    def truncate_to_share_(self, keep: float) -> TruncationRecord:
        """Keep the leading ``keep`` share of every internal bond (at least one slice) and remove the rest.

        Fixed-rank pruning, without training the gates down: zeroes the other slices' gates, masks and
        physically truncates them (slices already dead stay dead). Pass the returned record to
        ``slice_optimizer_state`` (or, in Lightning, ``after_truncation``) so an optimiser keeps training exactly.
        """
        for gate in self.gates:
            gate[tt_rank.leading_share(gate.numel(), keep) :] = 0.0
        self.refresh_masks_()
        return self.truncate_()

    @property
    def lr_scales(self) -> list[float]:
        """The learning-rate multiplier of every core (all 1 under ``standard``); fixed at construction, so a rank
        cut or a resume keeps the optimiser groups."""
        return list(self._lr_scales) if self._lr_scales else [1.0] * len(self.cores)

    def comera_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(kind, parameter) for every core (``"core"``) and gate (``"gate"``); used for optimiser groups."""
        for core in self.cores:
            yield "core", core
        for gate in self.gates:
            yield "gate", gate

    # --- checkpoints ---------------------------------------------------------------------------------
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        """Adopt the ranks of the incoming cores (e.g. a checkpoint taken after truncation)."""
        self.clear_inference_cache()
        core_keys = [k for k in state_dict if k.startswith(f"{prefix}cores.") and k[len(prefix) + 6 :].isdigit()]
        if core_keys and len(core_keys) != len(self.cores):
            raise ValueError(
                f"checkpoint has {len(core_keys)} cores under {prefix}cores but this layer has {len(self.cores)}: "
                f"the checkpoint is from a different architecture; build the layer with the modes it was trained with"
            )
        incoming = [state_dict.get(f"{prefix}cores.{k}") for k in range(len(self.cores))]
        shapes = [tuple(t.shape) for t in incoming if t is not None]
        if len(shapes) == len(self.cores):
            self._adopt_core_shapes(shapes, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def _adopt_core_shapes(self, shapes: list[tuple[int, ...]], prefix: str) -> None:
        ranks = self.check_core_shapes(shapes, prefix)
        if ranks == self.ranks:
            return
        self.clear_inference_cache()
        for shape, core in zip(shapes, self.cores, strict=True):
            core.data = core.data.new_zeros(shape)
            core.grad = None
        for k, gate in enumerate(self.gates):
            gate.data = gate.data.new_ones(ranks[k + 1])
            gate.grad = None
        self.reset_masks_to_ranks_(ranks[1:-1])

    @torch.no_grad()
    def _copy_factors_(self, factors: Sequence[torch.Tensor]) -> None:
        """Take ``factors`` as the cores, with their ranks (a decomposition may end below the layer's)."""
        self._adopt_core_shapes([tuple(f.shape) for f in factors], "")
        for core, factor in zip(self.cores, factors, strict=True):
            core.copy_(factor)

    def reset_masks_to_ranks_(self, bond_ranks: Sequence[int]) -> None:
        """All-active masks of the given internal bond ranks (after the parameters were resized to them)."""
        self.clear_inference_cache()
        device = self.rank_masks[0].device if self.num_bonds else None
        for k, rank in enumerate(bond_ranks):
            setattr(self, f"rank_mask_{k}", torch.ones(int(rank), dtype=torch.bool, device=device))

    def check_core_shapes(self, shapes: Sequence[Sequence[int]], prefix: str = "") -> list[int]:
        """The ranks ``[1, r_1, ..., 1]`` of incoming core ``shapes`` (a checkpoint's), after checking that this layer
        can take them (same modes, consistent ranks within the modes' limits); raises ``ValueError`` otherwise."""
        shapes = [tuple(s) for s in shapes]
        for k, (shape, core) in enumerate(zip(shapes, self.cores, strict=True)):
            if tuple(shape[1:-1]) != tuple(core.shape[1:-1]):
                raise ValueError(
                    f"checkpoint core {prefix}cores.{k} has mode sizes {tuple(shape[1:-1])} but this layer "
                    f"has {tuple(core.shape[1:-1])}: the checkpoint is from a different architecture; build "
                    f"the model with the modes the checkpoint was trained with"
                )
        ranks = [1] + [s[-1] for s in shapes]
        if any(shapes[k][0] != ranks[k] for k in range(len(shapes))) or ranks[-1] != 1:
            raise ValueError(
                f"checkpoint cores under {prefix}cores have inconsistent ranks: {shapes}; the checkpoint is damaged or "
                f"was edited (core k must start with the rank core k-1 ends with): load one that training saved"
            )
        too_big = [k for k, (r, m) in enumerate(zip(ranks, self.max_ranks, strict=True)) if r > m]
        if too_big:
            raise ValueError(
                f"checkpoint ranks {ranks} under {prefix}cores exceed the maximum {self.max_ranks} that this "
                f"layer's modes allow at bonds {too_big}: the checkpoint was made with other modes; build the layer "
                f"with the modes it was trained with"
            )
        return ranks

    def extra_repr(self) -> str:
        return f"ranks={self.ranks}, active_ranks={self.active_ranks}, threshold={self.rank_threshold}"


def _resize_parameter(param: nn.Parameter, selection: tt_rank.CoreSelection) -> None:
    param.data = tt_rank.select_rank_slices(param.data, selection)
    if param.grad is not None:
        param.grad = tt_rank.select_rank_slices(param.grad, selection)


def _torch_factors(tt: Any, ndim: int, where: str, expected: str) -> list[torch.Tensor]:
    """The factors of a tensorly TT / TT-matrix (any backend) or a list of tensors, as torch tensors."""
    factors = [torch.as_tensor(f).detach() for f in getattr(tt, "factors", tt)]
    if not factors or any(f.dim() != ndim for f in factors):
        raise ValueError(
            f"{where} expects {expected}: factors with {ndim} dimensions, got shapes "
            f"{[tuple(f.shape) for f in factors]}"
        )
    return factors


@contextmanager
def reusing_inference_factors(model: nn.Module) -> Iterator[None]:
    """Within the block, each TT layer of ``model`` checks its inference cache once (on its first cached call)
    and then serves the merged factors without checking again.

    For loops that call an unchanged model many times without autograd, token-by-token generation above all:
    the per-call check (a stamp over the layer's cores, gates and masks) is then paid once per layer per loop
    instead of once per layer per token. Do not change the model's weights inside the block.
    """
    layers = [m for m in model.modules() if isinstance(m, TTLayer)]
    for layer in layers:
        layer._reusing_factors, layer._trusted_entry = True, None
    try:
        yield
    finally:
        for layer in layers:
            layer._reusing_factors, layer._trusted_entry = False, None
