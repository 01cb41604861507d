"""The local fallback of :class:`~comera_lightning.loggers.ResilientMLFlowLogger`, and its upload.

While the MLflow tracking store fails, what the logger cannot send goes to one folder per run,
``<local_dir>/<experiment id>/<run id>/mlflow_fallback/`` (``offline`` and the logger's local id stand in
for ids MLflow never gave):

* ``metrics.csv``: metric values, one ``step,timestamp_ms,key,value`` row each;
* ``params.json`` and ``tags.json``;
* ``artifacts/``: artifacts at their artifact paths;
* ``run.json``: tracking URI, experiment, run, final status, and how much was uploaded already.

:class:`FallbackStore` writes the folder and, when the store answers again, uploads what it kept.
:func:`upload_fallback` (``python -m comera_lightning.loggers upload <folder>``) uploads a folder
after the process that wrote it has ended.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FALLBACK_FOLDER",
    "MAX_BATCH",
    "MAX_PARAMS",
    "METRICS_CSV",
    "FallbackStore",
    "main",
    "metric_rows",
    "upload_fallback",
]

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # MLflow's log_batch limit on metrics per request
MAX_PARAMS = 100  # ... and on params / tags per request
FALLBACK_FOLDER = "mlflow_fallback"
METRICS_CSV = "metrics.csv"
_CSV_HEADER = "step,timestamp_ms,key,value\n"

#: one metric value: ``(key, value, timestamp_ms, step)``
Row = tuple[str, float, int, int]


def metric_rows(rows: Sequence[Row]) -> list[Any]:
    """MLflow ``Metric`` entities of ``(key, value, timestamp_ms, step)`` rows."""
    from mlflow.entities import Metric

    return [Metric(key=key, value=value, timestamp=timestamp, step=step) for key, value, timestamp, step in rows]


class FallbackStore:
    """The fallback folder of one logger: what it keeps, and what of that is uploaded already.

    The folder is created on first use, where ``locate()`` says at that moment (the run's ids may be known
    or not); ``run_info()`` gives the identity fields of ``run.json`` (tracking URI, experiment and run
    names and ids, tags). Writes are serialised by the store's own lock; uploads run under the caller's
    network lock and never hold the store's lock during a request.

    Args:
        locate: the folder to create on first use.
        run_info: the identity fields written to ``run.json``.
    """

    def __init__(self, locate: Callable[[], Path], run_info: Callable[[], dict[str, Any]]) -> None:
        self._locate = locate
        self._run_info = run_info
        self.folder: Path | None = None  #: the folder, once something was kept
        self.status: str | None = None  #: the run's final status, when it could not be sent
        # totals over the logger's life, for messages
        self._kept_metrics = self._kept_artifacts = 0
        self._not_kept: list[str] = []  # names of the calls that could be neither sent nor kept
        self._csv_sent_bytes = 0  # bytes of metrics.csv already uploaded
        self._csv_bytes = 0  # bytes of metrics.csv written
        self._pending_params: dict[str, str] = {}
        self._pending_tags: dict[str, str] = {}
        self._pending_artifacts: list[str] = []  # relative paths under artifacts/ not uploaded yet
        self._uploaded_artifacts: list[str] = []  # ... and those uploaded on catching up
        self._lock = threading.RLock()

    # --- pickling (ddp_spawn sends the logger to its processes) ----------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # --- keeping -------------------------------------------------------------------------------------
    def open(self) -> Path:
        """The folder, created (with ``run.json``) on the first call."""
        with self._lock:
            if self.folder is None:
                self.folder = self._locate()
                self.folder.mkdir(parents=True, exist_ok=True)
                self.write_run_json()
            return self.folder

    def append_metrics(self, rows: Sequence[Row]) -> None:
        """Append ``(key, value, timestamp_ms, step)`` rows to ``metrics.csv``."""
        if not rows:
            return
        with self._lock:
            path = self.open() / METRICS_CSV
            text = io.StringIO()
            if self._csv_bytes == 0 and not path.exists():
                text.write(_CSV_HEADER)
            for key, value, timestamp, step in rows:
                text.write(f"{step},{timestamp},{_csv_field(key)},{value!r}\n")
            data = text.getvalue().encode()
            with open(path, "ab") as f:
                f.write(data)
            self._csv_bytes += len(data)
            self._kept_metrics += len(rows)

    def keep_call(self, name: str, arguments: dict[str, Any]) -> None:
        """Store what an MlflowClient ``log_*``/``set_*`` call named ``name`` carried (its bound arguments).

        Calls with nothing to keep locally are named once in a warning and in the final summary."""
        with self._lock:
            artifacts = self.open() / "artifacts"
            if name == "log_batch":
                self.append_metrics([(m.key, m.value, m.timestamp, m.step) for m in arguments.get("metrics") or ()])
                self._keep_mapping("params", {p.key: str(p.value) for p in arguments.get("params") or ()})
                self._keep_mapping("tags", {t.key: str(t.value) for t in arguments.get("tags") or ()})
            elif name == "log_metric":
                timestamp = arguments.get("timestamp") or int(time.time() * 1000)
                step = arguments.get("step") or 0
                self.append_metrics([(arguments["key"], float(arguments["value"]), timestamp, step)])
            elif name == "log_param":
                self._keep_mapping("params", {arguments["key"]: str(arguments["value"])})
            elif name == "set_tag":
                self._keep_mapping("tags", {arguments["key"]: str(arguments["value"])})
            elif name == "set_terminated":
                self.status = arguments.get("status") or "FINISHED"
                self.write_run_json()
            elif name in ("log_artifact", "log_artifacts"):
                source = Path(arguments["local_path" if name == "log_artifact" else "local_dir"])
                target = artifacts / (arguments.get("artifact_path") or "")
                target.mkdir(parents=True, exist_ok=True)
                if source.is_dir():
                    shutil.copytree(
                        source, target if name == "log_artifacts" else target / source.name, dirs_exist_ok=True
                    )
                else:
                    shutil.copy2(source, target / source.name)
                self._refresh_pending_artifacts()
            elif name in ("log_dict", "log_text", "log_figure"):
                path = artifacts / arguments["artifact_file"]
                path.parent.mkdir(parents=True, exist_ok=True)
                if name == "log_dict":
                    path.write_text(json.dumps(arguments["dictionary"], indent=1, default=str))
                elif name == "log_text":
                    path.write_text(arguments["text"])
                else:
                    arguments["figure"].savefig(path, **(arguments.get("save_kwargs") or {}))
                self._refresh_pending_artifacts()
            elif name not in self._not_kept:
                self._not_kept.append(name)
                log.warning(
                    f"ResilientMLFlowLogger: {name}(...) could not be sent to "
                    f"{self._run_info()['tracking_uri']} and is not kept locally."
                )

    def _keep_mapping(self, kind: str, values: dict[str, str]) -> None:
        if not values:
            return
        pending = self._pending_params if kind == "params" else self._pending_tags
        pending.update(values)
        path = self.open() / f"{kind}.json"
        stored = json.loads(path.read_text()) if path.exists() else {}
        stored.update(values)
        path.write_text(json.dumps(stored, indent=1, sort_keys=True))

    def _refresh_pending_artifacts(self) -> None:
        root = self.open() / "artifacts"
        known = set(self._pending_artifacts) | set(self._uploaded_artifacts)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            relative = path.relative_to(root).as_posix()
            if relative not in known:
                self._pending_artifacts.append(relative)
                self._kept_artifacts += 1
        self.write_run_json()

    def write_run_json(self) -> None:
        """Rewrite ``run.json`` (nothing before the folder exists)."""
        with self._lock:
            if self.folder is None:
                return
            info = {
                **self._run_info(),
                "status": self.status,
                "metrics_csv_uploaded_bytes": self._csv_sent_bytes,
                "artifacts_not_uploaded": list(self._pending_artifacts),
            }
            (self.folder / "run.json").write_text(json.dumps(info, indent=1))

    # --- catching up ---------------------------------------------------------------------------------
    @property
    def has_unsent_metrics(self) -> bool:
        """Whether ``metrics.csv`` holds values not uploaded yet."""
        return self._csv_sent_bytes < self._csv_bytes

    def send_metrics(self, send_rows: Callable[[list[Row]], None]) -> None:
        """Upload ``metrics.csv`` from the first byte not yet sent, streaming it in batches of MAX_BATCH rows;
        the sent offset advances as batches succeed (a failure resumes from the first unsent batch)."""
        if self.folder is None or not self.has_unsent_metrics:
            return
        end = self._csv_bytes
        with open(self.folder / METRICS_CSV, "rb") as f:
            f.seek(self._csv_sent_bytes)
            offset, batch = self._csv_sent_bytes, []
            while offset < end:
                line = f.readline()
                if not line:
                    break
                offset += len(line)
                row = _parse_csv_line(line)
                if row is not None:
                    batch.append(row)
                if len(batch) >= MAX_BATCH:
                    send_rows(batch)
                    batch = []
                    self._csv_sent_bytes = offset
            if batch:
                send_rows(batch)
            self._csv_sent_bytes = offset

    def upload(self, client: Any, run_id: str, send_rows: Callable[[list[Row]], None]) -> None:
        """Upload everything kept and not uploaded yet to ``run_id`` (raises on the first failure; what was
        uploaded before it is not sent again)."""
        from mlflow.entities import Param, RunTag

        if self._pending_params:
            params = [Param(k, v) for k, v in self._pending_params.items()]
            for i in range(0, len(params), MAX_PARAMS):
                client.log_batch(run_id, params=params[i : i + MAX_PARAMS])
            self._pending_params = {}
        if self._pending_tags:
            tags = [RunTag(k, v) for k, v in self._pending_tags.items()]
            for i in range(0, len(tags), MAX_PARAMS):
                client.log_batch(run_id, tags=tags[i : i + MAX_PARAMS])
            self._pending_tags = {}
        self.send_metrics(send_rows)
        while self._pending_artifacts:
            relative = self._pending_artifacts[0]
            parent = os.path.dirname(relative)
            client.log_artifact(run_id, str(self.open() / "artifacts" / relative), artifact_path=parent or None)
            self._uploaded_artifacts.append(self._pending_artifacts.pop(0))
        self.write_run_json()

    def summary(self) -> str:
        """What is kept and not uploaded, and how to upload it: the logger's last word on a failing store."""
        not_sent = self._csv_bytes - self._csv_sent_bytes
        folder = self.open()
        other = f"; not kept: {', '.join(sorted(self._not_kept))}" if self._not_kept else ""
        return (
            f"ResilientMLFlowLogger: the MLflow tracking store at {self._run_info()['tracking_uri']} was still "
            f"failing at the end; {self._kept_metrics} metric values ({not_sent} bytes of "
            f"{folder / METRICS_CSV} not uploaded), {len(self._pending_artifacts)} artifacts and the "
            f"params are kept in {folder}{other}. Upload them later with: "
            f"python -m comera_lightning.loggers upload {folder}"
        )


