"""``LayerConfig`` and ``LayerFactory``: one place that decides, layer by layer, whether a model gets a TT or a
dense layer, and at which rank.

Every model of the zoo takes one :class:`LayerConfig` (``layer_config=``) and builds every linear and embedding
through a :class:`LayerFactory` made from it, so a dense baseline is the same code with
``LayerConfig(tt_linears=False, tt_embeddings=False)``; single layers stay dense by a regex on their qualified
names (``dense_layers="classifier|pooler"``) or get their own rank (``layer_ranks={"lm_head": 128}``). The
config is a plain dataclass, so it reads the same in Python and in YAML::

    model:
      init_args:
        layer_config: {rank: 32, embedding_rank: 32, dense_layers: classifier, layer_ranks: {lm_head: 96}}

Callers pass the name the module will have in the final model (``model.get_submodule(name)``), so patterns
mean what they say; the factory records every decision in :attr:`LayerFactory.layers`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

from ..config import GroupedOptions
from ..nn.builder import LayerKind, LayerModes, TTLayerOptions, build_tt_layer
from ..tt import BOTTLENECK_ACTIVATIONS
from ..tt.parameterization import check_parameterization

__all__ = ["LayerConfig", "LayerFactory"]


def _compile(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{what} is not a valid regular expression: {pattern!r} ({err})") from err


@dataclass(frozen=True)
class LayerConfig(GroupedOptions):
    """Which linears and embeddings are tensor trains, and at which rank.

    A linear becomes TT when ``tt_linears`` is set, ``min(in_features, out_features) >= min_features``
    and its name does not match ``dense_layers``. An embedding becomes TT when ``tt_embeddings`` is set,
    it has at least ``min_embedding_rows`` rows (default ``min_features``) and its name does not match.
    Rows, not the embedding width, decide for tables: a DLRM table of 10^6 x 16 is worth compressing.

    Attributes:
        tt_linears: build eligible linears as :class:`TTLinear`.
        tt_embeddings: build eligible embeddings as :class:`TTEmbedding`.
        rank: internal rank of every TT linear (clamped to what its modes allow).
        embedding_rank: internal rank of every TT embedding.
        rank_threshold: gate magnitude at or below which a rank slice is switched off.
        dense_layers: regex searched in each layer's qualified name; matching layers stay dense.
        min_features: linears with a smaller side (and, by default, tables with fewer rows) stay dense.
        min_embedding_rows: row threshold for embeddings when it should differ from ``min_features``
            (``None``: the model's choice, which is ``min_features`` except for :class:`DLRM`'s 1000).
        layer_ranks: ``{regex: rank}``; the first pattern (in order) found in a TT layer's qualified name
            sets its rank instead of ``rank`` / ``embedding_rank``. Output heads over a vocabulary are the
            usual candidates: they lose the most when cut to the blocks' rank. A list gives every internal
            rank of that layer's train exactly (a fixed-rank TT at the ranks a CoMERA run ended with).
        low_rank_linears: regex; TT linears whose name matches get one mode per side, i.e. two cores
            ``(1, in, r) (r, out, 1)``: a rank-``r`` product ``W = A B`` with CoMERA's gate on its one bond.
            For layers whose index has no tensor structure: splitting a vocabulary's token ids into digits
            (the default modes) ties unrelated tokens together, and an output head suffers most from it.
        low_rank_embeddings: regex; TT embeddings whose name matches become ``E = A B`` (``A``: rows x ``r``,
            ``B``: ``r`` x width; ALBERT's factorised embedding) with the gate on the one bond, instead of a
            TT-matrix over split token ids. With ``low_rank_linears``, the plain low-rank baseline.
        bottleneck_activation: None, or a non-linearity (``silu``, ``gelu``, ``relu``, ``tanh``) on the middle
            bond of the TT linears matching ``activation_layers``: ``y = act(x L) R + b``. With
            ``low_rank_linears`` and ``learn_gates: false`` that is CoLA (Liu et al. 2025); on a gated TT it is
            CoLA's idea inside CoMERA.
        activation_layers: regex of the TT linears that get ``bottleneck_activation`` (None: every TT linear).
        learn_gates: False freezes every rank gate at 1: a fixed-rank model (plain TT, low-rank or CoLA) that
            no rank callback may shrink.
        parameterization: ``standard`` or ``mup``: per-core init and learning-rate multipliers from each core's
            fan-in, so a rate tuned at one width carries over to others (:mod:`comera_lightning.tt.parameterization`).
    """

    tt_linears: bool = True
    tt_embeddings: bool = True
    rank: int = 30
    embedding_rank: int = 32
    rank_threshold: float = 0.01
    dense_layers: str | None = None
    min_features: int = 64
    min_embedding_rows: int | None = None
    layer_ranks: dict[str, int | list[int]] | None = None
    low_rank_linears: str | None = None
    low_rank_embeddings: str | None = None
    bottleneck_activation: str | None = None
    activation_layers: str | None = None
    learn_gates: bool = True
    parameterization: str = "standard"

    argument: ClassVar[str] = "layer_config"

    def __post_init__(self) -> None:
        try:
            check_parameterization(self.parameterization)
        except ValueError as err:
            raise ValueError(f"layer_config.{err}") from None
        if self.min_features < 1:
            raise ValueError(f"layer_config.min_features must be >= 1, got {self.min_features}")
        if self.min_embedding_rows is not None and self.min_embedding_rows < 1:
            raise ValueError(f"layer_config.min_embedding_rows must be >= 1 or None, got {self.min_embedding_rows}")
        for name in ("rank", "embedding_rank"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"layer_config.{name} must be >= 1, got {getattr(self, name)}")
        if self.dense_layers:
            _compile(self.dense_layers, "layer_config.dense_layers")
        for name in ("low_rank_linears", "low_rank_embeddings", "activation_layers"):
            if getattr(self, name):
                _compile(getattr(self, name), f"layer_config.{name}")
        if self.bottleneck_activation is not None and self.bottleneck_activation not in BOTTLENECK_ACTIVATIONS:
            raise ValueError(
                f"layer_config.bottleneck_activation must be null or one of "
                f"{sorted(BOTTLENECK_ACTIVATIONS)}, got {self.bottleneck_activation!r}"
            )
        if self.activation_layers is not None and self.bottleneck_activation is None:
            raise ValueError(
                "layer_config.activation_layers picks the layers for bottleneck_activation, which is "
                "not set: set bottleneck_activation (e.g. silu) or drop activation_layers"
            )
        for pattern, rank in (self.layer_ranks or {}).items():
            _compile(pattern, f"layer_config.layer_ranks key {pattern!r}")
            ranks = rank if isinstance(rank, (list, tuple)) else [rank]
            if not ranks or any(int(r) < 1 for r in ranks):
                raise ValueError(
                    f"layer_config.layer_ranks[{pattern!r}] must be a rank >= 1 or a non-empty list "
                    f"of ranks >= 1, got {rank}"
                )


class LayerFactory:
    """Builds :class:`TTLinear` / :class:`TTEmbedding` or their dense ``torch.nn`` twins, as ``config`` decides
    (see :class:`LayerConfig`; a mapping of its fields or ``None`` for the defaults work too)."""

    def __init__(self, config: LayerConfig | Mapping[str, Any] | None = None) -> None:
        self.config = LayerConfig.of(config)
        self._dense_re = _compile(self.config.dense_layers, "dense_layers") if self.config.dense_layers else None
        self._low_rank_re = (
            _compile(self.config.low_rank_linears, "low_rank_linears") if self.config.low_rank_linears else None
        )
        self._low_rank_embedding_re = (
            _compile(self.config.low_rank_embeddings, "low_rank_embeddings")
            if self.config.low_rank_embeddings
            else None
        )
        self._rank_res = [
            (_compile(p, "layer_ranks"), [int(x) for x in r] if isinstance(r, (list, tuple)) else int(r))
            for p, r in (self.config.layer_ranks or {}).items()
        ]
        self._activation_re = (
            _compile(self.config.activation_layers, "activation_layers") if self.config.activation_layers else None
        )
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

    def rank_of(self, name: str, default: int) -> int | list[int]:
        """The rank of the TT layer ``name``: its first matching ``layer_ranks`` entry, else ``default``."""
        return next((rank for pattern, rank in self._rank_res if pattern.search(name)), default)

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
        config = self.config
        tt = config.tt_linears and min(in_features, out_features) >= config.min_features and not self.forced_dense(name)
        self._record(name, tt)
        if not tt:
            return nn.Linear(in_features, out_features, bias=bias)
        return self._tt_layer(
            "linear", name, (in_features, out_features), (in_modes, out_modes), bias=bias, **tt_kwargs
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
        config = self.config
        min_rows = config.min_features if config.min_embedding_rows is None else config.min_embedding_rows
        tt = config.tt_embeddings and num_embeddings >= min_rows and not self.forced_dense(name)
        self._record(name, tt)
        if not tt:
            return nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        shape, modes = (num_embeddings, embedding_dim), (vocab_modes, dim_modes)
        return self._tt_layer("embedding", name, shape, modes, padding_idx=padding_idx, **tt_kwargs)

    def _tt_layer(
        self, kind: LayerKind, name: str, shape: tuple[int, int], modes: LayerModes, **layer_kwargs: Any
    ) -> nn.Module:
        """The TT layer ``name`` as the config says: its rank, one mode per side where ``low_rank_linears`` /
        ``low_rank_embeddings`` match it, the bottleneck activation where ``activation_layers`` does."""
        config = self.config
        if kind == "linear":
            default_rank, low_rank_re, low_rank_option = config.rank, self._low_rank_re, "low_rank_linears"
            activated = config.bottleneck_activation is not None and (
                self._activation_re is None or self._activation_re.search(name) is not None
            )
        else:
            default_rank, low_rank_re, low_rank_option = (
                config.embedding_rank,
                self._low_rank_embedding_re,
                "low_rank_embeddings",
            )
            activated = False
        low_rank = low_rank_re is not None and low_rank_re.search(name) is not None
        if low_rank and modes != (None, None):
            raise ValueError(
                f"{'layer' if kind == 'linear' else 'embedding'} {name!r} matches {low_rank_option} but its model "
                f"gives it modes {modes[0]} x {modes[1]}: leave it out of {low_rank_option}"
            )
        options = TTLayerOptions(
            rank=self.rank_of(name, default_rank),
            rank_threshold=config.rank_threshold,
            low_rank=low_rank,
            bottleneck_activation=config.bottleneck_activation if activated else None,
            learn_gates=config.learn_gates,
            parameterization=config.parameterization,
        )
        layer, _ = build_tt_layer(kind, shape, options, modes=modes, **layer_kwargs)
        return layer

    def __repr__(self) -> str:
        return f"LayerFactory({self.config!r})"
