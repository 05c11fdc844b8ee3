"""Training, byte counting and timing for ``reproduce`` (bagua_algos/experiments/reproduce/).

A run trains the stacked workers of one algorithm on the one-process engine
(:class:`bagua_algos.engine.Engine`, docs/engine.md) through the sweep's training loop
(:func:`bagua_algos.experiments.training.train_epochs`: one ``engine.step`` per batch,
the averaged model and every worker evaluated after each epoch), with what the seeds'
settings add: IID shares (each epoch a seeded permutation dealt out as
``DistributedSampler`` deals it), the setting's protocol (optimizer and learning-rate
schedule, bagua_algos/experiments/protocol.py), and, for PowerSGD, the norm of every worker's error buffer after each epoch.

Bytes are not estimated: :func:`bytes_per_step` runs each algorithm's per-rank form on
two gloo workers and reads the package's counter of bytes handed to collectives
(``comm.bytes_sent``) over one steady-state step; a worker sends the same message at any
world size for every algorithm here (allreduce and allgather both hand over one
message per worker).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import torch

from bagua_algos.algorithms.table import AlgorithmConfig
from bagua_algos.engine import Engine
from samplers import WorkerShares
from bagua_algos.experiments.protocol import PROTOCOLS, Protocol, tail_accuracy
from bagua_algos.experiments.training import StackedWorkers, train_epochs

__all__ = ["Setting", "Run", "make_model", "load", "train", "bytes_per_step", "time_step"]

MODELS = ("mlp", "cnn", "resnet18", "vgg11", "vgg19")


@dataclass(frozen=True)
class Setting:
    """One training setting: the task, the model, the workers, and the protocol.

    ``lr`` is the peak learning rate; the ``protocol``
    (:class:`bagua_algos.experiments.protocol.Protocol`) names the optimizer, how the
    rate is warmed up and decayed over ``epochs`` (its paper's milestones scaled to this
    run's length) and the quantity reported first.
    ``alpha``: None for IID shares, else the Dirichlet α of ``WorkerShares``."""

    dataset: str
    model: str
    workers: int
    batch: int  # per worker
    epochs: int
    lr: float
    protocol: Protocol = PROTOCOLS["heavy_ball"]
    alpha: float | None = None
    max_steps_per_epoch: int | None = None

    def describe(self) -> str:
        data = "IID" if self.alpha is None else f"Dirichlet alpha={self.alpha:g}"
        return (f"{self.dataset}, {self.model}, {self.workers} workers x batch {self.batch} ({data}), "
                f"{self.epochs} epochs, peak lr {self.lr:g}; {self.protocol.describe(self.epochs)}")

    def with_(self, **changes) -> "Setting":
        return replace(self, **changes)

    def lr_at(self, epoch_float: float) -> float:
        """The learning rate at ``epoch_float`` (epochs done, fractional)."""
        return self.lr * self.protocol.lr_factor(epoch_float, self.epochs, self.workers)


def make_model(name: str, sample_shape: tuple, num_classes: int = 10) -> torch.nn.Module:
    """A fresh model (the caller seeds torch first)."""
    if name in ("mlp", "cnn", "vgg11"):
        from bagua_algos.experiments.data import SmallCNN, build_model

        if name == "cnn":
            return SmallCNN(tuple(sample_shape), num_classes)
        # build_model reads only these three fields of a data set
        shape = SimpleNamespace(image_shape=tuple(sample_shape), num_classes=num_classes,
                                name="cifar10" if name == "vgg11" else "digits")
        return build_model(shape, name)
    if name == "resnet18":
        from bagua_algos.experiments.cifar_resnet import CifarResNet18

        return CifarResNet18(num_classes)
    if name == "vgg19":  # the thesis's VGG-19 (with batch norm) for 32x32 inputs
        from torchvision.models import vgg19_bn

        net = vgg19_bn(num_classes=num_classes)
        net.avgpool = torch.nn.Flatten()
        net.classifier = torch.nn.Linear(512, num_classes)
        return net
    raise ValueError(f"model must be one of {list(MODELS)}, got {name!r}")


def load(dataset: str, data_dir, seed: int, device):
    from bagua_algos.experiments.data import load_data

    return load_data(dataset, data_dir, seed).to(device)


def iid_batches(n_samples: int, workers: int, batch: int, epoch: int, seed: int, device):
    """The ``[workers, batch]`` index batches of one epoch: a permutation seeded by
    (seed, epoch), worker i taking every workers-th index from i on (``DistributedSampler``'s
    deal), the remainder of the division and each share's last short batch dropped."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(n_samples, generator=g)
    per = n_samples // workers
    shares = order[:per * workers].view(per, workers).T.contiguous().to(device)
    for start in range(0, per - batch + 1, batch):
        yield shares[:, start:start + batch]


def steps_per_epoch(setting: Setting, n_samples: int) -> int:
    steps = (n_samples // setting.workers) // setting.batch
    return min(steps, setting.max_steps_per_epoch) if setting.max_steps_per_epoch else steps


@dataclass
class Run:
    """One training run's record."""

    label: str
    seed: int
    lr: float
    # test accuracy after each epoch: the workers' own models (their mean: the headline,
    # as the papers report it; and the worst), and the averaged model (1/n) Σ x_i beside
    # them (the same for an algorithm that keeps every worker's model equal)
    test_accuracy: list = field(default_factory=list)  # the workers' own models, mean over workers
    worst_worker_accuracy: list = field(default_factory=list)
    # the RelaySum paper's quantity: each worker's accuracy over the protocol's tail of
    # epochs, the minimum over workers (the last epoch's worst worker when it has no tail)
    worst_worker_tail_accuracy: float = float("nan")
    averaged_accuracy: list = field(default_factory=list)
    train_loss: list = field(default_factory=list)  # mean over workers and the epoch's steps
    error_norm: list = field(default_factory=list)  # mean over workers of ||e_w||, after each epoch
    step_seconds: float = float("nan")  # median engine step (all workers), epochs 2 on
    seconds: float = 0.0
    epoch_seconds: list = field(default_factory=list)  # wall time at the end of each epoch
    diverged: str = ""

    @property
    def final_accuracy(self) -> float:
        """The last epoch's workers' mean accuracy (nan when the run diverged)."""
        return self.test_accuracy[-1] if self.test_accuracy and not self.diverged else float("nan")

    @property
    def final_averaged_accuracy(self) -> float:
        return self.averaged_accuracy[-1] if self.averaged_accuracy and not self.diverged else float("nan")

    def headline(self, protocol: Protocol) -> float:
        """The protocol's quantity of this run (nan when it diverged)."""
        if self.diverged:
            return float("nan")
        return {"workers_mean": self.final_accuracy, "averaged_model": self.final_averaged_accuracy,
                "worst_worker_tail": self.worst_worker_tail_accuracy}[protocol.quantity]

    @property
    def final_worst_worker_accuracy(self) -> float:
        return self.worst_worker_accuracy[-1] if self.worst_worker_accuracy and not self.diverged else float("nan")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def error_buffer(engine):
    """The engine's error buffers ``[W, C]``: every worker's e_w over all buckets that keep
    one in ``bucket.state["error"]`` (PowerSGD, the sketches, the allgather compressors),
    or None for an algorithm without one."""
    errors = [bucket.state["error"] for bucket in engine.runtime.bagua_buckets
              if torch.is_tensor(bucket.state.get("error"))]
    return torch.cat([e.reshape(engine.n, -1) for e in errors], dim=1) if errors else None


def train(setting: Setting, data, config: AlgorithmConfig, seed: int, lr: float | None = None,
          device="cpu") -> Run:
    """Train ``config``'s algorithm on ``setting`` from seed ``seed`` on the engine
    (:func:`bagua_algos.experiments.training.train_epochs`, the sweep's loop), with the
    setting's learning-rate schedule, every step timed, and each worker's error-buffer
    norm read after each epoch."""
    setting = setting if lr is None else setting.with_(lr=lr)
    if getattr(data, "train_augment", None) is not None:  # CIFAR-10's crops and flips: this seed's draws
        data = replace(data, train_augment=data.train_augment.with_seed(seed))
    torch.manual_seed(seed)
    module = make_model(setting.model, data.image_shape, data.num_classes)
    optimizer = setting.protocol.optimizer_for(module, setting.lr)  # each worker's own, stacked
    engine = Engine(module, setting.workers, config.build(), optimizer, device=device)
    shares = None if setting.alpha is None else WorkerShares(data.train_y.cpu(), setting.workers, setting.alpha, seed)
    n_steps = steps_per_epoch(setting, len(data.train_y)) if shares is None else None
    per_epoch = n_steps or (len(shares) // setting.batch if shares is not None else 0) or 1
    batches = ((lambda epoch: iid_batches(len(data.train_y), setting.workers, setting.batch, epoch, seed, device))
               if shares is None else (lambda epoch: shares.batches(epoch, setting.batch, device=device)))
    run = Run(config.label, seed, setting.lr)

    def read_error_norm():
        error = error_buffer(engine)
        if error is not None:
            run.error_norm.append(float(error.norm(dim=1).mean()))

    started = time.perf_counter()
    curves = train_epochs(StackedWorkers(engine, data, batches, batched_average=False), setting.epochs,
                          setting.max_steps_per_epoch,
                          lr_at=setting.protocol.schedule_for(setting.lr, setting.epochs, per_epoch, setting.workers),
                          time_steps=True, codec_refusal_diverges=True, after_epoch=read_error_norm)
    run.test_accuracy = curves.mean_worker_accuracy
    run.worst_worker_accuracy = curves.min_worker_accuracy
    run.worst_worker_tail_accuracy = tail_accuracy(curves.worker_accuracy, setting.protocol.tail_fraction)
    run.averaged_accuracy = curves.averaged_accuracy
    run.train_loss = curves.train_loss
    run.epoch_seconds = curves.epoch_seconds
    diverged = curves.diverged
    if diverged is not None:  # a quantising codec refused non-finite values, or an epoch's loss is not finite
        run.diverged = (f"epoch {diverged.epoch}, step {diverged.step}: {diverged.error}" if diverged.error is not None
                        else f"training loss not finite in epoch {diverged.epoch}")
    run.step_seconds = statistics.median(curves.step_seconds) if curves.step_seconds else float("nan")
    run.seconds = time.perf_counter() - started
    return run


# ------------------------------------------------------------------------------ bytes


def _bytes_worker(rank, world_size, model_name, sample_shape, num_classes, configs):
    """On each gloo worker: every config's bytes handed to collectives in its third step."""
    from bagua_algos.runtime import comm

    sent = {}
    for config in configs:
        torch.manual_seed(0)
        model = make_model(model_name, sample_shape, num_classes)
        optimizer = config.optimizer_for(model.parameters(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
        model.with_bagua([optimizer], config.build(optimizer))
        g = torch.Generator().manual_seed(rank)
        for step in range(3):
            x = torch.randn(2, *sample_shape, generator=g)
            y = torch.randint(0, num_classes, (2,), generator=g)
            if step == 2:  # steady state: warm start, error buffers and start_iter behind us
                comm.reset_bytes_sent()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        sent[config.label] = comm.bytes_sent()
        if config.background_rounds:
            model.bagua_algorithm.abort(model)
        model.bagua_ddp.detach()
    return sent


def bytes_per_step(configs, model_name: str, sample_shape: tuple, num_classes: int = 10,
                   timeout: float = 300.0) -> dict:
    """label → bytes one worker hands to collectives per step (the larger of two gloo workers)."""
    from bagua_algos.experiments.gloo_workers import run_workers

    per_rank = run_workers(_bytes_worker, 2, model_name, tuple(sample_shape), num_classes, list(configs),
                           timeout=timeout)
    return {label: max(r[label] for r in per_rank) for label in per_rank[0]}


# ------------------------------------------------------------------------------ timing


def time_call(fn, device, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls (synchronised on CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_step(engine: Engine, x, y, device, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of one engine step on the fixed batch (x, y)."""
    loss_fn = torch.nn.functional.cross_entropy
    return time_call(lambda: engine.step(x, y, loss_fn), device, warmup, repeats)


def spread(values) -> tuple[float, float, float]:
    """(mean, min, max) of the finite values (nan when none)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan"), float("nan")
    return float(np.mean(values)), min(values), max(values)
