"""``comera export --ckpt_path C --out F``: a checkpoint's compact model, as a safetensors file."""

from __future__ import annotations

import argparse

from ..export import export_checkpoint, read_export_metadata
from .checkpoints import LATEST, latest_checkpoint


def _export_command(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="comera export",
        allow_abbrev=False,
        description="Write a checkpoint's model, TT cores at their active ranks, to a "
        "safetensors file that comera_lightning.export.load_exported rebuilds without the checkpoint.",
    )
    parser.add_argument(
        "--ckpt_path", required=True, help="a checkpoint written by comera fit, or last: the newest run's"
    )
    parser.add_argument("--out", required=True, help="the .safetensors file to write")
    parser.add_argument("--task", default=None, help="the task's class path, for checkpoints that do not record it")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json for the export to carry (load_exported_tokenizer reads it)"
    )
    options = parser.parse_args(argv)
    try:
        if options.ckpt_path == LATEST:
            options.ckpt_path = str(latest_checkpoint())
            print(f"comera: --ckpt_path last: {options.ckpt_path}")
        path = export_checkpoint(
            options.ckpt_path, options.out, task=options.task, overwrite=options.overwrite, tokenizer=options.tokenizer
        )
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        parser.exit(2, f"comera export: {error}\n")
    meta = read_export_metadata(path)["size"]
    print(
        f"comera: wrote {path}: {meta['active_parameters']:,} parameters, "
        f"{meta['compression_ratio']:.1f}x smaller than dense"
    )
