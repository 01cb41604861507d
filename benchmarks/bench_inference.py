"""Inference of trained-shape models, every part's candidates interleaved in one process (ratios of medians):

* ``decode``: ``CausalLM.generate`` of ``--new-tokens`` after a 16-token prompt, greedy, d_model 512 and 1024 (4
  layers, vocabulary 8192), batch 1 and 8: CoMERA (the ``configs/llm_cpu.yaml`` recipe cut to ``--compression`` of
  its dense twin's parameters) and dense, each with its KV cache and re-running the whole sequence per token;
  tokens/s and the peak of live tensors during a generation.
* ``forward``: the six-encoder classifier and masked LM of ``configs/mnli_6enc.yaml``'s shape, eval mode without
  gradients, batch 1 and 32 x 128: TT layers, untensorised (``untensorize``: the dense weights they compute) and
  dense; latency and the peak of live tensors.

    python -m benchmarks.bench_inference                       # both parts (about 15 minutes on 2 cores)
    python -m benchmarks.bench_inference --part decode --quick # the plumbing in seconds
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import harness
from benchmarks.harness import build_model, make_batch, paper_shape
from comera_lightning.lit import CausalLM
from comera_lightning.nn import size_report, tt_layers, untensorize

PROMPT_LEN = 16
VOCAB = 8192
DECODER_LAYERS = 4


# ------------------------------------------------------------------------------------------------------
# memory: torch's MemTracker refuses a module called many times in one step (a generation loop)


class _LiveTensors(TorchDispatchMode):
    """Bytes of the storages that operator outputs keep alive, and their peak, inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors referring to it]
        self.bytes = self.peak = 0

    def _release(self, pointer: int) -> None:
        entry = self.live[pointer]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[pointer]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (t for t in (out if isinstance(out, (tuple, list)) else (out,)) if torch.is_tensor(t)):
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer not in self.live:
                self.live[pointer] = [storage.nbytes(), 0]
                self.bytes += storage.nbytes()
                self.peak = max(self.peak, self.bytes)
            self.live[pointer][1] += 1
            weakref.finalize(tensor, self._release, pointer)
        return out


def peak_bytes(step: Callable[[], object], model: nn.Module) -> int:
    """Parameters and buffers of ``model`` plus the peak of the tensors ``step()`` creates and keeps alive."""
    resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    with _LiveTensors() as tracker:
        step()
    return resident + tracker.peak


# ------------------------------------------------------------------------------------------------------
# decode


