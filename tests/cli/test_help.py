"""The command line as a newcomer meets it: complete help, a version, and short errors that say what to do."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from comera_lightning.cli import main


def _fails(capsys, *argv: str) -> str:
    """The stderr of a ``comera`` command line that must exit with status 2."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    return capsys.readouterr().err


def test_help_lists_every_subcommand_with_whole_sentences(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,configs,export}" in out
    listed = {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines() if line.startswith("    ")}
    for name in ("fit", "validate", "test", "predict", "configs", "export"):
        assert listed.get(name), f"{name} is not listed in:\n{out}"
    help_text = " ".join(out.split())
    assert "make sure you never run on your" not in help_text  # Lightning's docstring cut mid-sentence
    assert "Score a checkpoint on the test set" in help_text


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"comera {version('comera_lightning')}")


def test_a_typo_is_one_line_naming_the_closest_option(capsys):
    err = _fails(capsys, "fit", "--config", "quickstart", "--trainer.max_stesp", "20")
    assert len(err.strip().splitlines()) == 1, err
    assert "--trainer.max_stesp" in err and "did you mean --trainer.max_steps?" in err


def test_abbreviations_are_refused(capsys):
    err = _fails(capsys, "fit", "--config", "quickstart", "--trainer.max_step", "20", "--print_config")
    assert len(err.strip().splitlines()) == 1, err
    assert "did you mean --trainer.max_steps?" in err


def test_an_option_without_a_close_match_points_at_the_help(capsys):
    err = _fails(capsys, "validate", "--config", "quickstart", "--qqqqqqqq", "1")
    assert len(err.strip().splitlines()) == 1, err
    assert "--qqqqqqqq" in err and "comera validate --help" in err


def test_fit_without_a_config_suggests_the_quickstart(capsys):
    err = _fails(capsys, "fit")
    assert "fit.data, fit.model" in err
    assert "--config quickstart" in err


@pytest.mark.slow
def test_the_installed_command_prints_its_help():
    done = subprocess.run(
        [sys.executable, "-m", "comera_lightning", "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: comera ") and "configs" in done.stdout
