"""QAdam's variants trained side by side: ``bagua_algos.experiments.qadam_variants``, also ``bagua-algos qadam-variants``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments]'``):
``python benchmarks/qadam_variants.py --help``."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/qadam_variants.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("qadam-variants"))
