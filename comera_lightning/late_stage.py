"""Moved to :mod:`comera_lightning.rank_adaptation.late_stage` (the late-stage policies).

This path works, with a warning, for one release.
"""

from .utilities.deprecation import moved_module

moved_module(__name__, "comera_lightning.rank_adaptation.late_stage")
