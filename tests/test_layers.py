"""The layer diagram of docs/DESIGN.md ("Layers") is the import graph: every import from
one of the project's packages into another is an arrow the diagram draws."""

from __future__ import annotations

import ast
import functools

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
    # under Bagua's names, and bagua_algos' list of Bagua's communication names (importing the
    # package `bagua` runs bagua_algos/__init__.py anyway: it is a subpackage)
    "bagua_algos.compat.bagua": {"bagua_algos", "bagua_algos.algorithms", "bagua_algos.runtime",
                                 "bagua_algos.launcher"},
    "bagua_algos.ddp_hooks": {"bagua_algos.algorithms", "bagua_algos.compression", "bagua_algos.runtime"},
    "bagua_algos.launch": {"bagua_algos.launcher"},
    # the launcher puts the package `bagua` on the workers' path, found by compat's finder
    "bagua_algos.launcher": {"bagua_algos.runtime", "bagua_algos.compat"},
    # the one-process engine: a backend of the runtime (the algorithms it runs are the caller's);
    # it imports the algorithms whose step it replaces with an equal-valued form of its own
    # (engine/forms.py), so that no algorithm asks which backend runs it; its gossip mix of
    # stacked rows takes cuda_ext's compiled sweep where that module is loaded
    "bagua_algos.engine": {"bagua_algos.runtime", "bagua_algos.arguments", "bagua_algos.algorithms", "cuda_ext"},
    # an algorithm named by its code, loaded with the compatibility package on the path
    "bagua_algos.algorithm_source": {"bagua_algos.runtime", "bagua_algos.compat"},
    "bagua_algos.algorithms": {"bagua_algos.runtime", "bagua_algos.compression", "bagua_algos.arguments"},
    "bagua_algos.runtime": {"bagua_algos.compression", "bagua_algos.arguments", "topologies"},
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


# --- circles between modules ---------------------------------------------------------
# The graph: a node per module (file) of the project's packages; an edge A -> B for each
# import in A of B, or of a name B defines (`from pkg import name` where name is not a
# submodule is an edge to pkg's __init__). Every import counts, at module level, inside a
# function, or under `if TYPE_CHECKING:`: a function-level import is still a dependency,
# only a later one, and a type-checking import one of the design (farm-studio reads the
# same). Importing a submodule runs its parents' __init__ too, but that is not an edge:
# every module of a package would then be in a circle with an __init__ that imports it.

# Circles being taken apart now, each a set of modules a circle may lie within. Empty this
# list as they land (test_the_allow_list_names_only_circles_that_exist says which is done).
CIRCLES_BEING_FIXED: dict = {}


@functools.lru_cache(maxsize=1)
def _module_graph():
    """{module: {modules it imports}} over PACKAGES (see above), and each edge's first line."""
    paths = {}
    for root in PACKAGES:
        for path in (REPO / root).rglob("*.py"):
            paths[".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")] = path
    graph, where = {module: set() for module in paths}, {}
    for module, path in paths.items():
        for line, imported in _imports(path, module):
            target = imported
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != module:
                graph[module].add(target)
                where.setdefault((module, target), f"{path.relative_to(REPO)}:{line}")
    return graph, where


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def connect(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _being_fixed(circle):
    """The allow-list's entry whose modules hold the whole circle, or None."""
    for reason, prefixes in CIRCLES_BEING_FIXED.items():
        if all(any(m == p or (p.endswith(".") and m.startswith(p)) for p in prefixes) for m in circle):
            return reason
    return None


def test_the_module_graph_sees_every_kind_of_import():
    graph, _ = _module_graph()
    assert "bagua_algos.runtime.bucket" in graph["bagua_algos.runtime.algorithm"]  # module level
    assert "bagua_algos.runtime.backend" in graph["bagua_algos.runtime.tensor"]  # inside a function
    assert "bagua_algos.experiments.reproduce.output" in graph["bagua_algos.experiments.lowcomm_frontier"]
    found = _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert found == [["a", "b", "c"]]


def test_no_import_circle_between_modules():
    graph, where = _module_graph()
    offenders = []
    for circle in _circles(graph):
        if _being_fixed(circle) is None:
            edges = [where[(a, b)] + f" {a} -> {b}" for a in circle for b in sorted(graph[a]) if b in circle]
            offenders.append(" <-> ".join(circle) + ":\n  " + "\n  ".join(edges))
    assert not offenders, "\n".join(offenders)


def test_the_allow_list_names_only_circles_that_exist():
    circles = _circles(_module_graph()[0])
    gone = [reason for reason in CIRCLES_BEING_FIXED if not any(_being_fixed(c) == reason for c in circles)]
    assert not gone, f"no circle is left of these: remove them from CIRCLES_BEING_FIXED: {gone}"


def test_the_library_never_reaches_the_experiments():
    """bagua_algos.experiments (and `bagua-algos`) sits behind the experiments extra: no
    module of the library imports it, directly or through others."""
    graph, where = _module_graph()
    for start in graph:
        if start.startswith("bagua_algos.experiments"):
            continue
        seen, todo, parent = {start}, [start], {}
        while todo:
            node = todo.pop()
            for nxt in graph[node]:
                if nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = node
                    todo.append(nxt)
        reached = sorted(m for m in seen if m.startswith("bagua_algos.experiments"))
        if reached:
            chain, node = [reached[0]], reached[0]
            while node != start:
                node = parent[node]
                chain.append(node)
            raise AssertionError(f"{start} reaches {reached[0]}: " + " -> ".join(reversed(chain)))


# --- runtime/'s private names stay inside runtime/ ------------------------------------
# A name of runtime/ that starts with one underscore is its own; what other layers use of
# it has a public, documented name (e.g. the backend's dispatch and register_backend, the
# bucket's before_ops / run_ops). Bagua's own API has underscored names, which stay.
BAGUAS_NAMES = {
    "_bagua_backend": "BaguaDistributedDataParallel's backend, which Bagua's algorithms call",
    "_get_default_group": "bagua.torch_api.communication's, which the compatibility package re-exports",
}
# (file, name) used for a while yet, with the reason.
PRIVATE_KEPT_FOR_NOW = {}


def _private_names(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _runtime_uses(path, module, runtime_private, own, methods):
    """(line, name) for each use in ``path`` of a private name of runtime/: imported from
    it, or an attribute the module's layer defines nowhere (``own``), and as ``self._x``
    or an overriding method (of ``methods``: a runtime class's private ones) only in a
    class built on a runtime class (another base's private names are its own)."""
    tree = ast.parse(path.read_text())
    from_runtime = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and _import_base(node, path, module).startswith("bagua_algos.runtime") for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and _import_base(node, path, module).startswith("bagua_algos.runtime"):
            for alias in node.names:
                if alias.name in runtime_private:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ClassDef):
            bases = [name for name in (_runtime_base(b, from_runtime) for b in node.bases) if name]
            on_runtime = bool(bases)
            for method in node.body:  # an override of a base's private method is a use of it
                if isinstance(method, ast.FunctionDef) and any(method.name in methods.get(b, ()) for b in bases):
                    yield method.lineno, method.name
            for inner in ast.walk(node):
                if (isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name)
                        and inner.value.id in ("self", "cls") and inner.attr in runtime_private and on_runtime
                        and inner.attr not in own):
                    yield inner.lineno, inner.attr
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in runtime_private and node.attr not in own
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            yield node.lineno, node.attr


