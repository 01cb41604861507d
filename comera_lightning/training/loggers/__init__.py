"""Moved to :mod:`comera_lightning.loggers`; this path (and its submodules) works, with a warning, for one release."""

from ...loggers import ResilientMLFlowLogger, TrackingDegradedWarning, upload_fallback
from ...utilities.deprecation import warn_moved

warn_moved(__name__, "comera_lightning.loggers")

__all__ = ["ResilientMLFlowLogger", "TrackingDegradedWarning", "upload_fallback"]
