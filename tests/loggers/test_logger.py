"""Experiment tracking against a real MLflow tracking server, a dead one, and one that drops out mid-run.

* A module fixture starts ``mlflow server`` (sqlite backend and proxied artifacts in a temp folder, one
  uvicorn worker, the job runner off so startup is just the app) on a free local port, waits until its
  REST API answers, and stops the whole process group (SIGTERM, then SIGKILL) when the module is done,
  whatever the tests did.
* A tiny ``comera fit`` (in-process ComeraCLI) logs to it over HTTP through ResilientMLFlowLogger; the test
  reads the rank history, the compression ratio and the artifacts back through MlflowClient.
* The same fit against a closed port: training completes, ONE TrackingDegradedWarning names the URI and
  the fallback file, the metrics are in that file, the checkpoints are written, and the fallback folder
  uploads to a store afterwards.
* An outage in the middle of a run (the client made to fail, no server needed): the values logged during
  it are kept and sent once the store answers again.
"""

from __future__ import annotations

import contextlib
import csv
import json
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlflow.tracking import MlflowClient

from comera_lightning.cli import ComeraCLI
from comera_lightning.loggers import ResilientMLFlowLogger, TrackingDegradedWarning, upload_fallback

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SERVER_START_TIMEOUT_S = (
    120.0  # a cold start imports mlflow twice (CLI, then the uvicorn worker): ~15 s on 2 busy cores
)

TINY = [
    "--model.d_model=32",
    "--model.num_heads=2",
    "--model.d_ff=64",
    "--model.num_layers=1",
    "--model.max_len=16",
    "--model.vocab_size=512",
    "--model.layer_config.rank=4",
    "--model.layer_config.embedding_rank=4",
    "--model.layer_config.min_features=16",
    "--model.optim.lr_gates=0.2",
    "--model.optim.warmup_steps=0",
    "--data.vocab_size=512",
    "--data.seq_len=16",
    "--data.batch_size=8",
    "--data.max_files=15",
    "--data.max_sequences=400",
    "--data.val_fraction=0.2",
    "--trainer.max_steps=8",
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=8",
    "--trainer.limit_val_batches=2",
    "--trainer.val_check_interval=null",
    "--trainer.log_every_n_steps=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
]
CALLBACKS = {
    "callbacks": [
        {
            "class_path": "RankAdaptation",
            "init_args": {
                "gamma": 1.0,
                "late_start_step": 4,
                "truncate_every_n_steps": 4,
                "min_dead_fraction": 0.1,
                "target_compression": 3.0,
            },
        },
        {"class_path": "ContractionPlanner"},
        {"class_path": "RankMonitor", "init_args": {"log_every_n_steps": 2}},
        {"class_path": "ModelCheckpoint", "init_args": {"save_last": True}},
    ]
}


# --- the server ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=2) as reply:
            return reply.status == 200 and "experiments" in json.loads(reply.read())
    except (OSError, ValueError):
        return False


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (mlflow CLI + uvicorn), SIGKILL what is left after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # start_new_session: the group id is the leader's pid
        try:
            proc.wait(timeout=wait_s)
            if sig == signal.SIGTERM:  # the leader is gone; SIGKILL any worker that outlived it
                continue
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``http://127.0.0.1:<port>`` of a running ``mlflow server``; stopped by process group at module end."""
    root = tmp_path_factory.mktemp("mlflow_server")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no huey job runner: faster start, one process less
    for attempt in range(3):  # a free port can be taken between probing it and the server binding it
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = root / f"server{attempt}.log"
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--serve-artifacts",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--workers",
            "1",
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                cwd=root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline and not _answers(url):
                time.sleep(0.25)
            if proc.poll() is None and _answers(url):
                break
            _stop_group(proc)
            text = log_path.read_text(errors="replace")
            if "address already in use" not in text.lower() or attempt == 2:
                pytest.fail(
                    f"mlflow server did not answer at {url} within {SERVER_START_TIMEOUT_S:.0f} s "
                    f"(exit code {proc.returncode}); its log ends:\n{text[-3000:]}"
                )
        except BaseException:
            _stop_group(proc)
            raise
    try:
        yield url, root
    finally:
        _stop_group(proc)


