"""Pure tensor-train math on torch tensors: no Lightning, no nn.Module.

* :mod:`.modes`: factorising dimensions into modes (with padding for sizes that do not factor).
* :mod:`.cores`: rank validation, initialisation, reconstruction and TT-SVD (through tensorly).
* :mod:`.rank`: rank gates, active masks, size accounting, physical truncation.
* :mod:`.contract`: contraction planner and custom autograd for TT linears.
* :mod:`.ttm`: TT-matrix embedding lookups.
"""

from .contract import (
    BOTTLENECK_ACTIVATIONS,
    PLANS,
    MergedTTLinear,
    PlanCost,
    chain_merge,
    merge_tt_linear,
    merged_tt_linear,
    plan_costs,
    plan_tt_linear,
    tt_linear,
)
from .cores import init_cores, max_ranks, resolve_ranks, tt_from_dense, tt_to_dense, ttm_from_dense, ttm_to_dense
from .modes import default_num_modes, factorize, padded_modes, validate_modes
from .rank import (
    DEFAULT_THRESHOLD,
    CoreSelection,
    apply_gates,
    bond_weights,
    leading_share,
    minimum_train_size,
    refresh_mask,
    select_rank_slices,
    train_parameter_count,
    truncate_train,
)
from .ttm import merge_ttm, ttm_halves, ttm_lookup, ttm_lookup_chain, ttm_lookup_halves

__all__ = [
    "BOTTLENECK_ACTIVATIONS",
    "DEFAULT_THRESHOLD",
    "PLANS",
    "CoreSelection",
    "MergedTTLinear",
    "PlanCost",
    "apply_gates",
    "bond_weights",
    "chain_merge",
    "default_num_modes",
    "factorize",
    "init_cores",
    "leading_share",
    "max_ranks",
    "merge_tt_linear",
    "merge_ttm",
    "merged_tt_linear",
    "minimum_train_size",
    "padded_modes",
    "plan_costs",
    "plan_tt_linear",
    "refresh_mask",
    "resolve_ranks",
    "select_rank_slices",
    "train_parameter_count",
    "truncate_train",
    "tt_from_dense",
    "tt_linear",
    "tt_to_dense",
    "ttm_from_dense",
    "ttm_halves",
    "ttm_lookup",
    "ttm_lookup_chain",
    "ttm_lookup_halves",
    "ttm_to_dense",
    "validate_modes",
]
