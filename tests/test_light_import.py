"""`pip install bagua-algos` is the library alone: torch and numpy. The experiments'
dependencies (setup.py's `experiments` extra) are imported by bagua_algos.experiments only,
so every library module imports, and imports none of them, where they are not installed;
and `bagua-algos COMMAND` without them says in one line which extra to install."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import json
import re

import pytest
from subprocesses import REPO, run_python

# the import names of setup.py's EXPERIMENTS_REQUIRES
EXPERIMENTS = ("matplotlib", "sklearn", "mlxtend", "torchvision", "tqdm")
LIBRARY_ROOTS = ("bagua_algos", "topologies", "samplers", "cuda_ext")

# Run in a fresh interpreter, the experiments' dependencies made absent as they are where
# they are not installed: an import of one fails (a finder refuses it and notes who asked),
# importlib.util.find_spec answers None, and importlib.metadata finds no distribution (what
# Lightning's checks read). Then every module named on the command line is imported. One
# JSON line out.
CHILD = r"""
import importlib, importlib.metadata, importlib.util, json, os, sys

FORBIDDEN = set(sys.argv[1].split(","))
DISTRIBUTIONS = {"sklearn": "scikit-learn"}
HIDDEN = {DISTRIBUTIONS.get(name, name).lower().replace("_", "-") for name in FORBIDDEN}
IMPORTLIB = os.path.dirname(importlib.__file__)
asked = []


def asker():
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith("<")
                                 or frame.f_code.co_filename.startswith(IMPORTLIB)):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else "?"


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            asked.append([name, asker()])
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def find_spec(name, package=None, _real=importlib.util.find_spec):
    try:
        return _real(name, package)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in FORBIDDEN:
            return None
        raise


def from_name(cls, name, _real=importlib.metadata.Distribution.from_name.__func__):
    if name.lower().replace("_", "-") in HIDDEN:
        raise importlib.metadata.PackageNotFoundError(name)
    return _real(cls, name)


if sys.argv[2] == "absent":
    sys.meta_path.insert(0, Absent())
    importlib.util.find_spec = find_spec
    importlib.metadata.Distribution.from_name = classmethod(from_name)
failed = {}
for module in sys.argv[3:]:
    try:
        importlib.import_module(module)
    except Exception as err:
        failed[module] = f"{type(err).__name__}: {err}"
print(json.dumps({"failed": failed, "asked": asked, "loaded": sorted(m for m in sys.modules
                                                                      if m.split(".")[0] in FORBIDDEN)}))
"""

# What the library's own dependencies import by themselves where the experiments' are
# installed (torch.hub imports tqdm when it can; Lightning imports torchvision and
# matplotlib): measured in the same way, so only what the library adds is counted.
THIRD_PARTY = ("torch", "numpy", "lightning", "torchft", "triton")


def library_modules():
    """Every module of the library: bagua_algos less bagua_algos.experiments, and the
    top-level packages beside it; a ``__main__`` runs a command, so it is not imported.
    bagua_algos.lightning, the lightning extra's module, has a test of its own."""
    modules = []
    for root in LIBRARY_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            if module.startswith("bagua_algos.experiments") or module.endswith("__main__"):
                continue
            if module != "bagua_algos.lightning":
                modules.append(module)
    return modules


def requirements(distribution):
    """The import names of what ``distribution`` requires itself (no extra), as far as EXPERIMENTS names them."""
    names = set()
    for line in importlib.metadata.requires(distribution) or []:
        if "extra ==" not in line:
            name = re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower().replace("_", "-")
            names.add({"scikit-learn": "sklearn"}.get(name, name))
    return names & set(EXPERIMENTS)


def _run(mode, modules, absent=EXPERIMENTS):
    code, out, err = run_python(["-c", CHILD, ",".join(absent), mode, *modules], timeout=300)
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _asked_by_the_project(result):
    return [(name, path) for name, path in result["asked"] if path.startswith(str(REPO)) and "/.venv/" not in path]


def test_the_module_list_is_the_whole_library():
    modules = library_modules()
    assert {"bagua_algos", "bagua_algos.runtime.ddp", "bagua_algos.engine.runtime", "bagua_algos.compat.bagua",
            "topologies", "samplers.dirichlet", "cuda_ext"} <= set(modules)
    assert not any(m.startswith("bagua_algos.experiments") for m in modules)


