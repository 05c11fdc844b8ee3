"""Neighbour exchanges posted in several orders: ``bagua_algos.experiments.exchange_order_benchmark``, also ``bagua-algos exchange-order-benchmark``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments]'``):
``python benchmarks/exchange_order_benchmark.py --help``."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/exchange_order_benchmark.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("exchange-order-benchmark"))
