"""The sweep's runs: one (config, α, learning rate) trained on either engine, and every
run of the sweep in turn (``--resume``'s log, ``--jobs`` at a time, the report).

Both engines train through :func:`bagua_algos.experiments.training.train_epochs` with the
same data, model, and the optimizer and schedule of the sweep's protocol (``config.protocol``, a
:class:`~bagua_algos.experiments.sweep.config.SweepConfig`), and report the same fields (:func:`run_result`)
from each worker's and the averaged model's test accuracy: ``--engine sim`` all
``--workers`` stacked in this process (:func:`train_stacked`, bagua_algos.engine),
``--engine processes`` one worker per process of a launched job (:func:`train_one`).
"""

from __future__ import annotations

import math
import socket
import sys
import time

import numpy as np
import torch

from bagua_algos.engine import Engine
from samplers import WorkerShares
from bagua_algos.experiments.data import build_model, load_data
from bagua_algos.experiments.protocol import tail_accuracy
from bagua_algos.experiments.sweep.config import SweepConfig, stacked_config_error  # noqa: F401  (re-exported)
from bagua_algos.experiments.sweep.report import config_label, write_report
from bagua_algos.experiments.sweep.runlog import RunLog, read_previous_runs, run_key
from bagua_algos.experiments.sweep.schedule import run_jobs
from bagua_algos.experiments.training import ProcessWorker, StackedWorkers, train_epochs
from bagua_algos.runtime.bucket import DEFAULT_BUCKET_SIZE

__all__ = ["Diverged", "run_result", "stacked_config_error", "train_stacked", "train_one", "Evaluator", "accuracy",
           "run_worker", "one_run", "score", "extension_jobs", "run_all"]


class Diverged(RuntimeError):
    """A worker's training loss is not finite: the run stops, the sweep goes on."""


def run_result(workers, curve_min, curve_avg, curve_loss, started: float, class_histogram,
               curve_mean=None, worst_worker_tail=None) -> dict:
    """The fields of one run of the sweep, the same from both engines: the last epoch's
    accuracy of every worker, the curves per epoch (the workers' own models: their mean
    and the worst; the averaged model (1/n) Σ x_i beside them), the RelaySum paper's worst
    worker over the protocol's tail of epochs (:func:`~bagua_algos.experiments.protocol.tail_accuracy`;
    the last epoch's worst worker when not given), the seconds since ``started``
    (``time.perf_counter()``) and the per-worker class counts."""
    return {
        "final_mean_worker_accuracy": sum(workers) / len(workers),
        "final_min_worker_accuracy": curve_min[-1],
        "final_worst_worker_tail_accuracy": curve_min[-1] if worst_worker_tail is None else worst_worker_tail,
        "final_averaged_model_accuracy": curve_avg[-1],
        "worker_accuracies": workers,
        "curve_mean_worker_accuracy": curve_mean if curve_mean is not None else [],
        "curve_min_worker_accuracy": curve_min,
        "curve_averaged_model_accuracy": curve_avg,
        "curve_train_loss": curve_loss,
        "seconds": time.perf_counter() - started,
        "class_histogram": np.asarray(class_histogram).tolist(),
    }


def _result(curves, workers: int, started: float, class_histogram, protocol) -> dict:
    """``run_result`` of ``train_epochs``' curves, or :class:`Diverged` naming the first
    worker whose epoch loss is not finite."""
    diverged = curves.diverged
    if diverged is not None:
        bad = diverged.bad_workers
        raise Diverged(f"worker {bad[0]}'s training loss is {diverged.losses[bad[0]].item()} in epoch "
                       f"{diverged.epoch} ({len(bad)} of {workers} workers not finite)")
    last = curves.worker_accuracy[-1] if curves.worker_accuracy else []
    return run_result(last, curves.min_worker_accuracy, curves.averaged_accuracy, curves.train_loss, started,
                      class_histogram, curves.mean_worker_accuracy,
                      tail_accuracy(curves.worker_accuracy, protocol.tail_fraction))


