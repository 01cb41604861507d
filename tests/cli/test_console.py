"""What a `comera fit` prints: the summary a user needs, none of the upstream messages they cannot act on, and a
warning when a GPU config is fitted on a machine without a GPU."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.cli import CONFIGS, TINY_ENCODER, TINY_TRAINER, _run

from comera_lightning.callbacks import KeepFreedMemory
from comera_lightning.callbacks.host_memory import keeps_freed_memory_here
from comera_lightning.cli import ComeraCLI, gpu_config_warning


@pytest.mark.slow
def test_a_quickstart_fit_prints_the_summary_and_no_upstream_noise(workdir, capfd):
    _run(
        "fit",
        f"--config={CONFIGS / 'quickstart.yaml'}",
        *TINY_ENCODER,
        *[a for a in TINY_TRAINER if "progress_bar" not in a],
        "--trainer.max_steps=2",
        "--trainer.enable_model_summary=true",
        "--data.max_files=15",
        "--data.max_sequences=200",
    )
    captured = capfd.readouterr()
    printed = captured.out + captured.err
    upstream_messages = (
        "Tip: For seamless cloud",
        "LeafSpec",
        "Total FLOPs",
        "Skipping setting a default",
        "Creating initial MLflow database tables",
    )
    for upstream in upstream_messages:
        assert upstream not in printed, upstream
    assert "Trainable params" in printed and "MaskedLanguageModel" in printed
    assert "CoMERA:" in printed and "dense-equivalent" in printed and "allocated" in printed
    assert "comera: trained 2 steps" in printed  # the end-of-fit summary
    # output to a pipe: plain progress lines, not a live bar
    assert re.search(r"^step 2/2 \(100%\)  train/loss [\d.]+ .*compression [\d.]+x$", captured.out, re.MULTILINE)


class _Built(Exception):
    def __init__(self, cli: ComeraCLI) -> None:
        self.cli = cli


class _BuildOnly(ComeraCLI):
    """Builds model, data module and trainer, then stops before fitting."""

    def before_fit(self) -> None:
        raise _Built(self)


def test_a_gpu_config_fitted_without_a_gpu_warns_and_names_the_cpu_config(workdir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with (
        pytest.warns(UserWarning, match=r"configs/llm_60m.yaml is made for GPUs .* use --config llm_cpu"),
        pytest.raises(_Built) as built,
    ):
        _BuildOnly(
            args=[
                "fit",
                f"--config={CONFIGS / 'llm_60m.yaml'}",
                *TINY_ENCODER,
                "--trainer.logger=false",
                "--trainer.precision=32-true",
                "--trainer.accelerator=cpu",
            ]
        )
    # fast by default on a CPU: freed memory kept, although this config does not list the callback
    if keeps_freed_memory_here():
        assert sum(isinstance(c, KeepFreedMemory) for c in built.value.cli.trainer.callbacks) == 1
    assert gpu_config_warning([CONFIGS / "llm_60m.yaml"], cuda_available=True) is None
    assert gpu_config_warning([CONFIGS / "quickstart.yaml"], cuda_available=False) is None
    assert "--config code_pairs" in gpu_config_warning(["mnli_6enc.yaml"], cuda_available=False)


def test_the_bf16_model_summary_notice_is_filtered_and_other_warnings_are_not():
    import warnings

    from comera_lightning.cli import quiet_upstream_messages

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_upstream_messages()
        warnings.warn(
            "Precision bf16-mixed is not supported by the model summary.  Estimated model size in MB will not be "
            "accurate. Using 32 bits instead.",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("Precision 16-mixed is something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["Precision 16-mixed is something else"]
