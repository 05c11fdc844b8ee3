"""What the benchmark scripts share: ``--configs`` parsing and starting workers.

A config is ``ddp`` (torch DDP, the usual baseline) or ``ALGO`` or
``ALGO:key=value,key=value`` with the values parsed as int, float, bool, None or str,
e.g. ``relay:topology=double_binary_tree``. The keys ``do_flatten`` and
``bucket_size`` go to ``with_bagua``, the others to the algorithm; for ``qadam``
the keys ``lr``, ``warmup_steps``, ``eps`` and ``weight_decay`` go to its
``QAdamOptimizer``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

from bagua_algos.algorithm_source import is_algorithm_source, load_algorithm_class

# keys of a config that are with_bagua's arguments, not the algorithm's
WITH_BAGUA_KEYS = ("do_flatten", "bucket_size")
# keys of a ``qadam`` config that go to its QAdamOptimizer, not to QAdamAlgorithm
QADAM_OPTIMIZER_KEYS = ("lr", "warmup_steps", "eps", "weight_decay", "variant")


class ConfigError(ValueError):
    """A bad --configs entry (unknown algorithm, bad key=value, bad arguments)."""


# ------------------------------------------------------------------------ usage errors

# How long a worker other than local rank 0 waits, after a usage error, for the launcher
# to stop it (which it does once local rank 0 has printed the error and exited).
USAGE_ERROR_GRACE_S = 60.0


def _quiet_worker() -> bool:
    """True in a worker of a launched job (torchrun's agent sets TORCHELASTIC_RUN_ID for
    its workers) other than the first of its node."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("LOCAL_RANK", "0") != "0"


def usage_error(prog: str, message: str, usage: str = "") -> NoReturn:
    """Exit with status 2 after ``usage`` and ``PROG: error: MESSAGE`` on stderr, as
    argparse does, but once per node in a launched job.

    Every worker parses the same command line and reaches the same error. Printed by all
    of them, the user reads it once per worker. Printed by local rank 0 alone, it could be
    lost: the launcher stops a node's workers as soon as one of them exits, so another
    worker that exited first could stop local rank 0 before it printed. So local rank 0
    prints and exits, and the others wait to be stopped (``USAGE_ERROR_GRACE_S`` at most)
    and exit without a word.
    """
    if _quiet_worker():
        time.sleep(USAGE_ERROR_GRACE_S)
        sys.exit(2)
    sys.stderr.write(f"{usage}{prog}: error: {message}\n")
    sys.stderr.flush()
    sys.exit(2)


class WorkerArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser for a script that every worker of a launched job runs: its
    errors go through :func:`usage_error` (printed once per node, exit status 2)."""

    def error(self, message: str) -> NoReturn:
        usage_error(self.prog, message, self.format_usage())


def cuda_shortage(workers: int | None) -> str | None:
    """For ``--device cuda``: None when this node has a GPU for each of its workers, else
    the reason, naming ``--device cpu``. ``workers``: the ``--spawn`` count in the parent;
    None in a worker, which counts LOCAL_WORLD_SIZE (1 outside a launched job)."""
    from bagua_algos.runtime.gpus import gpu_shortage

    if workers is None:
        return gpu_shortage("cuda", int(os.environ.get("LOCAL_WORLD_SIZE", "1")), "--nproc_per_node", "--device cpu")
    return gpu_shortage("cuda", workers, "--spawn", "--device cpu")


# ----------------------------------------------------------------------------- configs


def parse_value(text: str):
    """``"3"`` → 3, ``"0.5"`` → 0.5, ``"true"`` → True, ``"none"`` → None, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def format_value(value) -> str:
    """The ``--configs`` text of ``value``, read back by :func:`parse_value` as ``value``."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if isinstance(value, str) and text == text.strip() and not any(c in text for c in ";,:=") \
            and parse_value(text) == text:
        return text
    raise ValueError(f"{value!r} has no --configs form (ints, floats, bools, None and plain strings have)")


def config_spec(config) -> str:
    """The ``--configs`` entry of a row of bagua_algos.algorithms.table (``ALGO`` or
    ``ALGO:key=value,...``, the keys in the row's order; a ``qadam`` row's optimizer
    arguments follow its own, as the grammar routes them back to its QAdamOptimizer)."""
    kwargs = dict(config.kwargs)
    if config.own_optimizer is not None:
        kwargs.update(config.own_optimizer.kwargs)
    if not kwargs:
        return config.name
    return config.name + ":" + ",".join(f"{key}={format_value(value)}" for key, value in kwargs.items())


class BenchConfig:
    """One ``--configs`` entry: ``ddp`` or an algorithm with its arguments."""

    def __init__(self, spec: str, name: str, kwargs: dict, wrap_kwargs: dict, algorithm_class=None):
        self.spec = spec  # as written, the row's label
        self.name = name  # a registered name, or the code's FILE.py:ClassName / module:ClassName
        self.kwargs = kwargs  # the algorithm's (or DDP's) arguments
        self.wrap_kwargs = wrap_kwargs  # with_bagua's (do_flatten, bucket_size)
        self.algorithm_class = algorithm_class  # the class named by its code, else None

    @property
    def is_ddp(self) -> bool:
        return self.name == "ddp"

    @property
    def is_qadam(self) -> bool:
        return self.name == "qadam"

    def build_algorithm(self, optimizer=None):
        """The bagua_algos Algorithm of this config (ConfigError if it cannot be built).

        ``qadam`` is built on its own optimizer: pass the ``QAdamOptimizer`` from
        :meth:`build_qadam_optimizer` (without one, a throwaway is made to check the
        arguments)."""
        from bagua_algos.runtime.algorithm import Algorithm

        try:
            if self.is_qadam:
                algorithm_kwargs = {k: v for k, v in self.kwargs.items() if k not in QADAM_OPTIMIZER_KEYS}
                if optimizer is None:
                    import torch

                    optimizer = self.build_qadam_optimizer([torch.nn.Parameter(torch.zeros(1))], lr=0.001)
                return Algorithm.init(self.name, q_adam_optimizer=optimizer, **algorithm_kwargs)
            if self.algorithm_class is not None:
                return self.algorithm_class(**self.kwargs)
            return Algorithm.init(self.name, **self.kwargs)
        except ValueError as err:
            if self.name not in _available_algorithms():
                raise ConfigError(f"config {self.spec!r}: {err}") from None
            raise ConfigError(f"config {self.spec!r}: bad arguments for {self.name!r}: {err}") from None
        except TypeError as err:
            raise ConfigError(f"config {self.spec!r}: bad arguments for {self.name!r}: {err}") from None

    def build_qadam_optimizer(self, params, lr: float, default_warmup_steps: int = 2):
        """The ``QAdamOptimizer`` of a ``qadam`` config: its optimizer keys, with
        ``warmup_steps`` defaulting to ``default_warmup_steps`` and ``lr`` to ``lr``.

        A larger ``eps`` (e.g. 1e-4) keeps a ReLU model on random data finite: a weight
        whose gradient was exactly 0 through the warm-up has v = 0, and after it the 8-bit
        codec's rounding error on its momentum is divided by eps alone."""
        from bagua_algos.algorithms import QAdamOptimizer

        options = {k: v for k, v in self.kwargs.items() if k in QADAM_OPTIMIZER_KEYS}
        options.setdefault("lr", lr)
        options.setdefault("warmup_steps", default_warmup_steps)
        try:
            return QAdamOptimizer(params, **options)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"config {self.spec!r}: bad arguments for 'qadam': {err}") from None

    def __repr__(self) -> str:
        return f"BenchConfig({self.spec!r})"


def _available_algorithms() -> list[str]:
    from bagua_algos.runtime.algorithm import GlobalAlgorithmRegistry

    return GlobalAlgorithmRegistry.available_algorithms()