def steps_per_epoch(samples: int, batch_size: int, max_steps: int | None) -> int:
    """A worker's steps in an epoch of ``samples`` (the last batch may be short)."""
    steps = max(1, math.ceil(samples / batch_size))
    return min(steps, max_steps) if max_steps else steps


def train_stacked(sweep: SweepConfig, data, config, alpha: float, lr: float, make_model) -> dict:
    """One run of the sweep on the engine (``config``: one of ``sweep.parsed_configs``); the
    same fields as :func:`train_one`'s."""
    torch.manual_seed(sweep.seed)
    module = make_model()
    if config.is_qadam:  # QAdam owns its optimizer: the engine builds it on the stacked parameter
        algorithm = config.build_algorithm(config.build_qadam_optimizer(module.parameters(), lr=lr))
        optimizer = None
    else:
        algorithm = config.build_algorithm()
        optimizer = sweep.protocol.optimizer_for(module, lr)
    engine = Engine(module, sweep.workers, algorithm, optimizer, device=data.train_x.device,
                    bucket_size=config.wrap_kwargs.get("bucket_size", DEFAULT_BUCKET_SIZE))
    shares = WorkerShares(data.train_y.cpu(), sweep.workers, alpha, sweep.seed)
    workers = StackedWorkers(engine, data, lambda epoch: shares.batches(epoch, sweep.batch_size,
                                                                        device=data.train_x.device))
    lr_at = sweep.protocol.schedule_for(lr, sweep.epochs, steps_per_epoch(len(shares), sweep.batch_size,
                                                                         sweep.max_steps_per_epoch), sweep.workers)
    started = time.perf_counter()
    curves = train_epochs(workers, sweep.epochs, sweep.max_steps_per_epoch, lr_at=lr_at)
    return _result(curves, sweep.workers, started, shares.class_histogram(), sweep.protocol)


def accuracy(model, x, y, batch: int = 1000) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(x), batch):
            correct += int((model(x[start:start + batch]).argmax(1) == y[start:start + batch]).sum())
    model.train()
    return correct / len(x)


class Evaluator:
    """Test accuracy of every worker's model and of the averaged model, on every rank."""

    def __init__(self, data, make_model):
        self.data = data
        self.average_model = make_model()

    def __call__(self, model) -> tuple[list[float], float]:
        from bagua_algos.runtime import comm

        mine = accuracy(model, self.data.test_x, self.data.test_y)
        everyone = torch.zeros(comm.get_world_size(), dtype=torch.float64)  # CPU tensors: over gloo in any job
        comm.allgather(torch.tensor([mine], dtype=torch.float64), everyone)
        with torch.no_grad():
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
            comm.allreduce_inplace(flat, comm.ReduceOp.AVG)
            torch.nn.utils.vector_to_parameters(flat, self.average_model.parameters())
        return everyone.tolist(), accuracy(self.average_model, self.data.test_x, self.data.test_y)


def train_one(sweep: SweepConfig, data, config, alpha: float, lr: float, evaluator) -> dict:
    """One run of the sweep on this worker of a launched job (``--engine processes``;
    ``config``: one of ``sweep.parsed_configs``)."""
    from torch.utils.data import DataLoader, TensorDataset

    from bagua_algos.runtime import comm
    from samplers import DistributedHeterogeneousSampler

    rank, world = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(sweep.seed)
    model = build_model(data, sweep.model).to(data.train_x.device)
    optimizer = sweep.protocol.optimizer_for(model, lr)(model.parameters())
    model.with_bagua([optimizer], config.build_algorithm(), **config.wrap_kwargs)
    sampler = DistributedHeterogeneousSampler(
        TensorDataset(data.train_x, data.train_y), num_replicas=world, rank=rank,
        alpha=alpha, seed=sweep.seed, labels=data.train_y.cpu(),
    )
    loader = DataLoader(TensorDataset(data.train_x, data.train_y), batch_size=sweep.batch_size, sampler=sampler)
    lr_at = sweep.protocol.schedule_for(lr, sweep.epochs, steps_per_epoch(len(sampler), sweep.batch_size,
                                                                         sweep.max_steps_per_epoch), world)
    started = time.perf_counter()
    curves = train_epochs(ProcessWorker(model, optimizer, loader, sampler, evaluator, data.train_augment),
                          sweep.epochs, sweep.max_steps_per_epoch, lr_at=lr_at)
    model.bagua_ddp.detach()  # also on a NaN: every rank stops together (the losses are allgathered)
    return _result(curves, world, started, sampler.class_histogram(), sweep.protocol)


