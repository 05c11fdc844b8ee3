from setuptools import find_packages, setup

setup(
    name="bagua-algos",
    version="0.1.0",
    description=(
        "Decentralized and compressed data-parallel training algorithms written to "
        "Bagua's programming model, on torch.distributed"
    ),
    python_requires=">=3.10",
    packages=find_packages(include=["bagua_algos*", "topologies*", "samplers*", "cuda_ext*"]),
    install_requires=["torch>=2.4", "torchvision", "numpy", "tqdm", "matplotlib", "scikit-learn"],
    extras_require={"test": ["pytest", "hypothesis"]},
)
