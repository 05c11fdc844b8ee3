from setuptools import find_packages, setup

# The importable top-level packages and all their subpackages (directories with an
# __init__.py), e.g. bagua_algos.compat and the compatibility package under it,
# bagua_algos.compat.bagua. benchmarks/ and tests/ are not installed.
PACKAGE_ROOTS = ["bagua_algos", "topologies", "samplers"]

setup(
    name="bagua-algos",
    version="0.1.0",
    description=(
        "Decentralized and compressed data-parallel training algorithms written to "
        "Bagua's programming model, on torch.distributed"
    ),
    python_requires=">=3.10",
    packages=find_packages(include=[p for root in PACKAGE_ROOTS for p in (root, root + ".*")]),
    install_requires=["torch>=2.4", "torchvision", "numpy", "tqdm", "matplotlib", "scikit-learn"],
    extras_require={"test": ["pytest", "hypothesis"]},
)
