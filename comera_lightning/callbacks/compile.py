"""Compile: ``torch.compile`` any LightningModule's networks from the trainer side (``--trainer.callbacks+=``).

The callback compiles submodules in place with :meth:`torch.nn.Module.compile`: parameters, state-dict keys,
checkpoints and the optimiser stay those of the eager module, so it composes with every other callback and
with resuming. It compiles once the strategy has set the model up (after FSDP2 sharding and the DDP wrapper),
at the start of whichever of fit, validate, test or predict comes first. Only ``forward`` is compiled: the
task's own step, its host-side checks and a ``generate`` loop stay eager. A task that calls the submodules of a
compiled module directly runs eager: the callback warns after the first batch when no compiled forward ran.

The project's TT layers trace without graph breaks in training and in evaluation (``tests/training``), and
the compiled step equals the eager one. Physical rank truncation changes parameter shapes, which torch
answers with a recompilation; the callback forgets torch's compiled code when that happens, so that a long
run with many truncations does not reach torch's recompile limit and silently fall back to eager. Each cut then
costs one compilation (with inductor on a CPU, tens of seconds to minutes: ``benchmarks/bench_compiled.py``
reports it), so compile runs that cut rarely, or rank adaptation in mask mode (``truncate_every_n_steps:
null``), which never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchmetrics import Metric
from typing_extensions import override

from ..utilities.internals import compiled_before, compiled_frame_count

__all__ = ["Compile"]


class Compile(Callback):
    """``torch.compile`` the LightningModule's networks in place, once the strategy has set them up.

    Args:
        modules: attribute names of the submodules to compile (``"model"``, ``"encoder.layers.0"``); ``None``:
            the task's ``compiled_modules`` where it names them (MaskedLM: ``model.encoder`` and ``model.head``,
            which its step calls apart), else every direct child that holds parameters and is not a torchmetrics
            ``Metric`` (for the other comera tasks, ``model``). Only a compiled module's own forward runs
            compiled: name the modules the task calls.
        backend, mode, fullgraph, dynamic, options: passed to :func:`torch.compile`.
    """

    def __init__(
        self,
        modules: str | Sequence[str] | None = None,
        backend: str = "inductor",
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.modules = [modules] if isinstance(modules, str) else None if modules is None else list(modules)
        self.compile_kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
        if mode is not None:
            self.compile_kwargs["mode"] = mode
        if options is not None:
            self.compile_kwargs["options"] = options
        self.compiled: list[str] = []
        self.resets = 0  # times torch's compiled code was forgotten because parameter shapes changed
        self._shapes: tuple[tuple[int, ...], ...] | None = None
        self._frames_at_compile: int | None = None  # until the first batch after compiling has been checked

    def targets(self, pl_module: LightningModule) -> dict[str, nn.Module]:
        """The submodules to compile by name: the policy a subclass may override."""
        names = self.modules if self.modules is not None else getattr(pl_module, "compiled_modules", None)
        if names is None:
            return {
                name: child
                for name, child in pl_module.named_children()
                if not isinstance(child, Metric) and any(True for _ in child.parameters())
            }
        found: dict[str, nn.Module] = {}
        for name in names:
            try:
                found[name] = pl_module.get_submodule(name)
            except AttributeError:
                children = [n for n, _ in pl_module.named_children()]
                raise ValueError(
                    f"Compile(modules=...) names {name!r}, which {type(pl_module).__name__} does not have; its "
                    f"submodules are {children}: name one of them (dotted paths reach deeper), or leave modules "
                    "unset to compile every child that holds parameters"
                ) from None
        return found

    def _compile(self, pl_module: LightningModule) -> None:
        if self.compiled:
            return
        targets = self.targets(pl_module)
        if not targets:
            raise ValueError(
                f"Compile found nothing to compile in {type(pl_module).__name__}: it has no child module with "
                "parameters; name the modules to compile with Compile(modules=[...])"
            )
        first_compile = not any(compiled_before(module) for module in targets.values())
        for name, module in targets.items():
            module.compile(**self.compile_kwargs)
            self.compiled.append(name)
        self._shapes = self._parameter_shapes(pl_module)
        # modules compiled before may run from torch's cache without compiling a frame: nothing to check then
        self._frames_at_compile = compiled_frame_count() if first_compile else None

    def _check_something_ran_compiled(self, pl_module: LightningModule) -> None:
        """After the first batch: warn when no compiled module's forward ran (the task calls their submodules
        directly, so the run is eager) instead of leaving the user to find out from the step time."""
        if self._frames_at_compile is None:
            return
        if compiled_frame_count() == self._frames_at_compile:
            rank_zero_warn(
                f"Compile: {type(pl_module).__name__} ran a batch without calling the forward of any compiled "
                f"module ({', '.join(self.compiled)}), so nothing ran compiled; name the modules its steps call "
                "with Compile(modules=[...]) (a task can also list them in its compiled_modules)"
            )
        self._frames_at_compile = None

    @staticmethod
    def _parameter_shapes(pl_module: LightningModule) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(p.shape) for p in pl_module.parameters())

    def _forget_stale_code(self, pl_module: LightningModule) -> None:
        shapes = self._parameter_shapes(pl_module)
        if shapes != self._shapes:
            # graphs specialised on the old shapes can never run again: drop them instead of letting each
            # truncation use up one of torch's recompiles per code object
            torch.compiler.reset()
            self._shapes = shapes
            self.resets += 1

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._compile(pl_module)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._compile(pl_module)
        self._forget_stale_code(pl_module)

    # testing and predicting compile as fitting does (whichever of them comes first)
    on_test_start = on_predict_start = on_fit_start

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._check_something_ran_compiled(pl_module)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._check_something_ran_compiled(pl_module)

    # the other evaluation loops' batches are checked as validation's are
    on_test_batch_end = on_predict_batch_end = on_validation_batch_end

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._forget_stale_code(pl_module)
