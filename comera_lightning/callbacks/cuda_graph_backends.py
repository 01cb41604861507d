"""Capture backends of the :class:`~comera_lightning.callbacks.CudaGraphs` callback: the only CUDA-specific code.

A backend captures a function (the training step's forward + backward, or the optimiser step) into a
:class:`Graph` whose ``replay()`` recomputes its static ``outputs`` in place:

* :class:`CudaGraphBackend`: ``torch.cuda.graph`` on a side stream. Experimental: written without access
  to a GPU; ``benchmarks/bench_cuda_graphs.py`` is its first real run.
* :class:`ReplayBackend`: an eager stand-in on any device (re-runs the function, copies its results into
  the static tensors, and raises :class:`StaleGraphError` where a CUDA graph would silently replay old
  state). It tests the callback's plumbing on the CPU; no speed-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CAPTURE_HINT",
    "CudaGraphBackend",
    "CudaGraphCaptureError",
    "Graph",
    "GraphBackend",
    "ReplayBackend",
    "StaleGraphError",
]

CAPTURE_HINT = (
    "A captured training_step may contain only tensor operations without host synchronisation: no .item(), "
    "float(tensor), printing tensors, boolean-mask indexing (x[mask]), torch.unique/nonzero or Python branches on "
    "tensor values, in training_step or in the layers it calls (the project's layers and tasks skip theirs while "
    "capturing: see comera_lightning.nn.base.capturing_graph). Make the step static, or remove the "
    "CudaGraphs callback."
)


class CudaGraphCaptureError(RuntimeError):
    """The training step could not be captured (usually a host synchronisation inside it)."""


class StaleGraphError(RuntimeError):
    """The replay backend was asked to replay a graph whose inputs changed since capture (a bug: CUDA would
    silently replay the old state)."""


class Graph:
    """A captured function: ``outputs`` are its static result tensors, ``replay()`` recomputes them in place."""

    outputs: list[Tensor]

    def replay(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class GraphBackend:
    """Where and how steps are captured and replayed."""

    name = "abstract"

    def stream(self) -> contextlib.AbstractContextManager:
        """Context for eager warm-up steps (the capture stream on CUDA)."""
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], list[Tensor]], preserve: Sequence[Tensor], key: Callable[[], Any]) -> Graph:
        """Capture ``fn``. Capturing must leave no numeric trace: ``preserve`` lists tensors ``fn`` mutates;
        ``key()`` fingerprints what the graph reads by address (the replay backend checks it on every replay)."""
        raise NotImplementedError

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, tensor_lr: bool) -> None:
        """Make the optimiser's step capturable; ``tensor_lr``: learning rates become 0-dim device tensors."""
        device = _optimizer_device(optimizer)
        for group in optimizer.param_groups:
            # only optimisers with a capturable mode read a tensor lr on the device (SGD would call .item() on it;
            # foreach Adam without capturable refuses it): the others keep floats, and a change re-captures
            tensor_ok = "capturable" in group and (group["capturable"] or not group.get("foreach"))
            if tensor_lr and tensor_ok and not torch.is_tensor(group["lr"]):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)

    def release(self) -> None:
        """Forget memory pools of dropped graphs."""

    def pool_idle_bytes(self) -> int:
        """Bytes the graphs' private memory pool reserves that no live tensor holds (none without a pool)."""
        return 0


class _CudaGraph(Graph):
    def __init__(self, graph: Any, outputs: list[Tensor]) -> None:
        self._graph, self.outputs = graph, outputs

    def replay(self) -> None:
        self._graph.replay()


class CudaGraphBackend(GraphBackend):
    """``torch.cuda.graph`` capture on one side stream shared by warm-up and capture (per-stream BLAS handles
    are created during warm-up, not mid-capture), the graphs of one generation sharing a memory pool (they
    replay in capture order, never concurrently). Experimental: not yet run on a GPU."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device=device)
        self._pool: Any = None

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    def capture(self, fn: Callable[[], list[Tensor]], preserve: Sequence[Tensor], key: Callable[[], Any]) -> Graph:
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._stream):
                outputs = fn()
        except RuntimeError as error:
            raise CudaGraphCaptureError(f"capturing the training step failed: {error}\n{CAPTURE_HINT}") from error
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if self._pool is None:
            self._pool = graph.pool()
        return _CudaGraph(graph, outputs)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, tensor_lr: bool) -> None:
        for group in optimizer.param_groups:
            if "capturable" in group and not group["capturable"]:
                group["capturable"] = True
        for param, state in optimizer.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            if torch.is_tensor(step) and step.device != param.device:
                state["step"] = step.to(device=param.device, dtype=torch.float32)  # capturable keeps it on device
        super().prepare_optimizer(optimizer, tensor_lr)

    def release(self) -> None:
        self._pool = None

    def pool_idle_bytes(self) -> int:
        # a replay allocates nothing: its intermediates live in the pool's blocks freed after capture, which
        # torch.cuda.max_memory_allocated does not count
        if self._pool is None:
            return 0
        return sum(
            segment["total_size"] - segment["allocated_size"]
            for segment in torch.cuda.memory_snapshot()
            if tuple(segment["segment_pool_id"]) == tuple(self._pool)
        )


class _ReplayGraph(Graph):
    def __init__(self, fn: Callable[[], list[Tensor]], outputs: list[Tensor], key: Callable[[], Any]) -> None:
        self._fn, self.outputs, self._key_fn = fn, outputs, key
        self._key = key()

    def replay(self) -> None:
        if self._key_fn() != self._key:
            raise StaleGraphError(
                "replaying a graph whose parameters, buffers, optimiser state, hyperparameters or "
                "gradient tensors changed since capture; a CUDA graph would use the old ones"
            )
        fresh = self._fn()
        if len(fresh) != len(self.outputs) or any(a.shape != b.shape for a, b in zip(fresh, self.outputs, strict=True)):
            raise CudaGraphCaptureError(
                "a replay produced other outputs than the capture: the training step is not shape-static. "
                + CAPTURE_HINT
            )
        with torch.no_grad():
            for static, value in zip(self.outputs, fresh, strict=True):
                static.copy_(value)


class ReplayBackend(GraphBackend):
    """Eager stand-in for CUDA graphs on any device: a replay re-runs the function and copies its results into
    the tensors the capture returned (a real graph writes to the same addresses); capturing restores what the
    function mutated (a real capture runs no kernels). Tests the plumbing; no speed-up."""

    name = "replay"

    def capture(self, fn: Callable[[], list[Tensor]], preserve: Sequence[Tensor], key: Callable[[], Any]) -> Graph:
        saved = [t.detach().clone() for t in preserve]
        outputs = fn()
        with torch.no_grad():
            for tensor, value in zip(preserve, saved, strict=True):
                tensor.copy_(value)
        return _ReplayGraph(fn, outputs, key)


def _optimizer_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return param.device
    return torch.device("cpu")