# --- helpers ------------------------------------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A temp working directory; MLflow environment variables restored afterwards (the logger sets some)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    monkeypatch.chdir(tmp_path)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'unused.db'}"  # nothing should land here
    for key in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"):
        os.environ.pop(key, None)  # the logger's own bounds must apply
    yield tmp_path
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        del os.environ[key]
    os.environ.update(saved)


def _fit(workdir: Path, tracking_uri: str) -> ComeraCLI:
    """A tiny quickstart fit whose logger is a ResilientMLFlowLogger on ``tracking_uri``."""
    config = {
        "trainer": {
            **CALLBACKS,
            "logger": {
                "class_path": "comera_lightning.loggers.ResilientMLFlowLogger",
                "init_args": {
                    "experiment_name": "comera",
                    "tracking_uri": tracking_uri,
                    "local_dir": str(workdir / "runs"),
                    "flush_interval_s": 0.5,
                },
            },
        }
    }
    path = workdir / "tracking.yaml"
    path.write_text(yaml.safe_dump(config))
    return ComeraCLI(args=["fit", f"--config={CONFIGS / 'quickstart.yaml'}", *TINY, f"--config={path}"])


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# --- tests --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fit_logs_rank_history_to_a_real_tracking_server(mlflow_server, workdir):
    url, server_root = mlflow_server
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = _fit(workdir, url)
    assert not [w for w in caught if issubclass(w.category, TrackingDegradedWarning)]
    logger = cli.trainer.logger
    assert isinstance(logger, ResilientMLFlowLogger) and not logger.degraded and logger.fallback_dir is None
    assert cli.trainer.global_step == 8

    client = MlflowClient(tracking_uri=url)  # everything below is read back over the REST API
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    rank_keys = sorted(k for k in run.data.metrics if k.startswith("rank/"))
    assert rank_keys and "train/loss" in run.data.metrics
    history = client.get_metric_history(logger.run_id, rank_keys[0])
    assert [m.step for m in history] == [0, 2, 4, 6, 8]  # RankMonitor(log_every_n_steps=2), start and end
    ratio = client.get_metric_history(logger.run_id, "compression_ratio")
    assert len(ratio) == 5 and all(m.value >= 1.0 for m in ratio)
    assert run.data.params  # the hyperparameters
    assert {a.path for a in client.list_artifacts(logger.run_id)} >= {"config.yaml", "comera"}
    assert {a.path for a in client.list_artifacts(logger.run_id, "comera")} >= {
        "comera/rank_evolution.png",
        "comera/rank_history.json",
    }
    config = yaml.safe_load(Path(client.download_artifacts(logger.run_id, "config.yaml", str(workdir))).read_text())
    assert config["trainer"]["logger"]["class_path"].endswith("ResilientMLFlowLogger")
    saved = json.loads(
        Path(client.download_artifacts(logger.run_id, "comera/rank_history.json", str(workdir))).read_text()
    )
    assert saved["history"]["steps"] == [0, 2, 4, 6, 8]
    # the server stored the artifacts in its --artifacts-destination (proxied upload, not a client-side path)
    assert list(server_root.joinpath("artifacts").rglob("rank_history.json"))
    checkpoint = Path(cli.trainer.checkpoint_callback.last_model_path).resolve()
    assert (
        checkpoint.is_file()
        and checkpoint.parent == workdir / "runs" / logger.experiment_id / logger.run_id / "checkpoints"
    )