def _csv_field(key: str) -> str:
    return f'"{key}"' if "," in key or '"' in key else key


def _parse_csv_line(line: bytes) -> Row | None:
    """``(key, value, timestamp_ms, step)`` of a ``metrics.csv`` line; ``None`` for the header or a blank line."""
    text = line.decode().rstrip("\n")
    if not text or text == _CSV_HEADER.rstrip("\n"):
        return None
    step, timestamp, key, value = next(csv.reader([text]))
    return key, float(value), int(timestamp), int(step)


# --- the upload after the fact ---------------------------------------------------------------------------
def upload_fallback(folder: str | Path, tracking_uri: str | None = None, experiment_name: str | None = None) -> str:
    """Upload a :class:`~comera_lightning.loggers.ResilientMLFlowLogger` fallback folder to MLflow.

    The run recorded in ``run.json`` gets the values not uploaded yet if it exists on the target store;
    otherwise a new run is created in ``experiment_name`` (default: the recorded one) with the recorded tags.

    Args:
        folder: a ``.../mlflow_fallback`` folder.
        tracking_uri: target store; default the recorded URI.
        experiment_name: experiment of a newly created run; default the recorded one.

    Returns:
        The run id that received the data.
    """
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    folder = Path(folder)
    info = json.loads((folder / "run.json").read_text())
    uri = tracking_uri or info["tracking_uri"]
    client = MlflowClient(uri)
    run_id, offset = info.get("run_id"), int(info.get("metrics_csv_uploaded_bytes") or 0)
    if run_id is not None and uri == info["tracking_uri"]:
        try:
            client.get_run(run_id)
        except Exception:
            run_id = None
    else:
        run_id = None
    pending_artifacts = info.get("artifacts_not_uploaded")
    if run_id is None:
        offset, pending_artifacts = 0, None  # a new run gets everything
        name = experiment_name or info.get("experiment_name") or "Default"
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        tags = dict(info.get("tags") or {})
        tags["comera.uploaded_from"] = str(folder.resolve())
        if info.get("run_name"):
            tags["mlflow.runName"] = info["run_name"]
        run_id = client.create_run(experiment_id, tags=tags).info.run_id

    def stored(kind: str) -> dict[str, Any]:
        path = folder / f"{kind}.json"
        return json.loads(path.read_text()) if path.exists() else {}

    params = [Param(k, str(v)) for k, v in stored("params").items()]
    for i in range(0, len(params), MAX_PARAMS):
        client.log_batch(run_id, params=params[i : i + MAX_PARAMS])
    tags_kept = [RunTag(k, str(v)) for k, v in stored("tags").items()]
    for i in range(0, len(tags_kept), MAX_PARAMS):
        client.log_batch(run_id, tags=tags_kept[i : i + MAX_PARAMS])
    csv_path = folder / METRICS_CSV
    if csv_path.exists():
        with open(csv_path, "rb") as f:
            f.seek(offset)
            batch = []
            for line in f:
                row = _parse_csv_line(line)
                if row is not None:
                    batch.append(row)
                if len(batch) >= MAX_BATCH:
                    client.log_batch(run_id, metrics=metric_rows(batch))
                    batch = []
            if batch:
                client.log_batch(run_id, metrics=metric_rows(batch))
    artifacts = folder / "artifacts"
    if artifacts.is_dir():
        for path in sorted(p for p in artifacts.rglob("*") if p.is_file()):
            relative = path.relative_to(artifacts).as_posix()
            if pending_artifacts is not None and relative not in pending_artifacts:
                continue
            client.log_artifact(run_id, str(path), artifact_path=os.path.dirname(relative) or None)
    client.set_terminated(run_id, info.get("status") or "FINISHED")
    return run_id


def main(argv: list[str] | None = None) -> None:
    """``python -m comera_lightning.loggers upload <folder> [--tracking-uri U] [--experiment-name E]``."""
    parser = argparse.ArgumentParser(
        prog="python -m comera_lightning.loggers",
        description="Upload a ResilientMLFlowLogger fallback folder to MLflow.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    upload = sub.add_parser("upload", help="upload an mlflow_fallback folder")
    upload.add_argument("folder")
    upload.add_argument("--tracking-uri", default=None, help="default: the URI recorded in run.json")
    upload.add_argument("--experiment-name", default=None)
    args = parser.parse_args(argv)
    run_id = upload_fallback(args.folder, args.tracking_uri, args.experiment_name)
    print(f"uploaded {args.folder} to run {run_id}")
