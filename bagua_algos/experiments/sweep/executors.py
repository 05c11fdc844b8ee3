"""Where the sweep's runs train (``--executor``; :func:`run_sim` chooses): ``local``, in
this process or ``--jobs`` processes forked from it
(:func:`bagua_algos.experiments.sweep.schedule.run_jobs`), with ``--device cuda`` spawned
one per GPU slot (:func:`gpu_slots`, :func:`run_gpu_jobs`); or ``ray``, one Ray task per
run on a Ray cluster (:class:`RayExecutor`). The module sits above ``runs`` (it calls
``runs.run_all`` and ``runs.train_stacked``; ``runs`` imports nothing of it).

Either way the driver (this process) keeps the run log: each record comes back to it
and is appended to ``runs.jsonl`` as its run ends, so ``--resume`` goes on from a log
either executor wrote. A run's record does not depend on where it trained: every run
seeds everything it draws (the model, the shares, the batches) from ``--seed``, and
runs with ``--threads`` torch threads wherever it runs.

The Ray path follows Ray's guide to running independent training jobs as tasks
("Ray Core > Tasks", docs.ray.io/en/latest/ray-core/tasks.html, and its "Fault
tolerance" page, docs.ray.io/en/latest/ray-core/fault_tolerance/tasks.html): a remote
function per run, its resources declared (``num_cpus`` = ``--threads``; with ``--device
cuda``, ``num_gpus`` = ``--gpus-per-run``, a fraction letting several runs share a GPU),
the data put in the object store once, results collected with ``ray.wait`` as they
finish. A task whose worker process or node dies is retried by Ray (``max_retries``,
system failures only); a run that fails on its own (an exception) is recorded as
failed once: ``retry_exceptions=False`` (a NaN loss is caught inside the run already).
"""

from __future__ import annotations

import importlib.machinery
import math
import socket
import sys

from bagua_algos.experiments.sweep.config import EXECUTORS  # noqa: F401  (re-exported: the flag's choices)

__all__ = ["EXECUTORS", "RAY_INSTALL", "ExecutorError", "gpu_slots", "local_gpu_jobs", "run_gpu_jobs", "import_ray",
           "check_reachable", "RaySession", "RayExecutor", "where", "run_sim"]

RAY_INSTALL = "pip install 'bagua-algos[ray]'"
# How often Ray retries a run whose worker process or node was lost (not one that raised).
SYSTEM_RETRIES = 3
CONNECT_TIMEOUT_S = 5.0


class ExecutorError(RuntimeError):
    """An executor setting that cannot be used here: ``flag`` and the one-line ``reason``."""

    def __init__(self, flag: str, reason: str):
        self.flag, self.reason = flag, reason
        super().__init__(f"{flag}: {reason}")


def where() -> dict:
    """Where this process runs: the host's name (and, in a Ray task, the node's IP and id)."""
    place = {"host": socket.gethostname()}
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        place["node_ip"] = ray.util.get_node_ip_address()
        place["node_id"] = ray.get_runtime_context().get_node_id()
    return place


