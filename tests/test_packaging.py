"""setup.py installs exactly the packages of this checkout, compat subpackages included."""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools


@pytest.fixture(scope="module")
def setup_py(repo_root):
    """(keyword arguments setup.py passes to setuptools.setup, setup.py's globals);
    nothing is built."""
    captured, namespace = {}, {"__name__": "__main__"}
    original, cwd = setuptools.setup, os.getcwd()
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        os.chdir(repo_root)  # find_packages() looks under the working directory
        source = (repo_root / "setup.py").read_text()
        exec(compile(source, str(repo_root / "setup.py"), "exec"), namespace)
    finally:
        setuptools.setup = original
        os.chdir(cwd)
    return captured, namespace


@pytest.fixture(scope="module")
def setup_kwargs(setup_py):
    return setup_py[0]


def package_dirs(repo_root, roots):
    """Dotted names of every directory under ``roots`` that holds Python code, and
    whether it has an ``__init__.py``."""
    found = {}
    for root in roots:
        for directory, subdirs, files in os.walk(repo_root / root):
            subdirs[:] = [d for d in subdirs if d != "__pycache__" and not d.startswith(".")]
            if any(f.endswith(".py") for f in files):
                name = ".".join(Path(directory).relative_to(repo_root).parts)
                found[name] = "__init__.py" in files
    return found


ROOTS = ["bagua_algos", "topologies", "samplers", "cuda_ext"]


def test_packages_are_every_package_directory(setup_kwargs, repo_root):
    dirs = package_dirs(repo_root, ROOTS)
    assert all(dirs.values()), f"code directories without __init__.py: {[d for d, ok in dirs.items() if not ok]}"
    assert sorted(setup_kwargs["packages"]) == sorted(dirs)
    assert {"bagua_algos.compat", "bagua_algos.compat.bagua"} <= set(setup_kwargs["packages"])
    assert not any(p.split(".")[0] in ("tests", "benchmarks") for p in setup_kwargs["packages"])


def test_include_patterns_name_existing_packages(setup_py, repo_root):
    namespace = setup_py[1]
    for root in namespace["PACKAGE_ROOTS"]:
        assert (repo_root / root / "__init__.py").is_file(), root
    assert sorted(namespace["PACKAGE_ROOTS"]) == sorted(ROOTS)


def test_non_python_files_in_packages_are_package_data(setup_kwargs, repo_root):
    package_data = setup_kwargs.get("package_data", {})
    missing = []
    for package in setup_kwargs["packages"]:
        directory = repo_root.joinpath(*package.split("."))
        patterns = package_data.get(package, []) + package_data.get("", [])
        for entry in directory.iterdir():
            if entry.is_file() and entry.suffix not in (".py", ".pyc"):
                if not any(fnmatch.fnmatch(entry.name, p) for p in patterns):
                    missing.append(str(entry.relative_to(repo_root)))
    assert not missing, f"not in package_data, so not installed: {missing}"


def test_wheel_contains_the_compat_package(repo_root, tmp_path):
    """Build a wheel offline from a copy of the sources (the checkout stays clean)."""
    pytest.importorskip("pip")
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(repo_root / name, source / name)
    for root in ROOTS:
        shutil.copytree(repo_root / root, source / root,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("bagua_algos/compat/__init__.py", "bagua_algos/compat/bagua/__init__.py",
                 "bagua_algos/launcher/launch.py", "topologies/trees.py", "samplers/dirichlet.py",
                 "cuda_ext/__init__.py", "cuda_ext/csrc/householder.h", "cuda_ext/csrc/orthogonalize_kernel.cu",
                 "cuda_ext/csrc/orthogonalize_cpu.cpp", "cuda_ext/csrc/orthogonalize_cuda.cpp",
                 "cuda_ext/csrc/bindings.cpp", "cuda_ext/csrc/orthogonalize.h", "cuda_ext/csrc/orthogonalize_kernel.h"):
        assert path in names, path


def test_tests_import_this_checkout(repo_root, tests_dir):
    """conftest.py puts the checkout ahead of any installed (e.g. editable) copy."""
    import bagua_algos
    import samplers
    import subprocesses
    import topologies

    for module in (bagua_algos, samplers, topologies):
        assert Path(module.__file__).resolve().is_relative_to(repo_root), module.__file__
    assert Path(subprocesses.__file__).resolve().parent == tests_dir


def test_lightning_is_imported_by_its_strategy_module_only(repo_root):
    """Lightning is an optional dependency (the ``lightning`` extra): of the installed
    packages only ``bagua_algos/lightning.py`` may import it, and the experiment that
    times it, which ``bagua-algos lightning-benchmark`` imports only when it runs."""
    import ast

    allowed = {repo_root / "bagua_algos" / "lightning.py", repo_root / "bagua_algos" / "experiments" / "lightning_benchmark.py"}
    offenders = []
    for package in ("bagua_algos", "topologies", "samplers", "cuda_ext"):
        for path in (repo_root / package).rglob("*.py"):
            if path in allowed:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                if any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names):
                    offenders.append(f"{path.relative_to(repo_root)}:{node.lineno}")
    assert not offenders, offenders


