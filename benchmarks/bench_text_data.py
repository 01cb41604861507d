"""Pre-training data at scale (TextLMDataModule): tokenising throughput, loader throughput against the training
step's demand at llm_60m shapes, and peak memory against corpus size.

The corpus: JSON lines shards whose documents are the Python standard library's modules (``*/*.py``, read as
text), copied until the corpus holds ``--base-mb`` megabytes (1x) and ten times that (10x); every copy's
documents carry their copy number, so no two are equal. One byte-level BPE of 8,192 tokens is trained on the
first 8 MB beforehand (not timed). Every measurement runs in a fresh child process, so its peak resident set
(``ru_maxrss``) belongs to that phase alone:

* ``tokenize``: ``prepare_data`` writes the token store; tokens/s, MB of text/s, CPU seconds per wall second
  (how many cores the tokenizer kept busy), peak RSS. The 1x corpus with the tokenizer's threads limited to 1
  (``RAYON_NUM_THREADS=1``) and with every core; the 10x corpus with every core.
* ``load``: one epoch of the training loader at llm_60m shapes (rows of 256 tokens, batches of 128): rows/s,
  tokens/s, peak RSS of the process and of its workers; 1x and 10x, ``num_workers`` 0 and 2.
* ``step``: the llm_60m model (configs/llm_60m.yaml) in training on this CPU, batch 2 x 256: tokens/s it
  consumes. A GPU's demand is not measured here: the table gives what the loader supplies per process.

    python -m benchmarks.bench_text_data              # 100 MB and 1 GB corpora: about 8 minutes on 2 cores
    python -m benchmarks.bench_text_data --quick      # the plumbing in a minute
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks import harness

CHILD_FLAG = "--child"
SEQ_LEN, BATCH = 256, 128  # llm_60m's rows and batch


def write_corpus(folder: Path, megabytes: float, shard_mb: float = 64.0) -> int:
    """JSON lines shards of about ``megabytes`` of standard-library text; returns the bytes of text written."""
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*/*.py"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    folder.mkdir(parents=True, exist_ok=True)
    target, written, copy, shard = megabytes * 2**20, 0, 0, None
    while written < target:
        for number, text in enumerate(texts):
            if shard is None or shard.tell() > shard_mb * 2**20:
                if shard is not None:
                    shard.close()
                shard_path = folder / f"shard{len(list(folder.iterdir())):05d}.jsonl"
                shard = open(shard_path, "w", encoding="utf-8")  # noqa: SIM115 (closed when the next shard opens)
            document = f"# copy {copy} of module {number}\n{text}"
            shard.write(json.dumps({"text": document}) + "\n")
            written += len(document)
            if written >= target:
                break
        copy += 1
    shard.close()
    return written


def train_tokenizer(corpus: Path, out: Path) -> Path:
    from comera_lightning.data.text_sources import iter_pieces, resolve_files
    from comera_lightning.data.tokenizer import train_bpe_tokenizer

    texts, size = [], 0
    for source in resolve_files(str(corpus / "*.jsonl")):
        for piece in iter_pieces(source):
            texts.append(piece.text)
            size += len(piece.text)
            if size > 8 * 2**20:
                break
        if size > 8 * 2**20:
            break
    train_bpe_tokenizer(texts, 8192).save(str(out))
    return out


def _datamodule(corpus: Path, tokenizer: Path, token_dir: Path, workers: int = 0):
    from comera_lightning.data import TextLMDataModule

    return TextLMDataModule(
        files=str(corpus / "*.jsonl"),
        tokenizer_path=str(tokenizer),
        token_dir=str(token_dir),
        vocab_size=8192,
        seq_len=SEQ_LEN,
        batch_size=BATCH,
        num_workers=workers,
        val_fraction=0.01,
    )


def _peak_rss() -> dict:
    """This process's peak resident set, and the largest of its finished (reaped) children's."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return {"peak_rss_bytes": own, "peak_rss_workers_bytes": children}


