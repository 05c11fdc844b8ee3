"""The one training loop of the experiments: the sweep (both engines) and ``reproduce``.

:func:`train_epochs` runs epochs of steps over a set of workers and records, after each
epoch, every worker's mean training loss, every worker's test accuracy and the averaged
model's, and stops at the first sign of divergence (a worker's epoch loss that is not
finite, or, where asked, a codec refusing non-finite gradients) with a
:class:`Divergence` that says where, for the caller to report in its own words.

The workers are one of:

- :class:`StackedWorkers`: all n workers stacked on the one-process engine
  (:class:`bagua_algos.engine.Engine`): a step is one ``engine.step`` for all of them and
  its losses are a ``[n]`` tensor on the engine's device, read once per epoch;
- :class:`ProcessWorker`: this process's worker of a launched job (``with_bagua`` on a
  module): a step is forward, backward and ``optimizer.step()``, its loss read as a
  Python float, and each epoch's mean is allgathered so every rank sees every worker's
  (and all stop together on a NaN).

Both apply the data's training augmentation where it has one (``data.train_augment``:
CIFAR-10's crop and flip, :class:`bagua_algos.experiments.data.CifarAugmentation`) to
each batch, told the epoch, the step and the worker, whose draws depend on those alone:
so the engine's stacked batch and each process's own batch are cropped and flipped alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

__all__ = ["Divergence", "Curves", "StackedWorkers", "ProcessWorker", "train_epochs"]


@dataclass
class Divergence:
    """Where a run stopped: in ``epoch``, at ``step`` when a codec refused the step's
    non-finite gradients (its message in ``error``), else after the epoch, whose
    per-worker mean losses (``losses``, a CPU tensor) are not all finite."""

    epoch: int
    step: int | None = None
    error: str | None = None
    losses: torch.Tensor | None = None

    @property
    def bad_workers(self) -> list[int]:
        """The workers whose epoch loss is not finite ([] for a codec's refusal)."""
        if self.losses is None:
            return []
        return [i for i, v in enumerate(self.losses.tolist()) if not math.isfinite(v)]


@dataclass
class Curves:
    """What :func:`train_epochs` records, one entry per finished epoch."""

    worker_accuracy: list = field(default_factory=list)  # every worker's test accuracy
    averaged_accuracy: list = field(default_factory=list)  # the averaged model's
    train_loss: list = field(default_factory=list)  # the mean over workers of their epoch means
    epoch_seconds: list = field(default_factory=list)  # wall time since the start, at each epoch's end
    step_seconds: list = field(default_factory=list)  # timed steps (``time_steps``), epochs 2 on
    diverged: Divergence | None = None

    @property
    def min_worker_accuracy(self) -> list:
        return [min(workers) for workers in self.worker_accuracy]

    @property
    def mean_worker_accuracy(self) -> list:
        """The mean over workers of their own models' accuracy: what the decentralized
        papers report (each worker evaluates its own parameters)."""
        return [sum(workers) / len(workers) for workers in self.worker_accuracy]


class StackedWorkers:
    """n workers stacked on the engine. ``batches(epoch)`` yields ``[n, batch]`` index
    tensors into ``data.train_x``; ``batched_average`` evaluates every worker's model
    and the averaged one in one batched call (the sweep's), else in two (reproduce's)."""

    def __init__(self, engine, data, batches: Callable[[int], Iterable], batched_average: bool = True):
        self.engine = engine
        self.data = data
        self._batches = batches
        self.batched_average = batched_average
        self.device = data.train_x.device
        self.augment = getattr(data, "train_augment", None)
        self.position = (0, 0)  # (epoch, step) of the batch being trained

    def batches(self, epoch: int):
        for step, index in enumerate(self._batches(epoch)):
            self.position = (epoch, step)
            yield index

    def zero_losses(self):
        return torch.zeros(self.engine.n, device=self.device)

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def step(self, index):
        x = self.data.train_x[index]
        if self.augment is not None:  # every worker's batch, worker i's draws its own
            x = self.augment(x, *self.position, range(self.engine.n))
        return self.engine.step(x, self.data.train_y[index], torch.nn.functional.cross_entropy)

    def gradients_finite(self) -> bool:
        return bool(torch.isfinite(self.engine.model.grads).all())

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def epoch_losses(self, total, steps: int) -> torch.Tensor:
        return (total / max(steps, 1)).cpu()  # the epoch's one read of the losses

    def evaluate(self) -> tuple[list[float], float]:
        model, x, y = self.engine.model, self.data.test_x, self.data.test_y
        with torch.no_grad():
            if self.batched_average:  # every worker's model and the averaged one (the last row) in one call
                accuracies = (model.predict(x, with_average=True) == y).float().mean(1).tolist()
                return accuracies[:-1], accuracies[-1]
            workers = (model.predict(x) == y).float().mean(1).tolist()
            return workers, float((model.predict_averaged(x) == y).float().mean())


class ProcessWorker:
    """This rank's worker of a launched job: ``model`` wrapped by ``with_bagua``, its
    ``optimizer``, a ``loader`` over its ``sampler``'s share, and ``evaluate(model)``
    giving (every worker's accuracy, the averaged model's), collectively; ``augment``:
    the data's ``train_augment`` (None: none), applied to this rank's batches."""

    def __init__(self, model, optimizer, loader, sampler, evaluate, augment=None):
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.sampler = sampler
        self._evaluate = evaluate
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.augment = augment
        self.position = (0, 0)  # (epoch, step) of the batch being trained

    def batches(self, epoch: int):
        self.sampler.set_epoch(epoch)
        for step, batch in enumerate(self.loader):
            self.position = (epoch, step)
            yield batch

    def zero_losses(self):
        return 0.0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, batch) -> float:
        x, y = batch
        if self.augment is not None:
            from bagua_algos.runtime import comm

            x = self.augment(x, *self.position, comm.get_rank())
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def gradients_finite(self) -> bool:
        return all(bool(torch.isfinite(p.grad).all()) for p in self.model.parameters() if p.grad is not None)

    def synchronize(self) -> None:
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def epoch_losses(self, total, steps: int) -> torch.Tensor:
        """Every worker's mean loss of the epoch, on every worker (CPU tensors: over gloo in any job)."""
        from bagua_algos.runtime import comm

        everyone = torch.zeros(comm.get_world_size(), dtype=torch.float64)
        comm.allgather(torch.tensor([total / max(steps, 1)], dtype=torch.float64), everyone)
        return everyone

    def evaluate(self) -> tuple[list[float], float]:
        return self._evaluate(self.model)


