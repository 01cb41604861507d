"""Pre-emption: SIGTERM/SIGUSR1 mid-fit finishes the step, writes a step checkpoint, exits 128 + signal number,
and the checkpoint resumes exactly; disk-full saves name the path and leave the earlier file whole."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from tiny import TinyRegressor, regression_loader

from comera_lightning.callbacks.fault_tolerance import FaultTolerance, checkpoint_files, find_resume_checkpoint
from comera_lightning.data.common import rows_loader
from comera_lightning.utilities import checkpoint_io


class NoisyRegressor(TinyRegressor):
    """Input noise from the global torch stream: a resume is exact only if the random state comes back too."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x + 0.1 * torch.randn_like(x)).float(), y)
        self.losses.append(float(loss.detach()))
        return loss


class SignalAt(Callback):
    """Send ``signum`` to this process between backward and the optimiser step of step ``step`` (0-based)."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum
        self.fired = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step:
            self.fired = True
            os.kill(os.getpid(), self.signum)


def _loader():
    return rows_loader(regression_loader(n=96).dataset, batch_size=16, collate_fn=None, train=True, seed=3)


def _fit(root: Path, callbacks: list, max_steps: int, ckpt_path: Path | None = None) -> NoisyRegressor:
    torch.manual_seed(1)
    model = NoisyRegressor()
    trainer = Trainer(
        max_steps=max_steps,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
    )
    trainer.fit(model, _loader(), ckpt_path=ckpt_path, weights_only=True)
    return model


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_mid_fit_saves_exits_nonzero_and_resumes_exactly(tmp_path, monkeypatch, signum, capsys):
    reference = _fit(tmp_path / "ref", [], max_steps=10)  # 6 batches an epoch: the resume crosses an epoch

    # a second signal arrives while the pre-emption checkpoint is being written
    writes = []
    sender = SignalAt(4, signum)

    def save_and_signal_again(obj, path):
        writes.append(Path(path).name)
        if sender.fired:
            os.kill(os.getpid(), signum)
        original(obj, path)

    original = checkpoint_io.atomic_torch_save
    monkeypatch.setattr(checkpoint_io, "atomic_torch_save", save_and_signal_again)
    folder = tmp_path / "ft"
    previous = signal.getsignal(signum)
    with pytest.raises(SystemExit) as stopped:
        _fit(tmp_path / "run", [sender, FaultTolerance(every_n_steps=3, dirpath=str(folder))], max_steps=10)
    assert stopped.value.code == 128 + signum  # 143 for SIGTERM: the scheduler sees a run that did not finish
    assert signal.getsignal(signum) == previous  # handlers put back
    # the step in flight (step 5) finished and was saved; the periodic step 3 is still there
    assert [p.name for p in checkpoint_files(folder)] == ["step=000000005.ckpt", "step=000000003.ckpt"]
    assert writes == ["step=000000003.ckpt", "step=000000005.ckpt"] and not list(folder.glob(".*tmp"))
    assert find_resume_checkpoint(folder) == folder / "step=000000005.ckpt"
    monkeypatch.setattr(checkpoint_io, "atomic_torch_save", original)

    resumed = _fit(
        tmp_path / "run",
        [FaultTolerance(every_n_steps=3, dirpath=str(folder))],
        max_steps=10,
        ckpt_path=folder / "step=000000005.ckpt",
    )
    assert resumed.losses == reference.losses[5:]  # bit for bit, from the next step on


class _Full:
    """A writer that fills the disk after ``limit`` bytes, as a full file system does."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, obj, target, *args, **kwargs):
        if hasattr(target, "write"):
            target.write(b"\0" * self.limit)
        else:
            Path(target).write_bytes(b"\0" * self.limit)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_during_a_checkpoint_save_names_the_path_and_keeps_the_earlier_file(tmp_path, monkeypatch):
    folder = tmp_path / "ft"
    _fit(tmp_path, [FaultTolerance(every_n_steps=2, dirpath=str(folder), keep=1)], max_steps=2)
    earlier = (folder / "step=000000002.ckpt").read_bytes()
    monkeypatch.setattr(torch, "save", _Full(100))
    with pytest.raises(OSError, match=r"no space left on device.*step=000000002\.ckpt") as failed:
        checkpoint_io.AtomicCheckpointIO().save_checkpoint({"x": 1}, folder / "step=000000002.ckpt")
    assert failed.value.errno == errno.ENOSPC
    assert (folder / "step=000000002.ckpt").read_bytes() == earlier
    assert [p.name for p in folder.iterdir()] == ["step=000000002.ckpt"]  # no temporary file left behind


def test_disk_full_during_an_export_names_the_path(tmp_path, monkeypatch):
    from comera_lightning import export

    out = tmp_path / "model.safetensors"
    out.write_bytes(b"earlier")

    def full(state, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 10)
        raise RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )  # what safetensors' Rust writer raises

    monkeypatch.setattr(export, "save_file", full)
    with pytest.raises(
        OSError,
        match=r"no space left on device while writing .*model\.safetensors.* earlier file "
        r"is intact",
    ):
        export.export_model(TinyRegressor(), out, overwrite=True)
    assert out.read_bytes() == b"earlier" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


@pytest.mark.slow
def test_sigterm_during_comera_fit_saves_and_exits_143(tmp_path):
    """The real thing, as a scheduler does it: SIGTERM from outside to a running `comera fit`."""
    import time

    from tests.callbacks.test_fault_tolerance import _ft_dir, _launch

    proc = _launch(
        tmp_path, "--trainer.max_steps=100000", "--fault_tolerance.every_n_steps=5", "--fault_tolerance.keep=5"
    )
    log = tmp_path / "log.txt"
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and not list((tmp_path / "runs").rglob("step=*")):
            time.sleep(0.1)
        time.sleep(0.5)  # somewhere in the steps after the first periodic checkpoint
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 143, text[-3000:]
    newest = checkpoint_files(_ft_dir(tmp_path))[0]
    step = int(newest.name[5:14])
    assert step > 5 and f"received SIGTERM; finished step {step}, wrote the step checkpoint {newest}" in text, text[
        -3000:
    ]
    assert find_resume_checkpoint(newest.parent) == newest
