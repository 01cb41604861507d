"""A small generated tree of documented .py files (CodePairsDataModule's tests and the data modules' test/predict
tests): what extraction should find in it."""

from __future__ import annotations

from pathlib import Path

SHARED_DOC = "Scale the value by the box factor."  # the same docstring in every file (a method)


def _doc(i: int, j: int) -> str:
    return f"Compute result {j} of module {i} from the given value."


def _body(i: int, j: int) -> str:
    return f"def func_{i}_{j}(value):\n    return value * {j} + {i} - {i * j + 7}"


def _method_body(i: int) -> str:
    return f"def method(self, value):\n    return value * self.factor + {i}"


def write_tree(root: Path, n_files: int = 10, n_funcs: int = 4) -> dict[tuple[str, str], tuple[str, str]]:
    """A tree of documented functions; returns {(path, qualified name): (docstring, body)} of the usable ones."""
    expected: dict[tuple[str, str], tuple[str, str]] = {}
    for i in range(n_files):
        rel = f"pkg{i % 2}/mod{i}.py"
        parts = [f'"""Module {i}."""\n\nimport os\n']
        for j in range(n_funcs):
            head, ret = _body(i, j).split("\n")
            parts.append(f'\n@staticmethod\n{head}\n    """{_doc(i, j)}"""\n\n{ret}\n')
            expected[(rel, f"func_{i}_{j}")] = (_doc(i, j), _body(i, j))
        head, ret = _method_body(i).split("\n")
        parts.append(f'\nclass Box{i}:\n    {head}\n        """{SHARED_DOC}"""\n    {ret}\n')
        expected[(rel, f"Box{i}.method")] = (SHARED_DOC, _method_body(i))
        inner = f"def inner(x):\n    return x + value + {i}"
        parts.append(
            f'\ndef wrapper_{i}(value):\n    """Wrap the value in a closure for module {i}."""\n'
            f'    def inner(x):\n        """Add module offset {i} to x."""\n        return x + value + {i}\n'
            "    return inner\n"
        )
        expected[(rel, f"wrapper_{i}")] = (
            f"Wrap the value in a closure for module {i}.",
            f'def wrapper_{i}(value):\n    def inner(x):\n        """Add module offset {i} to x."""\n'
            f"        return x + value + {i}\n    return inner",
        )
        expected[(rel, f"wrapper_{i}.<locals>.inner")] = (f"Add module offset {i} to x.", inner)
        parts.append("\ndef undocumented(x):\n    return x + 1 + 2\n")
        parts.append('\ndef tiny(x):\n    """Does nothing at all, really."""\n    pass\n')
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(parts))
    (root / "pkg0" / "broken.py").write_text('def f(:\n    """Never parsed by anyone."""\n    return 1 + 2 + 3\n')
    (root / "notes.txt").write_text("not python")
    return expected


def small_source_tree(root: Path, n_files: int = 8, n_funcs: int = 25) -> Path:
    """A corpus of a few small undocumented .py files, far smaller than the standard library (tokenizers train on
    it in well under a second)."""
    for i in range(n_files):
        body = "\n".join(f"def func_{i}_{j}(value):\n    return value * {j} + {i}\n" for j in range(n_funcs))
        path = root / f"pkg{i % 2}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""Module {i}."""\n\n{body}')
    return root
