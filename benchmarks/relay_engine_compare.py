"""Relay on the one-process engine, this checkout against other trees, measured in one run:
``bagua_algos.experiments.relay_engine_compare``, also ``bagua-algos relay-engine-compare``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments]'``):
``python benchmarks/relay_engine_compare.py --tree a5e8a79=/tmp/relay_a5e8a79`` (after
``git worktree add /tmp/relay_a5e8a79 a5e8a79``)."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/relay_engine_compare.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("relay-engine-compare"))
