"""What the README and docs/ show a reader works: every Python block of the README runs
as printed, and every path they name can be opened from the repository's root.

A README block that joins a job (``init_process_group()``) runs under the plugin's
launcher on two CPU workers, as the README says to start it; any other block runs as a
script. Each run is a subprocess in its own session with a hard timeout.
"""

from __future__ import annotations

import fnmatch
import re

import pytest

from subprocesses import REPO, free_port, run_python

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def python_blocks(text: str) -> list[str]:
    """The fenced ```python blocks of a Markdown text, in order."""
    return [body for lang, body in _FENCE.findall(text) if lang == "python"]


README_BLOCKS = python_blocks((REPO / "README.md").read_text())


def test_the_readme_has_its_python_blocks():
    assert len(README_BLOCKS) >= 2  # `Use` and Lightning; a new one is run by the test below
    assert "init_process_group()" in README_BLOCKS[0]


@pytest.mark.parametrize("index", range(len(README_BLOCKS)))
def test_readme_python_block_runs_as_printed(index, tmp_path):
    block = README_BLOCKS[index]
    if "import lightning" in block:
        pytest.importorskip("lightning")
    script = tmp_path / "train.py"
    script.write_text(block)
    if "init_process_group()" in block:
        argv = ["-m", "bagua_algos.launch", "--nproc_per_node", 2, "--master_port", free_port(), script]
    else:
        argv = [script]
    code, out, err = run_python(argv, timeout=300)
    assert code == 0, f"README block {index} failed:\n{block}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]


# ------------------------------------------------------------------- named paths

def _ignored(name: str) -> bool:
    """Whether .gitignore ignores the top-level entry ``name`` (an output such as
    ``results/``, which the README's first command writes: not part of the repository)."""
    patterns = [line.strip().strip("/") for line in (REPO / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)


# The repository's own top-level entries, whatever a previous command wrote beside them.
TOP_LEVEL = {path.name for path in REPO.iterdir() if not path.name.startswith(".") and not _ignored(path.name)}
# A path with a directory in it, as the docs write one: `code` or a link target.
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)+/?$")
_EXTENSION = re.compile(r"\.(?:py|md|txt|toml|json|csv|png|sh|cpp|cu|h|cfg|yaml|yml)$")
# Named on purpose though not in this repository, with the reason.
OUTSIDE = {
    "shared/DESIGN.md": "the design the project started from, kept outside the repository",
    "bagua/torch_api/": "Bagua 0.9.2's own package, which docs/bagua_api.md goes through",
    "examples/elastic_training/main.py": "Bagua's elastic example (BaguaSys/bagua), retold in "
                                         "tests/launch_workers/bagua_elastic_mnist.py",
}


def named_paths(text: str):
    """(line, path) for every repository path ``text`` names: in inline code, a link
    target or a fenced block, a word with a directory in it that starts at a top-level
    entry of the repository or ends in a file extension (so `images/s` is not a path, nor
    `.venv/bin/python`, which the install makes)."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        chunks = [line] if fenced else _INLINE_CODE.findall(line) + _LINK.findall(line)
        for chunk in chunks:
            for word in re.split(r"[\s,;()\[\]'\"]+", chunk):
                word = word.rstrip(".:")
                if _PATH.match(word) and (word.split("/")[0] in TOP_LEVEL or _EXTENSION.search(word) or word.endswith("/")):
                    found.append((number, word))
    return found


def test_named_paths_are_found_and_judged():
    text = ("see `bagua_algos/compression/orthogonalization.py` and `compression/orthogonalization.py`, "
            "[a](docs/results.md), `images/s`, `.venv/bin/python`, https://x.org/a/b.py\n"
            "```bash\npython benchmarks/netem.py --nodes 2\n```\n")
    assert [path for _, path in named_paths(text)] == [
        "bagua_algos/compression/orthogonalization.py", "compression/orthogonalization.py", "docs/results.md",
        "benchmarks/netem.py"]


def test_every_path_the_readme_and_docs_name_exists():
    missing = []
    for doc in DOCS:
        for line, path in named_paths(doc.read_text()):
            if path in OUTSIDE or (REPO / path).exists() or (doc.parent / path).exists():
                continue
            missing.append(f"{doc.relative_to(REPO)}:{line}: {path}")
    assert not missing, "paths that cannot be opened from the repository's root:\n" + "\n".join(missing)
