"""A process group that outlives the interpreter: destroyed at exit, before finalization."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_importing_the_package_destroys_a_gloo_group_left_alive_at_exit(tmp_path):
    # Lightning destroys NCCL groups at exit but not gloo ones; a gloo group alive during interpreter finalization
    # can abort the process ("terminate called without an active exception"), as a ddp_spawn rank did
    script = textwrap.dedent(
        f"""
        import atexit
        import torch.distributed as dist

        # registered first, so it runs last (atexit is last in, first out): after the package's handler
        atexit.register(lambda: print("alive at exit:", dist.is_initialized(), flush=True))
        import comera_lightning  # noqa: F401

        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0, world_size=1)
        dist.all_reduce(__import__("torch").ones(3))
        print("initialized:", dist.is_initialized(), flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "initialized: True" in done.stdout
    assert "alive at exit: False" in done.stdout
