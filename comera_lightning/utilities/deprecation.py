"""Old import paths kept working for one release after a module moved."""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["moved_module"]


def moved_module(old: str, new: str) -> None:
    """Make the module ``old`` an alias of ``new`` (every name, private ones included) and warn once, naming the
    new path. Call it as the only statement of the old module."""
    warnings.warn(
        f"{old} has moved to {new}; import it from there (the old path will be removed in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
