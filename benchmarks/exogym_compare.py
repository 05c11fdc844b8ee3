"""EXO Gym against the one-process engine: ``bagua_algos.experiments.exogym_compare``, also ``bagua-algos exogym-compare``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments]'``):
``python benchmarks/exogym_compare.py --help``. EXO Gym itself is not installed with the
package: put a clone of exo-explore/gym on ``PYTHONPATH`` (the module's notes)."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/exogym_compare.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("exogym-compare"))
