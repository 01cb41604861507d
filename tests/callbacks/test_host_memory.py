"""KeepFreedMemory: freed host memory is reused (no page faults for a repeated large block), and restored."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys

import pytest
from lightning.pytorch import Callback, Trainer
from tiny import TinyRegressor, regression_loader

from comera_lightning.callbacks import KeepFreedMemory, host_memory
from comera_lightning.callbacks.host_memory import keep_freed_memory

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's"
)
# 40 MiB of float32: above glibc's largest mmap threshold (32 MiB) and below the 64 MiB heaps of its per-thread
# arenas, which serve larger blocks by mmap whatever the settings (in a busy process this thread may be on one)
BLOCK = 40 * 2**20 // 4


# Run in a fresh interpreter: in a process whose heap earlier work left with large free chunks (the full
# suite runs KeepFreedMemory in CLI tests), glibc serves the block from those chunks before it considers
# mmap, so "the default faults" would depend on test order.
MEASURE = f"""
import resource, sys, torch
from comera_lightning.callbacks.host_memory import keep_freed_memory

def fewest_faults_per_block(blocks=6):
    counts = []
    for _ in range(blocks):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty({BLOCK}).fill_(1.0)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(counts)  # the fewest: the heap may grow once or twice before freed blocks are reused

default = fewest_faults_per_block()
assert keep_freed_memory(True)
kept = fewest_faults_per_block()
assert keep_freed_memory(False)
print(default, kept)
"""


@glibc
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    pages = BLOCK * 4 // resource.getpagesize()
    result = subprocess.run([sys.executable, "-c", MEASURE], capture_output=True, text=True, check=True)
    default, kept = map(int, result.stdout.split())
    # glibc's default: every block is a fresh mapping (transparent huge pages fault less per page)
    assert default > 0.1 * pages / 512
    assert kept < 0.01 * pages


def test_callback_applies_for_the_run_and_restores_at_teardown(tmp_path, monkeypatch):
    calls: list[tuple[int, int]] = []

    class Recording:
        def mallopt(self, parameter, value):
            calls.append((parameter, value))
            return 1

        def malloc_trim(self, pad):
            calls.append(("trim", pad))

    monkeypatch.setattr(host_memory, "_glibc", Recording)

    class SeesIt(Callback):
        def on_train_start(self, trainer, pl_module):
            self.calls_at_start = list(calls)

    seen, keep = SeesIt(), KeepFreedMemory()
    trainer = Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
        callbacks=[keep, seen],
    )
    trainer.fit(TinyRegressor(), regression_loader())
    kept = [(host_memory._M_MMAP_MAX, 0), (host_memory._M_TRIM_THRESHOLD, 2**31 - 1)]
    assert seen.calls_at_start == kept
    assert calls == [*kept, (host_memory._M_MMAP_MAX, 65536), (host_memory._M_TRIM_THRESHOLD, 128 * 1024), ("trim", 0)]
    assert not keep.applied


def test_without_glibc_nothing_changes_and_the_callback_says_so(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    assert keep_freed_memory(True) is False
    callback = KeepFreedMemory()
    with pytest.warns(UserWarning, match="has no mallopt"):
        callback.setup(None, None, "fit")
    assert not callback.applied
    callback.teardown(None, None, "fit")


def test_a_refused_setting_is_an_error(monkeypatch):
    class Refuses:
        def mallopt(self, parameter, value):
            return 0

    monkeypatch.setattr(host_memory, "_glibc", Refuses)
    with pytest.raises(RuntimeError, match="mallopt refused"):
        keep_freed_memory(True)
