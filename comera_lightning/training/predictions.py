"""Moved to :mod:`comera_lightning.callbacks.predictions`; this path works, with a warning, for one release."""

from ..utilities.deprecation import moved_module

moved_module(__name__, "comera_lightning.callbacks.predictions")
