"""Tests of benchmarks/bench_training_step.py on tiny models: candidates, truncation, memory counts, outputs."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from benchmarks import bench_training_step as bts
from benchmarks import harness
from comera_lightning.nn import tt_layers
from comera_lightning.nn.dropout import PackedDropout
from comera_lightning.rank_adaptation.objectives import rank_penalty
from comera_lightning.tt import bond_weights

TINY = harness.Shape(vocab_size=300, d_model=64, num_heads=2, d_ff=256, num_layers=1, seq_len=16, dropout=0.0)
GALORE_TINY = {"rank": 8, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models on a shared 2-core machine: more threads only add OpenMP contention
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def batch():
    return harness.make_batch(TINY, 2)


def _galore_available() -> bool:
    return bts.import_galore()[1] is None


def test_paper_shape_is_the_configs_six_encoder_model():
    shape = harness.paper_shape()
    assert (
        shape.vocab_size,
        shape.d_model,
        shape.num_heads,
        shape.d_ff,
        shape.num_layers,
        shape.seq_len,
        shape.num_classes,
    ) == (30522, 768, 12, 3072, 6, 128, 3)
    assert (shape.rank, shape.embedding_rank) == (30, 32)
    # the reference code tensorises the pooler and keeps the 768 -> 3 classifier dense
    assert "pooler" not in shape.dense_layers and "classifier" in shape.dense_layers


def test_every_candidate_has_the_models_default_packed_dropout(batch):
    shape = replace(TINY, dropout=0.1)
    for cand in (bts.dense_adamw(shape, *batch), bts.comera(shape, *batch)):
        assert any(isinstance(m, PackedDropout) for m in cand.model.modules())
        assert math.isfinite(float(cand.step()))


def test_dense_and_comera_candidates_train_with_finite_losses(batch):
    ids, labels = batch
    dense = bts.dense_adamw(TINY, ids, labels)
    comera = bts.comera(TINY, ids, labels)
    for cand in (dense, comera):
        losses = [float(cand.step()) for _ in range(3)]
        assert all(math.isfinite(v) for v in losses), (cand.name, losses)
        assert losses[-1] < cand.info["first_loss"], f"{cand.name} does not learn its one batch: {losses}"
    assert not any(
        isinstance(m, torch.nn.Embedding) and m.num_embeddings == TINY.vocab_size for m in comera.model.modules()
    ), "CoMERA's word embedding must be a TT embedding"
    # word embedding + q,k,v,o,fc1,fc2 per layer + the pooler
    assert len(tt_layers(comera.model)) == 1 + 6 * TINY.num_layers + 1
    assert comera.parameters < dense.parameters


@pytest.mark.skipif(not _galore_available(), reason="galore-torch not installed (pip install -e .[galore])")
def test_galore_starts_from_the_dense_model_and_refreshes_only_when_asked(batch):
    ids, labels = batch
    dense = bts.dense_adamw(TINY, ids, labels)
    galore = bts.dense_galore(TINY, ids, labels, settings=GALORE_TINY)
    # same initial weights, no dropout: the first loss is the same function of the same batch
    assert galore.info["first_loss"] == pytest.approx(dense.info["first_loss"], rel=1e-6)
    targets = bts.galore_targets(galore.model)
    assert len(targets) == 6 * TINY.num_layers and all(p.dim() == 2 for p in targets)
    first = [galore.optimizer.state[p]["projector"].ortho_matrix for p in targets]
    for _ in range(3):
        assert math.isfinite(float(galore.step()))
    assert all(galore.optimizer.state[p]["projector"].ortho_matrix is m for p, m in zip(targets, first, strict=True)), (
        "a steady-state step must not recompute the projection"
    )
    galore.info["refresh_step"]()
    assert all(
        galore.optimizer.state[p]["projector"].ortho_matrix is not m for p, m in zip(targets, first, strict=True)
    ), "the refresh step must recompute every projection"
    assert all(
        galore.optimizer.state[p]["exp_avg"].shape[-1] == GALORE_TINY["rank"]
        or galore.optimizer.state[p]["exp_avg"].shape[0] == GALORE_TINY["rank"]
        for p in targets
    )


def test_galore_missing_is_skipped_with_the_install_command(batch, monkeypatch):
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # makes `import galore_torch` raise ImportError
    cand = bts.dense_galore(TINY, *batch)
    assert cand.skipped and "pip install -e .[galore]" in cand.skipped and cand.step is None


def test_rank_adaptation_work_adds_the_penalty_gradient_and_refreshes_masks(batch):
    ids, labels = batch
    cand = bts.comera(TINY, ids, labels)
    work = bts.RankAdaptationWork(cand.model, cand.optimizer, gamma=0.5)
    layers = [layer for _, layer in tt_layers(cand.model)]
    gates = [g for layer in layers for g in layer.gates]
    cand.optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(cand.model(ids), labels).backward()
    task = [g.grad.clone() for g in gates]
    masks = [m for layer in layers for m in layer.rank_masks]
    weights = [w for layer in layers for w in bond_weights(layer.mode_sizes, layer.active_ranks)]
    expected = torch.autograd.grad(rank_penalty(gates, masks, weights), gates)
    work.before_step()
    for gate, t, e in zip(gates, task, expected, strict=True):
        torch.testing.assert_close(gate.grad, t + 0.5 * e)
    cand.optimizer.step()
    layer = layers[1]
    with torch.no_grad():
        layer.gates[0][:3] = 0.0  # below the threshold: the mask refresh must switch these slices off
    work.after_step()
    assert layer.active_ranks[1] == layer.ranks[1] - 3


def test_memory_breakdown_matches_a_hand_count(batch):
    ids, labels = batch
    dense = bts.dense_adamw(TINY, ids, labels)
    n = sum(p.numel() for p in dense.model.parameters())
    tensors = len(list(dense.model.parameters()))
    mem = bts.measure_memory(dense, (ids, labels))
    assert mem["parameters"] == 4 * n
    assert mem["gradients"] == 4 * n  # the tiny model's peak is in optimizer.step(), with every gradient live
    assert mem["optimizer_state_persistent"] == 2 * 4 * n + 4 * tensors  # exp_avg, exp_avg_sq, a float32 step each
    assert mem["optimizer_state"] >= mem["optimizer_state_persistent"]
    assert mem["total"] >= mem["parameters"] + mem["gradients"] + mem["optimizer_state_persistent"]

    comera = bts.comera(TINY, ids, labels)
    n = sum(p.numel() for p in comera.model.parameters())  # cores, gates and the dense rest, all float32
    tensors = len(list(comera.model.parameters()))
    mem = bts.measure_memory(comera, (ids, labels))
    assert mem["parameters"] == 4 * n
    assert mem["optimizer_state_persistent"] == 2 * 4 * n + 4 * tensors
    assert 0 < mem["gradients"] <= 4 * n
    assert mem["buffers"] > 0  # the rank masks


@pytest.mark.skipif(not _galore_available(), reason="galore-torch not installed (pip install -e .[galore])")
def test_galore_memory_counts_its_projectors(batch):
    ids, labels = batch
    galore = bts.dense_galore(TINY, ids, labels, settings=GALORE_TINY)
    mem = bts.measure_memory(galore, (ids, labels))
    assert galore.info["projector_storage_bytes"] >= galore.info["projector_bytes"] > 0
    assert mem["other"] >= galore.info["projector_storage_bytes"]
    # projected moments: rank x (the weight's longer side) per weight, two of them, instead of two full copies
    galore_numel = galore.info["galore_parameters"]
    plain = sum(p.numel() for p in galore.model.parameters()) - galore_numel
    assert mem["optimizer_state_persistent"] < 2 * 4 * (plain + galore_numel)


def test_profile_and_explanation(batch):
    ids, labels = batch
    dense, comera = bts.dense_adamw(TINY, ids, labels), bts.comera(TINY, ids, labels)
    pc, pd = harness.profile_ops(comera.step), harness.profile_ops(dense.step)
    assert pc["top"] and sum(t["share"] for t in pc["top"]) <= 1.0 + 1e-9
    assert any(t["op"].startswith("aten::") for t in pc["top"])
    line = bts.explain(pc, pd)
    assert "top ops" in line and "cap the speedup" in line


def test_bf16_mixed_autocasts_forward_and_keeps_float32_state(batch):
    ids, labels = batch
    cand = bts.comera(TINY, ids, labels, execution=bts.Execution(precision="bf16-mixed"))
    outputs = []
    hook = cand.model.classifier.register_forward_hook(lambda module, inputs, out: outputs.append(out.dtype))
    try:
        assert math.isfinite(float(cand.step()))
    finally:
        hook.remove()
    assert outputs == [torch.bfloat16]
    assert {p.dtype for p in cand.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in cand.model.parameters() if p.grad is not None} == {torch.float32}
    assert {
        v.dtype
        for state in cand.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.is_floating_point()
    } == {torch.float32}


def test_execution_validates_and_names_the_outputs():
    assert bts.Execution().stem == "" and bts.Execution("cpu", "32-true") == bts.CPU_FP32
    assert bts.Execution(precision="bf16-mixed").stem == "_bf16"
    assert bts.Execution("cuda", "bf16-mixed").stem == "_cuda_bf16" and bts.Execution("cuda").stem == "_cuda"
    assert bts.Execution().describe().startswith("float32 CPU")
    with pytest.raises(ValueError, match="device must be one of"):
        bts.Execution("tpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        bts.Execution(precision="16-mixed")


def test_explain_adds_the_gpu_sentence_only_for_device_profiles():
    def profile(cpu_s: float, device_s: float | None) -> dict:
        out = {"total_self_cpu_s": cpu_s, "ops_s": {"aten::mm": cpu_s}, "top": [{"op": "aten::mm", "share": 1.0}]}
        if device_s is not None:
            out.update(total_self_device_s=device_s, device_ops_s={"aten::mm": device_s})
        return out

    assert "GPU" not in bts.explain(profile(0.01, None), profile(0.02, None))
    line = bts.explain(profile(0.01, 0.002), profile(0.02, 0.008))
    assert "On the GPU" in line and "CoMERA 2.00 ms" in line and "dense+AdamW 8.00 ms" in line


def test_device_times_reads_a_cuda_profiles_key_averages():
    from types import SimpleNamespace

    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    event = lambda key, device, us, note=False: SimpleNamespace(  # noqa: E731
        key=key, device_type=device, self_device_time_total=us, is_user_annotation=note
    )
    events = [
        event("aten::mm", cpu, 300.0),
        event("aten::add", cpu, 100.0),
        event("aten::view", cpu, 0.0),
        event("gemm_kernel", cuda, 300.0),
        event("add_kernel", cuda, 100.0),
        event("step", cuda, 999.0, True),
    ]
    out = harness.device_times(events, iterations=2)
    assert out["total_self_device_s"] == pytest.approx(200e-6)
    assert out["device_ops_s"] == pytest.approx({"aten::mm": 150e-6, "aten::add": 50e-6})
    assert list(out["device_ops_s"]) == ["aten::mm", "aten::add"]


def test_main_bf16_mixed_on_the_cpu_records_it_and_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bts, "paper_shape", lambda config=harness.PAPER_CONFIG: TINY)
    monkeypatch.setattr(bts, "GALORE_SETTINGS", GALORE_TINY)
    assert (
        bts.main(
            [
                "--quick",
                "--precision",
                "bf16-mixed",
                "--batch",
                "2",
                "--repeats",
                "1",
                "--refresh-samples",
                "0",
                "--profile",
                "never",
                "--max-other-load",
                "1",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "bf16-mixed (float32 weights) CPU" in capsys.readouterr().out
    assert not (tmp_path / "training_step.json").exists()  # the float32 results are not overwritten
    step = json.loads((tmp_path / "training_step_bf16.json").read_text())
    settings = step["settings"]
    assert (settings["device"], settings["precision"], settings["autocast_dtype"]) == ("cpu", "bf16-mixed", "bfloat16")
    for res in step["results"].values():
        for name, entry in res["candidates"].items():
            if entry["skipped"]:
                continue
            assert math.isfinite(entry["first_loss"]) and entry["median_s"] > 0, name
            assert "cuda_peak_bytes" not in entry
            entry.update(cuda_peak_bytes=3 * 2**20, cuda_step_peak_bytes=2**20)  # as a CUDA run records them
    assert (tmp_path / "training_step_bf16.png").exists()
    table = bts.step_tables({int(b): r for b, r in step["results"].items()}, step["verdicts"])
    assert bts.CUDA_HEADER in table and "| 3.00 (+1.00) |" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device cuda is valid here")
def test_device_cuda_without_cuda_fails_clearly(capsys):
    with pytest.raises(SystemExit) as exc:
        bts.main(["--device", "cuda", "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "torch.cuda.is_available() is False" in err and "--device cpu" in err


@pytest.mark.slow
def test_main_writes_tables_json_and_plots(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bts, "paper_shape", lambda config=harness.PAPER_CONFIG: TINY)
    monkeypatch.setattr(bts, "GALORE_SETTINGS", GALORE_TINY)
    rc = bts.main(
        [
            "--batch",
            "2",
            "--layers",
            "1",
            "--repeats",
            "1",
            "--refresh-samples",
            "1",
            "--profile",
            "always",
            "--min-total-s",
            "0",
            "--max-other-load",
            "1",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "time dense/CoMERA" in out and "| target |" in out and out.count("why (profile") == 2
    step = json.loads((tmp_path / "training_step.json").read_text())
    assert set(step["results"]) == {"1", "2"}
    res = step["results"]["2"]
    assert set(res["candidates"]) == {bts.DENSE, bts.GALORE, bts.COMERA}
    for name, entry in res["candidates"].items():
        if entry.get("skipped"):
            continue
        assert entry["median_s"] > 0 and entry["tokens_per_s"] > 0 and entry["memory"]["total"] > 0, name
        assert len(res["timing"]["samples_s"][name]) >= 1
    assert res["ratios"]["time dense/CoMERA"] == pytest.approx(
        res["candidates"][bts.DENSE]["median_s"] / res["candidates"][bts.COMERA]["median_s"]
    )
    assert len(step["verdicts"]) == 3 and [v["batch"] for v in step["verdicts"]] == [2, 1, 1]
    profiles = step["profiles"]
    assert set(profiles) == {"1", "2"} and profiles["2"]["against"] == bts.DENSE
    assert profiles["1"]["against"] == (bts.GALORE if _galore_available() else bts.DENSE)
    assert all(p["comera"]["top"] and p["other"]["top"] and "cap the speedup" in p["why"] for p in profiles.values())
    assert step["machine"]["torch"] == torch.__version__
    assert (tmp_path / "training_step.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_main_reports_skipped_galore(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bts, "paper_shape", lambda config=harness.PAPER_CONFIG: TINY)
    monkeypatch.setitem(sys.modules, "galore_torch", None)
    assert (
        bts.main(
            [
                "--batch",
                "1",
                "--repeats",
                "1",
                "--profile",
                "never",
                "--min-total-s",
                "0",
                "--max-other-load",
                "1",
                "--out-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "skipped" in out and "pip install -e .[galore]" in out
    step = json.loads((tmp_path / "training_step.json").read_text())
    assert "pip install" in step["results"]["1"]["candidates"][bts.GALORE]["skipped"]
    assert step["results"]["1"]["ratios"]["memory GaLore/CoMERA"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--profile", "bogus"], "invalid choice"),
        (["--batch", "0"], "positive integer"),
        (["--batch", "many"], "positive integer"),
    ],
)
def test_bad_arguments_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bts.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option, value", [("--precision", "16-mixed"), ("--device", "tpu")])
def test_unsupported_devices_and_precisions_are_refused(option, value, capsys):
    with pytest.raises(SystemExit) as exc:
        bts.main([option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{option}: invalid choice: {value!r}" in err