def test_every_library_module_imports_without_the_experiments_dependencies():
    """With them absent, every library module imports, and none of the project's files so
    much as tries to import one of them (a try/except around it would hide it)."""
    result = _run("absent", library_modules())
    assert result["failed"] == {}
    assert _asked_by_the_project(result) == []
    assert result["loaded"] == []


def test_the_lightning_strategy_imports_without_the_experiments_dependencies():
    """The same for bagua_algos.lightning, less what Lightning itself requires (tqdm)."""
    pytest.importorskip("lightning")
    absent = tuple(sorted(set(EXPERIMENTS) - requirements("lightning")))
    assert "matplotlib" in absent and "torchvision" in absent
    result = _run("absent", ["bagua_algos.lightning"], absent)
    assert result["failed"] == {}
    assert _asked_by_the_project(result) == []
    assert result["loaded"] == []


def test_importing_the_library_loads_none_of_the_experiments_dependencies():
    """Where they are installed, importing every library module adds none of them to
    sys.modules beyond what its third-party dependencies bring by themselves."""
    present = [m for m in EXPERIMENTS if importlib.util.find_spec(m) is not None]
    if not present:
        pytest.skip("none of the experiments' dependencies is installed")
    baseline = _run("present", [m for m in THIRD_PARTY if importlib.util.find_spec(m) is not None])
    assert baseline["failed"] == {}
    lightning = ["bagua_algos.lightning"] if importlib.util.find_spec("lightning") is not None else []
    after = _run("present", [m for m in THIRD_PARTY if importlib.util.find_spec(m) is not None]
                 + library_modules() + lightning)
    assert after["failed"] == {}
    assert sorted(set(after["loaded"]) - set(baseline["loaded"])) == []


@pytest.mark.parametrize("command", ["sweep", "reproduce", "codec-benchmark"])
def test_a_command_without_the_experiments_extra_says_which_to_install(monkeypatch, capsys, command):
    """`bagua-algos COMMAND` checks the extra before it starts: one line, exit 2."""
    from bagua_algos.experiments import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "sklearn" else real(name, *a, **k))
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--help"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"bagua-algos {command}: needs sklearn, which is not installed "
                                       "(pip install 'bagua-algos[experiments]')\n")


def test_a_dependency_missing_inside_a_command_is_one_line(monkeypatch, capsys):
    """A command that finds an extra's module missing only as it runs stops with the same line."""
    from bagua_algos.experiments import cli

    def fails(argv):
        raise ModuleNotFoundError("No module named 'matplotlib.pyplot'", name="matplotlib.pyplot")

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: type("M", (), {"main": staticmethod(fails)})
                        if name == cli.COMMANDS["sweep"][0] else real(name, *a))
    with pytest.raises(SystemExit) as stop:
        cli.main(["sweep"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("bagua-algos sweep: needs matplotlib, which is not installed "
                                       "(pip install 'bagua-algos[experiments]')\n")



def test_every_checkout_script_is_its_command_and_refuses_a_missing_extra_in_one_line(monkeypatch, capsys):
    """benchmarks/X.py runs `bagua-algos X` (the same check of the extra first): the
    README's command 1 without the extra says what to install, not a traceback."""
    import pathlib
    import re
    import runpy

    from bagua_algos.experiments import cli

    scripts = sorted((pathlib.Path(__file__).parents[1] / "benchmarks").glob("*.py"))
    named = {s.name: re.search(r'run_command\("([^"]+)"\)', s.read_text()) for s in scripts}
    assert all(named.values()), [n for n, m in named.items() if not m]
    assert sorted(m.group(1) for m in named.values()) == sorted(cli.COMMANDS)  # one script a command
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "sklearn" else real(name, *a, **k))
    monkeypatch.setattr(sys, "argv", ["heterogeneity_sweep.py", "--help"])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(scripts[0].parent / "heterogeneity_sweep.py"), run_name="__main__")
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("bagua-algos sweep: needs sklearn, which is not installed "
                                       "(pip install 'bagua-algos[experiments]')\n")