def run_worker(sweep: SweepConfig) -> None:
    from bagua_algos.runtime import comm

    torch.set_num_threads(1)
    comm.init_process_group(backend="gloo" if sweep.device == "cpu" else "nccl")
    rank = comm.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if sweep.device == "cuda" else torch.device("cpu")
    data = load_data(sweep.dataset, sweep.data_dir, sweep.seed).to(device)
    evaluator = Evaluator(data, lambda: build_model(data, sweep.model).to(device))
    train = lambda config, alpha, lr: train_one(sweep, data, config, alpha, lr, evaluator)  # noqa: E731
    run_all(sweep, train, show=rank == 0)
    comm.barrier()
    comm.destroy_process_group()


def one_run(train, config, alpha: float, lr: float) -> dict:
    """The record of one run: its settings and ``train``'s fields, or its ``"error"``
    when a worker's loss turned NaN (or an op refused a NaN/inf value, :data:`NON_FINITE`);
    ``"ran_on"``: the host (a Ray task adds its node)."""
    record = {"algorithm": config.name, "label": config_label(config), "config": config.spec, "alpha": alpha, "lr": lr}
    try:
        record = {**record, **train(config, alpha, lr)}
    except Diverged as err:
        record = {**record, "error": str(err)}
    except ValueError as err:
        if NON_FINITE not in str(err):
            raise
        record = {**record, "error": str(err)}  # diverged inside an op, before the epoch's loss was checked
    record["ran_on"] = {"host": socket.gethostname()}
    return record


# How the min-max codecs (bytegrad, the low-precision gossip) refuse a non-finite value:
# a ValueError raised on every worker at once, mid-step, when a rate too high (a grid
# extended upwards) made the gradients overflow; the run diverged, as with a NaN loss.
NON_FINITE = "has NaN/inf values"


def score(record: dict, headline: str) -> float:
    """A run's score for the lr tuning: its ``headline``, −∞ for a run that failed
    (a NaN loss is worse than any accuracy, so a grid stops growing past it)."""
    return -math.inf if "error" in record else record[headline]


def extension_jobs(sweep: SweepConfig, records: list) -> list:
    """The next learning rates to train where a (config, α)'s best rate is at an edge of
    the rates it has tried: the lowest halved, or the highest doubled (ties go to the
    smaller rate, which also decides when every run failed: halve), each (config, α) at
    most ``sweep.lr_extend`` rates beyond ``sweep.lrs``. With a single rate nothing
    grows. The result depends on the records only, so ``--resume`` finds the same."""
    from bagua_algos.experiments.sweep.report import headline_of

    if len(sweep.lrs) < 2 or sweep.lr_extend == 0:
        return []
    headline, base = headline_of(sweep), set(sweep.lrs)
    jobs = []
    for alpha in sweep.alphas:
        for config in sweep.parsed_configs:
            tried = {r["lr"]: score(r, headline) for r in records if (r["config"], r["alpha"]) == (config.spec, alpha)}
            if not base <= set(tried) or len(set(tried) - base) >= sweep.lr_extend:
                continue
            rates = sorted(tried)
            best = max(rates, key=lambda lr: tried[lr])  # the first, smallest, of equal scores
            if best == rates[0]:
                jobs.append((config, alpha, rates[0] / 2))
            elif best == rates[-1]:
                jobs.append((config, alpha, rates[-1] * 2))
    return jobs


