"""The configs installed with the package: found by name (``--config quickstart``), listed by ``comera configs``,
and the GPU configs that warn on a machine without one."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any


def _packaged_root() -> Path:
    return Path(str(resources.files("comera_lightning") / "configs"))


def packaged_configs() -> dict[str, Path]:
    """The configs and callback fragments installed with the package, by name (``quickstart``,
    ``callbacks/rank_adaptation``), so they work from a wheel as well as from a checkout."""
    root = _packaged_root()
    return {path.relative_to(root).with_suffix("").as_posix(): path for path in sorted(root.rglob("*.yaml"))}


def config_path(name: str) -> Path:
    """The installed config or fragment ``name`` (``quickstart``, ``quickstart.yaml``,
    ``configs/quickstart.yaml``, ``callbacks/rank_adaptation``); a ``KeyError`` lists the names."""
    key = name.removesuffix(".yaml").removesuffix(".yml").removeprefix("configs/")
    found = packaged_configs().get(key)
    if found is None:
        raise KeyError(f"no installed config named {name!r}; installed: {', '.join(packaged_configs())}")
    return found


def resolve_config_args(argv: list[str]) -> list[str]:
    """Replace each ``--config``/``-c`` value that is not a file here by the installed config of that name."""
    resolved, expect_value = [], False
    for arg in argv:
        if expect_value or arg.startswith("--config="):
            prefix, value = ("", arg) if expect_value else ("--config=", arg.split("=", 1)[1])
            if not Path(value).exists():
                try:
                    value = str(config_path(value))
                except KeyError as missing:
                    if re.fullmatch(r"[\w./-]+", value):  # a name or a path, not inline YAML
                        raise SystemExit(
                            f"comera: --config {value}: no such file here, and {missing.args[0]}"
                        ) from None
            arg = prefix + value
        expect_value = arg in ("--config", "-c")
        resolved.append(arg)
    return resolved


def _print_configs(names: list[str]) -> None:
    if names:  # comera configs NAME: the path alone, for --config $(comera configs NAME) in other CLIs
        for name in names:
            print(config_path(name))
        return
    for name, path in packaged_configs().items():
        print(f"{name:32} {path}")


#: configs made for GPUs, and the CPU config that trains the same kind of model in minutes
GPU_CONFIGS = {
    "llm_60m": "llm_cpu",
    "llm_130m": "llm_cpu",
    "mnli_6enc": "code_pairs",
    "mnli_6enc_dense": "code_pairs",
    "codebert_mlm": "quickstart",
    "dlrm_criteo": "dlrm_criteo --data.synthetic true",
}


def gpu_config_warning(config_paths: Any, cuda_available: bool) -> str | None:
    """The warning for a fit of a GPU config (:data:`GPU_CONFIGS`) on a machine without a GPU, else None."""
    if cuda_available:
        return None
    for path in config_paths or []:
        stem = Path(str(getattr(path, "relative", path))).stem
        if stem in GPU_CONFIGS:
            return (
                f"comera: configs/{stem}.yaml is made for GPUs (bf16, full-size model) and this machine has "
                f"none: on a CPU it runs for hours. For a CPU run use --config {GPU_CONFIGS[stem]}"
            )
    return None