def decoder_task(d_model: int, tt: bool, layers: int = DECODER_LAYERS, vocab: int = VOCAB) -> CausalLM:
    """A CausalLM of the llm_cpu recipe at ``d_model`` (heads of 64, SwiGLU width 8/3 d_model), dense or TT, its
    ranks from ``d_model / 8`` (the head's twice that): below 10x, so :func:`cut_to_compression` can reach it."""
    torch.manual_seed(0)
    rank = max(8, d_model // 8)
    layer_config = dict(rank=rank, embedding_rank=rank, low_rank_linears="lm_head", layer_ranks={"lm_head": 2 * rank})
    if not tt:
        layer_config = dict(tt_linears=False, tt_embeddings=False)
    dims = dict(vocab_size=vocab, d_model=d_model, num_heads=max(1, d_model // 64), d_ff=8 * d_model // 3)
    return CausalLM(**dims, num_layers=layers, max_len=256, dropout=0.0, layer_config=layer_config).eval()


def cut_to_compression(task: CausalLM, target: float) -> float:
    """Remove the trailing rank slices of every TT layer, the same share everywhere, until the model holds
    ``1 / target`` of its dense twin's parameters (bisection on the share); returns the compression reached."""
    low, high = 0.0, 1.0
    for _ in range(20):
        keep = (low + high) / 2
        trial = copy.deepcopy(task.model)
        for _, layer in tt_layers(trial):
            layer.truncate_to_share_(keep)
        if size_report(trial).compression_ratio >= target:
            low = keep
        else:
            high = keep
    for _, layer in tt_layers(task.model):
        layer.truncate_to_share_(low)
    return size_report(task.model).compression_ratio


CHECKED = "comera cache, checked per call"


def generate_checking_every_call(task: CausalLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` with each TT layer checking its merged factors on every call instead of once per
    ``generate`` (``reusing_inference_factors`` made a no-op)."""
    import comera_lightning.lit.causal_lm as causal_lm

    reusing = causal_lm.reusing_inference_factors
    causal_lm.reusing_inference_factors = lambda model: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        return task.generate(prompt, new_tokens, temperature=0.0, use_cache=True)
    finally:
        causal_lm.reusing_inference_factors = reusing


def _generations(models: dict[str, CausalLM], prompt: torch.Tensor, new_tokens: int) -> dict[str, Callable]:
    """Greedy generation by every model with and without its cache, and CoMERA's checking its factors per call."""
    steps: dict[str, Callable[[], object]] = {}
    for name, task in models.items():
        for cached in (True, False):
            steps[f"{name} {'cache' if cached else 'no cache'}"] = functools.partial(
                task.generate, prompt, new_tokens, temperature=0.0, use_cache=cached
            )
    steps[CHECKED] = functools.partial(generate_checking_every_call, models["comera"], prompt, new_tokens)
    return steps


def run_decode(args, d_models: list[int], batches: list[int]) -> dict:
    results = {}
    for d_model in d_models:
        dense = decoder_task(d_model, tt=False, layers=args.layers, vocab=args.vocab)
        comera = decoder_task(d_model, tt=True, layers=args.layers, vocab=args.vocab)
        reached = cut_to_compression(comera, args.compression)
        models = {"dense": dense, "comera": comera}
        for batch in batches:
            prompt = torch.randint(0, args.vocab, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
            steps = _generations(models, prompt, args.new_tokens)
            same = torch.equal(steps["comera cache"](), steps["comera no cache"]())
            same = same and torch.equal(steps["comera cache"](), steps[CHECKED]())
            timing = harness.interleave(steps, warmup=0, min_sample_s=0.0, **harness.timing_options(args))
            tokens_per_s = {n: batch * args.new_tokens / timing.median(n) for n in steps}
            peak = {name: peak_bytes(step, models[name.split()[0]]) for name, step in steps.items()}
            results[f"d{d_model} b{batch}"] = {
                **{"d_model": d_model, "batch": batch, "compression": reached, "cache_equals_rerun": same},
                **{"tokens_per_s": tokens_per_s, "peak_bytes": peak, "noise": timing.noise_cell()},
                "timing": timing.summary(),
                "parameters": {n: size_report(t.model).active_parameters for n, t in models.items()},
            }
            print(f"d{d_model} b{batch}: " + ", ".join(f"{n} {v:.0f} tok/s" for n, v in tokens_per_s.items()))
    return results


def decode_table(results: dict) -> str:
    rows = []
    for key, r in results.items():
        tps, peak = r["tokens_per_s"], r["peak_bytes"]
        cells = [key, f"{r['compression']:.1f}x"]
        cells += [f"{tps[n]:.0f}" for n in ("comera cache", "dense cache", "comera no cache", "dense no cache")]
        cells += [harness.times(tps["comera cache"] / tps[n]) for n in ("comera no cache", "dense cache", CHECKED)]
        cells += [harness.mib(peak["comera cache"]), harness.mib(peak["dense cache"])]
        rows.append([*cells, "yes" if r["cache_equals_rerun"] else "NO", r["noise"]])
    headers = (
        "shape|CoMERA size|CoMERA cache tok/s|dense cache tok/s|CoMERA no cache|dense no cache|cache vs none (CoMERA)"
        "|CoMERA vs dense (cache)|checked once vs per call (CoMERA)|CoMERA peak MiB|dense peak MiB|same tokens"
        "|clean rounds"
    )
    return harness.table(headers, rows)


# ------------------------------------------------------------------------------------------------------
# forward


def encoder_models(kind: str, shape) -> dict[str, nn.Module]:
    """CoMERA (TT), CoMERA untensorised and dense, of the classifier or the masked LM, in eval mode."""
    task = "classifier" if kind == "classifier" else "mlm"
    comera, dense = build_model(shape, tt=True, task=task), build_model(shape, tt=False, task=task)
    untensorised = copy.deepcopy(comera)
    untensorize(untensorised)
    return {"comera TT": comera.eval(), "comera untensorised": untensorised.eval(), "dense": dense.eval()}


def run_forward(args, shape, batches: list[int]) -> dict:
    results = {}
    for kind in ("classifier", "mlm"):
        models = encoder_models(kind, shape)
        for batch in batches:
            ids, _ = make_batch(shape, batch)
            steps = {name: (lambda m=model, ids=ids: torch.inference_mode()(m)(ids)) for name, model in models.items()}
            timing = harness.interleave(steps, **harness.timing_options(args))
            latency = {n: timing.median(n) for n in steps}
            results[f"{kind} b{batch}"] = {
                **{"kind": kind, "batch": batch, "latency_s": latency},
                "peak_bytes": {n: peak_bytes(step, models[n]) for n, step in steps.items()},
                "compression": size_report(models["comera TT"]).compression_ratio,
                **{"noise": timing.noise_cell(), "timing": timing.summary()},
            }
            print(f"{kind} b{batch}: " + ", ".join(f"{n} {harness.ms(v)} ms" for n, v in latency.items()))
    return results


def forward_table(results: dict) -> str:
    rows = []
    for key, r in results.items():
        lat = r["latency_s"]
        cells = [key, f"{r['compression']:.1f}x", *(harness.ms(lat[n]) for n in lat)]
        cells += [harness.times(lat["dense"] / lat[n]) for n in ("comera TT", "comera untensorised")]
        rows.append([*cells, *(harness.mib(r["peak_bytes"][n]) for n in lat), r["noise"]])
    headers = (
        "model, batch|CoMERA size|TT ms|untensorised ms|dense ms|TT vs dense|untensorised vs dense|TT peak MiB"
        "|untensorised peak MiB|dense peak MiB|clean rounds"
    )
    return harness.table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, write JSON/MD/PNG; returns 0 (run.py's contract)."""
    parser = harness.bench_parser(__doc__, repeats=(1, 3))
    add = parser.add_argument
    add("--part", choices=("decode", "forward", "all"), default="all")
    add("--compression", type=float, default=10.0, help="CoMERA decoder size target (default 10)")
    add("--new-tokens", type=int, default=harness.Quick(8, 128), help="generated tokens (default 128, quick 8)")
    args = harness.parse(parser, argv)
    if args.compression <= 1:
        parser.error(f"--compression must be > 1, got {args.compression}")
    quick = args.quick
    args.layers, args.vocab = (1, 512) if quick else (DECODER_LAYERS, VOCAB)
    shape = paper_shape()
    if quick:
        tiny = dict(d_model=64, num_heads=2, d_ff=128, num_layers=1, vocab_size=1000, seq_len=16, rank=4)
        shape = replace(shape, **tiny, embedding_rank=4)
    payload: dict = {"machine": harness.machine_info(), "settings": harness.settings(args)}
    markdown = []
    if args.part in ("decode", "all"):
        payload["decode"] = run_decode(args, [64] if quick else [512, 1024], [1, 2] if quick else [1, 8])
        decoding = f"Decoding (greedy, prompt 16 tokens, {args.new_tokens} new tokens):"
        markdown += [decoding, decode_table(payload["decode"])]
    if args.part in ("forward", "all"):
        payload["forward"] = run_forward(args, shape, [1, 2] if quick else [1, 32])
        where = f"{shape.num_layers} encoders, d_model {shape.d_model}, seq {shape.seq_len}"
        markdown += [f"Forward, eval, no gradients ({where}):", forward_table(payload["forward"])]
    text = "\n\n".join(markdown)
    print(text)
    harness.emit(args.out_dir / f"inference{'_quick' if quick else ''}.json", payload, markdown=text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
