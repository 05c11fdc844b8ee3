"""The plugin's one-peer gossip against Decent-DP's, over loopback and emulated links: ``bagua_algos.experiments.decentdp_compare``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments]'``):
``python benchmarks/decentdp_compare.py --help``."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/decentdp_compare.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("decentdp-compare"))
