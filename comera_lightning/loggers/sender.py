"""The metric buffer of :class:`~comera_lightning.loggers.ResilientMLFlowLogger` and who empties it.

The training loop only appends ``(key, value, timestamp_ms, step)`` rows to a list; the logger's ``flush``
sends them, called every ``interval_s`` seconds (or as soon as a full batch is waiting) either by a
daemon thread (``"thread"``) or by the training loop itself (``"inline"``). Past ``max_buffered`` rows the
oldest are handed to ``spill`` (the logger's fallback file), so memory stays flat whatever the store's speed.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

__all__ = ["MetricSender"]

log = logging.getLogger(__name__)

Row = tuple[str, float, int, int]


class MetricSender:
    """Buffers metric rows for ``flush`` and calls it off the training loop (``mode="thread"``) or from it.

    The thread holds the sender weakly, so a logger that is dropped takes its thread with it; a sender never
    stopped flushes what it holds when the interpreter exits.

    Args:
        flush: sends what :meth:`take` returns (the logger's ``flush``).
        spill: receives the oldest rows when more than ``max_buffered`` are waiting.
        interval_s: call ``flush`` at least this often (``0`` with ``"inline"``: on every :meth:`add`).
        mode: ``"thread"`` (a daemon thread calls ``flush``) or ``"inline"`` (:meth:`add` does).
        max_buffered: rows held in memory at most.
        batch_size: rows that make a full request: reaching it flushes at once.
    """

    def __init__(
        self,
        flush: Callable[[], None],
        spill: Callable[[Sequence[Row]], None],
        interval_s: float,
        mode: Literal["thread", "inline"],
        max_buffered: int,
        batch_size: int,
    ) -> None:
        self._flush = flush
        self._spill = spill
        self.interval_s = float(interval_s)
        self.mode = mode
        self.max_buffered = int(max_buffered)
        self.batch_size = int(batch_size)
        self._buffer: list[Row] = []
        self._last_flush = time.monotonic()
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._atexit_registered = False

    # --- pickling (ddp_spawn sends the logger to its processes): the buffer travels, the thread does not --
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_lock", "_wake", "_stop", "_thread", "_atexit_registered"):
            del state[key]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    @property
    def pending(self) -> bool:
        """Whether rows are waiting to be sent."""
        return bool(self._buffer)

    def add(self, rows: Sequence[Row]) -> None:
        """Buffer ``rows``; wake the thread for a full batch, or (inline) flush when one is due."""
        with self._lock:
            self._buffer.extend(rows)
            overflow = len(self._buffer) - self.max_buffered
            if overflow > 0:  # the store cannot keep up (or is stuck): park the oldest elsewhere, sent later
                spilled, self._buffer = self._buffer[:overflow], self._buffer[overflow:]
                self._spill(spilled)
            size = len(self._buffer)
        if self.mode != "inline":
            self._ensure_thread()
            if size >= self.batch_size:
                self._wake.set()
        elif size >= self.batch_size or time.monotonic() - self._last_flush >= self.interval_s:
            self._flush()

    def take(self) -> list[Row]:
        """All buffered rows, removed from the buffer (what ``flush`` sends)."""
        with self._lock:
            rows, self._buffer = self._buffer, []
            self._last_flush = time.monotonic()
        return rows

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=_sender_loop, args=(weakref.ref(self),), daemon=True, name="comera-mlflow-sender"
        )
        self._thread.start()
        if not self._atexit_registered:  # a logger never finalised still flushes at interpreter exit
            atexit.register(_flush_at_exit, weakref.ref(self))
            self._atexit_registered = True

    def stop(self) -> None:
        """Stop the thread after its last flush (waits up to 60 s); the next :meth:`add` starts a new one."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        self._wake.set()
        thread.join(timeout=60.0)
        self._thread = None
        self._stop.clear()
        if thread.is_alive():
            log.warning(
                "ResilientMLFlowLogger: the MLflow sender thread did not finish within 60 s; "
                "values it is sending may be missing."
            )


def _sender_loop(ref: weakref.ref) -> None:
    """The background sender: flush every ``interval_s`` or when woken, until stopped."""
    while True:
        sender = ref()
        if sender is None:
            return
        wake, stop, interval = sender._wake, sender._stop, max(sender.interval_s, 0.05)
        del sender  # no strong reference while waiting
        wake.wait(interval)
        wake.clear()
        sender = ref()
        if sender is None:
            return
        try:
            sender._flush()
        except Exception:
            log.exception("ResilientMLFlowLogger: sending metrics failed unexpectedly")
        if stop.is_set():
            return
        del sender


def _flush_at_exit(ref: weakref.ref) -> None:
    sender = ref()
    if sender is None:
        return
    if sender.pending:
        sender.stop()
        sender._flush()
