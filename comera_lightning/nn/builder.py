"""The one builder of TT layers: a :class:`TTLinear` or :class:`TTEmbedding` from a kind, a shape and
:class:`TTLayerOptions`.

:func:`~comera_lightning.nn.tensorize` (and so the ``Tensorize`` callback), the model zoo's ``LayerFactory`` and
the export's loader build every layer here, so the options (low-rank modes, frozen gates, the bottleneck
activation, the parameterisation) mean the same thing whichever way a layer is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

from torch import nn

from ..tt.rank import DEFAULT_THRESHOLD
from .base import TTLayer
from .embedding import TTEmbedding
from .linear import TTLinear

__all__ = ["LayerKind", "LayerModes", "LayerShape", "TTLayerOptions", "build_tt_layer", "freeze_gates_", "layer_shape"]

#: ``"linear"`` (shape ``(in_features, out_features)``) or ``"embedding"`` (shape ``(rows, width)``)
LayerKind = Literal["linear", "embedding"]
#: the modes of each side (``(in_modes, out_modes)`` or ``(vocab_modes, dim_modes)``); None picks balanced ones
LayerModes = tuple[Sequence[int] | None, Sequence[int] | None]


@dataclass(frozen=True)
class TTLayerOptions:
    """How one TT layer is built (the per-layer part of ``tensorize()``'s arguments and of ``LayerConfig``).

    Attributes:
        rank: internal rank of a TT linear, and of a TT embedding unless ``embedding_rank`` is given: one rank
            (clamped per bond to what the modes allow) or the list of internal ranks (validated strictly).
        embedding_rank: internal rank of a TT embedding (None: ``rank``).
        rank_threshold: gate magnitude at or below which a rank slice is switched off.
        low_rank: one mode per side instead of a tensor train: a linear becomes ``W = A B``, an embedding
            ``E = A B``, with the gate on their one bond.
        bottleneck_activation: None, or a non-linearity on a linear's middle bond, ``y = act(x L) R + b``
            (embeddings have none); see :class:`TTLinear`.
        learn_gates: False freezes the rank gates at 1 (a fixed-rank layer no rank callback shrinks).
        parameterization: ``standard`` or ``mup`` (:mod:`comera_lightning.tt.parameterization`).
    """

    rank: int | Sequence[int] = 30
    embedding_rank: int | Sequence[int] | None = None
    rank_threshold: float = DEFAULT_THRESHOLD
    low_rank: bool = False
    bottleneck_activation: str | None = None
    learn_gates: bool = True
    parameterization: str = "standard"

    def rank_of(self, kind: LayerKind) -> int | Sequence[int]:
        """The rank a layer of ``kind`` is built at."""
        if kind == "embedding" and self.embedding_rank is not None:
            return self.embedding_rank
        return self.rank


class LayerShape(NamedTuple):
    """What a TT layer stands for: its kind, the dense shape and the modes of each side."""

    kind: str
    shape: tuple[int, int]
    modes: tuple[list[int], list[int]]


def layer_shape(layer: TTLinear | TTEmbedding) -> LayerShape:
    """The kind, dense shape and modes of ``layer`` (what :func:`build_tt_layer` takes to build it again)."""
    if isinstance(layer, TTLinear):
        return LayerShape("linear", (layer.in_features, layer.out_features), (layer.in_modes, layer.out_modes))
    return LayerShape("embedding", (layer.num_embeddings, layer.embedding_dim), (layer.vocab_modes, layer.dim_modes))


def build_tt_layer(
    kind: LayerKind,
    shape: tuple[int, int],
    options: TTLayerOptions,
    *,
    modes: LayerModes = (None, None),
    dense: nn.Module | None = None,
    **layer_kwargs: Any,
) -> tuple[TTLinear | TTEmbedding, float | None]:
    """A :class:`TTLinear` or :class:`TTEmbedding` of ``shape``, built as ``options`` say.

    Args:
        kind: ``"linear"`` (``shape`` is ``(in_features, out_features)``) or ``"embedding"`` (``(rows, width)``).
        shape: the dense shape the layer stands for.
        options: rank, gates, low-rank modes, activation and parameterisation.
        modes: the model's own factorisation of each side (``(in_modes, out_modes)`` or
            ``(vocab_modes, dim_modes)``); None picks balanced modes. ``options.low_rank`` sets its own.
        dense: an ``nn.Linear`` / ``nn.Embedding`` of that shape to start from by TT-SVD (its bias or padding
            index, dtype and device are kept, so ``layer_kwargs`` may not set them); None draws the cores at random.
        layer_kwargs: further constructor arguments (``bias``, ``padding_idx``, ``dtype``, ``init_std``,
            ``deduplicate``, ...); they take precedence over ``options``.

    Returns:
        The layer, and the relative error ``||W_tt - W|| / ||W||`` of the TT-SVD of ``dense`` (None without it).
    """
    if kind not in ("linear", "embedding"):
        raise ValueError(f"kind must be 'linear' or 'embedding', got {kind!r}")
    rows, cols = shape
    fixed = sorted(set(layer_kwargs) & FIXED_BY_MODULE[kind]) if dense is not None else []
    if fixed:
        names = ", ".join(fixed)
        raise ValueError(
            f"dense= fixes {names} (taken from the dense module); drop {names}, or set them on the dense module"
        )
    if options.low_rank:
        if modes != (None, None):
            raise ValueError(f"low_rank sets one mode per side, but modes {modes[0]} x {modes[1]} were given")
        modes = ([rows], [cols]) if kind == "linear" else ([rows, 1], [1, cols])
    arguments: dict[str, Any] = dict(rank_threshold=options.rank_threshold, parameterization=options.parameterization)
    if kind == "linear" and options.bottleneck_activation is not None:
        arguments["bottleneck_activation"] = options.bottleneck_activation
    arguments.update(layer_kwargs)
    layer: TTLinear | TTEmbedding
    error = None
    rank, (side_a, side_b) = options.rank_of(kind), modes
    if kind == "linear":
        if dense is None:
            layer = TTLinear(rows, cols, rank, in_modes=side_a, out_modes=side_b, **arguments)
        else:
            linear = _checked(dense, nn.Linear, shape)
            layer, error = TTLinear.from_linear(linear, rank, in_modes=side_a, out_modes=side_b, **arguments)
    elif dense is None:
        layer = TTEmbedding(rows, cols, rank, vocab_modes=side_a, dim_modes=side_b, **arguments)
    else:
        embedding = _checked(dense, nn.Embedding, shape)
        layer, error = TTEmbedding.from_embedding(embedding, rank, vocab_modes=side_a, dim_modes=side_b, **arguments)
    if not options.learn_gates:
        freeze_gates_(layer)
    return layer, error


#: the constructor arguments a TT layer takes from the dense module it stands for (from_linear, from_embedding,
#: tensorize), which no layer argument may set as well
FIXED_BY_MODULE = {
    "linear": frozenset({"bias", "dtype", "device"}),
    "embedding": frozenset({"padding_idx", "dtype", "device"}),
}

_Dense = TypeVar("_Dense", nn.Linear, nn.Embedding)


def _checked(dense: nn.Module, expected: type[_Dense], shape: tuple[int, int]) -> _Dense:
    """``dense`` as the ``expected`` module of ``shape``, or a ValueError."""
    if isinstance(dense, expected):
        actual = dense.weight.shape if isinstance(dense, nn.Embedding) else dense.weight.shape[::-1]
        if tuple(actual) == tuple(shape):
            return dense
    raise ValueError(f"dense must be an nn.{expected.__name__} of shape {tuple(shape)}, got {dense}")


def freeze_gates_(layer: TTLayer) -> None:
    """Freeze ``layer``'s rank gates at their values (1 for a fresh layer)."""
    for gate in layer.gates:
        gate.requires_grad_(False)
