"""Moved to :mod:`comera_lightning.loggers.fallback`; this path works, with a warning, for one release."""

from ...utilities.deprecation import moved_module

moved_module(__name__, "comera_lightning.loggers.fallback")
