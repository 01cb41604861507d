"""Old import paths kept working for one release after a module moved."""

from __future__ import annotations

import importlib
import sys
import warnings

__all__ = ["moved_module", "warn_moved"]


def warn_moved(old: str, new: str, stacklevel: int = 2) -> None:
    """The DeprecationWarning of a name or module that moved from ``old`` to ``new``, naming the new path."""
    warnings.warn(
        f"{old} has moved to {new}; import it from there (the old path will be removed in the next release)",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def moved_module(old: str, new: str) -> None:
    """Make the module ``old`` an alias of ``new`` (every name, private ones included) and warn once, naming the
    new path. Call it as the only statement of the old module."""
    warn_moved(old, new, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
