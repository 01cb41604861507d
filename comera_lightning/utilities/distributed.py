"""The default process group is destroyed when a process exits, whatever its backend.

Lightning destroys the group it creates at exit only for NCCL. A gloo group (CPU ``ddp``, ``ddp_spawn``, FSDP2 on
CPU) is left to interpreter finalization, when gloo's worker threads may still hold finished work whose tensors
reach back into Python: a rank can then abort after a successful fit ("terminate called without an active
exception", SIGABRT). Importing :mod:`comera_lightning` registers :func:`destroy_process_group_at_exit`, which
runs while the interpreter is still whole; with no group it does nothing.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

__all__ = ["destroy_process_group_at_exit"]


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group if one is still initialised (an ``atexit`` handler)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(destroy_process_group_at_exit)
