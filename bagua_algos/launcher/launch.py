"""Job launchers with the command lines of ``bagua.distributed.launch`` and
``bagua.distributed.run``.

Usage (one invocation per node)::

    python -m bagua_algos.launch --nnodes 2 --node_rank 0 --nproc_per_node 4 \\
        --master_addr 10.0.0.1 --master_port 29500 train.py --lr 0.1
    python -m bagua.distributed.run --nnodes 1:4 --nproc_per_node 4 \\
        --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29400 --rdzv_id job7 train.py

Bagua's launchers spawned and watched the worker processes themselves (0.9's
``run`` was torch's elastic launcher with Bagua's service flags added). These only
parse the flags, check them, translate them into a ``torch.distributed.run``
(torchrun) argument list and hand the job to torchrun's elastic agent, which does the
rendezvous, spawns the workers, sets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/
``LOCAL_WORLD_SIZE``/``GROUP_RANK``/``MASTER_ADDR``/``MASTER_PORT`` for each of them,
stops the node's workers as soon as one fails, and restarts them (``--max_restarts``)
or re-forms the group when a node leaves or joins (``--nnodes MIN:MAX`` with c10d).

Both entry points take one set of flags; they differ only in the defaults that their
Bagua namesakes had (``ENTRY_DEFAULTS``): ``bagua_algos.launch`` and
``bagua.distributed.launch`` start one worker and never restart; Bagua 0.9's
``bagua.distributed.run`` started ``auto`` workers (a GPU each, else a CPU core
each), restarted up to 3 times and looked at its workers every 5 s.

The flags are data (:data:`bagua_algos.launcher.flags.FLAGS`): each row gives
a flag's names, value type, default, help and where it goes on torchrun's command line,
and :func:`torchrun_argv` translates by those rows alone. Every flag is also accepted in
torchrun's spelling (``--nproc-per-node``). Bagua's service flags (autotune, Bagua-Net,
metrics, host lists) are accepted with one warning naming those ignored.

``--backend B`` sets ``BAGUA_ALGOS_BACKEND=B`` for the workers (auto, gloo or nccl:
what ``init_process_group()`` uses when the script names no backend).

With the static rendezvous the agent's environment also gets ``NODE_RANK`` (inherited
by every worker), and ``MASTER_ADDR``/``MASTER_PORT``. With c10d the launcher sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless it is set already): torch's agent then
publishes the workers' master address afresh at every rendezvous, where otherwise an
agent kept the one of its first round and a node joining a running job waited for it
until the store's timeout (pytorch/pytorch#147064; ``rendezvous_failure``).

A rendezvous that fails (the endpoint unreachable, too few nodes within the join
timeout, a closed rendezvous, a store wait that timed out) ends the launcher with one
line naming the flag that configures it (``rendezvous_failure``), exit status 1.

When a job fails, one line on stderr names the worker that failed first and how, and
the launcher exits with its status (:mod:`bagua_algos.launcher.report`).

Bagua scripts: unless ``--no_bagua_compat`` is given, and only when no real Bagua
is importable, the directory of the compatibility package ``bagua``
(:func:`bagua_algos.compat.compat_path`) is put first on the workers' ``PYTHONPATH``,
so that an unchanged script can ``import bagua.torch_api``.
An installed Bagua is never shadowed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import List, Optional, Sequence

from bagua_algos.launcher.flags import (BAGUA_ONLY_FLAGS, CONF, ENTRY_DEFAULTS, FLAGS, LOGS, PROG,
                                        RDZV_CONF_KEYS, RDZV_TIMEOUT_KEY, RENDEZVOUS, RUN_PROG, SAME,
                                        SCRIPT, SHARE_STORE_ENV, STATIC, _dest, nnodes_text, rdzv_conf,
                                        rendezvous_backend, split_endpoint, torchrun_spelling)
# the failure report (first_failure and _failure_summary are also read through this module)
from bagua_algos.launcher.report import failure_summary, first_failure, rendezvous_failure  # noqa: F401
from bagua_algos.launcher.binding import bind_rendezvous, loopback_environment
from bagua_algos.runtime.bucket import BUCKET_SIZE_ENV

_failure_summary = failure_summary

# torchrun substitutes this macro with each worker's local rank
# (torch.distributed.elastic.utils.macros.local_rank).
_LOCAL_RANK_MACRO = "${local_rank}"


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


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The parser of entry point ``prog``, one argument per row of ``FLAGS`` with the
    entry point's own defaults (``ENTRY_DEFAULTS``)."""
    if prog not in ENTRY_DEFAULTS:
        raise ValueError(f"prog must be one of {sorted(ENTRY_DEFAULTS)}, got {prog!r}")
    defaults = ENTRY_DEFAULTS[prog]
    parser = argparse.ArgumentParser(
        prog=f"python -m {prog}",
        usage="%(prog)s [launcher flags] training_script [script args ...]",
        description=(
            "Launch a data-parallel job with the command line of Bagua's launchers "
            "(bagua.distributed.launch and bagua.distributed.run); the workers are run "
            "by torch.distributed.run's elastic agent. Every flag is also accepted in "
            "torchrun's spelling, with dashes (--nproc-per-node for --nproc_per_node)."
        ),
    )
    groups = {None: parser}
    for flag in FLAGS:
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        _flag(groups[flag.group], *flag.names, **flag.argparse_kwargs(defaults))
    parser.add_argument("training_script", type=str, nargs="?", default=None,
                        help="the training script (or module with -m, or program "
                        "with --no_python), followed by its arguments")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks that involve more than one flag, or the backend's rules."""
    if args.training_script is None:
        parser.error("argument training_script: missing; give the script (or module "
                     "with -m) after the launcher's flags")
    low, high = args.nnodes
    spec = nnodes_text(args.nnodes)
    if args.standalone and high != 1:
        parser.error(f"argument --standalone: runs one node, but --nnodes is {spec}; for more nodes give "
                     "--rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id JOB")
    backend = "c10d" if args.standalone else args.rdzv_backend
    if backend == "static":
        if low != high:
            parser.error(f"argument --nnodes: a range ({spec}) needs --rdzv_backend c10d; the static "
                         "rendezvous has a fixed number of nodes")
        if not 0 <= args.node_rank < high:
            parser.error(
                f"argument --node_rank: must be in [0, {high}) "
                f"(0 <= node_rank < nnodes), got {args.node_rank}")
        if not 1 <= args.master_port <= 65535:
            parser.error(
                f"argument --master_port: must be in [1, 65535], got {args.master_port}")
        if args.rdzv_endpoint and split_endpoint(args.rdzv_endpoint)[1] is None:
            parser.error(f"argument --rdzv_endpoint: the static rendezvous needs a port: "
                         f"{args.rdzv_endpoint}:PORT (or --master_addr and --master_port)")
    elif not args.standalone and high > 1 and not args.rdzv_endpoint:
        parser.error("argument --rdzv_endpoint: required with --rdzv_backend c10d on more than one node: "
                     "HOST:PORT of the agent that hosts the rendezvous store, the same on every node")
    if not args.standalone:
        keys = RDZV_CONF_KEYS[backend]
        for key, value in args.rdzv_conf.items():
            if key not in keys:
                hint = (f"; with c10d, {RDZV_TIMEOUT_KEY['c10d']} is the join timeout" if key == "timeout"
                        else "; --node_rank sets it" if key == "rank" else "")
                parser.error(f"argument --rdzv_conf: {key!r} is not read by the {backend} rendezvous "
                             f"(its keys: {', '.join(keys)}){hint}")
            wanted = keys[key](value)
            if wanted:
                parser.error(f"argument --rdzv_conf: {key} must be {wanted}, got {value!r}")
        if args.rdzv_timeout is not None and RDZV_TIMEOUT_KEY[backend] in args.rdzv_conf:
            parser.error(f"argument --rdzv_timeout: --rdzv_conf gives {RDZV_TIMEOUT_KEY[backend]} already")
    if args.max_restarts < 0:
        parser.error(f"argument --max_restarts: must be >= 0, got {args.max_restarts}")
    if args.rdzv_timeout is not None and args.rdzv_timeout < 1:
        parser.error(f"argument --rdzv_timeout: must be >= 1, got {args.rdzv_timeout}")
    if args.default_bucket_size is not None and args.default_bucket_size < 1:
        parser.error(f"argument --default_bucket_size: must be a positive number of bytes, got "
                     f"{args.default_bucket_size}")
    if args.module and args.no_python:
        parser.error("argument -m/--module: not allowed with argument --no_python")
    if args.run_path and (args.module or args.no_python):
        parser.error("argument --run_path: runs a Python file in the worker's interpreter; not allowed "
                     "with " + ("-m/--module" if args.module else "--no_python"))
    if args.logdir is not None and args.log_dir is not None:
        parser.error("argument --logdir: not allowed with argument --log_dir (--logdir D is --log_dir D "
                     "--redirects 3)")
    for flag, path in (("--logdir", args.logdir), ("--log_dir", args.log_dir)):
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            parser.error(f"argument {flag}: {path!r} exists and is not a directory")
    _check_torchft(parser, args)


