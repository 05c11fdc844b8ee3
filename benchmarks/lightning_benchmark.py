"""The same LightningModule under ``strategy="ddp"`` and ``strategy="bagua"``: ``bagua_algos.experiments.lightning_benchmark``, also ``bagua-algos lightning-benchmark``.

A script for the repository's checkout, where the package is installed (``pip install -e .``,
with the ``lightning`` extra): ``python benchmarks/lightning_benchmark.py --help``. Lightning's
launcher re-runs this script for its other processes."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/lightning_benchmark.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("lightning-benchmark"))
