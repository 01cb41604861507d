"""The sender process of :class:`comera_lightning.loggers.ResilientMLFlowLogger` (``sender="process"``).

Run as a script (``python _mlflow_sender.py <tracking uri>``), never imported by the package: it imports the
standard library and mlflow only, so it starts in a few seconds and its SQLAlchemy/HTTP work (about 0.1 ms of
Python per metric value on a sqlite store) runs outside the training process and its GIL.

Protocol, on stdin / the original stdout: frames of a 4-byte big-endian length and a pickle (both ends are
this package). Requests ``{"op": "log_batch", "run_id", "rows": [(key, value, timestamp_ms, step), ...]}``,
``{"op": "get_run", "run_id"}``, ``{"op": "stop"}``; every request gets ``{"ok": True, "cpu_s"}`` or
``{"ok": False, "error", "type", "cpu_s"}``. It exits on ``stop`` or when stdin closes (the trainer is gone).
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import time


def _read_exact(stream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us by closing stdin
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the protocol
    requests = sys.stdin.buffer

    def reply(message: dict) -> None:
        message["cpu_s"] = time.process_time()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        replies.write(struct.pack(">I", len(data)) + data)
        replies.flush()

    try:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(sys.argv[1])
    except Exception as err:  # noqa: BLE001 - tell the trainer, which falls back to sending in-process
        reply({"ok": False, "error": str(err), "type": type(err).__name__})
        return
    reply({"ok": True, "ready": True})
    while True:
        header = _read_exact(requests, 4)
        if header is None:
            return
        body = _read_exact(requests, struct.unpack(">I", header)[0])
        if body is None:
            return
        request = pickle.loads(body)
        op = request.get("op")
        try:
            if op == "log_batch":
                metrics = [Metric(key=k, value=v, timestamp=t, step=s) for k, v, t, s in request["rows"]]
                client.log_batch(request["run_id"], metrics=metrics)
            elif op == "get_run":
                client.get_run(request["run_id"])
            elif op == "stop":
                reply({"ok": True})
                return
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception as err:  # noqa: BLE001 - every store failure goes back to the trainer
            reply({"ok": False, "error": str(err), "type": type(err).__name__})
            continue
        reply({"ok": True})


if __name__ == "__main__":
    main()
