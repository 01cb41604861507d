"""DeadRankWatchdog: when a DDP process is killed, the others exit within the timeout, naming the lost rank."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from comera_lightning.callbacks.dead_rank import EXIT_CODE, DeadRankWatchdog, Heartbeat

TIMEOUT_S = 2.0
WORLD = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, log: str) -> None:
    """One process of a gloo group whose ranks then wait in a collective for the victim that never comes."""
    sys.stderr = open(log, "w", buffering=1)  # noqa: SIM115  (this process's whole life)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    heartbeat = Heartbeat(dist.TCPStore("127.0.0.1", port, WORLD, is_master=False), rank, WORLD, TIMEOUT_S).start()
    time.sleep(1.0)  # every rank beats
    if rank == 1:
        time.sleep(600)  # the victim: killed by the test meanwhile
    try:  # the survivors wait in a collective the victim never joins: gloo fails at once, naming no rank
        dist.all_reduce(torch.zeros(1))
    except RuntimeError as error:
        heartbeat.explain(error)  # what DeadRankWatchdog.on_exception does
        raise
    sys.exit(0)


def _rank_that_hangs(rank: int, port: int, log: str) -> None:
    """Ranks whose main thread is stuck elsewhere (a long step, a hung collective): the thread itself acts."""
    sys.stderr = open(log, "w", buffering=1)  # noqa: SIM115  (this process's whole life)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=30))
    Heartbeat(store, rank, WORLD, TIMEOUT_S).start()
    time.sleep(600)


@pytest.mark.parametrize(
    "victim,target",
    [(1, _rank), (0, _rank), (1, _rank_that_hangs)],
    ids=["a worker", "the store's host", "a worker, the others stuck"],
)
def test_survivors_of_a_killed_rank_exit_within_the_timeout_naming_it(tmp_path, victim, target):
    context = multiprocessing.get_context("fork")
    port = _free_port()
    logs = [tmp_path / f"rank{r}.txt" for r in range(WORLD)]
    procs = [context.Process(target=target, args=(r, port, str(logs[r]))) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(2.5)
        os.kill(procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        survivors = [r for r in range(WORLD) if r != victim]
        for r in survivors:
            procs[r].join(timeout=TIMEOUT_S + 10)
        took = time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    for r in survivors:
        text = logs[r].read_text()
        assert procs[r].exitcode == EXIT_CODE, (r, procs[r].exitcode, text)
        assert f"comera: lost rank {victim}" in text, text
        assert f"rank {r} exits with code {EXIT_CODE}" in text
    assert took < TIMEOUT_S + 5, took


def test_the_watchdog_is_idle_in_one_process_and_checks_its_timeout():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        DeadRankWatchdog(timeout_s=0)
    watchdog = DeadRankWatchdog(timeout_s=5)

    class _Single:
        world_size = 1

    watchdog.setup(_Single(), None, "fit")
    assert watchdog._heartbeat is None
