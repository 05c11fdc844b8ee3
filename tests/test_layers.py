"""The layer diagram of docs/DESIGN.md ("Layers") is the import graph: every import from
one of the project's packages into another is an arrow the diagram draws."""

from __future__ import annotations

import ast

from subprocesses import REPO

PACKAGES = ("bagua_algos", "topologies", "samplers", "cuda_ext")

# What each layer may import of the project (DESIGN.md's arrows). A layer is a
# subpackage of bagua_algos or a module directly in it, or a top-level package.
ALLOWED = {
    # the experiments and benchmarks (bagua-algos COMMAND): the top layer, which no other imports
    # (`import bagua_algos` itself: the package's patches of torch.nn.Module, with_bagua)
    "bagua_algos.experiments": {"bagua_algos", "bagua_algos.algorithm_source", "bagua_algos.algorithms",
                                "bagua_algos.compression", "bagua_algos.engine", "bagua_algos.launcher",
                                "bagua_algos.lightning", "bagua_algos.runtime", "topologies", "samplers",
                                "cuda_ext"},
    "bagua_algos": {"bagua_algos.algorithms", "bagua_algos.runtime"},
    "bagua_algos.lightning": {"bagua_algos.algorithms", "bagua_algos.runtime"},
    # the package `bagua` (Bagua's module paths): the runtime, the algorithms and the launcher
    # under Bagua's names
    "bagua_algos.compat.bagua": {"bagua_algos.algorithms", "bagua_algos.runtime", "bagua_algos.launcher"},
    "bagua_algos.ddp_hooks": {"bagua_algos.algorithms", "bagua_algos.compression", "bagua_algos.runtime"},
    "bagua_algos.launch": {"bagua_algos.launcher"},
    # the launcher puts the package `bagua` on the workers' path, found by compat's finder
    "bagua_algos.launcher": {"bagua_algos.runtime", "bagua_algos.compat"},
    # the one-process engine: a backend of the runtime (the algorithms it runs are the caller's)
    "bagua_algos.engine": {"bagua_algos.runtime", "bagua_algos.arguments"},
    # an algorithm named by its code, loaded with the compatibility package on the path
    "bagua_algos.algorithm_source": {"bagua_algos.runtime", "bagua_algos.compat"},
    "bagua_algos.algorithms": {"bagua_algos.runtime", "bagua_algos.compression", "bagua_algos.arguments"},
    # the gossip mix of stacked rows takes cuda_ext's compiled sweep where that module is loaded
    "bagua_algos.runtime": {"bagua_algos.compression", "bagua_algos.arguments", "topologies", "cuda_ext"},
    "bagua_algos.compression": {"bagua_algos.arguments", "cuda_ext"},
    "bagua_algos.arguments": set(),
    # compat's finder (where the package `bagua` is, whether a real Bagua is installed,
    # `python -m bagua_algos.compat`): the standard library only
    "bagua_algos.compat": set(),
    "topologies": set(),
    "samplers": set(),
    "cuda_ext": set(),
}


# A module's import the diagram does not draw, kept for a while, with the reason.
KEPT_FOR_NOW: dict = {}


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[:3] == ["bagua_algos", "compat", "bagua"]:
        return "bagua_algos.compat.bagua"  # the package `bagua`, a layer above compat's finder
    if parts[0] == "bagua_algos" and len(parts) > 1 and parts[1] != "__init__":
        return "bagua_algos." + parts[1]
    return parts[0]


def _imports(path, module: str):
    """(line, imported module) for each import of ``path`` (module ``module``), relative ones resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module.split(".") if not node.level else (
                package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else []))
            for alias in node.names:  # `from pkg import sub` may name a submodule
                yield node.lineno, ".".join(base + [alias.name])


def test_every_import_between_layers_is_an_arrow_of_the_diagram():
    offenders = []
    for root in PACKAGES:
        for path in (REPO / root).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            here = _layer(module)
            assert here in ALLOWED, f"{module}: a layer the diagram does not have ({here})"
            for line, imported in _imports(path, module):
                if imported.split(".")[0] not in PACKAGES:
                    continue
                there = _layer(imported)
                kept = (str(path.relative_to(REPO)), there) in KEPT_FOR_NOW
                if there != here and there not in ALLOWED[here] and not kept:
                    offenders.append(f"{path.relative_to(REPO)}:{line} imports {imported} ({here} -> {there})")
    assert not offenders, "\n".join(offenders)


def test_no_import_runs_upward():
    """The arrows form no cycle, so every layer sits above all it imports (the runtime
    imports neither the launcher nor compat: the launcher sits above both)."""
    assert "bagua_algos.compat" not in ALLOWED["bagua_algos.runtime"]
    assert "bagua_algos.launcher" not in ALLOWED["bagua_algos.runtime"]
    done, path = set(), []

    def visit(layer):
        if layer in path:
            raise AssertionError("the diagram has a cycle: " + " -> ".join(path[path.index(layer):] + [layer]))
        if layer in done:
            return
        path.append(layer)
        for below in sorted(ALLOWED[layer]):
            visit(below)
        path.pop()
        done.add(layer)

    for layer in sorted(ALLOWED):
        visit(layer)
