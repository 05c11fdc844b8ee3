"""The orthogonalization methods' times: ``bagua_algos.experiments.orthogonalization_benchmark``, also ``bagua-algos orthogonalization-benchmark``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments]'``):
``python benchmarks/orthogonalization_benchmark.py --help``."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/orthogonalization_benchmark.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("orthogonalization-benchmark"))
