"""No function of the library or the harness is longer than 100 lines.

A function's length is ``end_lineno - lineno + 1`` of its ``def`` node (from the
``def`` line to its last line, docstring included, decorators not), for every
function and method, nested ones included, in every ``.py`` file under the library
(``bagua_algos/``, with the harness ``bagua_algos/experiments/``) and the packages
beside it (``topologies/``, ``samplers/``, ``cuda_ext/``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("bagua_algos", "topologies", "samplers", "cuda_ext")
LIMIT = 100


def long_functions(path: Path, limit: int = LIMIT) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function in ``path`` longer than ``limit`` lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append((node.name, node.lineno, length))
    return sorted(found, key=lambda f: f[1])


def sources() -> list[Path]:
    files = []
    for tree in TREES:
        files.extend(sorted((ROOT / tree).rglob("*.py")))
    return files


def test_the_trees_are_read():
    files = sources()
    assert (ROOT / "bagua_algos" / "__init__.py") in files
    assert any(p.is_relative_to(ROOT / "bagua_algos" / "experiments") for p in files)
    assert len(files) > 50


def test_no_function_is_longer_than_100_lines():
    over = [f"{path.relative_to(ROOT)}:{line} {name}: {length} lines"
            for path in sources() for name, line, length in long_functions(path)]
    assert not over, f"functions over {LIMIT} lines (split each into named parts):\n" + "\n".join(over)


def _function_of(lines: int, name: str = "planted", indent: str = "") -> str:
    """Source of a function of exactly ``lines`` lines (its ``def`` line included)."""
    body = [f"{indent}    x{i} = {i}" for i in range(lines - 2)] + [f"{indent}    return 0"]
    return "\n".join([f"{indent}def {name}():"] + body) + "\n"


def test_the_measurement_sees_a_planted_101_line_function(tmp_path):
    path = tmp_path / "planted.py"
    path.write_text(_function_of(100, "fits") + "\n\n" + _function_of(101, "too_long") + "\n\n"
                    + "class Holder:\n" + _function_of(101, "method", indent="    ") + "\n\n"
                    + "def outer():\n" + _function_of(101, "nested", indent="    ") + "    return nested\n",
                    encoding="utf-8")
    found = {name: length for name, _, length in long_functions(path)}
    # "outer" holds its 101-line "nested" and two lines of its own
    assert found == {"too_long": 101, "method": 101, "nested": 101, "outer": 103}
