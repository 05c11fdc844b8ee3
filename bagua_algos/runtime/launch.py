"""Job launcher with the command line of ``bagua.distributed.launch``.

Usage (one invocation per node)::

    python -m bagua_algos.launch --nnodes 2 --node_rank 0 --nproc_per_node 4 \\
        --master_addr 10.0.0.1 --master_port 29500 train.py --lr 0.1

Bagua's launcher spawned and watched the worker processes itself.  This one
only parses Bagua's flags, translates them into a ``torch.distributed.run``
(torchrun) argument list and hands the job to torchrun's elastic agent, which
spawns the workers, sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/
``LOCAL_WORLD_SIZE``/``GROUP_RANK``/``MASTER_ADDR``/``MASTER_PORT`` for each of
them, and stops the whole local group as soon as one worker fails.

Flag translation (Bagua -> torchrun):

=============================  ==============================================
``--nnodes N``                 ``--nnodes N`` (fixed size, not elastic)
``--nproc_per_node P``         ``--nproc-per-node P``
``--node_rank R``              ``--node-rank R`` with ``--rdzv-backend static``
``--master_addr A``            ``--master-addr A``
``--master_port Q``            ``--master-port Q`` (rank-0 agent hosts the
                               rendezvous TCP store there; workers get
                               ``MASTER_ADDR=A``, ``MASTER_PORT=Q``)
``-m`` / ``--module``          ``-m``
``--no_python``                ``--no-python``
``--logdir D``                 ``--log-dir D --redirects 3`` (stdout and
                               stderr of each worker go to
                               ``D/<run>/attempt_<k>/<local_rank>/std{out,err}.log``)
``--set_additional_flag``      ``--local_rank=<local rank>`` is passed to the
                               script (torchrun's ``${local_rank}`` macro)
``--max_restarts K``           ``--max-restarts K`` (extension, default 0)
``--rdzv_timeout S``           ``--rdzv-conf timeout=S`` (extension: how long
                               an agent waits for the other nodes)
``--backend B``                ``BAGUA_ALGOS_BACKEND=B`` for the workers
                               (extension: auto, gloo or nccl; what
                               ``init_process_group()`` uses when the script
                               names no backend)
Bagua-only flags               accepted, ignored, one notice each on stderr
=============================  ==============================================

In addition the agent's environment gets ``NODE_RANK`` (inherited by every
worker), and ``MASTER_ADDR``/``MASTER_PORT``.

Bagua scripts: unless ``--no_bagua_compat`` is given, and only when no real Bagua
is importable, the directory of the compatibility package ``bagua``
(:func:`bagua_algos.compat.compat_path`) is put first on the workers'
``PYTHONPATH``, so that an unchanged script can ``import bagua.torch_api``.
An installed Bagua is never shadowed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from typing import List, Optional, Sequence

PROG = "bagua_algos.launch"

# torchrun substitutes this macro with each worker's local rank
# (torch.distributed.elastic.utils.macros.local_rank).
_LOCAL_RANK_MACRO = "${local_rank}"

# Flags of Bagua 0.9's launcher that configure Bagua's own services (autotune
# server, Bagua-Net, metrics, baguarun's host list).  They have no meaning here.
# name -> argparse keyword arguments (every default is None so that we can tell
# whether the flag was given).
BAGUA_ONLY_FLAGS = {
    "--bagua_service_port": dict(type=int),
    "--autotune_level": dict(type=int),
    "--autotune_log_file": dict(type=str),
    "--is_output_autotune_log": dict(action="store_true"),
    "--report_metrics": dict(action="store_true"),
    "--autotune_max_samples": dict(type=int),
    "--autotune_sampling_confidence_time": dict(type=float),
    "--autotune_warmup_time": dict(type=float),
    "--default_bucket_size": dict(type=int),
    "--enable_bagua_net": dict(action="store_true"),
    "--host_list": dict(type=str),
    "--ssh_port": dict(type=int),
}


def _dest(flag: str) -> str:
    return flag.lstrip("-")


def torchrun_spelling(flag: str) -> str:
    """``--nproc_per_node`` -> ``--nproc-per-node``: torchrun's spelling of a flag."""
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def _flag(container, *names: str, **kwargs) -> None:
    """``container.add_argument(*names, **kwargs)``, and for each name written with
    underscores (Bagua's spelling, the one --help shows and errors name) a twin in
    torchrun's spelling with the same destination, left out of the help. An error in
    a value given to the twin names the twin, the spelling the user typed."""
    action = container.add_argument(*names, **kwargs)
    twin_kwargs = {k: v for k, v in kwargs.items() if k not in ("help", "default", "dest")}
    for name in names:
        if name.startswith("--") and "_" in name:
            # default=SUPPRESS: the twin writes the destination only when it is given
            container.add_argument(torchrun_spelling(name), dest=action.dest, default=argparse.SUPPRESS,
                                   help=argparse.SUPPRESS, **twin_kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROG}",
        usage="%(prog)s [launcher flags] training_script [script args ...]",
        description=(
            "Launch a data-parallel job with bagua.distributed.launch's command "
            "line; the workers are run by torch.distributed.run's elastic agent. "
            "Every flag is also accepted in torchrun's spelling, with dashes "
            "(--nproc-per-node for --nproc_per_node)."
        ),
    )
    _flag(parser, "--nnodes", type=int, default=1,
          help="number of nodes (default 1)")
    _flag(parser, "--node_rank", type=int, default=0,
          help="rank of this node, in [0, nnodes) (default 0)")
    _flag(parser, "--nproc_per_node", type=int, default=1,
          help="worker processes on this node (default 1)")
    _flag(parser, "--master_addr", type=str, default="127.0.0.1",
          help="address of node 0 (default 127.0.0.1)")
    _flag(parser, "--master_port", type=int, default=29500,
          help="free port on node 0 (default 29500)")
    _flag(parser, "-m", "--module", action="store_true",
          help="run the training script as a module, like 'python -m'")
    _flag(parser, "--no_python", action="store_true",
          help="execute the training script directly, without 'python'")
    _flag(parser, "--logdir", type=str, default=None,
          help="directory for per-worker stdout/stderr files")
    _flag(parser, "--set_additional_flag", action="store_true",
          help="pass --local_rank=<local rank> to the training script")
    _flag(parser, "--max_restarts", type=int, default=0,
          help="restarts of the worker group before failing (default 0)")
    _flag(parser, "--rdzv_timeout", type=int, default=None,
          help="seconds an agent waits for the other nodes to join "
          "(torchrun's static rendezvous default: 600)")
    _flag(parser, "--backend", choices=("auto", "gloo", "nccl"), default=None,
          help="backend of the workers' init_process_group() when the script names none "
          "(sets BAGUA_ALGOS_BACKEND): nccl puts each worker on GPU LOCAL_RANK (CUDA tensors "
          "over NCCL, CPU tensors over gloo) and needs a GPU per worker; gloo runs on CPU "
          "(CUDA tensors staged through host memory); auto (the default) is nccl when CUDA "
          "is available, else gloo")
    _flag(parser, "--no_bagua_compat", action="store_true",
          help="do not put the compatibility package 'bagua' on the "
          "workers' PYTHONPATH (by default it is put there when no real "
          "Bagua is installed, so that 'import bagua.torch_api' works)")

    bagua = parser.add_argument_group(
        "Bagua-only flags (accepted for compatibility and ignored)")
    for flag, kwargs in BAGUA_ONLY_FLAGS.items():
        _flag(bagua, flag, dest=_dest(flag), default=None, help="ignored", **kwargs)

    parser.add_argument("training_script", type=str, nargs="?", default=None,
                        help="the training script (or module with -m, or program "
                        "with --no_python), followed by its arguments")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.training_script is None:
        parser.error("argument training_script: missing; give the script (or module "
                     "with -m) after the launcher's flags")
    if args.nnodes < 1:
        parser.error(f"argument --nnodes: must be >= 1, got {args.nnodes}")
    if args.nproc_per_node < 1:
        parser.error(
            f"argument --nproc_per_node: must be >= 1, got {args.nproc_per_node}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(
            f"argument --node_rank: must be in [0, {args.nnodes}) "
            f"(0 <= node_rank < nnodes), got {args.node_rank}")
    if not 1 <= args.master_port <= 65535:
        parser.error(
            f"argument --master_port: must be in [1, 65535], got {args.master_port}")
    if args.max_restarts < 0:
        parser.error(f"argument --max_restarts: must be >= 0, got {args.max_restarts}")
    if args.rdzv_timeout is not None and args.rdzv_timeout < 1:
        parser.error(f"argument --rdzv_timeout: must be >= 1, got {args.rdzv_timeout}")
    if args.module and args.no_python:
        parser.error("argument -m/--module: not allowed with argument --no_python")
    if args.logdir is not None and os.path.exists(args.logdir) \
            and not os.path.isdir(args.logdir):
        parser.error(f"argument --logdir: {args.logdir!r} exists and is not a directory")


