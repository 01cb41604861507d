"""atomic_write's file modes and file_lock: outputs are created as plain ``open()`` creates them, and one
process at a time holds a lock."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from comera_lightning.utilities.atomic import atomic_torch_save, atomic_write, file_lock


@pytest.fixture
def umask():
    """Set a umask for the test and restore the previous one after it."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_new_files_get_the_mode_plain_open_gives_under_the_umask(tmp_path, umask, mask):
    umask(mask)
    with open(tmp_path / "plain", "w") as fh:
        fh.write("x")
    with atomic_write(tmp_path / "atomic") as tmp:
        tmp.write_text("x")
    atomic_torch_save({"w": torch.zeros(2)}, tmp_path / "model.ckpt")
    with atomic_write(tmp_path / "new", overwrite=False) as tmp:
        tmp.write_text("x")
    expected = 0o666 & ~mask
    assert _mode(tmp_path / "plain") == expected
    assert _mode(tmp_path / "atomic") == expected
    assert _mode(tmp_path / "model.ckpt") == expected
    assert _mode(tmp_path / "new") == expected


def test_replacing_a_file_keeps_its_mode_as_plain_open_does(tmp_path, umask):
    umask(0o022)
    target = tmp_path / "shared.json"
    target.write_text("old")
    target.chmod(0o664)
    with atomic_write(target) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new" and _mode(target) == 0o664


def _hold(path: str, log: str, hold_s: float) -> None:
    with file_lock(path):
        with open(log, "a") as fh:
            fh.write(f"in {time.monotonic()}\n")
        time.sleep(hold_s)
        with open(log, "a") as fh:
            fh.write(f"out {time.monotonic()}\n")


def test_file_lock_lets_one_process_in_at_a_time(tmp_path):
    log = tmp_path / "log"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_hold, args=(str(tmp_path / "store.db"), str(log), 0.3)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    events = [line.split()[0] for line in log.read_text().splitlines()]
    assert events == ["in", "out", "in", "out"]  # never two inside at once
    assert (tmp_path / ".store.db.lock").exists()
