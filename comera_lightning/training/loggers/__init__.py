"""Moved to :mod:`comera_lightning.loggers`; this path (and its submodules) works, with a warning, for one release."""

import warnings

from ...loggers import ResilientMLFlowLogger, TrackingDegradedWarning, upload_fallback

warnings.warn(
    "comera_lightning.training.loggers has moved to comera_lightning.loggers; import it from there (the old path "
    "will be removed in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["ResilientMLFlowLogger", "TrackingDegradedWarning", "upload_fallback"]
