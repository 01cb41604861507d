"""The coordinate check of the ``mup`` parameterisation: flat within 2x from d 128 to 1024, where the standard one
is not."""

from __future__ import annotations

import pytest

from benchmarks import coordinate_check as cc

WIDTHS = (128, 256, 512, 1024)


def spread(values: list[float]) -> float:
    return max(values) / min(values)


@pytest.mark.parametrize("kind", cc.KINDS)
def test_coordinate_check_is_flat_within_2x_from_width_128_to_1024_under_mup(kind):
    rows = [cc.coordinate_check("mup", kind, w) for w in WIDTHS]
    for key in ("hidden", "output", "hidden_change", "output_change"):
        values = [r[key] for r in rows]
        assert spread(values) < 2.0, (key, values)
        assert min(values) > 0.1, (key, values)  # Theta(1): flat, not flat because it vanished


def test_under_the_standard_parameterisation_the_low_rank_update_grows_with_the_width():
    changes = [cc.coordinate_check("standard", "low-rank", w)["output_change"] for w in WIDTHS]
    assert changes == sorted(changes) and spread(changes) > 4.0, changes


def test_an_unknown_layer_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        cc.coordinate_check("mup", "dense", 128)
