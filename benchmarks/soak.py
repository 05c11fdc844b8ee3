"""The fault-tolerance soak: ``bagua_algos.experiments.soak``, also ``bagua-algos soak``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments,torchft]'``):
``python benchmarks/soak.py --help``."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/soak.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("soak"))
