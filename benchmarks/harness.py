"""Shared machinery of the benchmarks: interleaved timing with contention probing (rounds during which other
processes took more than a given share of the CPUs are left out and retried; every claim is a ratio of medians),
peak memory by torch's ``MemTracker``, profiles, the six-encoder classifier built from a :class:`Shape`, the common
command line, and markdown/JSON/PNG output.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PAPER_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "mnli_6enc.yaml"


# ------------------------------------------------------------------------------------------------------
# contention


class ContentionProbe:
    """CPU used by OTHER processes (and the hypervisor's steal) since the probe was made, from /proc/stat."""

    _tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self) -> None:
        self.wall, self.cpu, self.busy = time.perf_counter(), time.process_time(), self._busy()

    @classmethod
    def _busy(cls) -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy
        return (sum(fields[:8]) - fields[3] - fields[4]) / cls._tick

    def read(self) -> tuple[float | None, float]:
        """``(other_load, own_share)``: other processes' CPU seconds per wall second as a share of the machine (None
        without /proc/stat: then no round is rejected), and this process's per torch thread."""
        wall = max(time.perf_counter() - self.wall, 1e-9)
        own = time.process_time() - self.cpu
        busy = self._busy()
        own_share = own / wall / torch.get_num_threads()
        if busy is None or self.busy is None:
            return None, own_share
        return max(busy - self.busy - own, 0.0) / wall / (os.cpu_count() or 1), own_share


def wait_until_quiet(max_other_load: float, deadline: float, interval_s: float = 0.5) -> bool:
    """Sleep until other processes use at most ``max_other_load`` of the machine, or until ``deadline``."""
    while True:
        probe = ContentionProbe()
        time.sleep(interval_s)
        other, _ = probe.read()
        if other is None or other <= max_other_load:
            return True
        if time.perf_counter() >= deadline:
            return False


# ------------------------------------------------------------------------------------------------------
# interleaved timing


@dataclass
class Timing:
    """Per-candidate samples (seconds per step) from the rounds used for the medians, plus every round."""

    samples: dict[str, list[float]]
    rounds: list[dict]
    inner: dict[str, int]
    contended: bool = False

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def medians(self) -> dict[str, float]:
        return {name: self.median(name) for name in self.samples}

    def minimum(self, name: str) -> float:
        return min(self.samples[name])

    def ratio(self, slower: str, faster: str) -> float:
        """Ratio of medians: how many times longer ``slower``'s step takes than ``faster``'s."""
        return self.median(slower) / self.median(faster)

    def paired_ratios(self, slower: str, faster: str) -> list[float]:
        """Per-round ratios (same round = same machine state): their spread is the noise of ``ratio``."""
        return [s / f for s, f in zip(self.samples[slower], self.samples[faster], strict=True)]

    def summary(self) -> dict:
        """Medians, minima, every sample and round, and the contention counts, as JSON values."""
        loads = [r["other_load"] for r in self.rounds if r["other_load"] is not None]
        return {
            "median_s": self.medians(),
            "min_s": {n: self.minimum(n) for n in self.samples},
            "samples_s": self.samples,
            "inner_iterations": self.inner,
            "rounds_total": len(self.rounds),
            "rounds_clean": sum(r["clean"] for r in self.rounds),
            "contended": self.contended,
            "other_load_median": statistics.median(loads) if loads else None,
            "rounds": self.rounds,
        }

    def noise_cell(self) -> str:
        """A table cell: clean/total rounds, the median load of other processes, ``!`` when contended."""
        s = self.summary()
        load = s["other_load_median"]
        cell = f"{s['rounds_clean']}/{s['rounds_total']}" + (f" ({load:.0%})" if load is not None else "")
        return cell + (" !" if self.contended else "")


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _synchronize() -> None:
    if _cuda():
        torch.cuda.synchronize()