@pytest.mark.slow
def test_fit_survives_an_unreachable_tracking_server(workdir, capfd):
    dead = f"http://127.0.0.1:{_free_port()}"  # bound and released: nothing listens there
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = _fit(workdir, dead)
    elapsed = time.monotonic() - start
    assert cli.trainer.global_step == 8  # training went on
    degraded = [w for w in caught if issubclass(w.category, TrackingDegradedWarning)]
    assert len(degraded) == 1, [str(w.message) for w in degraded]
    logger = cli.trainer.logger
    fallback = logger.fallback_dir
    message = str(degraded[0].message)
    assert dead in message and str(fallback / "metrics.csv") in message and "Training goes on" in message
    assert "Traceback" not in capfd.readouterr().err  # one warning, not a traceback per step
    assert elapsed < 90, f"a dead server cost {elapsed:.0f} s"  # MLflow's defaults would retry ~4 min a request

    # the run folder: the fallback next to the checkpoints, under a local id MLflow never gave
    run_dir = workdir / "runs" / "offline" / logger.version
    assert fallback == run_dir / "mlflow_fallback"
    assert Path(cli.trainer.checkpoint_callback.last_model_path).resolve() == run_dir / "checkpoints" / "last.ckpt"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

    rows = _read_csv(fallback / "metrics.csv")
    keys = {row["key"] for row in rows}
    assert "train/loss" in keys and "compression_ratio" in keys and any(k.startswith("rank/") for k in keys)
    rank_key = sorted(k for k in keys if k.startswith("rank/"))[0]
    assert [int(r["step"]) for r in rows if r["key"] == rank_key] == [0, 2, 4, 6, 8]
    assert (fallback / "artifacts" / "config.yaml").is_file()
    assert (fallback / "artifacts" / "comera" / "rank_history.json").is_file()
    assert (fallback / "artifacts" / "comera" / "rank_evolution.png").is_file()
    assert json.loads((fallback / "params.json").read_text())
    info = json.loads((fallback / "run.json").read_text())
    assert info["tracking_uri"] == dead and info["status"] == "FINISHED" and info["run_id"] is None

    # nothing is lost: the folder uploads to a store afterwards
    store = f"sqlite:///{workdir / 'recovered.db'}"
    run_id = upload_fallback(fallback, tracking_uri=store)
    client = MlflowClient(store)
    assert [m.step for m in client.get_metric_history(run_id, rank_key)] == [0, 2, 4, 6, 8]
    assert len(client.get_metric_history(run_id, "train/loss")) == sum(r["key"] == "train/loss" for r in rows)
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.yaml", "comera"}
    assert client.get_run(run_id).info.status == "FINISHED"


def test_outage_mid_run_is_kept_and_caught_up(workdir):
    store = f"sqlite:///{workdir / 'mlflow.db'}"
    logger = ResilientMLFlowLogger(
        experiment_name="outage",
        tracking_uri=store,
        local_dir=str(workdir / "runs"),
        sender="inline",
        flush_interval_s=0,
        retry_interval_s=0.05,
    )
    pickle.loads(pickle.dumps(logger))  # ddp_spawn sends loggers to its processes
    logger.log_hyperparams({"lr": 0.1})
    client = logger.experiment.client
    real_log_batch, real_log_artifact = client.log_batch, client.log_artifact

    def down(*args, **kwargs):
        raise ConnectionError("[Errno 111] Connection refused")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(0, 5):
            logger.log_metrics({"x": float(step)}, step=step)
        client.log_batch = client.log_artifact = down  # the store drops out
        for step in range(5, 10):
            logger.log_metrics({"x": float(step)}, step=step)
        note = workdir / "note.txt"
        note.write_text("kept")
        logger.experiment.log_artifact(logger.run_id, str(note), artifact_path="notes")
        assert logger.degraded
        client.log_batch, client.log_artifact = real_log_batch, real_log_artifact  # ... and comes back
        time.sleep(0.1)
        for step in range(10, 15):
            logger.log_metrics({"x": float(step)}, step=step)
        logger.finalize("success")
    assert len([w for w in caught if issubclass(w.category, TrackingDegradedWarning)]) == 1
    assert not logger.degraded
    kept = [int(r["step"]) for r in _read_csv(logger.fallback_dir / "metrics.csv")]
    assert kept[:5] == list(range(5, 10)) and set(kept) <= set(range(5, 15))  # what the outage would have lost
    reader = MlflowClient(store)
    assert sorted(m.step for m in reader.get_metric_history(logger.run_id, "x")) == list(range(15))
    assert {a.path for a in reader.list_artifacts(logger.run_id, "notes")} == {"notes/note.txt"}
    assert reader.get_run(logger.run_id).info.status == "FINISHED"