def run_all(sweep: SweepConfig, train, show: bool, jobs: int = 1, execute=None) -> None:
    """Every (α, config, lr) run through ``train``, but those ``--resume`` finds done;
    ``jobs`` of them at a time (:func:`bagua_algos.experiments.sweep.schedule.run_jobs`),
    or through ``execute`` (jobs -> (index, record) as each ends: an executor). Then, while
    a (config, α)'s best rate is at an edge of its grid, one more rate beyond it
    (:func:`extension_jobs`), round by round. A run whose loss turns NaN is reported with
    its worker and the sweep goes on. Where ``show``, each run is appended to the run log
    as it ends, and the outputs are written with whatever finished (on Ctrl-C too), the
    runs in the order of the sweep whatever ``jobs``."""
    if execute is None:
        execute = lambda pending: run_jobs(lambda job: one_run(train, *job), pending, jobs)  # noqa: E731
    previous = read_previous_runs(sweep) if sweep.resume else []
    done = {run_key(r) for r in previous}
    log = RunLog(sweep, previous) if show else None
    pending = [(c, a, lr) for a in sweep.alphas for c in sweep.parsed_configs for lr in sweep.lrs
               if run_key({"config": c.spec, "alpha": a, "lr": lr}) not in done]
    runs = [r for r in previous if "error" not in r]
    failed = [r for r in previous if "error" in r]
    if show and previous:
        print(f"heterogeneity_sweep: resuming: {len(previous)} runs from {log.path}, {len(pending)} to go",
              file=sys.stderr)
    bar = None
    if show and not sweep.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(pending), desc=f"sweep ({sweep.engine}, {sweep.executor})", unit="run", file=sys.stderr)
    started = time.perf_counter()
    finished: dict = {}  # (round, job index) -> its record
    try:
        for round_ in range(sweep.lr_extend + 1):
            if round_ > 0:
                pending = extension_jobs(sweep, runs + failed + list(finished.values()))
                if not pending:
                    break
                if bar is not None:
                    bar.total += len(pending)
                    bar.refresh()
            for index, outcome in execute(pending):
                if not outcome.get("lost"):  # first: a Ctrl-C from here on still reports it
                    finished[round_, index] = outcome
                _finish(outcome, show, log, bar)
    except KeyboardInterrupt:
        runs, failed = in_order(runs, failed, finished)
        if show:
            print(f"\ninterrupted: {len(runs) + len(failed)} runs are in {log.path}; the same command with --resume "
                  "goes on from there", file=sys.stderr)
            if runs:
                write_report(sweep, runs, failed, started)
        raise SystemExit(130) from None
    finally:
        if bar is not None:
            bar.close()
    runs, failed = in_order(runs, failed, finished)
    if show:
        write_report(sweep, runs, failed, started)


def _finish(outcome: dict, show: bool, log, bar) -> None:
    """A run just ended: say why it stopped if it failed, log it, move the bar."""
    place = outcome.get("ran_on", {})
    at = place.get("node_ip") or place.get("host", "")
    if "error" in outcome and show:
        what = "lost" if outcome.get("lost") else "stopped"
        print(f"\n{what} {outcome['config']!r} alpha={outcome['alpha']:g} lr={outcome['lr']:g}: "
              f"{outcome['error']}" + ("; --resume trains it again" if outcome.get("lost") else ""), file=sys.stderr)
    if log is not None and not outcome.get("lost"):
        log.append(outcome)
    if bar is not None:
        bar.set_postfix_str(f"{outcome['label']} alpha={outcome['alpha']:g} lr={outcome['lr']:g} done"
                            + (f" on {at}" if at else ""))
        bar.update()


def in_order(runs: list, failed: list, finished: dict) -> tuple:
    """The runs and failed runs so far, the ``finished`` ones (job index -> record)
    after the earlier ones in the order of the jobs."""
    ordered = [finished[i] for i in sorted(finished)]
    return runs + [r for r in ordered if "error" not in r], failed + [r for r in ordered if "error" in r]