def parse_args(argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None
               ) -> argparse.Namespace:
    """Parse and validate; exits with status 2 and a usage message on bad flags."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    return args


def check_before_start(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What every worker would fail on, checked once here before any starts (a usage
    error, exit status 2): the training script exists, and a job that puts its workers
    on GPUs (``--backend nccl``, or ``$BAGUA_ALGOS_BACKEND=nccl`` inherited) has a GPU
    for each worker of this node. Under ``auto`` the script may still choose gloo, so
    only the workers can tell."""
    script = args.training_script
    if args.no_python:
        if shutil.which(script) is None:
            parser.error(f"argument training_script: {script!r} is neither a program on PATH nor an "
                         "executable file (--no_python runs it directly)")
    elif not args.module and not os.path.isfile(script):
        parser.error(f"argument training_script: no file {script!r} (relative to {os.getcwd()}); "
                     "give the path of the script, or a module name with -m")
    from bagua_algos.runtime.comm import BACKEND_ENV
    from bagua_algos.runtime.gpus import gpu_shortage

    if args.backend is not None:
        backend, asked, where = args.backend, args.backend, "argument --backend: "
    else:
        backend, where = os.environ.get(BACKEND_ENV), ""
        asked = f"{BACKEND_ENV}={backend} (set in this environment)"
    if backend == "nccl":
        shortage = gpu_shortage(asked, args.nproc_per_node, "--nproc_per_node", "--backend gloo")
        if shortage:
            parser.error(where + shortage)