def child(part: str, spec: dict) -> dict:
    """One measurement in this (fresh) process."""
    corpus, tokenizer, token_dir = Path(spec["corpus"]), Path(spec["tokenizer"]), Path(spec["token_dir"])
    import comera_lightning.data  # noqa: F401  (the imports' memory is the baseline, not the phase's)

    before = {"rss_before_bytes": harness.resident_bytes()}
    if part == "tokenize":
        dm = _datamodule(corpus, tokenizer, token_dir)
        wall, cpu = time.perf_counter(), time.process_time()
        dm.prepare_data()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        meta = json.loads((token_dir / "meta.json").read_text())
        tokens = sum(meta["tokens"].values())
        return {
            "tokens": tokens,
            "seconds": wall,
            "tokens_per_s": tokens / wall,
            "cores_busy": cpu / wall,
            "text_mb_per_s": spec["text_bytes"] / 2**20 / wall,
            **before,
            **_peak_rss(),
        }
    if part == "load":
        dm = _datamodule(corpus, tokenizer, token_dir, workers=spec["workers"])
        dm.setup("fit")
        loader = dm.train_dataloader()
        rows, start = 0, time.perf_counter()
        for batch in loader:
            rows += len(batch["input_ids"])
        seconds = time.perf_counter() - start
        del loader  # shuts the workers down and reaps them, so their peak counts in RUSAGE_CHILDREN
        gc.collect()
        return {
            "rows": rows,
            "seconds": seconds,
            "rows_per_s": rows / seconds,
            "tokens_per_s": rows * SEQ_LEN / seconds,
            **before,
            **_peak_rss(),
        }
    if part == "step":
        import torch
        import yaml

        from comera_lightning.lit import CausalLM

        config = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "llm_60m.yaml").read_text())
        model = CausalLM(**config["model"]["init_args"]).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = {"input_ids": torch.randint(0, 32000, (2, SEQ_LEN)), "labels": torch.randint(0, 32000, (2, SEQ_LEN))}
        times = []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            loss = model.training_step(batch, 0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        median = sorted(times[1:])[len(times[1:]) // 2]
        return {"step_seconds": median, "tokens_per_s": 2 * SEQ_LEN / median, **before, **_peak_rss()}
    raise ValueError(part)


def run_child(part: str, spec: dict, env: dict | None = None) -> dict:
    out = subprocess.run(
        harness.module_command(__spec__.name, CHILD_FLAG, part, json.dumps(spec)),
        capture_output=True,
        text=True,
        env=harness.child_env(**(env or {})),
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{part} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [CHILD_FLAG]:
        print(json.dumps(child(argv[1], json.loads(argv[2]))))
        return 0
    parser = harness.bench_parser(__doc__)
    parser.add_argument(
        "--base-mb",
        type=float,
        default=harness.Quick(2.0, 100.0),
        help="megabytes of text of the 1x corpus (10x: ten times; default 100, quick 2)",
    )
    parser.add_argument(
        "--step-repeats",
        type=int,
        default=harness.Quick(2, 4),
        help="llm_60m steps timed, the first dropped (default 4, quick 2; 0: skip)",
    )
    args = harness.parse(parser, argv)
    results: dict = {"machine": harness.machine_info(), "settings": harness.settings(args), "corpora": {}}
    with tempfile.TemporaryDirectory(prefix="bench_text_data_") as tmp:
        tmp = Path(tmp)
        corpora = {scale: tmp / f"corpus{scale}x" for scale in (1, 10)}
        sizes = {scale: write_corpus(folder, args.base_mb * scale) for scale, folder in corpora.items()}
        tokenizer = train_tokenizer(corpora[1], tmp / "tokenizer.json")
        rows = []
        for scale, label, env in (
            (1, "1 thread", {"RAYON_NUM_THREADS": "1"}),
            (1, "all cores", {}),
            (10, "all cores", {}),
        ):
            token_dir = tmp / f"tokens{scale}x-{label.replace(' ', '')}"
            spec = {
                "corpus": str(corpora[scale]),
                "tokenizer": str(tokenizer),
                "token_dir": str(token_dir),
                "text_bytes": sizes[scale],
            }
            result = run_child("tokenize", spec, env)
            results["corpora"].setdefault(f"{scale}x", {"text_bytes": sizes[scale]})[f"tokenize {label}"] = result
            rows.append(
                [
                    f"tokenise {scale}x ({sizes[scale] / 2**20:.0f} MB), {label}",
                    f"{result['tokens']:,}",
                    f"{result['tokens_per_s']:,.0f}",
                    f"{result['text_mb_per_s']:.2f}",
                    f"{result['cores_busy']:.2f}",
                    harness.mib(result["rss_before_bytes"]),
                    harness.mib(result["peak_rss_bytes"]),
                    "-",
                ]
            )
            print(rows[-1], flush=True)
        for scale in (1, 10):
            token_dir = tmp / f"tokens{scale}x-allcores"
            for workers in (0, 2):
                spec = {
                    "corpus": str(corpora[scale]),
                    "tokenizer": str(tokenizer),
                    "token_dir": str(token_dir),
                    "workers": workers,
                }
                result = run_child("load", spec)
                results["corpora"][f"{scale}x"][f"load workers={workers}"] = result
                rows.append(
                    [
                        f"load one epoch {scale}x, {workers} workers",
                        f"{result['rows'] * SEQ_LEN:,}",
                        f"{result['tokens_per_s']:,.0f}",
                        "-",
                        "-",
                        harness.mib(result["rss_before_bytes"]),
                        harness.mib(result["peak_rss_bytes"]),
                        harness.mib(result["peak_rss_workers_bytes"]),
                    ]
                )
                print(rows[-1], flush=True)
    if args.step_repeats > 1:
        step = run_child("step", {"corpus": "", "tokenizer": "", "token_dir": "", "steps": args.step_repeats})
        results["llm_60m_step_cpu"] = step
        rows.append(
            [
                "llm_60m training step on this CPU (batch 2 x 256)",
                "-",
                f"{step['tokens_per_s']:,.0f}",
                "-",
                "-",
                harness.mib(step["rss_before_bytes"]),
                harness.mib(step["peak_rss_bytes"]),
                "-",
            ]
        )
    markdown = harness.table(
        [
            "phase",
            "tokens",
            "tokens/s",
            "MB text/s",
            "cores busy",
            "RSS after imports MiB",
            "peak RSS MiB",
            "workers' peak RSS MiB",
        ],
        rows,
    )
    print("\n" + markdown)
    harness.emit(
        args.out_dir / ("text_data_quick.json" if args.quick else "text_data.json"), results, markdown=markdown
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