def parse_configs(text: str) -> list[BenchConfig]:
    """Parse ``--configs`` and check every algorithm exists and accepts its arguments.

    An entry is ``NAME[:key=value,...]`` (a registered algorithm, or ``ddp``), or an
    algorithm named by its code: ``FILE.py:ClassName[:key=value,...]`` or
    ``package.module:ClassName[:key=value,...]`` (:mod:`bagua_algos.algorithm_source`;
    a file written for Bagua loads with the compatibility package on the path)."""
    configs = []
    for raw in text.split(";"):
        spec = raw.strip()
        if not spec:
            continue
        name, _, rest = spec.partition(":")
        name = name.strip()
        if not name:
            raise ConfigError(f"config {spec!r}: missing the algorithm name before ':'")
        algorithm_class = None
        second, _, after = rest.partition(":")
        if is_algorithm_source(name, second):  # FILE.py:ClassName[:...] or package.module:ClassName[:...]
            name, rest = f"{name}:{second.strip()}", after
            try:
                algorithm_class = load_algorithm_class(name)
            except ValueError as err:
                raise ConfigError(f"config {spec!r}: {err}") from None
        kwargs: dict = {}
        for item in rest.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ConfigError(f"config {spec!r}: expected key=value, got {item!r}")
            if key in kwargs:
                raise ConfigError(f"config {spec!r}: key {key!r} given twice")
            kwargs[key] = parse_value(value)
        wrap_kwargs = {}
        if name != "ddp":
            wrap_kwargs = {k: kwargs.pop(k) for k in WITH_BAGUA_KEYS if k in kwargs}
            if "do_flatten" in wrap_kwargs and not isinstance(wrap_kwargs["do_flatten"], bool):
                raise ConfigError(f"config {spec!r}: do_flatten must be true or false")
            if "bucket_size" in wrap_kwargs and not (
                isinstance(wrap_kwargs["bucket_size"], int) and wrap_kwargs["bucket_size"] > 0
            ):
                raise ConfigError(f"config {spec!r}: bucket_size must be a positive number of bytes")
        config = BenchConfig(spec, name, kwargs, wrap_kwargs, algorithm_class)
        if not config.is_ddp:
            config.build_algorithm()  # unknown names and bad arguments fail here, before any training
        configs.append(config)
    if not configs:
        raise ConfigError("--configs is empty; give e.g. 'ddp;gradient_allreduce'")
    labels = [c.spec for c in configs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ConfigError(f"--configs lists {duplicates} more than once")
    return configs


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag VALUE`` and ``flag=VALUE``."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == flag:
            skip = True
        elif not token.startswith(flag + "="):
            out.append(token)
    return out


DEVICES = ("auto", "cpu", "cuda")


def worker_device(choice: str = "auto") -> str:
    """``"cuda"`` or ``"cpu"`` for a worker of a launched job: ``"auto"`` is CUDA when
    the node has a GPU for each of its workers (LOCAL_WORLD_SIZE), else CPU, so a job
    with more workers than GPUs runs on CPU instead of failing."""
    import torch

    if choice not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {choice!r}")
    if choice != "auto":
        return choice
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= local else "cpu"


def init_for_device(device: str):
    """Join the job for a worker training on ``device`` ("cpu": gloo; "cuda": NCCL,
    on GPU LOCAL_RANK) and return the torch.device it trains on."""
    import torch

    from bagua_algos.runtime import comm

    comm.init_process_group(backend="nccl" if device == "cuda" else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


# Set by launch_self in the environment of the workers it starts, and only there, to the
# module they run: how an experiment tells its own workers from its parent. Not RANK: a
# cluster (Kubernetes, SLURM, an outer torchrun) sets RANK for every process, the
# parent included.
LAUNCHED_WORKER_ENV = "BAGUA_ALGOS_LAUNCHED_WORKER"


def launched_worker(module: str) -> bool:
    """True in a worker that ``launch_self(module, ...)`` started; False in the parent,
    whatever RANK, WORLD_SIZE, ... its environment holds."""
    return os.environ.get(LAUNCHED_WORKER_ENV) == module


def launch_self(module: str, nproc: int, argv: list[str], command_env: str) -> None:
    """Run ``python -m module`` with ``argv`` in ``nproc`` local workers through the
    plugin's launcher (torchrun underneath); it exits non-zero if a worker fails. The
    user's command line is kept in ``command_env`` for the workers to report, and
    :data:`LAUNCHED_WORKER_ENV` names ``module`` (:func:`launched_worker`). The workers
    get this process's environment with the launcher's RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT over any it had; this
    process's own environment is as before once the launcher returns (or exits). A
    module, not a file: the workers import it from the installed package, wherever it
    lives."""
    from bagua_algos.launcher import launch

    before = dict(os.environ)
    try:
        os.environ[command_env] = shlex.join([Path(sys.executable).name, *sys.argv])
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ[LAUNCHED_WORKER_ENV] = module
        launch.main([
            "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()),
            "-m", module,
            *argv,
        ])
    finally:  # the launcher sets the workers' variables (set_worker_environment) in this process
        for name in set(os.environ) - set(before):
            del os.environ[name]
        for name, value in before.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