def ignored_flag_notices(args: argparse.Namespace) -> List[str]:
    """One notice line per Bagua-only flag that was given on the command line."""
    notices = []
    for flag, kwargs in BAGUA_ONLY_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is None:
            continue
        shown = flag if kwargs.get("action") == "store_true" else f"{flag}={value}"
        notices.append(f"{PROG}: ignoring Bagua-only flag {shown}")
    return notices


def torchrun_argv(args: argparse.Namespace) -> List[str]:
    """The ``torch.distributed.run`` command line equivalent to ``args``."""
    argv = [
        "--nnodes", str(args.nnodes),
        "--nproc-per-node", str(args.nproc_per_node),
        "--rdzv-backend", "static",
        "--node-rank", str(args.node_rank),
        "--master-addr", args.master_addr,
        "--master-port", str(args.master_port),
        "--max-restarts", str(args.max_restarts),
    ]
    if args.rdzv_timeout is not None:
        argv += ["--rdzv-conf", f"timeout={args.rdzv_timeout}"]
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no-python")
    if args.logdir is not None:
        # 3 = stdout and stderr of every local rank
        argv += ["--log-dir", args.logdir, "--redirects", "3"]
    argv.append(args.training_script)
    if args.set_additional_flag:
        argv.append(f"--local_rank={_LOCAL_RANK_MACRO}")
    argv += list(args.training_script_args)
    return argv


