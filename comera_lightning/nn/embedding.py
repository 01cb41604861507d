"""TTEmbedding: an ``nn.Embedding`` whose table is a rank-gated TT-matrix, looked up by half-merge."""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorly as tl
import torch
from torch import nn

from ..tt.cores import init_cores, max_ranks, resolve_ranks, ttm_from_dense, ttm_to_dense
from ..tt.modes import default_num_modes, factorize, padded_modes, validate_modes
from ..tt.parameterization import check_parameterization, core_fan_ins, mup_init_stds, mup_lr_scales
from ..tt.rank import DEFAULT_THRESHOLD
from ..tt.ttm import ttm_halves, ttm_lookup, ttm_lookup_halves
from .base import TTLayer, _torch_factors, capturing_graph

__all__ = ["TTEmbedding"]


class TTEmbedding(TTLayer):
    """Embedding table ``E (V x D)`` as TT-matrix cores ``(r_{k-1}, v_k, e_k, r_k)``.

    Each call merges the first and the last half of the cores once (batch-free), then every token
    costs one gather per half and one small product. Vocabularies that do not factor are padded
    (30522 -> 30576 rows); padded rows are never looked up.

    In eval mode without autograd (generation, validation) the merged halves are kept and reused (about
    ``r * (V_left E_left + V_right E_right)`` elements), so a token costs its gathers and product only; see
    :class:`~comera_lightning.nn.TTLayer` for when they are refreshed, and ``inference_cache = False`` to merge
    on every call.

    Args:
        num_embeddings: vocabulary size ``V``.
        embedding_dim: ``D``.
        rank: one rank for every internal bond (clamped) or a list of the internal ranks (strict).
        vocab_modes, dim_modes: explicit factorisations with the same number of modes; None picks them.
        padding_idx: this row always returns zeros and receives no gradient, as in ``nn.Embedding``.
        deduplicate: compute each distinct id once per call (pays off when batches repeat tokens).
        rank_threshold: gate magnitude at or below which a rank slice is switched off.
        init_std: std of the reconstructed table (default 1, as ``nn.Embedding``).
        parameterization: ``standard`` or ``mup`` (per-core init and learning-rate multipliers from each core's
            fan-in; see :mod:`comera_lightning.tt.parameterization`).
        dtype, device: of the cores (gates are always fp32).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        rank: int | Sequence[int] = 32,
        vocab_modes: Sequence[int] | None = None,
        dim_modes: Sequence[int] | None = None,
        padding_idx: int | None = None,
        deduplicate: bool = False,
        rank_threshold: float = DEFAULT_THRESHOLD,
        init_std: float = 1.0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        parameterization: str = "standard",
    ) -> None:
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(f"num_embeddings and embedding_dim must be >= 1, got {num_embeddings}, {embedding_dim}")
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}), got {padding_idx}")
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.padding_idx = None if padding_idx is None else padding_idx % num_embeddings
        self.deduplicate = bool(deduplicate)
        num_modes = (
            len(vocab_modes)
            if vocab_modes is not None
            else (len(dim_modes) if dim_modes is not None else default_num_modes(num_embeddings))
        )
        self.vocab_modes = (
            padded_modes(num_embeddings, num_modes)
            if vocab_modes is None
            else validate_modes(vocab_modes, num_embeddings, "vocab_modes")
        )
        self.dim_modes = (
            factorize(embedding_dim, num_modes)
            if dim_modes is None
            else validate_modes(dim_modes, embedding_dim, "dim_modes", allow_padding=False)
        )
        if len(self.vocab_modes) != len(self.dim_modes):
            raise ValueError(
                f"vocab_modes {self.vocab_modes} and dim_modes {self.dim_modes} must have the same number "
                f"of modes (one TT-matrix core per pair)"
            )
        sizes = [v * e for v, e in zip(self.vocab_modes, self.dim_modes, strict=True)]
        ranks = resolve_ranks(sizes, rank)
        dtype = dtype or torch.get_default_dtype()
        shapes = [
            (ranks[k], v, e, ranks[k + 1])
            for k, (v, e) in enumerate(zip(self.vocab_modes, self.dim_modes, strict=True))
        ]
        if check_parameterization(parameterization) == "mup":
            fan_ins = core_fan_ins(shapes, 0)
            stds = mup_init_stds(fan_ins, float(init_std))  # entries of variance init_std**2 by construction
            cores, lr_scales = init_cores(shapes, dtype=dtype, device=device, stds=stds), mup_lr_scales(fan_ins)
        else:
            cores, lr_scales = init_cores(shapes, init_std, dtype=dtype, device=device), [1.0] * len(shapes)
        self._init_train(cores, rank_threshold, max_ranks(sizes), parameterization, lr_scales)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, rank: int | Sequence[int] = 32, **kwargs
    ) -> tuple[TTEmbedding, float]:
        """A TTEmbedding initialised by TT-matrix SVD of ``embedding.weight``; returns it and the relative error."""
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            rank,
            padding_idx=embedding.padding_idx,
            dtype=embedding.weight.dtype,
            device=embedding.weight.device,
            **kwargs,
        )
        layer._copy_factors_(ttm_from_dense(embedding.weight.detach(), layer.vocab_modes, layer.dim_modes, layer.ranks))
        with torch.no_grad():
            reference = embedding.weight
            error = (layer.weight_dense() - reference).norm() / reference.norm().clamp_min(1e-30)
        return layer, float(error)

    @property
    def dense_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise TypeError(f"TTEmbedding expects integer token ids, got dtype {ids.dtype}")
        flat = ids.reshape(-1).long()
        capturing = capturing_graph()
        if not capturing and flat.numel():
            low, high = int(flat.min()), int(flat.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise IndexError(
                    f"token id {bad} is outside the vocabulary [0, {self.num_embeddings}); check the tokenizer's "
                    f"vocabulary size against num_embeddings={self.num_embeddings}"
                )
        deduplicate = self.deduplicate and not capturing
        if self._serves_from_cache():
            device = self.cores[0].device.type
            # the merge runs under the caller's autocast, as an uncached lookup's would: its state is the key
            autocast = (True, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else (False,)
            left, right = self._inference_cached(autocast, self._owned_halves)
            rows = ttm_lookup_halves(left, right, flat, deduplicate)
        else:
            rows = ttm_lookup(self.gated_cores(), flat, deduplicate=deduplicate)
        if self.padding_idx is not None:
            rows = rows * (flat != self.padding_idx).unsqueeze(1).to(rows.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def _owned_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`ttm_halves` of the gated cores, in memory of their own: a half that is a single core is a view
        of the parameter, whose storage a sharded wrapper (FSDP) may free while the cache still holds it."""
        left, right = ttm_halves(self.gated_cores())
        return (left if left._base is None else left.clone()), (right if right._base is None else right.clone())

    def weight_dense(self) -> torch.Tensor:
        """The ``(num_embeddings, embedding_dim)`` table ``nn.Embedding`` would hold (differentiable)."""
        table = ttm_to_dense(self.gated_cores())[: self.num_embeddings]
        if self.padding_idx is not None:
            table = table.index_fill(0, torch.tensor([self.padding_idx], device=table.device), 0.0)
        return table

    def to_tensorly(self) -> tl.tt_matrix.TTMatrix:
        """The gated factors as a tensorly ``TTMatrix`` (rows ``vocab_modes``, columns ``dim_modes``)."""
        with tl.backend_context("pytorch", local_threadsafe=True):
            return tl.tt_matrix.TTMatrix(self.gated_cores())

    @classmethod
    def from_tensorly(
        cls,
        ttm: tl.tt_matrix.TTMatrix | Sequence[torch.Tensor],
        *,
        num_embeddings: int | None = None,
        padding_idx: int | None = None,
        **kwargs,
    ) -> TTEmbedding:
        """The inverse of :meth:`to_tensorly`: a TTEmbedding whose cores are ``ttm``'s factors (gates 1, all active).

        Args:
            ttm: a ``TTMatrix`` (or its factors ``(r, v, e, r')``): rows ``vocab_modes``, columns ``dim_modes``.
            num_embeddings: the unpadded vocabulary; default the product of the row modes.
            padding_idx: as the constructor's; ``to_tensorly`` keeps the padding row's values (the layer zeroes
                it when looking up), so pass the original layer's ``padding_idx`` to get the same outputs.
            kwargs: forwarded to the constructor (e.g. ``deduplicate``, ``rank_threshold``).
        """
        factors = _torch_factors(ttm, 4, "TTEmbedding.from_tensorly", "a TTMatrix (TTLinear takes TTTensor)")
        vocab_modes = [int(f.shape[1]) for f in factors]
        dim_modes = [int(f.shape[2]) for f in factors]
        num_embeddings = math.prod(vocab_modes) if num_embeddings is None else num_embeddings
        # built at the factors' ranks (muP's rates follow the ranks); copying them checks that they chain
        ranks = [int(f.shape[-1]) for f in factors[:-1]]
        layer = cls(
            num_embeddings,
            math.prod(dim_modes),
            ranks,
            vocab_modes,
            dim_modes,
            padding_idx=padding_idx,
            dtype=factors[0].dtype,
            device=factors[0].device,
            **kwargs,
        )
        layer._copy_factors_(factors)
        return layer

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, vocab_modes="
            f"{self.vocab_modes}, dim_modes={self.dim_modes}, padding_idx={self.padding_idx}, "
            f"deduplicate={self.deduplicate}, {super().extra_repr()}"
        )
