"""DeadRankWatchdog: when one process of a distributed run dies, the others stop within a timeout and say which.

A DDP process killed outright (``kill -9``, the OOM killer, a lost node) leaves its peers waiting in their
next collective. With gloo on one machine they often fail at once, with an error about a closed connection
that names no rank; with NCCL, or across machines, they wait for the process group's timeout (30 minutes by
default) or until the job's wall-time ends.

Every process runs a daemon thread that bumps its own counter in the run's rendezvous store (the c10d
``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, which every launcher sets up) every ``min(timeout_s / 6, 2)``
seconds and reads its peers' counters. A peer whose counter has not moved for ``timeout_s`` (measured on this
machine's clock, so clocks of different machines never compare) is lost; a store that stops answering means
the process hosting it is gone (rank 0 under Lightning's launcher and SLURM, the agent under torchrun). The
thread then prints which rank was lost and ends this process with :data:`EXIT_CODE`, even while its main
thread is blocked in a collective. When the main thread fails first (gloo's "Connection closed by peer",
which names no rank), :meth:`Heartbeat.explain` looks for the peer that stopped beating within three beats
and reports it the same way. The newest step checkpoint (``FaultTolerance``) is where the run resumes.

The watchdog only notices processes that stop; a process that hangs with its threads alive (a deadlock in
user code) keeps its heartbeat, which the process group's own timeout catches.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

__all__ = ["EXIT_CODE", "DeadRankWatchdog", "Heartbeat"]

#: exit status of a process whose peer was lost (EX_SOFTWARE would hide it among crashes; 75 is EX_TEMPFAIL:
#: "try again later", which a requeueing scheduler reads as worth retrying)
EXIT_CODE = 75
_PREFIX = "comera/heartbeat/"
_VERDICT = "comera/lost"


class Heartbeat:
    """Beat for ``rank`` in ``store`` and watch the other ranks' beats; calls ``on_lost(ranks, message)`` once
    when a peer stops (default: print the message to stderr and end the process with :data:`EXIT_CODE`).

    Args:
        store: a ``torch.distributed.Store`` every rank reaches (the rendezvous store).
        rank, world_size: this process and the group.
        timeout_s: how long a peer may stay silent.
        on_lost: what to do; for tests and embedding.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_lost: Callable[[list[int], str], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, float(timeout_s)
        self.interval_s = min(self.timeout_s / 6, 2.0)
        self.on_lost = on_lost or _exit_lost
        now = time.monotonic()
        # per peer: its last counter and when it last changed (this machine's clock)
        self._seen: dict[int, tuple[Any, float]] = {r: (None, now) for r in range(world_size) if r != rank}
        self._store_silent_since: float | None = None
        self._store_error = ""
        self._reported = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"comera-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        """Start beating and watching (a daemon thread)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (a clean end of the run: peers that end too are not reported as lost)."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)

    def _run(self) -> None:
        beat = 0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                beat += 1
                self.store.set(f"{_PREFIX}{self.rank}", str(beat))
                if self.store.check([_VERDICT]):  # another process found a lost rank first: the same verdict here
                    reporter, ranks = self.store.get(_VERDICT).decode().split(":")
                    self._report([int(r) for r in ranks.split(",")], f"; found by rank {reporter}", post=False)
                    return
                for peer in self._seen:
                    key = f"{_PREFIX}{peer}"
                    value = self.store.get(key) if self.store.check([key]) else None
                    if value != self._seen[peer][0]:
                        self._seen[peer] = (value, now)
                self._store_silent_since = None
            except Exception as error:
                if self._stop.is_set():
                    return
                self._store_silent_since = self._store_silent_since or now
                self._store_error = f"{type(error).__name__}: {error}"
                if now - self._store_silent_since >= min(self.timeout_s, 2 * self.interval_s):
                    self._report([0])
                    return
            else:
                lost = [peer for peer, (_, changed) in self._seen.items() if now - changed >= self.timeout_s]
                if lost:
                    self._report(lost)
                    return
            self._stop.wait(self.interval_s)

    def explain(self, error: BaseException) -> None:
        """After ``error`` in this process's main thread (a collective that failed because a peer closed its
        connection, as gloo does at once): wait up to three beats for the peers that stopped beating, and if
        there are any, report them as lost (which by default ends the process); else return, and the caller
        re-raises ``error``."""
        if not self._thread.is_alive():
            return
        start = time.monotonic()
        deadline = start + 3 * self.interval_s + 0.5
        while time.monotonic() < deadline and not self._stop.is_set():
            now = time.monotonic()
            if self._store_silent_since is not None and now - self._store_silent_since >= self.interval_s:
                self._report([0])
                return
            if now - start >= 2 * self.interval_s:
                lost = [peer for peer, (_, changed) in self._seen.items() if now - changed > 1.5 * self.interval_s]
                if lost:
                    self._report(lost, f"; here it showed as {type(error).__name__}: {str(error)[:160]}")
                    return
            time.sleep(self.interval_s / 4)

    def _report(self, lost: list[int], cause: str = "", post: bool = True) -> None:
        with self._reported:  # once, whichever thread sees it first
            if self._stop.is_set():
                return
            self._stop.set()
        if post and self._store_silent_since is None:
            # tell the others before leaving (this process may host the store): they report the same rank
            # instead of this process's exit
            try:
                self.store.set(_VERDICT, f"{self.rank}:{','.join(map(str, lost))}")
                time.sleep(1.5 * self.interval_s)
            except Exception:
                pass
        if lost == [0] and self._store_silent_since is not None:
            message = (
                f"comera: lost rank 0 (the process that hosts the rendezvous store at {_store_address()} "
                f"stopped answering: {self._store_error}{cause})"
            )
        else:
            silent = self.timeout_s if not cause else 1.5 * self.interval_s
            message = (
                f"comera: lost rank {', '.join(map(str, lost))} of {self.world_size}: no heartbeat for "
                f"{silent:.1f} s (killed, out of memory, or its machine is gone){cause}"
            )
        self.on_lost(
            lost,
            f"{message}; rank {self.rank} exits with code {EXIT_CODE} instead of waiting for it. "
            "Resume from the newest step checkpoint (comera fit ... --resume auto).",
        )


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _exit_lost(ranks: list[int], message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)  # the main thread may be blocked in a collective: no clean unwinding is possible


class DeadRankWatchdog(Callback):
    """End every process of a distributed fit within ``timeout_s`` seconds of one of them dying, naming it.

    See the module docstring. Does nothing in a single-process run. The ``comera`` CLI adds it to every
    ``fit`` (``--trainer.callbacks+=DeadRankWatchdog --trainer.callbacks.timeout_s 120`` sets another timeout).

    Args:
        timeout_s: how long a silent process is waited for (longer than the longest pause of a healthy
            process's threads: a garbage-collection or swap stall).
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._heartbeat: Heartbeat | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.world_size < 2 or self._heartbeat is not None or not (dist.is_available() and dist.is_initialized()):
            return
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            rank_zero_warn(
                "DeadRankWatchdog: MASTER_ADDR/MASTER_PORT are not set, so there is no store to beat in; "
                "a dead process is noticed only through the process group's own timeout"
            )
            return
        store = dist.TCPStore(
            host, int(port), trainer.world_size, is_master=False, timeout=timedelta(seconds=self.timeout_s)
        )
        self._heartbeat = Heartbeat(store, trainer.global_rank, trainer.world_size, self.timeout_s).start()

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._heartbeat is not None and not isinstance(exception, (SystemExit, KeyboardInterrupt)):
            self._heartbeat.explain(exception)  # a failed collective: name the lost rank (and exit) if one is
        self._stop()  # Lightning calls no teardown hook after an exception; the process may live on

    def _stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
