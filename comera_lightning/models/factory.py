"""``LayerFactory``: one place that decides, layer by layer, whether a model gets a TT or a dense layer.

The model zoo builds every linear and embedding through a factory, so a dense baseline is the same
code with ``tt_linears=False, tt_embeddings=False``, and single layers can be kept dense by a regex on
their qualified names (``dense_layers=r"classifier|pooler"``). Callers pass the name the module will
have in the final model (``model.get_submodule(name)``), so patterns mean what they say; the factory
records every decision in :attr:`LayerFactory.layers`.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from torch import nn

from ..nn import TTEmbedding, TTLinear

__all__ = ["LayerFactory"]


class LayerFactory:
    """Builds :class:`TTLinear` / :class:`TTEmbedding` or their dense ``torch.nn`` twins.

    A linear becomes TT when ``tt_linears`` is set, ``min(in_features, out_features) >= min_features``
    and its name does not match ``dense_layers``. An embedding becomes TT when ``tt_embeddings`` is set,
    it has at least ``min_embedding_rows`` rows (default ``min_features``) and its name does not match.
    Rows, not the embedding width, decide for tables: a DLRM table of 10^6 x 16 is worth compressing.

    Args:
        tt_linears: build eligible linears as :class:`TTLinear`.
        tt_embeddings: build eligible embeddings as :class:`TTEmbedding`.
        rank: internal rank of every TT linear (clamped to what its modes allow).
        embedding_rank: internal rank of every TT embedding.
        rank_threshold: gate magnitude at or below which a rank slice is switched off.
        dense_layers: regex searched in each layer's qualified name; matching layers stay dense.
        min_features: linears with a smaller side (and, by default, tables with fewer rows) stay dense.
        min_embedding_rows: row threshold for embeddings when it should differ from ``min_features``.
    """

    def __init__(
        self,
        tt_linears: bool = True,
        tt_embeddings: bool = True,
        rank: int = 30,
        embedding_rank: int = 32,
        rank_threshold: float = 0.01,
        dense_layers: str | None = None,
        min_features: int = 64,
        min_embedding_rows: int | None = None,
    ) -> None:
        if min_features < 1:
            raise ValueError(f"min_features must be >= 1, got {min_features}")
        if min_embedding_rows is not None and min_embedding_rows < 1:
            raise ValueError(f"min_embedding_rows must be >= 1 or None, got {min_embedding_rows}")
        self.tt_linears = bool(tt_linears)
        self.tt_embeddings = bool(tt_embeddings)
        self.rank = int(rank)
        self.embedding_rank = int(embedding_rank)
        self.rank_threshold = float(rank_threshold)
        self.dense_layers = dense_layers or None
        try:
            self._dense_re = re.compile(dense_layers) if dense_layers else None
        except re.error as err:
            raise ValueError(f"dense_layers is not a valid regular expression: {dense_layers!r} ({err})") from err
        self.min_features = int(min_features)
        self.min_embedding_rows = self.min_features if min_embedding_rows is None else int(min_embedding_rows)
        #: qualified name -> "tt" or "dense", in build order
        self.layers: dict[str, str] = {}

    def _record(self, name: str, tt: bool) -> None:
        if not name:
            raise ValueError("every layer needs its qualified name (got an empty name)")
        if name in self.layers:
            raise ValueError(f"layer name {name!r} was already used; names must be the modules' qualified names")
        self.layers[name] = "tt" if tt else "dense"

    def forced_dense(self, name: str) -> bool:
        """Whether ``dense_layers`` keeps the layer called ``name`` dense."""
        return self._dense_re is not None and self._dense_re.search(name) is not None

    def linear(
        self,
        name: str,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_modes: Sequence[int] | None = None,
        out_modes: Sequence[int] | None = None,
        **tt_kwargs: Any,
    ) -> nn.Module:
        """A :class:`TTLinear` or ``nn.Linear`` for the layer ``name``; modes and ``tt_kwargs`` only
        matter for the TT case."""
        tt = (
            self.tt_linears
            and min(in_features, out_features) >= self.min_features
            and not self.forced_dense(name)
        )
        self._record(name, tt)
        if not tt:
            return nn.Linear(in_features, out_features, bias=bias)
        return TTLinear(
            in_features, out_features, self.rank, in_modes=in_modes, out_modes=out_modes, bias=bias,
            rank_threshold=self.rank_threshold, **tt_kwargs,
        )

    def embedding(
        self,
        name: str,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        vocab_modes: Sequence[int] | None = None,
        dim_modes: Sequence[int] | None = None,
        **tt_kwargs: Any,
    ) -> nn.Module:
        """A :class:`TTEmbedding` or ``nn.Embedding`` for the layer ``name``; modes and ``tt_kwargs``
        (e.g. ``deduplicate=True``) only matter for the TT case."""
        tt = (
            self.tt_embeddings
            and num_embeddings >= self.min_embedding_rows
            and not self.forced_dense(name)
        )
        self._record(name, tt)
        if not tt:
            return nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        return TTEmbedding(
            num_embeddings, embedding_dim, self.embedding_rank, vocab_modes=vocab_modes, dim_modes=dim_modes,
            padding_idx=padding_idx, rank_threshold=self.rank_threshold, **tt_kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"LayerFactory(tt_linears={self.tt_linears}, tt_embeddings={self.tt_embeddings}, rank={self.rank}, "
            f"embedding_rank={self.embedding_rank}, rank_threshold={self.rank_threshold}, "
            f"dense_layers={self.dense_layers!r}, min_features={self.min_features}, "
            f"min_embedding_rows={self.min_embedding_rows})"
        )
