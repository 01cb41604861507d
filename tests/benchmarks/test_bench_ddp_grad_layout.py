"""bench_ddp_grad_layout: two DDP ranks time the step with gradients in the parameters' layout and as contracted."""

from __future__ import annotations

import json

import bench_ddp_grad_layout as bench
import pytest


@pytest.mark.slow
def test_the_before_variant_reproduces_odd_layouts_and_the_kept_one_has_none(tmp_path, capsys):
    assert bench.main(["--quick", "--rounds", "1", "--steps", "1", "--port", "29533", "--out-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "ddp_grad_layout_quick.json").read_text())
    assert res["odd_layout_parameters"]["before"] >= 1 and res["odd_layout_parameters"]["kept"] == 0
    assert all(len(res["times"][name]) == 1 for name in bench.VARIANTS) and res["before_over_kept"] > 0
    assert "before / kept" in capsys.readouterr().out


def test_the_patch_is_undone_after_the_before_variant():
    from comera_lightning.tt import contract, cores

    original = cores.grad_in_layout, contract.grad_in_layout
    with bench.gradients_as_contracted():
        assert cores.grad_in_layout is not original[0]
    assert (cores.grad_in_layout, contract.grad_in_layout) == original