def _check_torchft(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--torchft``'s flags: a quorum needs at least one replica and can never hold more
    than the job launches (nnodes x nproc_per_node; a larger minimum waits forever), and a
    job on several nodes must share one lighthouse (each launcher would otherwise start
    its own, and every node would train alone)."""
    if not args.torchft:
        return
    high = args.nnodes[1]
    if high > 1 and not args.lighthouse:
        parser.error(f"argument --lighthouse: --torchft on {high} nodes needs one lighthouse for all of them: "
                     "start one (torchft_lighthouse --min_replicas N --bind HOST:PORT, on a private network) "
                     "and pass its address, --lighthouse http://HOST:PORT, on every node")
    replicas = high * args.nproc_per_node if isinstance(args.nproc_per_node, int) else None
    if args.min_replicas < 1 or (replicas is not None and args.min_replicas > replicas):
        valid = f"[1, {replicas}] (nnodes x nproc_per_node = {high} x {args.nproc_per_node})" if replicas \
            else ">= 1"
        parser.error(f"argument --min_replicas: must be in {valid}, got {args.min_replicas}")


def parse_args(argv: Optional[Sequence[str]] = None, parser: Optional[argparse.ArgumentParser] = None
               ) -> argparse.Namespace:
    """Parse and validate; exits with status 2 and a usage message on bad flags."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    return args


def local_world_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--nproc_per_node as a number: auto/cpu/gpu by torchrun's own rule
    (``torch.distributed.run.determine_local_world_size``), so that this launcher and
    the agent count alike."""
    if not isinstance(args.nproc_per_node, str):
        return args.nproc_per_node
    from torch.distributed.run import determine_local_world_size

    try:
        count = determine_local_world_size(args.nproc_per_node)
    except ValueError as error:
        parser.error(f"argument --nproc_per_node: {args.nproc_per_node}: {error}")
    if count < 1:
        parser.error(f"argument --nproc_per_node: {args.nproc_per_node} finds no device here")
    return count


def check_before_start(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What every worker would fail on, checked once here before any starts (a usage
    error, exit status 2): the training script exists, and a job that puts its workers
    on GPUs (``--backend nccl``, or ``$BAGUA_ALGOS_BACKEND=nccl`` inherited) has a GPU
    for each worker of this node. Under ``auto`` the script may still choose gloo, so
    only the workers can tell. ``--nproc_per_node`` becomes a number here."""
    script = args.training_script
    if args.no_python:
        if shutil.which(script) is None:
            parser.error(f"argument training_script: {script!r} is neither a program on PATH nor an "
                         "executable file (--no_python runs it directly)")
    elif not args.module and not os.path.isfile(script):
        parser.error(f"argument training_script: no file {script!r} (relative to {os.getcwd()}); "
                     "give the path of the script, or a module name with -m")
    args.nproc_per_node = local_world_size(parser, args)
    _check_torchft(parser, args)  # again, now that --nproc_per_node is a number
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


def ignored_flags_warning(args: argparse.Namespace, prog: str = PROG) -> Optional[str]:
    """One warning line naming every Bagua service flag that was given, or None."""
    given = []
    for flag, kwargs in BAGUA_ONLY_FLAGS.items():
        value = getattr(args, _dest(flag))
        if value is None or value is False:
            continue
        given.append(flag if kwargs.get("action") == "store_true" else f"{flag}={value}")
    if not given:
        return None
    return (f"{prog}: warning: ignoring {', '.join(given)}: Bagua's autotune service, Bagua-Net, "
            "metrics and host lists are not part of bagua-algos")



def torchrun_argv(args: argparse.Namespace) -> List[str]:
    """The ``torch.distributed.run`` command line equivalent to ``args`` (after
    :func:`check_before_start`, which makes ``--nproc_per_node`` a number): each flag
    goes where its row of ``FLAGS`` says."""
    static = rendezvous_backend(args) == "static"
    argv: List[str] = []
    script_flags: List[str] = []
    for flag in FLAGS:
        value = getattr(args, flag.dest)
        where = flag.torchrun
        if where in (SAME, RENDEZVOUS, STATIC):
            if value is None or value is False or (where == RENDEZVOUS and args.standalone) \
                    or (where == STATIC and not static):
                continue
            argv.append(torchrun_spelling(flag.name))
            if not flag.switch:
                argv.append(flag.text(value))
        elif where == CONF and flag.dest == "rdzv_conf":
            conf = rdzv_conf(args)  # --rdzv_timeout joins --rdzv_conf's pairs here
            if conf:
                argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())]
        elif where == LOGS and flag.dest == "redirects":
            if args.logdir is not None:
                # 3 = stdout and stderr of every local rank
                argv += ["--log-dir", args.logdir, "--redirects", "3"]
            else:
                if args.log_dir is not None:
                    argv += ["--log-dir", args.log_dir]
                argv += ["--redirects", args.redirects]
        elif where == SCRIPT and value:
            # --set_additional_flag: torchrun's macro, each worker's local rank
            script_flags.append(f"--local_rank={_LOCAL_RANK_MACRO}")
    return argv + [args.training_script] + script_flags + list(args.training_script_args)


