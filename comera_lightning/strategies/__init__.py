"""Training strategies: FSDP2 with CoMERA's rank cuts resharded (``--trainer.strategy comera_fsdp2``)."""

from .fsdp2 import FSDP2Strategy, checkpoint_shapes, data_parallel_mesh, shard_model

__all__ = ["FSDP2Strategy", "checkpoint_shapes", "data_parallel_mesh", "shard_model"]
