"""DLRM (Naumov et al., 2019) with TT-matrix embedding tables: the paper's recommendation benchmark.

Dense features go through a bottom MLP to an ``embedding_dim`` vector; every categorical feature looks
up one row of its table. The "dot" interaction takes the pairwise dot products of these ``1 + T``
vectors (upper triangle, no diagonal) and concatenates them with the bottom output; a top MLP maps that
to one click logit. Almost all of DLRM's parameters sit in the large tables (Criteo: 26 tables, up to
~10^7 rows), so those become :class:`TTEmbedding` with batch deduplication (categorical ids repeat a
lot within a batch); small tables and small linears stay dense.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .factory import LayerConfig, LayerFactory

__all__ = ["DLRM"]

_INTERACTIONS = ("dot", "cat")


class DLRM(nn.Module):
    """Click-through-rate model; ``forward(dense, sparse)`` returns logits ``(B,)``.

    Layer names: ``bottom_mlp.{i}``, ``embeddings.{t}``, ``top_mlp.{i}`` (the last top layer maps to the
    single logit). :attr:`layer_kinds` maps every name to ``"tt"`` or ``"dense"``.

    Args:
        num_dense: number of continuous features (13 in Criteo).
        table_sizes: rows of each categorical table (26 tables in Criteo).
        embedding_dim: width of every table and of the bottom MLP's output.
        bottom_mlp: widths of the bottom MLP; the last must equal ``embedding_dim``.
        top_mlp: hidden widths of the top MLP (a final layer to 1 logit is added).
        interaction: ``"dot"`` (pairwise dot products, as DLRM/CoMERA) or ``"cat"`` (concatenation).
        layer_config: which linears and tables are TT and their ranks (:class:`LayerConfig`). Without a config,
            tables of fewer than 1000 rows stay dense unless ``min_embedding_rows`` says otherwise.
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        num_dense: int = 13,
        embedding_dim: int = 16,
        bottom_mlp: Sequence[int] = (512, 256, 16),
        top_mlp: Sequence[int] = (512, 256),
        interaction: str = "dot",
        layer_config: LayerConfig | None = None,
    ) -> None:
        super().__init__()
        table_sizes, bottom_mlp, top_mlp = [int(s) for s in table_sizes], list(bottom_mlp), list(top_mlp)
        if not table_sizes or min(table_sizes) < 1:
            raise ValueError(f"table_sizes must be a non-empty list of positive row counts, got {table_sizes}")
        if not bottom_mlp or bottom_mlp[-1] != embedding_dim:
            raise ValueError(
                f"the last bottom_mlp width must equal embedding_dim={embedding_dim} (its output is "
                f"interacted with the embeddings), got bottom_mlp={bottom_mlp}"
            )
        if interaction not in _INTERACTIONS:
            raise ValueError(f"interaction must be one of {_INTERACTIONS}, got {interaction!r}")
        config = LayerConfig.of(layer_config)
        if config.min_embedding_rows is None:
            config = dataclasses.replace(config, min_embedding_rows=1000)
        factory = LayerFactory(config)
        self.num_dense, self.embedding_dim, self.interaction = num_dense, embedding_dim, interaction
        self.table_sizes = table_sizes

        widths = [num_dense, *bottom_mlp]
        self.bottom_mlp = nn.ModuleList(
            factory.linear(f"bottom_mlp.{i}", widths[i], widths[i + 1]) for i in range(len(bottom_mlp))
        )
        # deduplicate only reaches TT tables (dense ones ignore TT-only arguments)
        self.embeddings = nn.ModuleList(
            factory.embedding(f"embeddings.{t}", rows, embedding_dim, deduplicate=True)
            for t, rows in enumerate(table_sizes)
        )
        widths = [self.interaction_dim, *top_mlp, 1]
        self.top_mlp = nn.ModuleList(
            factory.linear(f"top_mlp.{i}", widths[i], widths[i + 1]) for i in range(len(widths) - 1)
        )
        self.layer_kinds: dict[str, str] = dict(factory.layers)

    @property
    def interaction_dim(self) -> int:
        """Width of the top MLP's input."""
        num_vectors = 1 + len(self.table_sizes)
        if self.interaction == "dot":
            return self.embedding_dim + num_vectors * (num_vectors - 1) // 2
        return self.embedding_dim * num_vectors

    def _interact(self, bottom: torch.Tensor, embedded: list[torch.Tensor]) -> torch.Tensor:
        vectors = torch.stack([bottom, *[e.to(bottom.dtype) for e in embedded]], dim=1)  # (B, 1 + T, D)
        if self.interaction == "cat":
            return vectors.flatten(1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, 1 + T, 1 + T)
        rows, cols = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1, device=vectors.device)
        return torch.cat([bottom, products[:, rows, cols]], dim=1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """``dense (B, num_dense)`` floats and ``sparse (B, num_tables)`` ids, one per table -> logits ``(B,)``."""
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense must be (batch, {self.num_dense}), got shape {tuple(dense.shape)}")
        if sparse.dim() != 2 or sparse.shape[1] != len(self.embeddings) or sparse.shape[0] != dense.shape[0]:
            raise ValueError(
                f"sparse must be (batch={dense.shape[0]}, {len(self.embeddings)}) ids, got shape {tuple(sparse.shape)}"
            )
        x = dense
        for layer in self.bottom_mlp:
            x = F.relu(layer(x))
        embedded = [table(sparse[:, t]) for t, table in enumerate(self.embeddings)]
        z = self._interact(x, embedded)
        for i, layer in enumerate(self.top_mlp):
            z = layer(z)
            if i < len(self.top_mlp) - 1:
                z = F.relu(z)
        return z.squeeze(1)
