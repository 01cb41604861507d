"""Moved: the generic callbacks live in :mod:`comera_lightning.callbacks`, the MLflow logger in
:mod:`comera_lightning.loggers`, the atomic writer and Lightning/MLflow adapters in :mod:`comera_lightning.utilities`.

This package keeps the old import paths (and configs' ``comera_lightning.training.X`` class paths) working, with a
warning, for one release.
"""

import pkgutil
import warnings

from .. import callbacks as _callbacks
from ..loggers import ResilientMLFlowLogger

warnings.warn(
    "comera_lightning.training has moved: callbacks to comera_lightning.callbacks, the MLflow logger to "
    "comera_lightning.loggers, atomic files and adapters to comera_lightning.utilities; import them from there (the "
    "old paths will be removed in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

# the callbacks that lived here: those whose module left a shim module in this package
_shims = {module.name for module in pkgutil.iter_modules(__path__)}
_moved = {
    name: getattr(_callbacks, name)
    for name in _callbacks.__all__
    if getattr(_callbacks, name).__module__.removeprefix(f"{_callbacks.__name__}.") in _shims
}
globals().update(_moved)

__all__ = sorted([*_moved, ResilientMLFlowLogger.__name__])
