"""ResilientMLFlowLogger itself: the run's identity, Lightning's logging API, and the degraded state.

The metric buffer and its thread are :mod:`.sender`'s, the local folder and the later upload
:mod:`.fallback`'s; the package docstring (:mod:`comera_lightning.loggers`) tells the behaviour.

Only public API of Lightning's :class:`~lightning.pytorch.loggers.MLFlowLogger` is used: its ``experiment``,
``run_id`` and ``experiment_id`` properties (which create the experiment and the run) and its ``finalize``
(which uploads the checkpoints for ``log_model=True`` and closes the run); this logger keeps its own copies of
what it was given (tracking URI, names, prefix) instead of reading MLFlowLogger's attributes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from ..utilities.atomic import file_lock
from ..utilities.internals import mlflow_logger_without_client
from .fallback import FALLBACK_FOLDER, MAX_BATCH, METRICS_CSV, FallbackStore, Row, metric_rows
from .sender import MetricSender

__all__ = ["DEFAULT_TRACKING_URI", "ResilientMLFlowLogger", "TrackingDegradedWarning", "default_tracking_uri"]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def default_tracking_uri() -> str:
    """Where runs are tracked when no URI is given: ``MLFLOW_TRACKING_URI`` if set, else a sqlite file in the
    working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


log = logging.getLogger(__name__)

_UNSAFE_KEY = re.compile(r"[^a-zA-Z0-9_/. -]+")  # what Lightning's MLFlowLogger deletes from metric keys
_MAX_RETRY_DELAY_S = 600.0
_STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}


class TrackingDegradedWarning(UserWarning):
    """The MLflow tracking store failed; training goes on and what cannot be sent is kept locally."""


class _GuardedClient:
    """What :attr:`ResilientMLFlowLogger.experiment` returns: the logger's MlflowClient, whose ``log_*`` and
    ``set_*`` methods never raise for a tracking-store failure (the logger keeps the data instead)."""

    def __init__(self, logger: ResilientMLFlowLogger) -> None:
        self._logger = logger

    @property
    def client(self) -> Any:
        """The unwrapped :class:`~mlflow.tracking.MlflowClient`."""
        return self._logger._mlflow()

    def __getattr__(self, name: str) -> Any:
        from mlflow.tracking import MlflowClient

        # looked up on the class: opening the client (and its store) is part of the guarded call
        if name.startswith(("log_", "set_")) and callable(getattr(MlflowClient, name, None)):
            return functools.partial(self._logger._guarded_call, name)
        return getattr(self._logger._mlflow(), name)

    def __repr__(self) -> str:
        return f"<guarded {self._logger._mlflow()!r}>"