def gpu_slots(visible: int, gpus_per_run: float, jobs: int | None) -> list[int]:
    """The GPU of each of the runs trained at a time by the local executor: ``jobs`` slots
    (None: as many as the GPUs hold), slot k on GPU ⌊k / per_gpu⌋ where per_gpu = ⌊1 /
    gpus_per_run⌋ runs share a GPU (gpus_per_run ≤ 1); a run asking for g ≥ 1 GPUs holds
    g of them (it trains on the first: the engine stacks all its workers on one device).
    Raises :class:`ExecutorError` when a run asks for more GPUs than ``visible``, or
    ``jobs`` runs do not fit."""
    if not (math.isfinite(gpus_per_run) and gpus_per_run > 0):
        raise ExecutorError("--gpus-per-run", f"expected a positive number, got {gpus_per_run}")
    if gpus_per_run > 1 and gpus_per_run != int(gpus_per_run):
        raise ExecutorError("--gpus-per-run", f"expected a fraction of one GPU or a whole number, got {gpus_per_run:g}")
    if gpus_per_run > visible:
        raise ExecutorError("--gpus-per-run", f"a run asks for {gpus_per_run:g} GPUs and this machine has {visible} "
                                              "visible; use --gpus-per-run at most the GPU count, or --executor ray "
                                              "on a cluster")
    if gpus_per_run <= 1:
        per_gpu = int(math.floor(1 / gpus_per_run + 1e-9))
        slots = [k // per_gpu for k in range(visible * per_gpu)]
    else:
        slots = [k * int(gpus_per_run) for k in range(visible // int(gpus_per_run))]
    if jobs is None:
        return slots
    if jobs > len(slots):
        raise ExecutorError("--jobs", f"{jobs} runs at a time with --gpus-per-run {gpus_per_run:g} need "
                                      f"{jobs * gpus_per_run:g} GPUs and this machine has {visible}; use --jobs "
                                      f"{len(slots)} or fewer, or a smaller --gpus-per-run")
    return slots[:jobs]


def local_gpu_jobs(sweep_jobs: int | None, runs: int, visible: int, gpus_per_run: float) -> list[int]:
    """The GPU of each local job with ``--device cuda``: ``--jobs`` when given, else as
    many as the visible GPUs hold, at most the number of ``runs``."""
    if visible < 1:
        raise ExecutorError("--device", "cuda, but this machine has no visible GPU; use --device cpu")
    slots = gpu_slots(visible, gpus_per_run, sweep_jobs)
    return slots if sweep_jobs is not None else slots[:max(1, min(len(slots), runs))]


def import_ray():
    """The ``ray`` module, or :class:`ExecutorError` naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ExecutorError("--executor", f"ray is not installed in this Python; {RAY_INSTALL}") from None
    return ray


def check_reachable(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse, within ``timeout_s``, an ``address`` (HOST:PORT, or ray://HOST:PORT) where
    nothing accepts a TCP connection: Ray's own connect would wait for minutes. None and
    "auto" are Ray's to resolve (start a local Ray; find the running one)."""
    if address in (None, "auto"):
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise ExecutorError("--ray-address", f"expected HOST:PORT (e.g. 10.0.0.1:6379) or auto, got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ExecutorError("--ray-address", f"nothing answers at {host}:{port} ({err.strerror or err}); start the "
                                             f"head there with `ray start --head --port {port}`, or leave "
                                             "--ray-address out to start a Ray on this machine") from None


class RaySession:
    """Ray for one sweep: joins a Ray this process already initialised (and leaves it
    running), or connects to ``address`` (None: start a local Ray; "auto": the running
    cluster this machine belongs to) and disconnects at :meth:`close`."""

    def __init__(self, address: str | None):
        self.ray = import_ray()
        self.owned = not self.ray.is_initialized()
        if not self.owned:
            return
        check_reachable(address)
        try:
            if address is None:
                self.ray.init(include_dashboard=False, log_to_driver=False)
            else:
                self.ray.init(address=address, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError, TimeoutError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ExecutorError("--ray-address", f"cannot join Ray at {address or 'a new local instance'}: {first}") \
                from None

    def close(self) -> None:
        if self.owned and self.ray.is_initialized():
            self.ray.shutdown()


def _register_code_by_value(ray, configs) -> None:
    """Algorithms loaded from a file (``FILE.py:Class``) live in a module no Ray worker can
    import by name: send their code with the task (cloudpickle by value)."""
    for config in configs:
        cls = getattr(config, "algorithm_class", None)
        module = sys.modules.get(getattr(cls, "__module__", "")) if cls is not None else None
        if module is None:
            continue
        # PathFinder, not importlib.util.find_spec: that one answers from sys.modules
        if importlib.machinery.PathFinder.find_spec(module.__name__.partition(".")[0]) is None:
            ray.cloudpickle.register_pickle_by_value(module)


def _train_in_task(sweep, data, job) -> dict:
    """One run in a Ray worker: the same call the local executor makes (``runs.one_run``
    of ``runs.train_stacked``), on this worker's CPU threads or on the GPU Ray gave it."""
    import torch

    from bagua_algos.experiments.data import build_model
    from bagua_algos.experiments.sweep.runs import one_run, train_stacked

    torch.set_num_threads(sweep.threads)
    device = torch.device("cuda" if sweep.device == "cuda" else "cpu")  # Ray sets CUDA_VISIBLE_DEVICES per task
    data = data.to(device)
    make_model = lambda: build_model(data, sweep.model)  # noqa: E731
    record = one_run(lambda config, alpha, lr: train_stacked(sweep, data, config, alpha, lr, make_model), *job)
    record["ran_on"] = where()
    return record


def _failed(job, error: str) -> dict:
    """The record of the run ``job`` (config, α, lr) that ended with ``error``."""
    from bagua_algos.experiments.sweep.report import config_label

    config, alpha, lr = job
    return {"algorithm": config.name, "label": config_label(config), "config": config.spec, "alpha": alpha, "lr": lr,
            "error": error}


class RayExecutor:
    """Runs jobs ``(config, α, lr)`` as Ray tasks; :meth:`__call__` yields ``(index,
    record)`` as each finishes, like ``schedule.run_jobs``. A task that raised gives the
    run's record with its ``"error"`` (once: not retried); one lost past Ray's retries
    (its node gone for good) gives a record marked ``"lost"``, which the run log skips
    (``--resume`` trains it again)."""

    def __init__(self, session: RaySession, sweep, data):
        self.ray = session.ray
        self.sweep = sweep
        _register_code_by_value(self.ray, sweep.parsed_configs)
        self.data_ref = self.ray.put(data)  # once: every task reads it from the object store
        self.sweep_ref = self.ray.put(sweep)  # and the settings, not pickled again for every task
        gpus = sweep.gpus_per_run if sweep.device == "cuda" else 0
        self.remote = self.ray.remote(_train_in_task).options(
            num_cpus=sweep.threads, num_gpus=gpus, max_retries=SYSTEM_RETRIES, retry_exceptions=False,
            name="bagua_algos.sweep.run")

    def describe(self) -> str:
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in nodes)
        gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in nodes)
        return f"Ray: {len(nodes)} nodes, {cpus:g} CPUs, {gpus:g} GPUs"

    def __call__(self, jobs: list):
        ray = self.ray
        refs = {self.remote.remote(self.sweep_ref, self.data_ref, job): index for index, job in enumerate(jobs)}
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1)
                index = refs.pop(ready[0])
                try:
                    record = ray.get(ready[0])
                except ray.exceptions.RayTaskError as err:  # the run raised: recorded once as failed
                    cause = err.cause if getattr(err, "cause", None) is not None else err
                    record = _failed(jobs[index], f"{type(cause).__name__}: {cause}".splitlines()[0])
                except ray.exceptions.RayError as err:  # lost past its retries (a node, a worker): not a result
                    record = {**_failed(jobs[index], f"{type(err).__name__} after {SYSTEM_RETRIES} retries: "
                                                     f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}"),
                              "lost": True}
                yield index, record
        finally:  # Ctrl-C, or the caller stopped early: nothing left running for this sweep
            for ref in refs:
                ray.cancel(ref, force=True)


def run_sim(sweep: SweepConfig, data) -> None:
    """The sweep on the one-process engine: every run's workers stacked on ``sweep.device``,
    training on ``data`` (loaded on the CPU by the command line's memory check), through
    ``sweep.executor``: here (``--jobs`` at a time; with ``--device cuda`` and more than one
    job, each job on its own GPU slot) or as Ray tasks."""
    import torch

    from bagua_algos.experiments.data import build_model
    from bagua_algos.experiments.sweep.runs import run_all, train_stacked

    if sweep.executor == "ray":
        session = RaySession(sweep.ray_address)
        try:
            executor = RayExecutor(session, sweep, data)
            print(f"heterogeneity_sweep: {executor.describe()}", file=sys.stderr)
            run_all(sweep, None, show=True, execute=executor)
        finally:
            session.close()
        return
    torch.set_num_threads(sweep.threads)
    if sweep.device == "cuda" and sweep.jobs > 1:
        slots = local_gpu_jobs(sweep.jobs, sweep.runs, torch.cuda.device_count(), sweep.gpus_per_run)
        run_all(sweep, None, show=True, execute=lambda pending: run_gpu_jobs(sweep, data, pending, slots))
        return
    device = torch.device("cuda" if sweep.device == "cuda" else "cpu")
    data = data.to(device)
    make_model = lambda: build_model(data, sweep.model)  # noqa: E731
    if sweep.jobs > 1:  # torch.optim's optimizers import it when first used (about 1 s): once here, not in every job
        import torch._dynamo as _dynamo  # noqa: F401
    run_all(sweep, lambda config, alpha, lr: train_stacked(sweep, data, config, alpha, lr, make_model), show=True,
            jobs=sweep.jobs)


# The state of a GPU job process of run_gpu_jobs: its GPU, the sweep and the data there.
_GPU_JOB: dict = {}


def _gpu_job_start(slots, fields: dict, data) -> None:
    """A spawned GPU job process: take the next free slot's GPU, rebuild the sweep from
    its fields (a spawned process shares no memory; an algorithm from a file is loaded
    again from it) and put the data on that GPU."""
    import signal

    import torch

    from bagua_algos.experiments.sweep.config import SweepConfig

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    gpu = slots.get()
    sweep = SweepConfig(**fields)
    torch.set_num_threads(sweep.threads)
    device = torch.device("cpu")  # a CPU sweep: the same processes, for the tests on a machine without a GPU
    if sweep.device == "cuda":
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    _GPU_JOB.update(gpu=gpu if sweep.device == "cuda" else None, sweep=sweep, data=data.to(device))


def _gpu_job(task: tuple) -> tuple:
    from bagua_algos.experiments.data import build_model
    from bagua_algos.experiments.sweep.runs import one_run, train_stacked

    index, (config_index, alpha, lr) = task
    sweep, data = _GPU_JOB["sweep"], _GPU_JOB["data"]
    make_model = lambda: build_model(data, sweep.model)  # noqa: E731
    train = lambda config, a, rate: train_stacked(sweep, data, config, a, rate, make_model)  # noqa: E731
    record = one_run(train, sweep.parsed_configs[config_index], alpha, lr)
    if _GPU_JOB["gpu"] is not None:
        record["ran_on"]["gpu"] = _GPU_JOB["gpu"]
    return index, record


def run_gpu_jobs(sweep, data, jobs: list, slots: list):
    """(index, record) of every job ``(config, α, lr)`` of ``sweep`` as each ends, trained
    ``len(slots)`` at a time by processes spawned from this one, process k on GPU
    ``slots[k]`` (:func:`~bagua_algos.experiments.sweep.executors.gpu_slots`). Spawned, not
    forked: this process has used CUDA (the memory check), and a forked child cannot."""
    import dataclasses
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    free = context.Queue()
    for gpu in slots:
        free.put(gpu)
    fields = {f.name: getattr(sweep, f.name) for f in dataclasses.fields(sweep) if f.init}
    specs = [c.spec for c in sweep.parsed_configs]
    tasks = [(index, (specs.index(config.spec), alpha, lr)) for index, (config, alpha, lr) in enumerate(jobs)]
    pool = context.Pool(len(slots), initializer=_gpu_job_start, initargs=(free, fields, data.to("cpu")))
    try:
        yield from pool.imap_unordered(_gpu_job, tasks)
        pool.close()
    finally:
        pool.terminate()
        pool.join()
