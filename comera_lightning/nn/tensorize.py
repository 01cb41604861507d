"""``tensorize()``: swap a model's large ``nn.Linear`` / ``nn.Embedding`` modules for comera layers,
``untensorize()``: the way back to dense modules, ``tensorize_like()``: the same swap again from a state dict,
and ``size_report()``: what every comera layer costs against the dense layer it replaced.

``tensorize()`` records its arguments on the module it was called on, and that module's ``state_dict()`` carries
them in its metadata (``state_dict._metadata[prefix]["comera_tensorize"]``, which ``torch.save``/``torch.load``
keep, also with ``weights_only=True``). A fresh, dense instance of the same model then gets the same structure
from the state dict alone (:func:`tensorize_like`) before the weights load; the checkpoint's ranks are adopted by
the layers while loading.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from ..tt.rank import DEFAULT_THRESHOLD, train_parameter_count
from .base import TTLayer
from .builder import FIXED_BY_MODULE, LayerKind, TTLayerOptions, build_tt_layer, layer_shape
from .embedding import TTEmbedding
from .fast_path import restore_fast_paths, steer_off_fast_paths
from .linear import TTLinear

__all__ = [
    "LayerSize",
    "SizeReport",
    "TensorizeOptions",
    "TensorizeRecord",
    "size_report",
    "tensorize",
    "tensorize_like",
    "tensorize_options",
    "tensorize_specs",
    "tt_layers",
    "untensorize",
]

#: the key of tensorize()'s arguments in a module's state-dict metadata
SPEC_KEY = "comera_tensorize"
_SPECS_ATTR = "_comera_tensorize"  # on the module tensorize() was called on: the list of its specs


@dataclass
class TensorizeRecord:
    """What :func:`tensorize` (or :func:`untensorize`) did to one module."""

    name: str
    kind: str  # "linear" or "embedding"
    shape: tuple[int, int]
    ranks: list[int]
    dense_parameters: int
    tt_parameters: int
    relative_error: float | None  # ||W_tt - W|| / ||W|| when decomposed from pretrained weights

    @property
    def compression(self) -> float:
        return self.dense_parameters / max(self.tt_parameters, 1)

    @classmethod
    def of(
        cls, name: str, layer: TTLinear | TTEmbedding, ranks: list[int], parameters: int, error: float | None = None
    ) -> TensorizeRecord:
        """The record of ``layer`` at ``name`` with ``ranks`` and ``parameters`` (allocated or active)."""
        kind, shape, _ = layer_shape(layer)
        return cls(name, kind, shape, ranks, layer.dense_parameters, parameters, error)


@dataclass(frozen=True)
class TensorizeOptions:
    """The arguments of :func:`tensorize` as one object: which modules it swaps, and how it builds their TT layers.

    The :class:`~comera_lightning.callbacks.Tensorize` callback takes the same options, and every call records them
    in the state-dict metadata of the module it was called on, from which :func:`tensorize_like` calls it again.
    :func:`tensorize_options` makes one from keyword arguments the way :func:`tensorize` takes them.

    Attributes:
        rank: rank of the TT linears (and embeddings unless ``embedding_rank`` is given): one rank, clamped per
            bond, or the list of internal ranks.
        min_features: a module qualifies when both of its dimensions are at least this.
        include, exclude: regexes searched in each module's qualified name: only matches of ``include`` (if given)
            and no match of ``exclude`` (if given) are replaced.
        linears, embeddings: replace the ``nn.Linear`` (and Hugging Face ``Conv1D``) / ``nn.Embedding`` modules.
        embedding_rank: rank of the TT embeddings (None: ``rank``).
        decompose: initialise from the existing weights by TT-SVD (and report the error) instead of training from
            scratch.
        low_rank: one mode per side instead of a tensor train: every linear a product ``W = A B`` and every
            embedding ``E = A B`` of rank ``rank`` (the gate on their one bond), as ``LayerConfig``'s
            ``low_rank_linears`` / ``low_rank_embeddings``.
        bottleneck_activation: a non-linearity on the middle bond of every new linear, ``y = act(x L) R + b``
            (with ``low_rank`` and ``learn_gates=False``: CoLA); see :class:`TTLinear`.
        learn_gates: False freezes the rank gates at 1 (a fixed-rank model no rank callback shrinks).
        rank_threshold: gate magnitude at or below which a rank slice is switched off (None: the layers' default).
        parameterization: ``standard`` or ``mup`` (None: the layers' default, ``standard``).
        layer_kwargs: further arguments of the layer constructors (e.g. ``init_std``); an entry named like one of
            the fields above sets that field. Each reaches the layers whose constructor takes it (``deduplicate``
            only the embeddings). Not ``bias``, ``padding_idx``, ``dtype`` or ``device``: each layer takes them from
            the module it replaces.
    """

    rank: int | Sequence[int] = 30
    min_features: int = 128
    include: str | None = None
    exclude: str | None = None
    linears: bool = True
    embeddings: bool = True
    embedding_rank: int | Sequence[int] | None = None
    decompose: bool = False
    low_rank: bool = False
    bottleneck_activation: str | None = None
    learn_gates: bool = True
    rank_threshold: float | None = None
    parameterization: str | None = None
    layer_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        extra = dict(self.layer_kwargs or {})
        for name in [key for key in extra if key in _FIELD_NAMES]:  # e.g. layer_kwargs={"rank_threshold": 0.05}
            value, current = extra.pop(name), getattr(self, name)
            if current != _DEFAULTS[name] and current != value:
                raise ValueError(f"{name} is given twice, as {current!r} and as layer_kwargs[{name!r}]={value!r}")
            object.__setattr__(self, name, value)
        object.__setattr__(self, "layer_kwargs", extra)
        fixed = ", ".join(sorted(set(extra) & (FIXED_BY_MODULE["linear"] | FIXED_BY_MODULE["embedding"])))
        if fixed:
            raise ValueError(
                f"layer_kwargs may not set {fixed}: each TT layer takes them from the module it replaces; set them"
                " on the model before tensorizing it (e.g. model.to(torch.float64))"
            )
        unknown = [name for name in extra if not any(name in taken for taken in _LAYER_ARGUMENTS.values())]
        if unknown:
            linear, embedding = _LAYER_ARGUMENTS["linear"], _LAYER_ARGUMENTS["embedding"]
            taken = [f"{name} (TTEmbedding)" for name in sorted(embedding - linear)]
            taken += [f"{name} (TTLinear)" for name in sorted(linear - embedding)] + sorted(linear & embedding)
            raise ValueError(
                f"layer argument {', '.join(unknown)}: neither TTLinear nor TTEmbedding takes it; besides tensorize's"
                f" own options they take {', '.join(taken)}"
            )
        for name in ("rank", "embedding_rank"):  # a YAML list and a Python tuple are the same ranks
            if isinstance(getattr(self, name), tuple):
                object.__setattr__(self, name, list(getattr(self, name)))
        if self.min_features < 1:
            raise ValueError(f"min_features must be >= 1, got {self.min_features}")
        if self.decompose and self.bottleneck_activation is not None:
            raise ValueError(
                f"decompose=True initialises each layer from its dense weight, but with "
                f"bottleneck_activation={self.bottleneck_activation!r} a layer is no longer linear; train it from "
                f"scratch (decompose=False) or drop the activation"
            )

    def apply(self, model: nn.Module) -> list[TensorizeRecord]:
        """Replace, in place, every module of ``model`` that qualifies, as :func:`tensorize` does."""
        return _swap_layers(model, self)

    def layer_options(self) -> TTLayerOptions:
        """How each new layer is built."""
        return TTLayerOptions(
            rank=self.rank,
            embedding_rank=self.embedding_rank,
            rank_threshold=DEFAULT_THRESHOLD if self.rank_threshold is None else self.rank_threshold,
            low_rank=self.low_rank,
            bottleneck_activation=self.bottleneck_activation,
            learn_gates=self.learn_gates,
            parameterization="standard" if self.parameterization is None else self.parameterization,
        )

    def to_spec(self) -> dict[str, Any]:
        """The call as state-dict metadata records it: plain values a ``weights_only`` load accepts.

        A layer argument that is no plain value is kept by name only, under ``"unportable"``.
        """
        spec: dict[str, Any] = {key: _plain(getattr(self, key)) for key in _SPEC_KEYS}
        given = {key: getattr(self, key) for key in ("rank_threshold", "parameterization")}
        spec["layer_kwargs"], unportable = {}, []
        for key, value in {**{k: v for k, v in given.items() if v is not None}, **(self.layer_kwargs or {})}.items():
            try:
                spec["layer_kwargs"][key] = _plain(value)
            except TypeError:
                unportable.append(f"{key}={value!r}")
        if unportable:
            spec["unportable"] = unportable
        return spec

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> TensorizeOptions:
        """The options of a recorded call (:meth:`to_spec`, also as earlier releases wrote it)."""
        arguments = {k: v for k, v in spec.items() if k not in ("layer_kwargs", "decompose", "unportable")}
        return tensorize_options(**arguments, layer_kwargs=dict(spec.get("layer_kwargs") or {}))


_DEFAULTS = {f.name: f.default for f in fields(TensorizeOptions) if f.name != "layer_kwargs"}
_FIELD_NAMES = frozenset(_DEFAULTS)
# the constructor arguments a layer argument may set: not the shape and modes tensorize() picks, nor what the
# replaced module fixes, nor what the options set
_SET_ELSEWHERE = {"self", "rank", *FIXED_BY_MODULE["linear"], *FIXED_BY_MODULE["embedding"], *_FIELD_NAMES}
_LAYER_ARGUMENTS = {
    kind: frozenset(inspect.signature(layer.__init__).parameters) - _SET_ELSEWHERE - set(structure)
    for kind, layer, structure in (
        ("linear", TTLinear, ("in_features", "out_features", "in_modes", "out_modes")),
        ("embedding", TTEmbedding, ("num_embeddings", "embedding_dim", "vocab_modes", "dim_modes")),
    )
}
# the keys of a recorded call, in their order; rank_threshold and parameterization, when given, and the other layer
# arguments are under "layer_kwargs" (decompose is not recorded: the weights come from the state dict)
_SPEC_KEYS = tuple(name for name in _DEFAULTS if name not in ("decompose", "rank_threshold", "parameterization"))


def tensorize_options(**arguments: Any) -> TensorizeOptions:
    """:class:`TensorizeOptions` from :func:`tensorize`'s keyword arguments: a name it has no field for is a layer
    constructor argument (as ``layer_kwargs``)."""
    extra = {key: arguments.pop(key) for key in list(arguments) if key not in _FIELD_NAMES and key != "layer_kwargs"}
    if extra:
        arguments["layer_kwargs"] = {**(arguments.get("layer_kwargs") or {}), **extra}
    return TensorizeOptions(**arguments)


def tensorize(
    model: nn.Module,
    rank: int | Sequence[int] = 30,
    *,
    min_features: int = 128,
    include: str | None = None,
    exclude: str | None = None,
    linears: bool = True,
    embeddings: bool = True,
    embedding_rank: int | Sequence[int] | None = None,
    decompose: bool = False,
    low_rank: bool = False,
    bottleneck_activation: str | None = None,
    learn_gates: bool = True,
    rank_threshold: float | None = None,
    parameterization: str | None = None,
    **layer_kwargs: Any,
) -> list[TensorizeRecord]:
    """Replace, in place, every ``nn.Linear`` / ``nn.Embedding`` of ``model`` that qualifies.

    A module qualifies when both of its dimensions are at least ``min_features``, its qualified name
    matches the regex ``include`` (if given) and not ``exclude`` (if given). Only exact ``nn.Linear`` /
    ``nn.Embedding`` instances are replaced: subclasses (e.g. ``nn.MultiheadAttention.out_proj``) are
    read directly as weights by their owners and must stay dense. Hugging Face's ``Conv1D`` (GPT-2,
    OpenAI GPT: a linear whose weight is stored transposed, ``(in, out)``) counts as a linear and becomes
    a :class:`TTLinear` computing the same map (``decompose`` factorises its ``weight.T``).

    Tied weights are not kept tied: a head that shares its embedding's ``Parameter`` (``lm_head`` of GPT-2,
    BERT's MLM decoder) becomes a TT layer of its own; leave one of them dense (``exclude``) to keep a
    shared table.

    Args:
        model: the model to modify in place.
        rank, min_features, include, exclude, linears, embeddings, embedding_rank, decompose, low_rank,
            bottleneck_activation, learn_gates, rank_threshold, parameterization: see :class:`TensorizeOptions`
            (``TensorizeOptions(...).apply(model)`` is the same call).
        layer_kwargs: forwarded to the layer constructors (e.g. ``init_std``).

    Returns:
        One :class:`TensorizeRecord` per replaced module, in model order.
    """
    options = TensorizeOptions(
        rank=rank,
        min_features=min_features,
        include=include,
        exclude=exclude,
        linears=linears,
        embeddings=embeddings,
        embedding_rank=embedding_rank,
        decompose=decompose,
        low_rank=low_rank,
        bottleneck_activation=bottleneck_activation,
        learn_gates=learn_gates,
        rank_threshold=rank_threshold,
        parameterization=parameterization,
        layer_kwargs=layer_kwargs,
    )
    return options.apply(model)


def _swap_layers(model: nn.Module, options: TensorizeOptions) -> list[TensorizeRecord]:
    layer_options = options.layer_options()
    records = []
    replaced: dict[int, nn.Module] = {}  # a module used in several places becomes ONE shared TT layer
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) in replaced:
            _set_submodule(model, name, replaced[id(module)])
            continue
        candidate = _candidate(name, module, options)
        if candidate is None:
            continue
        if not name:
            raise ValueError(
                f"tensorize replaces submodules, but the model itself is an {type(module).__name__}; build "
                f"TTLinear/TTEmbedding directly, or wrap the layer in a container such as nn.Sequential"
            )
        kind, shape = candidate
        layer, error = _tt_layer_for(module, kind, shape, layer_options, options)
        _set_submodule(model, name, layer)
        replaced[id(module)] = layer
        records.append(TensorizeRecord.of(name, layer, layer.ranks, layer.allocated_parameters(), error))
    if records:
        _record_spec(model, options.to_spec())
        steer_off_fast_paths(model)
    return records


def _candidate(name: str, module: nn.Module, options: TensorizeOptions) -> tuple[LayerKind, tuple[int, int]] | None:
    """The kind and dense shape of the TT layer that replaces ``module``, or None when it does not qualify."""
    kind: LayerKind
    shape: tuple[int, ...]
    if options.linears and _is_hf_conv1d(module):
        kind, shape = "linear", tuple(module.get_parameter("weight").shape)  # Conv1D stores (in, out)
    elif options.linears and type(module) is nn.Linear:
        kind, shape = "linear", (module.in_features, module.out_features)
    elif options.embeddings and type(module) is nn.Embedding:
        kind, shape = "embedding", (module.num_embeddings, module.embedding_dim)
    else:
        return None
    if min(shape) < options.min_features:
        return None
    if options.include and not re.search(options.include, name):
        return None
    if options.exclude and re.search(options.exclude, name):
        return None
    return kind, (int(shape[0]), int(shape[1]))


def _tt_layer_for(
    module: nn.Module, kind: LayerKind, shape: tuple[int, int], layer_options: TTLayerOptions, options: TensorizeOptions
) -> tuple[TTLinear | TTEmbedding, float | None]:
    """The TT layer that replaces ``module``: decomposed from its weight, or fresh with its bias or padding index,
    dtype and device."""
    extra = {name: value for name, value in (options.layer_kwargs or {}).items() if name in _LAYER_ARGUMENTS[kind]}
    if options.decompose:
        dense = _conv1d_as_linear(module) if _is_hf_conv1d(module) else module
        return build_tt_layer(kind, shape, layer_options, dense=dense, **extra)
    weight = module.get_parameter("weight")
    like: dict[str, Any] = dict(dtype=weight.dtype, device=weight.device)
    if kind == "linear":
        like["bias"] = module.bias is not None
    else:
        like["padding_idx"] = module.padding_idx
    return build_tt_layer(kind, shape, layer_options, **like, **extra)


def _plain(value: Any) -> Any:
    """``value`` as data a ``weights_only`` load accepts (tuples as lists), or raise TypeError."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    raise TypeError(type(value).__name__)


def _record_spec(model: nn.Module, spec: dict[str, Any]) -> None:
    specs = model.__dict__.get(_SPECS_ATTR)
    if specs is None:
        specs = []
        object.__setattr__(model, _SPECS_ATTR, specs)
        register = getattr(model, "register_state_dict_post_hook", None) or model._register_state_dict_hook
        register(_write_specs)
    specs.append(spec)


def _write_specs(module: nn.Module, state_dict: Any, prefix: str, local_metadata: dict[str, Any]) -> None:
    """State-dict hook: the module's tensorize() arguments into its metadata entry."""
    specs = module.__dict__.get(_SPECS_ATTR)
    if specs:
        local_metadata[SPEC_KEY] = [dict(spec, layer_kwargs=dict(spec["layer_kwargs"])) for spec in specs]


def tensorize_specs(source: nn.Module | Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The :func:`tensorize` calls recorded on a model or in its state dict: ``{module name: [arguments, ...]}``,
    each module's calls in order."""
    if isinstance(source, nn.Module):
        return {
            name: [dict(spec) for spec in module.__dict__[_SPECS_ATTR]]
            for name, module in source.named_modules()
            if module.__dict__.get(_SPECS_ATTR)
        }
    metadata = getattr(source, "_metadata", None) or {}
    return {
        prefix: list(entry[SPEC_KEY])
        for prefix, entry in metadata.items()
        if isinstance(entry, Mapping) and entry.get(SPEC_KEY)
    }


def tensorize_like(
    model: nn.Module, state_dict: Mapping[str, Any], specs: Mapping[str, list[dict[str, Any]]] | None = None
) -> list[TensorizeRecord]:
    """Give a dense ``model`` the comera layers that ``state_dict`` was saved with, so that it loads.

    Repeats, on the same submodules, the :func:`tensorize` calls recorded in the state dict's metadata (or given as
    ``specs``, as :func:`tensorize_specs` returns them); calls the model already made (a model that tensorises
    itself in ``__init__``) are not repeated. Layers are built at their initial ranks and adopt the state dict's
    ranks in ``load_state_dict``; ``decompose`` is skipped, the weights come from the state dict.

    Raises:
        ValueError: the state dict holds comera layers where ``model`` has none and records no way to build them,
            or a recorded call took a layer argument a checkpoint cannot carry.
    """
    specs = tensorize_specs(state_dict) if specs is None else specs
    records: list[TensorizeRecord] = []
    for prefix, calls in specs.items():
        try:
            target = model.get_submodule(prefix)
        except AttributeError as err:
            raise ValueError(
                f"the state dict records tensorize() on submodule {prefix!r}, which this "
                f"{type(model).__name__} does not have: it is from a different model"
            ) from err
        done = target.__dict__.get(_SPECS_ATTR, [])
        for spec in calls:
            if spec in done:
                continue
            if spec.get("unportable"):
                raise ValueError(
                    f"tensorize() on {prefix or 'the model'} was called with {', '.join(spec['unportable'])}, which a "
                    f"checkpoint cannot carry; call tensorize() with these arguments in the model's __init__ (or by "
                    f"hand before loading)"
                )
            records += TensorizeOptions.from_spec(spec).apply(target)
    missing = _missing_tt_layers(model, state_dict)
    if missing:
        raise ValueError(
            f"the state dict holds comera layers at {missing}, which this {type(model).__name__} builds dense, and "
            f"records no tensorize() call that builds them (saved before tensorize() recorded its arguments, or "
            f"its metadata was lost, e.g. by copying into a plain dict); call tensorize() with the arguments used "
            f"in training, then load_state_dict"
        )
    return records


def _missing_tt_layers(model: nn.Module, state_dict: Mapping[str, Any]) -> list[str]:
    prefixes = {key[: -len(".cores.0")] for key in state_dict if key.endswith(".cores.0")}
    modules = dict(model.named_modules())
    return sorted(p for p in prefixes if p in modules and not isinstance(modules[p], TTLayer))


def untensorize(model: nn.Module) -> list[TensorizeRecord]:
    """Replace, in place, every :class:`TTLinear` / :class:`TTEmbedding` of ``model`` by the dense module it computes.

    The dense weight is the layer's reconstruction with its gates and rank masks applied (``weight_dense()``),
    so the model's outputs are unchanged up to rounding. Bias, ``padding_idx``, dtype, device and train/eval
    mode are kept; a layer used in several places becomes one shared dense module.

    Returns:
        One :class:`TensorizeRecord` per replaced layer, in model order, with its active ranks and parameters.
    """
    records = []
    replaced: dict[int, nn.Module] = {}
    for name, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) in replaced:
            _set_submodule(model, name, replaced[id(module)])
            continue
        if not isinstance(module, (TTLinear, TTEmbedding)):
            continue
        if not name:
            raise ValueError(
                f"untensorize replaces submodules, but the model itself is a {type(module).__name__}; call its "
                f"weight_dense() directly, or wrap the layer in a container such as nn.Sequential"
            )
        dense = _dense_module(module)
        _set_submodule(model, name, dense)
        replaced[id(module)] = dense
        records.append(TensorizeRecord.of(name, module, module.active_ranks, module.active_parameters()))
    restore_fast_paths(model)
    if not tt_layers(model):  # a dense model's state dict must not ask for comera layers again
        for module in model.modules():
            module.__dict__.pop(_SPECS_ATTR, None)
    return records


@torch.no_grad()
def _dense_module(layer: TTLinear | TTEmbedding) -> nn.Module:
    # a clone, not .contiguous(): a sliced view would keep the padded rows' storage alive
    weight = layer.weight_dense().detach().clone(memory_format=torch.contiguous_format)
    requires_grad = layer.cores[0].requires_grad
    if isinstance(layer, TTLinear):
        # built on the meta device: the parameters are replaced right away, so skip the random init
        dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        dense.weight = nn.Parameter(weight, requires_grad=requires_grad)
        if layer.bias is not None:
            dense.bias = nn.Parameter(layer.bias.detach().clone(), requires_grad=layer.bias.requires_grad)
    else:
        dense = nn.Embedding.from_pretrained(weight, freeze=not requires_grad, padding_idx=layer.padding_idx)
    return dense.train(layer.training)


def _is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face ``transformers.pytorch_utils.Conv1D``, recognised without importing transformers."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.shape[1] == module.nf
    )


