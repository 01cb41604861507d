"""README.md and docs/*.md as tested code: Python blocks run, shell commands parse, relative links resolve.

A page's ```python blocks run in order in one namespace, in a temporary folder; a block preceded by
``<!-- docs-test: skip (why) -->`` is left out and says why. In ```bash blocks, every ``comera`` command
(also after ``srun``/``torchrun``, or as ``python -m comera_lightning``) goes through the CLI's own parsing:
``--print_config`` for the LightningCLI subcommands, the export command's parser, ``comera configs`` as it is;
``python -m benchmarks.<module>`` must name a module that exists.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"^(?:<!-- docs-test: skip \((?P<why>[^)]+)\) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```$", re.M | re.S
)
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _blocks(page: Path, lang: str) -> list[tuple[str, str | None]]:
    """``(code, reason to skip or None)`` of each ``lang`` block of ``page``."""
    return [(m["body"], m["why"]) for m in FENCE.finditer(page.read_text()) if m["lang"] == lang]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


# --- Python blocks ------------------------------------------------------------------------------------------------
PYTHON_PAGES = [page for page in PAGES if _blocks(page, "python")]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=_name)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    namespace: dict[str, Any] = {"__name__": "__main__"}  # as `python block.py` runs it: main guards run too
    for number, (code, skip) in enumerate(_blocks(page, "python"), start=1):
        if skip is not None:
            continue
        try:
            exec(compile(code, f"{_name(page)} python block {number}", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{_name(page)}: python block {number} failed: {error!r}\n{code}") from error


def test_every_skipped_block_says_why():
    for page in PAGES:
        for marker in re.findall(r"<!-- docs-test:[^>]*-->", page.read_text()):
            assert re.fullmatch(r"<!-- docs-test: skip \([^)]+\) -->", marker), f"{_name(page)}: {marker}"


# --- shell commands -----------------------------------------------------------------------------------------------
def _commands(page: Path) -> list[list[str]]:
    """The commands of ``page``'s bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for code, skip in _blocks(page, "bash"):
        if skip is not None:
            continue
        for line in code.replace("\\\n", " ").splitlines():
            if line.startswith("#") or not line.strip():
                continue
            for part in re.split(r"\s&&\s", line):
                words = shlex.split(part, comments=True)
                if words:
                    commands.append(words)
    return commands


def _comera_args(words: list[str]) -> list[str] | None:
    """The arguments after ``comera`` (or ``python -m comera_lightning``) in ``words``, else None."""
    if words[:1] == ["python"] and (words[1:2] != ["-m"] or words[2:3] != ["comera_lightning"]):
        return None  # a script or a benchmark (python -m benchmarks...), whose arguments may name a family "comera"
    for i, word in enumerate(words):
        if word in ("comera", "comera)"):  # "comera", "srun ... comera", "torchrun ... $(which comera)"
            return words[i + 1 :]
        if words[i : i + 3] == ["python", "-m", "comera_lightning"]:
            return words[i + 3 :]
    return None


COMERA = [(page, args) for page in PAGES for words in _commands(page) if (args := _comera_args(words)) is not None]


class _Exported(Exception):
    """The export command's arguments parsed; nothing is written."""


@pytest.mark.parametrize(("page", "args"), COMERA, ids=[f"{_name(p)}: {' '.join(a)[:60]}" for p, a in COMERA])
def test_comera_commands_parse(page, args, monkeypatch, tmp_path):
    from comera_lightning import cli

    monkeypatch.chdir(ROOT)  # the commands name configs/... from a checkout
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    if args[:1] == ["export"]:

        def export(*_: Any, **__: Any) -> None:
            raise _Exported

        monkeypatch.setattr("comera_lightning.cli.export.export_checkpoint", export)
        with pytest.raises(_Exported):
            cli.main(args)
        return
    if args[:1] == ["configs"]:
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(args)
        return
    with contextlib.redirect_stdout(io.StringIO()) as out, pytest.raises(SystemExit) as done:
        cli.main([*args, "--print_config"])
    assert done.value.code in (0, None), f"{_name(page)}: comera {' '.join(args)}: exit {done.value.code}"
    assert "trainer:" in out.getvalue()


def test_benchmark_scripts_named_in_the_docs_exist():
    for page in PAGES:
        for words in _commands(page):
            assert not (words[:1] == ["python"] and words[1:2] and words[1].startswith("benchmarks/")), (
                f"{_name(page)}: {' '.join(words)}: the benchmarks run as python -m benchmarks.<module>"
            )
            if words[:2] == ["python", "-m"] and words[2:3] and words[2].startswith("benchmarks."):
                assert importlib.util.find_spec(words[2]) is not None, f"{_name(page)}: {' '.join(words)}"


# --- links --------------------------------------------------------------------------------------------------------
def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings (lower case, punctuation dropped, spaces as hyphens)."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#+\s+(.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve():
    for page in PAGES:
        for target in (m["target"] for m in LINK.finditer(FENCE.sub("", page.read_text()))):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{_name(page)}: the link {target} points at nothing"
            if fragment and linked.suffix == ".md":
                assert fragment in _anchors(linked), f"{_name(page)}: {target}: no heading #{fragment}"
