import os

from setuptools import find_packages, setup

# The importable top-level packages and all their subpackages (directories with an
# __init__.py), e.g. bagua_algos.compat and the compatibility package under it,
# bagua_algos.compat.bagua. benchmarks/ and tests/ are not installed.
PACKAGE_ROOTS = ["bagua_algos", "topologies", "samplers", "cuda_ext"]

# cuda_ext compiles its C++/CUDA sources on first use, so they are installed with it.
PACKAGE_DATA = {"cuda_ext": ["csrc/*.h", "csrc/*.cpp", "csrc/*.cu"]}


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
    install_requires=["torch>=2.4", "torchvision", "numpy", "tqdm", "matplotlib", "scikit-learn", "mlxtend"],
    # lightning: bagua_algos.lightning (strategy="bagua"); the tests run it too. pytest-xdist:
    # the README's test command runs a pytest process per core.
    # one command with subcommands (bagua-algos sweep, reproduce, ...; docs/cli.md)
    entry_points={"console_scripts": ["bagua-algos = bagua_algos.experiments.cli:main"]},
    # torchft: fault tolerance at the step (--torchft; docs/elastic.md). It resolves from the
    # local index offline (pip download torchft==0.2.0 --no-deps), so the tests get it too.
    extras_require={"lightning": ["lightning>=2.1"], "torchft": ["torchft==0.2.0"],
                    "test": ["pytest", "pytest-xdist", "hypothesis", "lightning>=2.1", "torchft==0.2.0"]},
    **compiled_extensions(),
)
