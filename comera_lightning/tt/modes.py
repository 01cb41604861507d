"""Factorising layer dimensions into tensor-train modes.

A TT layer reshapes a dimension ``n`` into modes ``n_1 * ... * n_d``. Balanced modes (768 -> 12*8*8) give
the smallest cores; a size with a large prime factor (30522 = 2*3*5087) has no useful factorisation, so
it is padded to the nearest size that has one (30522 -> 30576 = 14*14*13*12) and the extra rows are
never used.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from functools import cache

__all__ = ["default_num_modes", "factorize", "padded_modes", "validate_modes"]

# Target size of one mode when the caller does not say how many modes to use: the paper's shapes
# (768 = 12*8*8, 3072 = 12*16*16, 32000 = 16*20*10*10) all sit near it.
_TYPICAL_MODE_SIZE = 12
# A factorisation is "balanced enough" when its largest mode is at most this many times n ** (1/d).
_MAX_MODE_SPREAD = 2.0
# How far (relative) padding may grow a dimension before we give up and keep the unbalanced modes.
_MAX_PADDING = 0.25


def default_num_modes(n: int) -> int:
    """Number of modes that makes each mode about 12 (768 -> 3, 3072 -> 3, 30522 -> 4)."""
    if n < 1:
        raise ValueError(f"cannot factorise a dimension of size {n}; sizes must be >= 1")
    return max(1, round(math.log(n) / math.log(_TYPICAL_MODE_SIZE)))


@cache
def _best_factorization(n: int, num_modes: int, largest_allowed: int) -> tuple[int, ...] | None:
    """Non-increasing factors of n (exactly num_modes of them) with the smallest largest factor."""
    if num_modes == 1:
        return (n,) if n <= largest_allowed else None
    best: tuple[int, ...] | None = None
    lower = math.ceil(n ** (1.0 / num_modes) - 1e-9)
    for first in range(min(n, largest_allowed), lower - 1, -1):
        if n % first:
            continue
        rest = _best_factorization(n // first, num_modes - 1, first)
        if rest is not None:
            candidate = (first, *rest)
            if (
                best is None
                or max(candidate) < max(best)
                or (max(candidate) == max(best) and sum(candidate) < sum(best))
            ):
                best = candidate
    return best


def factorize(n: int, num_modes: int | None = None) -> list[int]:
    """Split ``n`` into ``num_modes`` factors (non-increasing) that are as equal as possible.

    Exact: the product is ``n``. A prime ``n`` gives ``[n, 1, ...]``; use :func:`padded_modes` when a
    balanced factorisation matters more than the exact size.
    """
    num_modes = default_num_modes(n) if num_modes is None else num_modes
    if n < 1:
        raise ValueError(f"cannot factorise a dimension of size {n}; sizes must be >= 1")
    if num_modes < 1:
        raise ValueError(f"num_modes must be >= 1, got {num_modes}")
    factors = _best_factorization(n, num_modes, n)
    assert factors is not None  # (n, 1, 1, ...) always qualifies
    return list(factors)


def padded_modes(n: int, num_modes: int | None = None) -> list[int]:
    """Balanced modes for the smallest size >= ``n`` that has them (30522 -> [14, 14, 13, 12]).

    The product may exceed ``n``; layers pad the extra rows/columns with zeros and never use them.
    """
    num_modes = default_num_modes(n) if num_modes is None else num_modes
    exact = factorize(n, num_modes)
    target = n ** (1.0 / num_modes)
    limit = math.ceil(_MAX_MODE_SPREAD * target)
    if max(exact) <= limit:
        return exact
    for size in range(n + 1, int(n * (1 + _MAX_PADDING)) + 2):
        found = _best_factorization(size, num_modes, limit)
        if found is not None:
            return list(found)
    return exact


def _as_int(value: object) -> int | None:
    """``value`` as an int when it is a whole number (``4``, ``4.0``, a numpy or 0-d torch integer), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        number = float(value)
        return int(number) if number.is_integer() else None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _int_list(values: object) -> list[int] | None:
    """``values`` as a list of ints, or None when it is not a sequence of whole numbers (str, 2.5, ...)."""
    if isinstance(values, (str, bytes, numbers.Number)):
        return None
    try:
        items = [_as_int(v) for v in values]  # type: ignore[attr-defined]
    except TypeError:
        return None
    return None if any(v is None for v in items) else items  # type: ignore[return-value]


def validate_modes(modes: Sequence[int], size: int, what: str, allow_padding: bool = True) -> list[int]:
    """Check explicit modes for a dimension of ``size`` and return them as a list of ints.

    Raises:
        TypeError: ``modes`` is not a list of integers.
        ValueError: a mode is < 1, or the product is smaller than ``size`` (or differs from it when
            padding is not allowed). The message says which product was expected.
    """
    checked = _int_list(modes)
    if checked is None:
        raise TypeError(f"{what}: modes must be a list of positive integers (or None), got {modes!r}")
    modes = checked
    if not modes:
        raise ValueError(f"{what}: modes must be a non-empty list of positive integers")
    if any(m < 1 for m in modes):
        raise ValueError(f"{what}: every mode must be >= 1, got {modes}")
    product = math.prod(modes)
    if product < size or (product != size and not allow_padding):
        relation = "equal" if not allow_padding else "be at least"
        raise ValueError(
            f"{what}: the product of modes {modes} is {product} but must {relation} {size}; "
            f"pass modes whose product is {size} (e.g. {factorize(size, len(modes))}) or leave them "
            f"as None to choose automatically"
        )
    return modes