def test_the_console_command_is_the_experiments_cli(setup_kwargs):
    """`pip install` puts `bagua-algos` on the path: an entry point to an importable main."""
    import importlib

    (entry,) = [e for e in setup_kwargs["entry_points"]["console_scripts"] if e.split("=")[0].strip() == "bagua-algos"]
    module, function = entry.split("=")[1].strip().split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_the_library_needs_torch_and_numpy_and_each_extra_names_its_own(setup_kwargs):
    """`pip install bagua-algos` is the library (tests/test_light_import.py holds its imports
    to it); the experiments' dependencies are their extra's, and `test` installs every extra."""
    assert setup_kwargs["install_requires"] == ["torch>=2.4", "numpy"]
    extras = setup_kwargs["extras_require"]
    assert sorted(extras["experiments"]) == ["matplotlib", "mlxtend", "scikit-learn", "torchvision", "tqdm"]
    assert extras["ray"] == ["ray>=2.9"]
    assert {"pytest", "pytest-xdist", "hypothesis"} <= set(extras["test"])
    for extra in ("experiments", "lightning", "torchft", "ray"):
        assert set(extras[extra]) <= set(extras["test"]), extra


def test_the_readme_commands_install_their_extras_and_ci_runs_the_second(repo_root):
    """README's command 1 installs the experiments extra, command 2 the test extra; .ci/run's
    last line is command 2 to the letter."""
    readme = (repo_root / "README.md").read_text()
    block = readme[readme.index("## Two commands"):]
    block = block[block.index("```bash\n") + len("```bash\n"):block.index("```\n", block.index("```bash\n") + 8)]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert "pip install -e '.[experiments]' &&" in commands[0] and "benchmarks/heterogeneity_sweep.py" in commands[0]
    assert "pip install -e '.[test]' &&" in commands[1]
    ci = [line for line in (repo_root / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci[-1] == commands[1]


def test_bagua_s_communication_names_are_one_list_exported_twice(repo_root, monkeypatch):
    """bagua_algos and the compatibility package's bagua.torch_api export Bagua's
    communication names from one list, with the same values (get_rank and get_world_size
    the replica's slot under torchft in both)."""
    import importlib
    import sys

    import bagua_algos
    from bagua_algos.compat import compat_path, real_bagua_installed
    from bagua_algos.runtime.comm import fault_tolerance

    if real_bagua_installed():
        pytest.skip("a real Bagua is installed here")
    monkeypatch.setattr(sys, "path", [compat_path(), *sys.path])
    before = {m for m in sys.modules if m == "bagua" or m.startswith("bagua.")}
    try:
        torch_api = importlib.import_module("bagua.torch_api")
        assert Path(torch_api.__file__).resolve().is_relative_to(repo_root)
        names = bagua_algos.BAGUA_COMMUNICATION_NAMES
        assert len(set(names)) == len(names) > 20
        for name in names:
            assert getattr(torch_api, name) is getattr(bagua_algos, name), name
        assert bagua_algos.get_rank is torch_api.get_rank is fault_tolerance.job_rank
        assert bagua_algos.get_world_size is torch_api.get_world_size is fault_tolerance.job_world_size
        assert callable(bagua_algos.neighbor_exchange) and not hasattr(torch_api, "neighbor_exchange")
    finally:
        for module in [m for m in sys.modules if (m == "bagua" or m.startswith("bagua.")) and m not in before]:
            del sys.modules[module]
