"""``bagua-algos``: the experiments as one command with subcommands, as ``torchrun`` and
Lightning's CLI are: ``bagua-algos COMMAND [ARGS]``, each command with its own
``--help``. Installed with the package (``[project.scripts]``-style entry point in
setup.py), also ``python -m bagua_algos.experiments``.

Each command is a module's ``main(argv)``: the same code as the repository's script
``benchmarks/X.py``, with the same flags, outputs and messages.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

__all__ = ["COMMANDS", "build_parser", "main", "run_command"]

# command -> (module whose main(argv) runs it, one line of help)
COMMANDS = {
    "sweep": ("bagua_algos.experiments.sweep.cli",
              "the heterogeneity sweep: every algorithm x topology x Dirichlet alpha on N local workers"),
    "reproduce": ("bagua_algos.experiments.reproduce", "the seeds' tables and figures, one command each ('list')"),
    "synthetic-benchmark": ("bagua_algos.experiments.synthetic_benchmark",
                            "images/s of each algorithm against a baseline on synthetic data"),
    "network-sweep": ("bagua_algos.experiments.network_sweep",
                      "the synthetic benchmark over emulated networks at several rates (root, Linux)"),
    "engine-benchmark": ("bagua_algos.experiments.engine_benchmark",
                         "the one-process engine's speed: stacking, its hooks' share of a step, "
                         "the sweep against processes"),
    "bagua-synthetic": ("bagua_algos.experiments.bagua_synthetic", "Bagua's synthetic benchmark, flag for flag"),
    "netem": ("bagua_algos.experiments.netem", "run a job over an emulated network (root, Linux)"),
    "powersgd-benchmark": ("bagua_algos.experiments.powersgd_benchmark",
                           "PowerSGD's step and memory against torch's powerSGD_hook"),
    "orthogonalization-benchmark": ("bagua_algos.experiments.orthogonalization_benchmark",
                                    "the orthogonalization methods' times"),
    "codec-benchmark": ("bagua_algos.experiments.codec_benchmark", "the min-max codec's encode and decode speeds"),
    "pace": ("bagua_algos.experiments.pace", "each hot path's time against its baseline"),
    "qadam-variants": ("bagua_algos.experiments.qadam_variants", "QAdam's variants trained side by side"),
    "exchange-order-benchmark": ("bagua_algos.experiments.exchange_order_benchmark",
                                 "neighbour exchanges posted in several orders against an allreduce"),
    "lightning-benchmark": ("bagua_algos.experiments.lightning_benchmark",
                            "one LightningModule under strategy='ddp' and 'bagua' (the lightning extra)"),
    "elastic-faults": ("bagua_algos.experiments.elastic_faults",
                       "workers SIGKILLed under --max_restarts, resumed from a checkpoint (needs a checkout)"),
    "exogym-compare": ("bagua_algos.experiments.exogym_compare",
                       "EXO Gym against the one-process engine: step time, memory, accuracy (needs exogym)"),
    "relay-engine-compare": ("bagua_algos.experiments.relay_engine_compare",
                             "relay's step on the engine, this checkout against other trees (git worktrees), one run"),
    "soak": ("bagua_algos.experiments.soak",
             "a fault-tolerance soak: replicas killed and hung under --torchft, committed steps and stalls"),
    "decentdp-compare": ("bagua_algos.experiments.decentdp_compare",
                         "the plugin's one-peer gossip against Decent-DP's, step time over gloo (needs decent-dp)"),
}

# The import names of the `experiments` extra (setup.py's EXPERIMENTS_REQUIRES): what the
# commands load their datasets and models with, draw their figures with and show progress with.
# Every command is an experiment, so each is refused before it starts when one is missing (a
# figure is drawn after hours of training).
EXPERIMENTS_MODULES = ("torchvision", "matplotlib", "sklearn", "mlxtend", "tqdm")

# an optional dependency a command imports -> the extra that installs it
EXTRAS = {"lightning": "lightning", "ray": "ray", **dict.fromkeys(EXPERIMENTS_MODULES, "experiments")}


def _missing_extra(parser, name, module):
    parser.exit(2, f"bagua-algos {name}: needs {module}, which is not installed "
                   f"(pip install 'bagua-algos[{EXTRAS[module]}]')\n")


def build_parser() -> argparse.ArgumentParser:
    """The top level's parser: ``--help`` lists the commands (each parses its own flags)."""
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="bagua-algos", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Bagua-style data-parallel training algorithms: the experiments and benchmarks.",
        epilog=f"commands:\n{listing}\n\n'bagua-algos COMMAND --help' lists a command's flags.")
    parser.add_argument("command", metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    parser.add_argument("args", nargs="*", metavar="ARGS", help="the command's flags and arguments")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        parser.error(f"argument COMMAND: invalid choice: {name!r} (choose from {', '.join(COMMANDS)})")
    return run_command(name, rest, parser)


def run_command(name: str, argv=None, parser=None) -> int:
    """Command ``name``'s ``main(argv)`` (``argv`` None: this process's arguments), or
    one line naming the extra to install, exit 2, when a dependency it needs is missing;
    what ``bagua-algos NAME`` and the checkout's ``benchmarks/*.py`` scripts both run."""
    parser = parser or build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    for dependency in EXPERIMENTS_MODULES:
        if importlib.util.find_spec(dependency) is None:
            _missing_extra(parser, name, dependency)
    try:
        code = importlib.import_module(COMMANDS[name][0]).main(argv)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in EXTRAS:
            raise
        _missing_extra(parser, name, err.name.split(".")[0])
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    raise SystemExit(main())