def _conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` view of a ``Conv1D`` (``weight.T``, the same bias), sharing its storage."""
    weight = conv.get_parameter("weight")
    bias = conv.bias if isinstance(conv.bias, torch.Tensor) else None
    in_features, out_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach().t(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def tt_layers(model: nn.Module) -> list[tuple[str, TTLayer]]:
    """(qualified name, layer) of every comera layer in ``model``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TTLayer)]


@dataclass
class LayerSize:
    name: str
    ranks: list[int]
    active_ranks: list[int]
    active_parameters: int
    allocated_parameters: int
    dense_parameters: int

    @property
    def compression(self) -> float:
        return self.dense_parameters / max(self.active_parameters, 1)


@dataclass
class SizeReport:
    """Sizes of a model with comera layers. ``active`` counts only unmasked rank slices plus every
    non-TT parameter; ``dense_equivalent`` replaces every comera layer by the dense layer it stands for."""

    layers: list[LayerSize] = field(default_factory=list)
    other_parameters: int = 0

    @property
    def active_parameters(self) -> int:
        return sum(layer.active_parameters for layer in self.layers) + self.other_parameters

    @property
    def allocated_parameters(self) -> int:
        return sum(layer.allocated_parameters for layer in self.layers) + self.other_parameters

    @property
    def dense_equivalent_parameters(self) -> int:
        return sum(layer.dense_parameters for layer in self.layers) + self.other_parameters

    @property
    def compression_ratio(self) -> float:
        return self.dense_equivalent_parameters / max(self.active_parameters, 1)

    def as_dict(self) -> dict:
        return {
            "layers": [asdict(layer) | {"compression": layer.compression} for layer in self.layers],
            "other_parameters": self.other_parameters,
            "active_parameters": self.active_parameters,
            "allocated_parameters": self.allocated_parameters,
            "dense_equivalent_parameters": self.dense_equivalent_parameters,
            "compression_ratio": self.compression_ratio,
        }

    def to_markdown(self) -> str:
        lines = ["| layer | ranks | active params | dense params | compression |", "|---|---|---|---|---|"]
        for layer in self.layers:
            lines.append(
                f"| {layer.name} | {layer.active_ranks} | {layer.active_parameters:,} | "
                f"{layer.dense_parameters:,} | {layer.compression:.1f}x |"
            )
        lines.append(f"| other (dense) | - | {self.other_parameters:,} | {self.other_parameters:,} | 1.0x |")
        lines.append(
            f"| **total** | - | {self.active_parameters:,} | {self.dense_equivalent_parameters:,} | "
            f"{self.compression_ratio:.1f}x |"
        )
        return "\n".join(lines)


def size_report(model: nn.Module) -> SizeReport:
    """Per-layer and total sizes of ``model``; comera gates and masks are bookkeeping, not counted."""
    layers = tt_layers(model)
    tt_param_ids = {id(p) for _, layer in layers for p in [*layer.cores, *layer.gates]}
    report = SizeReport()
    for name, layer in layers:
        # read masks and shapes once per layer: loggers call this every step
        ranks, active, sizes = layer.ranks, layer.active_ranks, layer.mode_sizes
        report.layers.append(
            LayerSize(
                name,
                ranks,
                active,
                train_parameter_count(sizes, active),
                train_parameter_count(sizes, ranks),
                layer.dense_parameters,
            )
        )
    # a TT layer's bias is an ordinary parameter: it counts on both sides
    report.other_parameters = sum(p.numel() for p in model.parameters() if id(p) not in tt_param_ids)
    return report