def _runtime_base(base, from_runtime):
    """The class name of a base class taken from runtime/ (``Name`` imported from it, or
    ``module.Name`` of a runtime module imported), else None."""
    if isinstance(base, ast.Name) and base.id in from_runtime:
        return base.id
    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in from_runtime:
        return base.attr
    return None


def _import_base(node, path, module):
    """The module an ImportFrom node imports from, relative imports resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if not node.level:
        return node.module
    return ".".join(package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else []))


def test_no_module_outside_the_runtime_uses_its_private_names():
    runtime_private, methods = set(), {}  # methods: runtime class name -> its private methods
    for path in (REPO / "bagua_algos" / "runtime").rglob("*.py"):
        tree = ast.parse(path.read_text())
        runtime_private |= _private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods.setdefault(node.name, set()).update(
                    m.name for m in node.body if isinstance(m, ast.FunctionDef) and m.name in _private_names(m))
    runtime_private -= set(BAGUAS_NAMES)
    modules, layer_names = {}, {}
    for root in PACKAGES:
        for path in (REPO / root).rglob("*.py"):
            relative = path.relative_to(REPO)
            if relative.parts[:2] != ("bagua_algos", "runtime"):
                module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
                modules[module] = path
                layer_names.setdefault(_layer(module), set()).update(_private_names(ast.parse(path.read_text())))
    offenders = []
    for module, path in sorted(modules.items()):
        relative = path.relative_to(REPO)
        uses = _runtime_uses(path, module, runtime_private, layer_names[_layer(module)], methods)
        for line, name in sorted(set(uses)):
            if (str(relative), name) not in PRIVATE_KEPT_FOR_NOW:
                offenders.append(f"{relative}:{line} uses runtime's private {name}")
    assert not offenders, "\n".join(offenders)


def test_the_private_name_check_sees_each_kind_of_use(tmp_path):
    source = tmp_path / "user.py"
    source.write_text(
        "from bagua_algos.runtime import backend as backend_module\n"
        "from bagua_algos.runtime.backend import BaguaBackend, _backends\n"
        "class Mine(backend_module.BaguaBackend):\n"
        "    def _hand_over(self, k):\n"
        "        self._ready[k] = set()\n"
        "        self._mine = 1\n"
        "def f(bucket):\n"
        "    return bucket._numels, backend_module._backends_lock, bucket._mine\n")
    uses = sorted(set(_runtime_uses(source, "bagua_algos.engine.user", {"_backends", "_backends_lock", "_hand_over",
                                                                        "_ready", "_numels", "_mine"},
                                    {"_mine"}, {"BaguaBackend": {"_hand_over"}})))
    assert uses == [(2, "_backends"), (4, "_hand_over"), (5, "_ready"), (8, "_backends_lock"), (8, "_numels")]
