"""Moved to :mod:`comera_lightning.strategies.resharding` (FSDP2's resharding helpers).

This path works, with a warning, for one release.
"""

from ..utilities.deprecation import moved_module

moved_module(__name__, "comera_lightning.strategies.resharding")
