"""What the README and docs/ show a reader works: every Python block of the README runs
as printed, every path they name can be opened from the repository's root, and every
function, class or module of the packages they name in code exists.

A README block that joins a job (``init_process_group()``) runs under the plugin's
launcher on two CPU workers, as the README says to start it; any other block runs as a
script. Each run is a subprocess in its own session with a hard timeout.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import re

import pytest
import torch
import torch.distributed

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
    "tasks/cifar.py": "epfml/relaysgd's task, whose weight decay the protocol 'relaysum' follows",
    "paper-code/train.py": "epfml/powersgd's training script, which the protocol 'powersgd' follows",
    "exogym/strategy/diloco.py": "EXO Gym's DiLoCo (exo-explore/gym), which exogym_compare's matched DiLoCo follows",
    "exogym/train_node.py": "EXO Gym's node (exo-explore/gym), whose batches exogym_compare's engine reads",
    "torchft/checkpointing/http_transport.py": "torchft 0.2.0's healing transport, which unpickles (not used)",
    "torchft/checkpointing/pg_transport.py": "torchft 0.2.0's process-group transport, which unpickles (not used)",
    "torchft/manager.py": "torchft 0.2.0's manager, whose server binds every interface",
    "tasks/models/vgg.py": "epfml/relaysgd's VGG-11, which the sweep's vgg11 follows",
    "tasks/models/resnet20.py": "epfml/relaysgd's ResNet-20, which the sweep's resnet20 follows",
    "paper-code/tasks/cifar_architectures/resnet.py": "epfml/powersgd's ResNet-18, which the sweep's resnet18 is",
}


def named_paths(text: str):
    """(line, path) for every repository path ``text`` names: in inline code, a link
    target or a fenced block, a word with a directory in it that starts at a top-level
    entry of the repository or ends in a file extension (so `images/s` is not a path, nor
    `.venv/bin/python`, which the install makes), and not under a git-ignored top-level
    entry (`results/x.json`: output)."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        chunks = [line] if fenced else _INLINE_CODE.findall(line) + _LINK.findall(line)
        for chunk in chunks:
            for word in re.split(r"[\s,;()\[\]'\"]+", chunk):
                word = word.rstrip(".:")
                if _ignored(word.split("/")[0]):
                    continue  # an output a command writes (results/x.json), not the repository's
                if _PATH.match(word) and (word.split("/")[0] in TOP_LEVEL or _EXTENSION.search(word) or word.endswith("/")):
                    found.append((number, word))
    return found


def test_named_paths_are_found_and_judged():
    text = ("see `bagua_algos/compression/orthogonalization.py` and `compression/orthogonalization.py`, "
            "[a](docs/results.md), `images/s`, `.venv/bin/python`, https://x.org/a/b.py, `results/x.json`\n"
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


# ------------------------------------------------------------------- named code

# The code the docs name lives in these packages.
PACKAGES = ("bagua_algos", "cuda_ext", "topologies", "samplers")
# Module names that are also everyday words in the docs (`tensor.grad`, `data.x`,
# `engine.md`): a dotted name starting with one of them is judged only when written
# from its package down (`bagua_algos.engine.runtime`). The compatibility package
# `bagua` is Bagua's API, which the docs also describe where this project has no
# counterpart, so its names are not judged here either.
GENERIC = {"tensor", "data", "env", "run", "table", "handle", "base", "utils", "counter", "functional",
           "stacked", "engine", "runtime", "algorithms", "compression", "distributed", "bagua", "torch_api",
           "contrib", "checks", "fuse", "groups", "rounds", "signs", "trees", "direct", "backend", "optimizer",
           "registry", "lifecycle", "communication", "collectives", "arguments", "algorithm", "topology",
           "launch", "checkpoint", "bucket", "gossip", "staging", "neighbors", "helper_thread", "agent_watch",
           "lightning", "compat", "dirichlet", "heterogeneous", "hierarchical", "model_averaging", "diloco"}
_FILE_SUFFIXES = {"py", "md", "txt", "toml", "json", "jsonl", "csv", "png", "sh", "cpp", "cu", "h", "cfg", "yaml", "yml",
                  "log", "so", "pt", "pth"}


class _Module:
    """What a module defines at its top level (functions, classes, assignments, imported
    names) and what each of its classes defines (methods, class attributes), read from
    its source without importing it."""

    def __init__(self, path):
        tree = ast.parse(path.read_text())
        self.names, self.members = set(), {}
        for node in tree.body:
            for name in _defined(node):
                self.names.add(name)
            if isinstance(node, ast.ClassDef):
                members = set()
                for item in node.body:
                    members.update(_defined(item))
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        # self.x = ... in __init__: an instance attribute
                        for sub in ast.walk(item):
                            if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                                    and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                                members.add(sub.attr)
                self.members[node.name] = members


def _defined(node):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    if isinstance(node, (ast.If, ast.Try)):  # definitions under `if TYPE_CHECKING:` / try-import
        blocks = [node.body, node.orelse] + ([h.body for h in node.handlers] + [node.finalbody]
                                             if isinstance(node, ast.Try) else [])
        return [name for block in blocks for item in block for name in _defined(item)]
    return []


def _modules():
    """dotted module path -> _Module, for every module of PACKAGES (a package is its
    ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = _Module(path)
    return found


MODULES = _modules()
def _everything_defined():
    """Every name the packages' code defines anywhere: a function or class (nested ones
    too), a parameter, a variable, or an attribute it assigns (``optimizer.fuse_step = ...``)."""
    names = set()
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return names


DEFINED = _everything_defined()
# the last part of a module's path -> its full paths (`ops` -> bagua_algos.runtime.ops)
SHORT = {}
for _path in MODULES:
    SHORT.setdefault(_path.rsplit(".", 1)[-1], []).append(_path)
# a class of the packages -> the members each class of that name defines
CLASSES = {}
for _module in MODULES.values():
    for _name, _members in _module.members.items():
        CLASSES.setdefault(_name, []).append(_members)

_DOTTED = re.compile(r"(?<![\w./\-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/\-])")
# a span that is one call: `rank_seed(seed, rank)`, `zero_grad()`
_CALL_SPAN = re.compile(r"^([A-Za-z_]\w*)\(.*\)$")


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` names a module of the packages, or a name (and a class's
    member) that one of them defines: modules are matched from the longest prefix."""
    parts = dotted.split(".")
    if parts[0] in CLASSES:  # Class.member
        return any(parts[1] in members for members in CLASSES[parts[0]])
    if parts[0] in PACKAGES:
        starts = [""]
    else:
        starts = [path[: -len(parts[0])] for path in SHORT.get(parts[0], [])]
    for start in starts:
        for cut in range(len(parts), 0, -1):
            module = start + ".".join(parts[:cut])
            if module not in MODULES:
                continue
            rest = parts[cut:]
            if not rest:
                return True
            info = MODULES[module]
            if rest[0] not in info.names:
                break
            if len(rest) == 1 or rest[0] not in info.members or rest[1] in info.members[rest[0]]:
                return True
            break
    return False


