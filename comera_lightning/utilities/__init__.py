"""Small shared utilities: moved-module shims."""

from .deprecation import moved_module

__all__ = ["moved_module"]