def bagua_compat_pythonpath(pythonpath: Optional[str], prog: str = PROG) -> tuple[Optional[str], Optional[str]]:
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
        return pythonpath, (f"{prog}: Bagua is installed ({where}); the workers import it, "
                            "not bagua_algos' compatibility package")
    path = compat.compat_path()
    if not pythonpath:
        return path, None
    first = pythonpath.split(os.pathsep)[0]
    if first and os.path.realpath(first) == os.path.realpath(path):
        return pythonpath, None
    return path + os.pathsep + pythonpath, None



def set_worker_environment(args: argparse.Namespace, prog: str = PROG) -> None:
    """What the workers inherit from this process (torchrun's agent copies its own
    environment into theirs and adds RANK, LOCAL_RANK, ... on top)."""
    if rendezvous_backend(args) == "static":
        os.environ["NODE_RANK"] = str(args.node_rank)
        os.environ["MASTER_ADDR"] = args.master_addr
        os.environ["MASTER_PORT"] = str(args.master_port)
    else:
        # c10d numbers the nodes at each rendezvous (GROUP_RANK); an inherited
        # NODE_RANK would be stale, and the agent sets MASTER_ADDR/PORT itself
        os.environ.pop("NODE_RANK", None)
        # every rendezvous publishes the workers' master afresh: without it a node
        # that joins a running job waits for keys the running agent never writes
        os.environ.setdefault(SHARE_STORE_ENV, "1")
    loopback_environment(args)
    if args.default_bucket_size is not None:
        os.environ[BUCKET_SIZE_ENV] = str(args.default_bucket_size)
    if args.backend is not None:
        from bagua_algos.runtime.comm import BACKEND_ENV

        os.environ[BACKEND_ENV] = args.backend
    if not args.no_bagua_compat:
        pythonpath, notice = bagua_compat_pythonpath(os.environ.get("PYTHONPATH"), prog)
        if notice:
            print(notice, file=sys.stderr, flush=True)
        if pythonpath is not None:
            os.environ["PYTHONPATH"] = pythonpath


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> None:
    parser = build_parser(prog)
    args = parse_args(argv, parser)
    check_before_start(parser, args)
    warning = ignored_flags_warning(args, prog)
    if warning:
        print(warning, file=sys.stderr, flush=True)

    if args.torchft:  # replicas of torchft, not torchrun's agent (a lost worker must not stop the others)
        from .replicas import run_replicas

        sys.exit(run_replicas(args, prog, set_worker_environment))
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    targs = torchrun.parse_args(torchrun_argv(args))
    set_worker_environment(args, prog)
    store = bind_rendezvous(args, targs)  # noqa: F841 - kept for the job: the agent's store is its tenant
    logdir = args.logdir or args.log_dir
    if logdir is not None:
        print(f"{prog}: worker logs go to {os.path.abspath(logdir)}/"
              "<run>/attempt_<n>/<local_rank>/{stdout,stderr}.log",
              file=sys.stderr, flush=True)

    try:
        torchrun.run(targs)
    except ChildFailedError as err:
        line, status = failure_summary(err, prog)
        print(line, file=sys.stderr, flush=True)
        sys.exit(status)
    except SignalException as err:
        print(f"{prog}: received {err.sigval.name}, workers stopped",
              file=sys.stderr, flush=True)
        sys.exit(128 + int(err.sigval))
    except (RendezvousError, dist.DistError) as err:
        print(rendezvous_failure(err, args, prog), file=sys.stderr, flush=True)
        sys.exit(1)


def run_main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m bagua.distributed.run``: the same flags, Bagua 0.9's run.py defaults."""
    main(argv, RUN_PROG)


if __name__ == "__main__":
    main()
