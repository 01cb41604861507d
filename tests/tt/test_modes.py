"""Mode factorisation helpers: factorize, padded_modes, validate_modes, default_num_modes."""

from __future__ import annotations

import math

import pytest

from comera_lightning.tt import default_num_modes, factorize, padded_modes, validate_modes


def _has_balanced_factorization(n: int, num_modes: int, limit: int) -> bool:
    """Brute force: can n be written as num_modes factors, each <= limit?"""
    if num_modes == 1:
        return 1 <= n <= limit
    return any(n % f == 0 and _has_balanced_factorization(n // f, num_modes - 1, limit) for f in range(1, limit + 1))


@pytest.mark.parametrize(
    "n, num_modes, expected",
    [
        (768, 3, [12, 8, 8]),
        (768, None, [12, 8, 8]),
        (3072, 3, [16, 16, 12]),
        (12, 2, [4, 3]),
        (64, 3, [4, 4, 4]),
        (1000, 3, [10, 10, 10]),
        (36, 2, [6, 6]),
        (37, 3, [37, 1, 1]),  # prime: exact factorisation is (n, 1, ...)
        (1, 3, [1, 1, 1]),
        (5, 1, [5]),
    ],
)
def test_factorize_known_values(n, num_modes, expected):
    assert factorize(n, num_modes) == expected


@pytest.mark.parametrize("n", [2, 12, 30, 97, 360, 768, 1024, 3072, 30522, 32000])
@pytest.mark.parametrize("num_modes", [1, 2, 3, 4])
def test_factorize_is_exact_and_non_increasing(n, num_modes):
    modes = factorize(n, num_modes)
    assert len(modes) == num_modes
    assert math.prod(modes) == n
    assert modes == sorted(modes, reverse=True)
    assert all(m >= 1 for m in modes)


@pytest.mark.parametrize("n, num_modes", [(768, 3), (3072, 3), (360, 2), (1024, 4), (30, 3)])
def test_factorize_minimises_the_largest_mode(n, num_modes):
    largest = max(factorize(n, num_modes))
    # no exact factorisation of n has a smaller largest factor
    assert not _has_balanced_factorization(n, num_modes, largest - 1)


@pytest.mark.parametrize("n, expected", [(1, 1), (12, 1), (144, 2), (768, 3), (3072, 3), (30522, 4), (32000, 4)])
def test_default_num_modes(n, expected):
    assert default_num_modes(n) == expected


@pytest.mark.parametrize("bad", [0, -5])
def test_factorize_rejects_non_positive_sizes(bad):
    with pytest.raises(ValueError, match=f"cannot factorise a dimension of size {bad}; sizes must be >= 1"):
        factorize(bad, 2)
    with pytest.raises(ValueError, match=f"cannot factorise a dimension of size {bad}; sizes must be >= 1"):
        default_num_modes(bad)


def test_factorize_rejects_zero_modes():
    with pytest.raises(ValueError, match="num_modes must be >= 1, got 0"):
        factorize(12, 0)


def test_padded_modes_vocab_30522():
    modes = padded_modes(30522)
    assert len(modes) == 4
    size = math.prod(modes)
    assert 30522 <= size <= 1.25 * 30522
    limit = math.ceil(2.0 * 30522**0.25)  # balanced: no mode above twice the geometric mean
    assert max(modes) <= limit
    assert modes == sorted(modes, reverse=True)
    # smallest padded size that is balanced: nothing in [30522, size) factors with modes <= limit
    assert not any(_has_balanced_factorization(m, 4, limit) for m in range(30522, size))


@pytest.mark.parametrize("n", [768, 3072, 1024, 32000, 12])
def test_padded_modes_keeps_sizes_that_factor(n):
    assert padded_modes(n) == factorize(n)
    assert math.prod(padded_modes(n)) == n


@pytest.mark.parametrize("n, num_modes", [(37, 2), (97, 2), (1009, 3), (30522, 3)])
def test_padded_modes_pads_primes(n, num_modes):
    modes = padded_modes(n, num_modes)
    assert len(modes) == num_modes
    assert n < math.prod(modes) <= 1.25 * n + 1
    assert max(modes) <= math.ceil(2.0 * n ** (1.0 / num_modes))


def test_validate_modes_accepts_and_normalises():
    assert validate_modes((12, 8, 8), 768, "in_modes") == [12, 8, 8]
    assert validate_modes([14, 14, 13, 12], 30522, "vocab_modes") == [14, 14, 13, 12]
    out = validate_modes([4.0, 3], 12, "x", allow_padding=False)
    assert out == [4, 3] and all(type(m) is int for m in out)


def test_validate_modes_product_too_small():
    with pytest.raises(ValueError, match=r"in_modes: the product of modes \[4, 3, 2\] is 24 but must be at least 768"):
        validate_modes([4, 3, 2], 768, "in_modes")


@pytest.mark.parametrize("modes", ["12", [4, "x"], 7])
def test_validate_modes_refuses_what_is_not_a_list_of_integers(modes):
    with pytest.raises(TypeError, match="in_modes: modes must be a list of positive integers \\(or None\\)"):
        validate_modes(modes, 12, "in_modes")


def test_validate_modes_padding_not_allowed():
    with pytest.raises(ValueError, match=r"dim_modes.*must equal 30"):
        validate_modes([4, 8], 30, "dim_modes", allow_padding=False)
    # the message suggests an exact factorisation
    with pytest.raises(ValueError, match=r"\[6, 5\]"):
        validate_modes([4, 8], 30, "dim_modes", allow_padding=False)


@pytest.mark.parametrize("modes", [[], [4, 0, 3], [-2, 6]])
def test_validate_modes_rejects_empty_or_non_positive(modes):
    fix = (
        "modes must be a non-empty list of positive integers"
        if not modes
        else rf"every mode must be >= 1, got \[{modes[0]}"
    )
    with pytest.raises(ValueError, match=f"out_modes: {fix}"):
        validate_modes(modes, 12, "out_modes")


@pytest.mark.parametrize("num_modes", [1, 2, 3, 4])
def test_padded_modes_pad_to_the_smallest_balanced_size_within_a_quarter(num_modes):
    """Balanced: every mode at most twice the ``num_modes``-th root of ``n`` (rounded up). The exact modes when they
    are balanced, else those of the smallest larger size that has balanced ones, padding at most a quarter (and one)."""
    for n in range(2, 600):
        limit = math.ceil(2 * n ** (1 / num_modes))
        exact = factorize(n, num_modes)
        if max(exact) <= limit:
            expected = n
        else:
            larger = range(n + 1, math.floor(1.25 * n) + 2)
            expected = next((size for size in larger if _has_balanced_factorization(size, num_modes, limit)), n)
        modes = padded_modes(n, num_modes)
        assert math.prod(modes) == expected and len(modes) == num_modes, (n, modes)
        assert expected == n or max(modes) <= limit
    assert padded_modes(5, 2) == [5, 1]  # 5 is at the bound (2 * sqrt(5) rounds up to 5): kept
    assert padded_modes(7, 2) == [4, 2]  # the next size, 8
    assert padded_modes(11, 3) == [3, 2, 2]  # 12, where the search may go up to 11 * 1.25 = 13.75, and one
