"""The min-max codec's encode and decode speeds: ``bagua_algos.experiments.codec_benchmark``, also ``bagua-algos codec-benchmark``.

A script for the repository's checkout, where the package is installed (``pip install -e '.[experiments]'``):
``python benchmarks/codec_benchmark.py --help``."""

try:
    from bagua_algos.experiments.cli import run_command
except ModuleNotFoundError as err:
    if err.name != "bagua_algos":
        raise
    raise SystemExit("benchmarks/codec_benchmark.py: the bagua_algos package is not importable; install the "
                     "repository first (pip install -e '.[experiments]' from its root)") from None

if __name__ == "__main__":
    raise SystemExit(run_command("codec-benchmark"))