def bagua_compat_pythonpath(pythonpath: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """The workers' PYTHONPATH given the launcher's, and a notice line (or None).

    When no real Bagua is importable here, the compatibility directory
    (:func:`bagua_algos.compat.compat_path`) is put first (once: a PYTHONPATH that
    already starts with it is kept). When a real Bagua is installed, ``pythonpath`` is
    returned unchanged, with a notice saying where that Bagua is: it is never shadowed.
    """
    from bagua_algos import compat

    real = compat.find_real_bagua()
    if real is not None:
        where = os.path.dirname(real.origin) if real.submodule_search_locations else real.origin
        return pythonpath, (f"{PROG}: Bagua is installed ({where}); the workers import it, "
                            "not bagua_algos' compatibility package")
    path = compat.compat_path()
    if not pythonpath:
        return path, None
    first = pythonpath.split(os.pathsep)[0]
    if first and os.path.realpath(first) == os.path.realpath(path):
        return pythonpath, None
    return path + os.pathsep + pythonpath, None


def first_failure(failures) -> int:
    """The global rank whose failure started the job's end, from ChildFailedError.failures.

    torchrun's agent stops the other workers with SIGTERM as soon as it sees one fail
    (and with SIGKILL 30 s later if they ignore it), then records every worker that
    ended non-zero, each with the time in whole seconds at which it was recorded (or,
    for a worker with an error file, the time the error was written). So the stopped
    workers usually carry the same second as the worker that failed. The failure
    chosen is

    1. the earliest by timestamp;
    2. on a tie, one not ended by SIGTERM (the agent's own stop signal) over one
       that was;
    3. then a worker killed by another signal (SIGKILL from the OOM killer, SIGSEGV,
       SIGABRT: a cause) over one that exited with a code (often a consequence:
       a collective failing because a peer died);
    4. then the order in which the agent recorded them (the order of ``failures``).
    """
    if not failures:
        raise ValueError("no failures to choose from")
    sigterm = -int(signal.SIGTERM)
    position = {rank: index for index, rank in enumerate(failures)}

    def key(rank):
        f = failures[rank]
        return (f.timestamp, f.exitcode == sigterm, f.exitcode >= 0, position[rank])

    return min(failures, key=key)


def _how(f) -> str:
    return f"was killed by signal {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"


def _failure_summary(err) -> tuple[str, int]:
    """A one-line description of a ChildFailedError and the exit status to use."""
    failures = err.failures
    rank = first_failure(failures)
    f = failures[rank]
    status = 1 if f.exitcode < 0 else (f.exitcode if 0 < f.exitcode < 256 else 1)
    others = []
    for r in sorted(failures):
        if r != rank:
            code = failures[r].exitcode
            others.append(f"{r} ({failures[r].signal_name() if code < 0 else f'code {code}'})")
    tail = f"; other local ranks ended: {', '.join(others)}" if others else ""
    line = (f"{PROG}: job failed: worker rank {rank} (local_rank {f.local_rank}, "
            f"pid {f.pid}) {_how(f)}; the node's workers were stopped{tail}")
    return line, status


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = build_parser()
    args = parse_args(argv, parser)
    check_before_start(parser, args)
    for line in ignored_flag_notices(args):
        print(line, file=sys.stderr, flush=True)

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    targv = torchrun_argv(args)
    targs = torchrun.parse_args(targv)

    # Inherited by the workers (torchrun's agent copies its own environment
    # into theirs and adds RANK, LOCAL_RANK, ... on top).
    os.environ["NODE_RANK"] = str(args.node_rank)
    os.environ["MASTER_ADDR"] = args.master_addr
    os.environ["MASTER_PORT"] = str(args.master_port)
    if args.backend is not None:
        from bagua_algos.runtime.comm import BACKEND_ENV

        os.environ[BACKEND_ENV] = args.backend
    if not args.no_bagua_compat:
        pythonpath, notice = bagua_compat_pythonpath(os.environ.get("PYTHONPATH"))
        if notice:
            print(notice, file=sys.stderr, flush=True)
        if pythonpath is not None:
            os.environ["PYTHONPATH"] = pythonpath

    if args.logdir is not None:
        print(f"{PROG}: worker logs go to {os.path.abspath(args.logdir)}/"
              "<run>/attempt_<n>/<local_rank>/{stdout,stderr}.log",
              file=sys.stderr, flush=True)

    try:
        torchrun.run(targs)
    except ChildFailedError as err:
        line, status = _failure_summary(err)
        print(line, file=sys.stderr, flush=True)
        sys.exit(status)
    except SignalException as err:
        print(f"{PROG}: received {err.sigval.name}, workers stopped",
              file=sys.stderr, flush=True)
        sys.exit(128 + int(err.sigval))


if __name__ == "__main__":
    main()