def named_code(text: str):
    """(line, name) for every name of the code that ``text`` gives in inline code
    spans: a dotted name whose first part is one of PACKAGES, a module of them (not a
    GENERIC word, not a file name such as ``ops.py``) or a class of them
    (``StackedModel.predict``), and the function of a span that
    is one call (``rank_seed(seed, rank)``)."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for span in _INLINE_CODE.findall(line):
            for dotted in _DOTTED.findall(span):
                first, last = dotted.split(".")[0], dotted.rsplit(".", 1)[-1]
                if last in _FILE_SUFFIXES or first in GENERIC:
                    continue
                if first in PACKAGES or first in SHORT or first in CLASSES:
                    found.append((number, dotted))
            call = _CALL_SPAN.match(span)
            if call:
                found.append((number, call.group(1) + "()"))
    return found


def _exists(name: str) -> bool:
    """A dotted name must resolve in the packages; a called name must be defined by
    them, by Python, or by the torch classes a training script calls methods of."""
    if name.endswith("()"):
        name = name[:-2]
        return name in DEFINED or hasattr(builtins, name) or any(
            hasattr(owner, name) for owner in (torch, torch.Tensor, torch.nn.Module, torch.optim.Optimizer,
                                               torch.distributed, torch.distributed.ProcessGroup))
    return _resolves(name)


def test_named_code_is_found_and_judged():
    text = ("`ops.compressed_scatter_gather` and `ops.reduce_encoded_chunks`, `rank_seed(seed, rank)`, "
            "`bagua_algos.launcher.flags.FLAGS`, `flags.Flag.argparse_kwargs`, "
            "`flags.Flag.no_such_method`, `ops.py`, `tensor.grad`, `torch.linalg.qr`, "
            "`no_such_function()`, `zero_grad(set_to_none=True)`, `a 2 node(s) line`, "
            "`StackedModel.predict`, `StackedModel.no_such_member`\n```python\nops.not_judged_in_a_block\n```\n")
    named = [name for _, name in named_code(text)]
    assert named == ["ops.compressed_scatter_gather", "ops.reduce_encoded_chunks", "rank_seed()",
                     "bagua_algos.launcher.flags.FLAGS", "flags.Flag.argparse_kwargs",
                     "flags.Flag.no_such_method", "no_such_function()", "zero_grad()",
                     "StackedModel.predict", "StackedModel.no_such_member"]
    assert [name for name in named if not _exists(name)] == [
        "ops.reduce_encoded_chunks", "flags.Flag.no_such_method", "no_such_function()",
        "StackedModel.no_such_member"]


# Named on purpose though not in the packages, with the reason.
NOT_HERE = {
    "BaguaCommunicator.abort": "Bagua's NCCL communicator abort, which docs/bagua_api.md lists as not covered",
    "DistributedSampler": "torch.utils.data's, which a script builds right after init (docs/elastic.md)",
    "_streaming_load": "torchft 0.2.0's HTTP transport's loader, which unpickles (docs/elastic.md)",
}


def test_every_function_and_class_the_docs_name_exists():
    missing = []
    for doc in DOCS:
        for line, name in named_code(doc.read_text()):
            if name.removesuffix("()") not in NOT_HERE and not _exists(name):
                missing.append(f"{doc.relative_to(REPO)}:{line}: {name}")
    assert not missing, "code names that the packages do not define:\n" + "\n".join(missing)
