"""What must reach into Lightning's distribution machinery: re-setup after a physical truncation."""

from .resize import after_truncation, check_truncation_supported, slice_optimizer_state

__all__ = ["after_truncation", "check_truncation_supported", "slice_optimizer_state"]
