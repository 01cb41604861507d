"""Moved to :mod:`comera_lightning.strategies.fsdp2` (FSDP2 with rank cuts).

This path works, with a warning, for one release.
"""

from .utilities.deprecation import moved_module

moved_module(__name__, "comera_lightning.strategies.fsdp2")