def interleave(
    steps: dict[str, Callable[[], object]],
    repeats: int = 5,
    warmup: int = 1,
    min_sample_s: float = 0.01,
    min_total_s: float = 0.0,
    max_rounds: int = 40,
    max_other_load: float = 0.15,
    wait_quiet_s: float = 0.0,
    seed: int = 0,
) -> Timing:
    """Time every ``steps[name]()`` round by round, interleaved, in a fresh random order.

    Each sample is the mean over an inner loop at least ``min_sample_s`` long (a short step gets one untimed call
    first, so it does not start cache-cold). At least ``repeats`` clean rounds, more while they add up to less than
    ``min_total_s``. A round in which other processes used more than ``max_other_load`` of the machine stays in
    ``rounds`` but is left out of the samples and retried (at most ``repeats`` retries; >= 1 keeps every round);
    ``wait_quiet_s`` > 0 waits up to that long for a quiet machine before the first round and each retry.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(steps)
    deadline = time.perf_counter() + wait_quiet_s
    if wait_quiet_s > 0:
        wait_until_quiet(max_other_load, deadline)
    inner: dict[str, int] = {}
    for name in names:
        for _ in range(warmup):
            steps[name]()
        _synchronize()
        fastest = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            steps[name]()
            _synchronize()
            fastest = min(fastest, time.perf_counter() - t0)
            if fastest > 0.05:
                break
        inner[name] = int(min(200, max(1, math.ceil(min_sample_s / max(fastest, 1e-7)))))

    rounds: list[dict] = []
    shuffler = random.Random(seed)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one candidate's sample would be charged to it alone
    try:
        while len(rounds) < max(max_rounds, 2 * repeats):
            clean = [r for r in rounds if r["clean"]]
            clean_s = sum(r["times_s"][n] * inner[n] for r in clean for n in names)
            if (len(clean) >= repeats and clean_s >= min_total_s) or len(rounds) - len(clean) >= repeats:
                break
            if wait_quiet_s > 0 and rounds and not rounds[-1]["clean"]:
                wait_until_quiet(max_other_load, deadline)
            order = names[:]
            shuffler.shuffle(order)
            probe = ContentionProbe()
            times = {}
            for name in order:
                if inner[name] > 1:
                    steps[name]()
                _synchronize()
                t0 = time.perf_counter()
                for _ in range(inner[name]):
                    steps[name]()
                _synchronize()
                times[name] = (time.perf_counter() - t0) / inner[name]
            other, own = probe.read()
            clean_round = other is None or max_other_load >= 1.0 or other <= max_other_load
            rounds.append(
                {"order": order, "times_s": times, "other_load": other, "own_cpu_share": own, "clean": clean_round}
            )
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    clean = [r for r in rounds if r["clean"]]
    used = clean if len(clean) >= max(1, (repeats + 1) // 2) else rounds
    return Timing(
        samples={n: [r["times_s"][n] for r in used] for n in names},
        rounds=rounds,
        inner=inner,
        contended=any(not r["clean"] for r in used),
    )


# ------------------------------------------------------------------------------------------------------
# memory, kernel work, profiles


def peak_memory(
    step: Callable[[], object],
    modules: Iterable[nn.Module] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    tensors: Iterable[torch.Tensor] = (),
) -> dict:
    """Peak live tensor bytes during one ``step()`` (run it once before), split by MemTracker at the peak into
    ``parameters``, ``buffers``, ``gradients``, ``optimizer_state`` (everything ``optimizer.step()`` allocates;
    ``optimizer_state_persistent``: ``optimizer.state`` alone), ``activations``, ``temporaries``, ``other`` (e.g. the
    extra ``tensors``), ``total``. On CUDA also ``cuda_allocator_peak_bytes`` and ``cuda_allocated_before_bytes``.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    gc.collect()
    tracker = MemTracker()
    modules, optimizers, tensors = list(modules), list(optimizers), list(tensors)
    if modules or optimizers or tensors:
        tracker.track_external(*modules, *optimizers, *tensors)
    cuda = _cuda()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with tracker:
        step()
    labels = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other", "Total")
    categories = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "other")
    names = dict(zip(labels, (*categories, "total"), strict=True))
    out = {v: 0 for v in names.values()}
    for per_device in tracker.get_tracker_snapshot("peak").values():
        for key, nbytes in per_device.items():
            out[names[key if isinstance(key, str) else key.value]] += int(nbytes)
    storages = {
        value.untyped_storage().data_ptr(): value.untyped_storage().nbytes()
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    }
    out["optimizer_state_persistent"] = sum(storages.values())
    if cuda:
        torch.cuda.synchronize()
        out["cuda_allocator_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        out["cuda_allocated_before_bytes"] = int(base)
    return out


def kernel_work(step: Callable[[], object]) -> dict:
    """Minor page faults and user / system CPU seconds of one call of ``step`` (``getrusage``)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "user_s": after.ru_utime - before.ru_utime,
        "system_s": after.ru_stime - before.ru_stime,
    }


def profile_ops(step: Callable[[], object], iterations: int = 1, top: int = 12) -> dict:
    """Ops of ``step`` by self CPU time per call (``torch.profiler``, ``iterations`` calls after an unprofiled one):
    the total, every op's seconds, the ``top`` ops with calls and shares. With CUDA initialised the GPU is profiled
    too: the host's final wait for it is ``device_drain_wait_s`` (left out of the ops), plus :func:`device_times` and
    ``self_device_s`` in every ``top`` entry."""
    from torch.profiler import ProfilerActivity, profile

    cuda = _cuda()
    step()
    _synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        for _ in range(iterations):
            step()
        _synchronize()
    averages = prof.key_averages()
    drain = (lambda key: key.startswith("cudaDeviceSynchronize")) if cuda else (lambda key: False)
    events = sorted(
        (e for e in averages if e.device_type == torch.autograd.DeviceType.CPU and not drain(e.key)),
        key=lambda e: -e.self_cpu_time_total,
    )
    ops = {e.key: e.self_cpu_time_total / 1e6 / iterations for e in events}
    total = sum(ops.values()) or 1e-12
    out = {
        "total_self_cpu_s": total,
        "ops_s": ops,
        "top": [
            {"op": e.key, "calls": e.count / iterations, "self_cpu_s": ops[e.key], "share": ops[e.key] / total}
            for e in events[:top]
        ],
    }
    if cuda:
        out["device_drain_wait_s"] = sum(e.self_cpu_time_total for e in averages if drain(e.key)) / 1e6 / iterations
        out.update(device_times(averages, iterations))
        for entry in out["top"]:
            entry["self_device_s"] = out["device_ops_s"].get(entry["op"], 0.0)
    return out


def device_times(events: Iterable, iterations: int = 1) -> dict:
    """GPU time per call from a CUDA profile's key averages: ``total_self_device_s`` (kernels, copies, memsets) and
    ``device_ops_s``, the self device time of every CPU-side op that launched some, largest first."""
    cpu = torch.autograd.DeviceType.CPU
    events = list(events)

    def self_us(e):  # torch < 2.4: self_cuda_time_total
        return e.self_device_time_total if hasattr(e, "self_device_time_total") else e.self_cuda_time_total

    device = [e for e in events if e.device_type != cpu and not getattr(e, "is_user_annotation", False)]
    by_op = {e.key: self_us(e) / 1e6 / iterations for e in events if e.device_type == cpu and self_us(e) > 0}
    return {
        "total_self_device_s": sum(map(self_us, device)) / 1e6 / iterations,
        "device_ops_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])),
    }


def keep_freed_memory_for_run() -> None:
    """``--keep-freed-memory``: glibc's malloc keeps freed memory for the rest of the process, as the
    ``KeepFreedMemory`` callback does in training."""
    from comera_lightning.training.host_memory import keep_freed_memory

    if not keep_freed_memory(True):
        raise SystemExit("--keep-freed-memory needs glibc's malloc (mallopt); this C library has none")


# ------------------------------------------------------------------------------------------------------
# the six-encoder classifier from a shape: the one model builder of the step benchmarks


@dataclass(frozen=True)
class Shape:
    """Model shape and CoMERA settings of one benchmarked ``SequenceClassifier``."""

    vocab_size: int = 30522
    d_model: int = 768
    num_heads: int = 12
    d_ff: int = 3072
    num_layers: int = 6
    seq_len: int = 128
    num_classes: int = 3
    dropout: float = 0.1
    rank: int = 30
    embedding_rank: int = 32
    dense_layers: str | None = "position_embeddings|token_type_embeddings|classifier"
    lr_cores: float = 1e-4
    lr_gates: float = 1e-3
    lr_other: float = 5e-5


def paper_shape(config: Path = PAPER_CONFIG) -> Shape:
    """The shape of the paper's MNLI run, read from ``configs/mnli_6enc.yaml`` so both stay in sync."""
    import yaml

    parsed = yaml.safe_load(config.read_text())
    model = parsed["model"]["init_args"]
    values = {**model, **model["layer_config"], **model["optim"], "seq_len": parsed["data"]["init_args"]["seq_len"]}
    return Shape(**{f.name: values[f.name] for f in fields(Shape) if f.name in values})


def build_model(shape: Shape, tt: bool, seed: int = 0, device: str = "cpu", task: str = "classifier") -> nn.Module:
    """The ``SequenceClassifier`` (``task="mlm"``: ``MaskedLanguageModel``) of ``shape``, dense or CoMERA (TT linears
    and word embedding), in train mode, initialised on the CPU (the same weights on every device)."""
    from comera_lightning.models import MaskedLanguageModel, SequenceClassifier

    layers = dict(tt_linears=tt, tt_embeddings=tt, rank=shape.rank, embedding_rank=shape.embedding_rank)
    kwargs = dict(
        vocab_size=shape.vocab_size,
        d_model=shape.d_model,
        num_heads=shape.num_heads,
        d_ff=shape.d_ff,
        num_layers=shape.num_layers,
        max_len=shape.seq_len,
        dropout=shape.dropout,
        layer_config={**layers, "dense_layers": shape.dense_layers},
    )
    torch.manual_seed(seed)
    if task == "mlm":
        return MaskedLanguageModel(**kwargs).train().to(device)
    return SequenceClassifier(num_classes=shape.num_classes, **kwargs).train().to(device)


def make_batch(shape: Shape, batch: int, seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``(batch, seq_len)`` (never the padding id 0) and class labels, drawn on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, shape.vocab_size, (batch, shape.seq_len), generator=gen)
    return ids.to(device), torch.randint(0, shape.num_classes, (batch,), generator=gen).to(device)


# ------------------------------------------------------------------------------------------------------
# the command line every script shares


@dataclass(frozen=True)
class Quick:
    """An option's default that depends on ``--quick``: :func:`parse` puts ``quick`` or ``full`` in its place."""

    quick: object
    full: object


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def bench_parser(doc: str, *, repeats: tuple[int, int]) -> argparse.ArgumentParser:
    """A parser with the shared options: ``--quick``, ``--threads``, ``--out-dir`` and, for :func:`interleave`,
    ``--repeats`` (default ``repeats``: quick, full), ``--max-other-load`` and ``--wait-quiet``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="a small version: the plumbing in seconds")
    add("--threads", type=int, default=None, help="torch.set_num_threads (default: torch decides)")
    add("--out-dir", type=Path, default=RESULTS_DIR, help="where JSON/PNG go (default %(default)s)")
    add(
        "--repeats", type=int, default=Quick(*repeats), help=f"clean rounds at least ({repeats[1]}, quick {repeats[0]})"
    )
    add(
        "--max-other-load",
        type=float,
        default=0.15,
        help="a round in which other processes took more than this share of the CPUs (/proc/stat) is left out of "
        "the medians and retried (default 0.15; 1 keeps all)",
    )
    add("--wait-quiet", type=float, default=0.0, metavar="SECONDS", help="wait up to this long for a quiet machine")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``, resolve the :class:`Quick` defaults, refuse impossible shared options and apply ``--threads``."""
    args = parser.parse_args(argv)
    for name, value in vars(args).items():
        if isinstance(value, Quick):
            setattr(args, name, value.quick if args.quick else value.full)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not 0.0 <= args.max_other_load <= 1.0:
        parser.error(f"--max-other-load is a share of the machine in [0, 1], got {args.max_other_load}")
    if args.wait_quiet < 0:
        parser.error(f"--wait-quiet must be >= 0 seconds, got {args.wait_quiet}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def timing_options(args: argparse.Namespace) -> dict:
    """The :func:`interleave` keywords of the shared options."""
    return {"repeats": args.repeats, "max_other_load": args.max_other_load, "wait_quiet_s": args.wait_quiet}


def settings(args: argparse.Namespace) -> dict:
    """The parsed options as JSON values (paths as strings), for the ``settings`` of a result."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


# ------------------------------------------------------------------------------------------------------
# reporting


def machine_info() -> dict:
    """What the numbers were measured on (goes into every JSON and into docs/results.md)."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        pass
    return info


def ms(seconds: float) -> str:
    """Milliseconds with three significant-ish digits."""
    value = seconds * 1e3
    digits = 0 if value >= 100 else 1 if value >= 10 else 2 if value >= 1 else 3
    return f"{value:.{digits}f}"


def mib(nbytes: float) -> str:
    """Bytes as MiB, two decimals below 100 MiB."""
    return f"{nbytes / 2**20:.2f}" if nbytes < 100 * 2**20 else f"{nbytes / 2**20:.0f}"


def times(ratio: float | None) -> str:
    """A ratio as '4.21x' ('-' for None)."""
    return "-" if ratio is None else f"{ratio:.2f}x"


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None when either is missing (a skipped candidate)."""
    return None if a is None or b is None else a / b


def verdict(measured: float | None, target: float) -> str:
    """'met' / 'MISSED' of a measured value against the least it should reach ('n/a' when nothing was measured)."""
    if measured is None:
        return "n/a"
    return "met" if measured >= target else "MISSED"


def table(headers: str | Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; ``headers`` a list, or one string of them separated by ``|``."""
    if isinstance(headers, str):
        headers = headers.split("|")
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def write_json(path: Path, payload: dict) -> Path:
    """Write ``payload`` as indented JSON, creating the folder; replaced whole (a kill mid-write leaves the old)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(payload, indent=1, default=str))
    partial.replace(path)
    return path


def read_json(path: Path) -> dict:
    """A JSON file written by :func:`write_json`."""
    return json.loads(Path(path).read_text())


def emit(json_path: Path, payload: dict, fig=None, markdown: str | None = None) -> Path:
    """Write a result: the JSON, ``fig`` as the PNG next to it, ``markdown`` as the .md next to it; print where."""
    written = [write_json(json_path, payload)]
    if markdown is not None:
        written.append(json_path.with_suffix(".md"))
        written[-1].write_text(markdown + "\n")
    if fig is not None:
        import matplotlib.pyplot as plt

        written.append(json_path.with_suffix(".png"))
        fig.tight_layout()
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    print("\n" + "\n".join(f"{p.suffix[1:].upper()}: {p}" for p in written), flush=True)
    return json_path


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure on the non-interactive Agg backend (benchmarks run headless) and its axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def label_axes(
    ax, xlabel: str | None = None, ylabel: str | None = None, *, xlog=False, ylog=False, title=None, legend=True
) -> None:
    """Labels, log scales, a title, a light grid and a small legend on ``ax``."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if xlog:
        ax.set_xscale("log")
    if ylog:
        ax.set_yscale("log")
    if title is not None:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    if legend:
        ax.legend(fontsize=7)


def bars(ax, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, log: bool = True) -> None:
    """Grouped bars on ``ax``: one group per label in ``groups``, one bar per entry of ``series`` in each."""
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))], values, width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    label_axes(ax, ylabel=ylabel, ylog=log)
