"""The study drivers' (``tuned``, ``width``) shared part: a job's identity, the study's JSON file and the run loop.

A driver's plan lists the jobs still to run (``plan.pending(runs)``, a pure function of the finished runs, so a resumed
study decides alike); its :class:`StudyFile` trains them, writes the file after every run and resumes from it. Nothing
here imports torch when loaded, so ``report`` (which reads ``tuned``'s rate protocol) loads quickly.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, astuple, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar


def log(text: str) -> None:
    """Print a driver's progress line, stamped with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


@dataclass(frozen=True)
class StudyJob:
    """The base of a driver's frozen dataclass of one training run: its identity, and the job a ``runs`` entry ran."""

    @property
    def key(self) -> tuple:
        """The job's fields, rates rounded: equal for the same run, planned or read back from the file."""
        return tuple(round(value, 12) if isinstance(value, float) else value for value in astuple(self))

    @classmethod
    def of(cls, run: dict[str, Any]) -> Any:
        """The job that a ``runs`` entry (the job's fields and its results) ran."""
        return cls(**{field.name: run[field.name] for field in fields(cls)})


class StudyFile:
    """A study's JSON (``runs`` plus its protocol) and the plan that extends it, one run at a time.

    A driver's subclass gives the file's ``FORMAT``, the protocol keys a resumed file must share (``FIXED``), how a
    job trains (:meth:`_submit`) and what a failed run records besides its job (:meth:`failed`); it may merge a
    resumed file's protocol with its own (:meth:`merged`)."""

    FORMAT: ClassVar[str]
    FIXED: ClassVar[tuple[str, ...]]
    WALL_S: ClassVar[bool] = False  # whether each run records its wall seconds (``wall_s``)
    state: dict[str, Any]  # the file's JSON

    def __init__(self, path: Path, plan: Any, task: str, corpus: str, protocol: dict[str, Any]) -> None:
        """Resume the study at ``path`` under ``protocol`` (refused when one of ``FIXED`` differs), or start one."""
        from benchmarks import harness

        self.path, self.plan = path, plan
        if not path.exists():
            self.state = {"format": self.FORMAT, "task": task, "corpus": corpus, "protocol": protocol, "runs": []}
            return
        state = harness.read_json(path)
        old = state.get("protocol", {})
        theirs = {"set": [], **old}  # a study from before --set ran the config's own settings
        changed = {key: (theirs.get(key), protocol[key]) for key in self.FIXED if theirs.get(key) != protocol[key]}
        if changed:
            raise ValueError(
                f"{path} holds a study with another protocol (theirs, this one's: {changed}); give another"
                " --out, or move that file away"
            )
        self.state = {**state, "protocol": {**old, **protocol, **self.merged(old, state.get("runs", []))}}

    def merged(self, old: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
        """Protocol entries of a resumed study that combine its file's (``old``, and its ``runs``) with this one's."""
        return {}

    @property
    def runs(self) -> list[dict[str, Any]]:
        return self.state["runs"]

    def save(self) -> None:
        """Write the study whole, with the machine it runs on (a kill mid-write leaves the file as it was)."""
        from benchmarks import harness

        self.state["machine"] = harness.machine_info()
        harness.write_json(self.path, self.state)

    def run(self, workers: int, hours: float | None = None, threads: int = 1) -> None:
        """Train the plan's jobs on ``workers`` processes of ``threads`` torch threads until none is left, starting no
        run after ``hours``; then say where the study is and how many runs it has left."""
        from benchmarks.studies.common import run_pool

        deadline = None if hours is None else time.time() + 3600 * hours
        run_pool(lambda: self.plan.pending(self.runs), self._submit, self._finish, workers, threads, deadline)
        print(f"JSON: {self.path} ({len(self.runs)} runs; {len(self.plan.pending(self.runs))} runnable runs left)")

    def _submit(self, pool: ProcessPoolExecutor, job: Any) -> Future:
        """Start ``job`` on ``pool``: the driver's worker function, which returns the run's ``runs`` entry."""
        raise NotImplementedError

    def failed(self, job: Any) -> dict[str, Any]:
        """What a run of ``job`` that raised records besides the job's fields, its error and a NaN loss."""
        return {}

    def _finish(self, job: Any, outcome: dict[str, Any] | BaseException, wall_s: float) -> None:
        """Record a finished run (a failed one with its error and a NaN loss, so the plan does not start it again),
        save the study and log the run."""
        if isinstance(outcome, BaseException):
            print(f"    FAILED {job!r}: {outcome!r}", flush=True)
            outcome = {**asdict(job), **self.failed(job), "error": repr(outcome), "val_loss": math.nan}
        if self.WALL_S:
            outcome["wall_s"] = wall_s
        self.runs.append(outcome)
        self.save()
        log(f"done  {job}: val loss {outcome['val_loss']:.4f}, {outcome.get('params_active', 0):,} params")
