"""Which checkpoint a command reads or writes: ``--ckpt_path last``, the warning for an evaluation without a
checkpoint, and the key that names a fit's fault-tolerance folder."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

#: the subcommands that score or apply a trained model, and take ``--ckpt_path last``
EVALUATIONS = ("validate", "test", "predict")
#: the ``--ckpt_path`` value that stands for the newest run's last checkpoint (:func:`latest_checkpoint`)
LATEST = "last"

FAULT_TOLERANCE_DIR = "fault_tolerance"
#: fit options that do not change what is trained, left out of the experiment key
#: (--rank_adaptation.* is written into trainer.callbacks, which the key covers)
_KEY_IGNORED = {"config", "resume", "fault_tolerance", "ckpt_path", "weights_only", "__path__", "rank_adaptation"}
_KEY_IGNORED_TRAINER = {"logger", "enable_progress_bar", "enable_model_summary", "default_root_dir"}


def latest_checkpoint(root: str | os.PathLike[str] = "runs") -> Path:
    """The newest ``<root>/<experiment id>/<run id>/checkpoints/last.ckpt`` (by modification time): what
    ``--ckpt_path last`` means for ``comera validate``, ``test``, ``predict`` and ``export``.

    Raises:
        FileNotFoundError: no run under ``root`` has one, naming the fix.
    """
    found = [path for path in Path(root).glob(f"*/*/checkpoints/{LATEST}.ckpt") if path.exists()]
    if not found:
        raise FileNotFoundError(
            f"--ckpt_path last: no run under {str(root)!r} has a checkpoints/last.ckpt; train one first "
            "(comera fit --config quickstart), or pass a checkpoint's path"
        )
    return max(found, key=lambda path: path.stat().st_mtime)


def missing_checkpoint_warning(subcommand: str | None, ckpt_path: Any) -> str | None:
    """The warning for an evaluation (:data:`EVALUATIONS`) without ``--ckpt_path``, which scores the freshly
    initialised weights of the config's model; ``None`` when there is nothing to warn about."""
    if subcommand not in EVALUATIONS or ckpt_path:
        return None
    return (
        f"comera {subcommand}: no --ckpt_path, so this uses the model's freshly initialised (random) weights, "
        "not a trained model; pass --ckpt_path runs/<exp>/<run>/checkpoints/last.ckpt, or --ckpt_path last for "
        "the newest run's"
    )


def experiment_key(config: dict[str, Any]) -> str:
    """``<first config file's stem>-<12 hex digits>``: the identity of a fit configuration across launches.

    The digits hash the resolved ``fit`` config (a plain dict) without the options that cannot change the
    training trajectory (``_KEY_IGNORED`` and, under ``trainer``, ``_KEY_IGNORED_TRAINER``), so every
    launch of the same experiment, including ``--resume auto`` relaunches, gets the same key, and changing
    the model, data, optimisation, callbacks or budget gives a new one.
    """
    files = config.get("config") or []
    stem = Path(str(files[0])).stem if files else "run"
    kept = {k: v for k, v in config.items() if k not in _KEY_IGNORED}
    if isinstance(kept.get("trainer"), dict):
        kept["trainer"] = {k: v for k, v in kept["trainer"].items() if k not in _KEY_IGNORED_TRAINER}
    digest = hashlib.sha1(json.dumps(kept, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:12]
    return f"{stem}-{digest}"