def train_epochs(workers, epochs: int, max_steps_per_epoch: int | None = None,
                 lr_at: Callable[[int, int], float] | None = None, time_steps: bool = False,
                 codec_refusal_diverges: bool = False, after_epoch: Callable[[], None] | None = None) -> Curves:
    """Train ``workers`` (:class:`StackedWorkers` or :class:`ProcessWorker`) for ``epochs``.

    ``max_steps_per_epoch`` cuts epochs short; ``lr_at(epoch, step)`` sets the learning
    rate before each step; ``time_steps`` times each step between two device
    synchronisations (from the second epoch on, or in the only one);
    ``codec_refusal_diverges``: a ValueError from a step whose gradients are not all
    finite (a quantising codec refusing them) stops the run as diverged instead of
    propagating; ``after_epoch()`` runs after each recorded epoch (e.g. to read state).
    """
    curves = Curves()
    started = time.perf_counter()
    for epoch in range(epochs):
        total, steps = workers.zero_losses(), 0
        for step, batch in enumerate(workers.batches(epoch)):
            if max_steps_per_epoch is not None and step >= max_steps_per_epoch:
                break
            if lr_at is not None:
                workers.set_lr(lr_at(epoch, step))
            if time_steps:
                workers.synchronize()
            t0 = time.perf_counter()
            try:
                loss = workers.step(batch)
            except ValueError as err:
                if not codec_refusal_diverges or workers.gradients_finite():
                    raise
                curves.diverged = Divergence(epoch, step=step, error=str(err))
                break
            total += loss
            if time_steps:
                workers.synchronize()
                if epoch > 0 or epochs == 1:
                    curves.step_seconds.append(time.perf_counter() - t0)
            steps += 1
        if curves.diverged is not None:
            break
        losses = workers.epoch_losses(total, steps)
        if not torch.isfinite(losses).all():
            curves.diverged = Divergence(epoch, losses=losses)
            break
        worker_accuracy, averaged = workers.evaluate()
        curves.worker_accuracy.append(worker_accuracy)
        curves.averaged_accuracy.append(averaged)
        curves.train_loss.append(float(losses.mean()))
        if after_epoch is not None:
            after_epoch()
        curves.epoch_seconds.append(time.perf_counter() - started)
    return curves