class ResilientMLFlowLogger(MLFlowLogger):
    """MLFlowLogger that buffers, sends off the training loop, and survives a failing tracking store.

    See :mod:`comera_lightning.loggers` for the behaviour. All of
    :class:`~lightning.pytorch.loggers.MLFlowLogger`'s arguments keep their meaning, except that
    ``tracking_uri`` defaults to ``MLFLOW_TRACKING_URI`` read when the logger is built (not when the module is
    imported) and else to MLflow 3's ``sqlite:///mlflow.db``.

    Args:
        local_dir: root of the local fallback folders: the Trainer's ``default_root_dir``, so that a run's
            fallback lands next to its checkpoints (``<local_dir>/<experiment id>/<run id>/``). ``None``:
            ``./runs`` unless :attr:`local_dir` is set before the first failure (the ``comera`` CLI sets it to
            the Trainer's ``default_root_dir``).
        flush_interval_s: send buffered metrics at least this often (seconds). ``0`` with
            ``sender="inline"`` sends every ``log_metrics`` call at once, like MLFlowLogger.
        sender: who sends the metrics: ``"thread"`` (a daemon thread) or ``"inline"`` (the training loop,
            every ``flush_interval_s``). Params, tags, artifacts and the run itself always go from the calling
            thread.
        max_buffered: metric values held in memory at most; beyond, the oldest go to ``metrics.csv`` and are
            sent from there (memory stays flat whatever the store's speed).
        retry_interval_s: first wait before trying a failed store again; doubles up to ten minutes.
        http_timeout_s: ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (seconds per connect/read) for http(s) URIs, unless
            set in the environment; ``None`` leaves MLflow's default (120 s).
        http_max_retries: ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` likewise (MLflow's default: 7, about 4 min).
        log_system_metrics: also record CPU, memory, disk, network and (with ``pynvml``) GPU use under
            ``system/`` with MLflow's own monitor (needs ``psutil``: ``pip install comera_lightning[system]``),
            every ``system_metrics_interval_s`` seconds, from global rank 0.

    Example::

        trainer = Trainer(logger=ResilientMLFlowLogger(experiment_name="comera", tracking_uri="http://mlflow:5000",
                                                       local_dir="runs"), default_root_dir="runs")
    """

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        save_dir: str | None = "./mlruns",
        log_model: Literal[True, False, "all"] = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        synchronous: bool | None = None,
        local_dir: str | None = None,
        flush_interval_s: float = 2.0,
        sender: Literal["thread", "inline"] = "thread",
        max_buffered: int = 100_000,
        retry_interval_s: float = 30.0,
        http_timeout_s: int | None = 5,
        http_max_retries: int | None = 2,
        log_system_metrics: bool = False,
        system_metrics_interval_s: float = 10.0,
    ) -> None:
        tracking_uri = tracking_uri or default_tracking_uri()
        if flush_interval_s < 0 or retry_interval_s <= 0 or max_buffered < 1:
            raise ValueError("flush_interval_s must be >= 0, retry_interval_s > 0 and max_buffered >= 1")
        if sender not in ("thread", "inline"):
            raise ValueError(f"sender must be 'thread' or 'inline', got {sender!r}")
        if tracking_uri.startswith(("http://", "https://")):
            _bound_http_requests(http_timeout_s, http_max_retries)
        with mlflow_logger_without_client():  # the store is opened on first use, by rank 0 only
            super().__init__(
                experiment_name=experiment_name,
                run_name=run_name,
                tracking_uri=tracking_uri,
                tags=tags,
                save_dir=save_dir,
                log_model=log_model,
                prefix=prefix,
                artifact_location=artifact_location,
                run_id=run_id,
                synchronous=synchronous,
            )
        if log_system_metrics:
            try:
                import psutil  # noqa: F401  (MLflow's system metrics monitor needs it)
            except ImportError as missing:
                raise ImportError(
                    "log_system_metrics=True needs psutil: pip install psutil (or "
                    "comera_lightning[system]), or leave log_system_metrics off"
                ) from missing
        if system_metrics_interval_s <= 0:
            raise ValueError(f"system_metrics_interval_s must be > 0, got {system_metrics_interval_s}")
        # what MLFlowLogger was given, kept here: its own copies are private
        self._uri = tracking_uri
        self._experiment_title = experiment_name
        self._run_title = run_name
        self._metric_prefix = prefix
        self._batch_kwargs: dict[str, Any] = {} if synchronous is None else {"synchronous": synchronous}
        self.log_system_metrics = log_system_metrics
        self.system_metrics_interval_s = float(system_metrics_interval_s)
        self._local_dir = os.path.abspath(local_dir) if local_dir else None
        self.flush_interval_s = float(flush_interval_s)
        self.sender = sender
        self.max_buffered = int(max_buffered)
        self.retry_interval_s = float(retry_interval_s)
        self._local_run_id = f"offline-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self._client: Any = None  # the MlflowClient, once MLFlowLogger.experiment gave it (or one made for a call)
        self._connected = False  # MLFlowLogger.experiment succeeded: the experiment and the run exist
        # degradation state
        self._degraded = False
        self._retry_delay = self.retry_interval_s
        self._next_retry = 0.0
        self._key_cache: dict[str, str] = {}
        self._store = FallbackStore(self._fallback_location, self._run_info)
        self._sender = MetricSender(
            self._flush_now, self._store.append_metrics, self.flush_interval_s, sender, self.max_buffered, MAX_BATCH
        )
        self._init_runtime()

    # --- runtime objects (not pickled: ddp_spawn sends the logger to its processes) --------------------
    def _init_runtime(self) -> None:
        self._net_lock = threading.RLock()  # one network conversation at a time
        self._guarded = _GuardedClient(self)
        self._system_monitor: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_net_lock", "_guarded", "_system_monitor"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # --- identity ------------------------------------------------------------------------------------
    @property
    @rank_zero_experiment
    @override
    def experiment(self) -> Any:
        """The MlflowClient (failure-safe ``log_*``/``set_*``, see :class:`_GuardedClient`). Creates the
        experiment and the run on first use; if the store fails, degrades and returns the wrapper anyway."""
        if not self._connected and not self._degraded:
            with self._net_lock:
                if not self._connected and not self._degraded:
                    try:
                        self._connect()
                    except Exception as err:
                        self._degrade(err, "creating the experiment/run")
        return self._guarded

    def _connect(self) -> None:
        # MLFlowLogger's own experiment property finds or creates the experiment and creates the run (or gets
        # run_id's); it returns its MlflowClient. Its run_id/experiment_id properties then read what it set.
        with store_creation_lock(self._uri):  # creating a store, or an experiment, races with other processes
            if self._client is None:
                self._client = _new_client(self._uri)
            self._mlflow_client = self._client
            self._client = super().experiment
        self._connected = True
        if self.log_system_metrics and self.run_id is not None and self._system_monitor is None:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._system_monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=self.system_metrics_interval_s, tracking_uri=self._uri
            )
            self._system_monitor.start()

    def _mlflow(self) -> Any:
        """The MlflowClient: MLFlowLogger's once connected, before that one of our own for the same URI."""
        if self._client is None:
            with store_creation_lock(self._uri):
                self._client = _new_client(self._uri)
        return self._client

    @property
    @override
    def name(self) -> str | None:
        """The experiment id, or ``"offline"`` when MLflow could not give one (checkpoint folder names)."""
        experiment_id = self.experiment_id
        return experiment_id if experiment_id is not None else "offline"

    @property
    @override
    def version(self) -> str | None:
        """The run id, or a local ``offline-<time>-<hex>`` id when the run could not be created."""
        run_id = self.run_id
        return run_id if run_id is not None else self._local_run_id

    @property
    def tracking_uri(self) -> str:
        """The tracking store's URI."""
        return self._uri

    @property
    def experiment_name(self) -> str:
        """The MLflow experiment's name."""
        return self._experiment_title

    @property
    def run_name(self) -> str | None:
        """The run's name as given (``None``: MLflow picks one)."""
        return self._run_title

    @property
    def local_dir(self) -> str | None:
        """Root of the fallback folders as given (``None``: ``./runs``); settable until the first failure."""
        return self._local_dir

    @local_dir.setter
    def local_dir(self, value: str | None) -> None:
        self._local_dir = os.path.abspath(value) if value else None

    @property
    def degraded(self) -> bool:
        """Whether the tracking store is currently failing (data goes to :attr:`fallback_dir`)."""
        return self._degraded

    @property
    def fallback_dir(self) -> Path | None:
        """The local folder that received what could not be sent, once there was something."""
        return self._store.folder

    # --- Lightning's logging API (log_hyperparams is MLFlowLogger's, through the guarded client) ----------
    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        _ = self.experiment  # create the run in the training thread, before the first send
        if self._metric_prefix:
            metrics = {f"{self._metric_prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        timestamp_ms = int(time.time() * 1000)
        rows = []
        for key, value in metrics.items():
            if isinstance(value, str):
                log.warning(f"Discarding metric with string value {key}={value}.")
                continue
            rows.append((self._safe_key(key), float(value), timestamp_ms, step or 0))
        self._sender.add(rows)

    @override
    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if not self._connected and not self._degraded and not self._sender.pending:
            return
        if self._system_monitor is not None:
            self._system_monitor.finish()
            self._system_monitor = None
        self._sender.stop()
        if self._degraded:
            self._next_retry = 0.0  # one last attempt to reach the store before the run ends
        self.flush()
        status = _STATUS.get(status, status)
        with self._net_lock:
            if not self._degraded and self.run_id is not None:
                try:  # MLFlowLogger's: uploads the checkpoints (log_model=True), closes the run
                    super().finalize(status)
                except Exception as err:
                    self._degrade(err, "closing the run")
            if self._degraded:
                self._store.status = status
                self._store.write_run_json()
                log.warning(self._store.summary())

    def flush(self) -> None:
        """Send the buffered metrics now (and, if the store was failing and a retry is due, try it again)."""
        batch = self._sender.take()
        with self._net_lock:
            if self._degraded and time.monotonic() >= self._next_retry:
                self._try_recover()
            if self._degraded or self.run_id is None:
                self._store.append_metrics(batch)
                return
            if self._store.has_unsent_metrics:  # spilled values wait on disk: they go first
                try:
                    self._store.send_metrics(self._send_rows)
                except Exception as err:
                    self._degrade(err, "sending metrics")
                    self._store.append_metrics(batch)
                    return
            for i in range(0, len(batch), MAX_BATCH):
                try:
                    self._send_rows(batch[i : i + MAX_BATCH])
                except Exception as err:
                    self._degrade(err, "sending metrics")
                    self._store.append_metrics(batch[i:])
                    return

    def _flush_now(self) -> None:
        # what the sender calls: ``flush`` looked up now, so a wrapped ``logger.flush`` (a benchmark's timer) runs
        self.flush()

    def _send_rows(self, rows: list[Row]) -> None:
        """One ``log_batch`` of ``(key, value, timestamp_ms, step)`` rows."""
        self._mlflow().log_batch(self.run_id, metrics=metric_rows(rows), **self._batch_kwargs)

    # --- failure handling ----------------------------------------------------------------------------
    def _guarded_call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        from mlflow.tracking import MlflowClient

        try:  # the class's signature names the arguments (the instance's method may be wrapped)
            bound = inspect.signature(getattr(MlflowClient, name)).bind(None, *args, **kwargs)
        except (TypeError, ValueError):
            return getattr(self._mlflow(), name)(*args, **kwargs)  # a wrong call is the caller's bug: MLflow says so
        arguments = bound.arguments
        run_id = self.run_id
        if "run_id" in arguments and arguments["run_id"] is None and run_id is not None:
            arguments["run_id"] = run_id  # e.g. an artifact logged while offline, after recovery
        with self._net_lock:
            if not self._degraded and arguments.get("run_id", run_id) is not None:
                try:
                    return getattr(self._mlflow(), name)(*bound.args[1:], **bound.kwargs)
                except Exception as err:
                    self._degrade(err, name)
            self._store.keep_call(name, arguments)
        return None

    def _degrade(self, err: BaseException, during: str) -> None:
        """Enter the degraded state: warn once per outage, schedule a retry, open the fallback folder."""
        first = not self._degraded
        self._degraded = True
        self._next_retry = time.monotonic() + self._retry_delay
        if not first:
            return
        folder = self._store.open()
        warnings.warn(
            f"ResilientMLFlowLogger: the MLflow tracking store at {self._uri} failed while {during} "
            f"({_short_error(err)}). Training goes on, but metrics, params and artifacts are NOT reaching MLflow: "
            f"they are kept in {folder} (metric values in {folder / METRICS_CSV}). Retrying every "
            f"{self._retry_delay:g} s or more; what was kept is uploaded if the store answers again.",
            TrackingDegradedWarning,
            stacklevel=2,
        )

    def _try_recover(self) -> None:
        """One attempt to reach the store again; on success upload everything kept. Holds ``_net_lock``."""
        try:
            if self.run_id is None:
                self._connect()
            else:
                self._mlflow().get_run(self.run_id)
            if self.run_id is None:
                raise RuntimeError("connected without a run")
            self._store.upload(self._mlflow(), self.run_id, self._send_rows)
        except Exception:
            self._retry_delay = min(2 * self._retry_delay, _MAX_RETRY_DELAY_S)
            self._next_retry = time.monotonic() + self._retry_delay
            return
        self._degraded = False
        self._retry_delay = self.retry_interval_s
        log.warning(
            f"ResilientMLFlowLogger: the MLflow tracking store at {self._uri} answers again; "
            f"run {self.run_id} has everything kept in {self._store.folder} (the local copy stays)."
        )

    # --- what the fallback store needs to know -------------------------------------------------------
    def _fallback_location(self) -> Path:
        """``<local_dir>/<experiment id>/<run id>/mlflow_fallback``; asked once, when something is first kept
        (the logger is then connected or degraded, so the ids are read without a request)."""
        experiment, run = self.experiment_id, self.run_id
        root = Path(self._local_dir or os.path.abspath("runs"))
        return (
            root
            / str(experiment if experiment is not None else "offline")
            / str(run if run is not None else self._local_run_id)
            / FALLBACK_FOLDER
        )

    def _run_info(self) -> dict[str, Any]:
        """The identity fields of the fallback folder's ``run.json``."""
        return {
            "tracking_uri": self._uri,
            "experiment_name": self._experiment_title,
            "experiment_id": self.experiment_id,
            "run_id": self.run_id,
            "local_run_id": self._local_run_id,
            "run_name": self._run_title,
            "tags": {str(k): str(v) for k, v in (self.tags or {}).items()},
        }

    def _safe_key(self, key: str) -> str:
        safe = self._key_cache.get(key)
        if safe is None:
            safe = _UNSAFE_KEY.sub("", key)
            if safe != key:
                warnings.warn(
                    f"MLFlow only allows '_', '/', '.' and ' ' special characters in metric name. "
                    f"Replacing {key} with {safe}.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self._key_cache[key] = safe
        return safe


def _new_client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def store_creation_lock(uri: str) -> contextlib.AbstractContextManager[None]:
    """Between processes, one at a time opens a local sqlite store: the first creates its tables, and MLflow's
    table creation and migration race when several processes open a new store at once (two fits started
    together in one folder). A lock on ``.<name>.lock`` beside the database; other stores need none.
    Not re-entrant: a process holding it must not take it again."""
    if not uri.startswith("sqlite:"):
        return contextlib.nullcontext()
    from sqlalchemy.engine import make_url

    database = make_url(uri).database
    if not database or database == ":memory:":
        return contextlib.nullcontext()
    return file_lock(os.path.abspath(database))


def _bound_http_requests(timeout_s: int | None, max_retries: int | None) -> None:
    """Bound MLflow's HTTP retries (process-wide environment variables, read per request; set ones win)."""
    if timeout_s is not None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(timeout_s))))
    if max_retries is not None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(max(0, int(max_retries))))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


def _short_error(err: BaseException) -> str:
    """The root cause of an MLflow/requests error in one line (``[Errno 111] Connection refused``, ...)."""
    text = str(err)
    errno = re.search(r"\[Errno -?\d+\][^'\")]*", text)
    if errno:
        return f"{type(err).__name__}: {errno.group(0).strip()}"
    for marker in ("Read timed out", "timed out", "Max retries exceeded"):
        if marker in text:
            return f"{type(err).__name__}: {marker}"
    text = " ".join(text.split())
    return f"{type(err).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"