def test_values_past_max_buffered_wait_on_disk_and_go_first(workdir):
    """The sender's buffer is bounded: the oldest values spill to the fallback store's metrics.csv, and the next
    flush sends them before the buffered ones (no outage needed)."""
    store = f"sqlite:///{workdir / 'mlflow.db'}"
    logger = ResilientMLFlowLogger(
        experiment_name="spill",
        tracking_uri=store,
        local_dir=str(workdir / "runs"),
        sender="inline",
        flush_interval_s=3600,
        max_buffered=3,
    )
    for step in range(10):
        logger.log_metrics({"x": float(step)}, step=step)
    spilled = [int(r["step"]) for r in _read_csv(logger.fallback_dir / "metrics.csv")]
    assert spilled == list(range(7)) and not logger.degraded  # kept on disk, not an outage
    logger.finalize("success")
    history = MlflowClient(store).get_metric_history(logger.run_id, "x")
    assert sorted(m.step for m in history) == list(range(10))


def test_a_logger_creates_its_store_on_first_use_only(workdir, monkeypatch):
    """Was: MLFlowLogger makes its MlflowClient in ``__init__`` and MLflow 3's client opens a sqlite store at
    once, so every process (every node's working directory) got an ``mlflow.db``, though only rank 0 logs."""
    from lightning.pytorch.utilities import rank_zero_only

    database = workdir / "mlflow.db"
    store = f"sqlite:///{database}"
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger = ResilientMLFlowLogger(experiment_name="lazy", tracking_uri=store, sender="inline", flush_interval_s=0)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    assert not database.exists()

    monkeypatch.setattr(rank_zero_only, "rank", 0)
    logger = ResilientMLFlowLogger(experiment_name="lazy", tracking_uri=store, sender="inline", flush_interval_s=0)
    assert not database.exists()
    logger.log_metrics({"x": 2.0}, step=0)
    logger.finalize("success")
    assert [m.value for m in MlflowClient(store).get_metric_history(logger.run_id, "x")] == [2.0]
    assert MlflowClient(store).get_run(logger.run_id).info.status == "FINISHED"


def _first_run_in_a_new_store(store: str, root: str, seed: int, barrier: Any, result: str) -> None:
    """One of several processes that start logging to the same, not yet existing, sqlite store at once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = ResilientMLFlowLogger(
            experiment_name="together", tracking_uri=store, local_dir=root, sender="inline", flush_interval_s=0
        )
        barrier.wait(timeout=120)
        note = Path(root) / f"note{seed}.txt"
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(str(seed))
        logger.experiment.log_artifact(logger.run_id, str(note))  # the CLI's config artifact goes this way
        logger.log_metrics({"seed": float(seed)}, step=0)
        logger.finalize("success")
    degraded = [str(w.message) for w in caught if issubclass(w.category, TrackingDegradedWarning)]
    Path(result).write_text(json.dumps({"run_id": logger.run_id, "degraded": degraded}))


@pytest.mark.slow
def test_processes_that_create_one_sqlite_store_together_all_reach_it(tmp_path):
    """Was: two fits started together in one folder both created mlflow.db and MLflow's table migration
    raced (``duplicate column name: step``, ``table _alembic_tmp_tags already exists``); one fell back to its
    offline folder and its config artifact call ended the fit."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(3)
    results = [tmp_path / f"result{seed}.json" for seed in range(3)]
    workers = [
        context.Process(
            target=_first_run_in_a_new_store, args=(store, str(tmp_path / "runs"), seed, barrier, str(result))
        )
        for seed, result in enumerate(results)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    outcomes = [json.loads(result.read_text()) for result in results]
    assert [outcome["degraded"] for outcome in outcomes] == [[], [], []]
    client = MlflowClient(store)
    for seed, outcome in enumerate(outcomes):
        assert [m.value for m in client.get_metric_history(outcome["run_id"], "seed")] == [float(seed)]
        assert [a.path for a in client.list_artifacts(outcome["run_id"])] == [f"note{seed}.txt"]
    assert (tmp_path / ".mlflow.db.lock").exists()
