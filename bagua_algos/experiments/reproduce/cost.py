"""What each seed-scale command costs: its FLOPs, counted, and its time on this CPU and on
one GPU (``reproduce estimate``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bagua_algos.experiments import reproduce_train as rt
from bagua_algos.experiments.reproduce.output import print_table


@dataclass(frozen=True)
class SeedCost:
    """What ``--scale seed`` trains: ``runs`` runs (rows x seeds x tuned rates, at the
    default 3 seeds) of ``epochs`` epochs of CIFAR-10 with ``model`` on ``workers`` workers."""

    model: str
    runs: int
    epochs: int
    workers: int


CIFAR_TRAIN, CIFAR_TEST = 50_000, 10_000


def flops_per_image(model_name: str) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs of one 3x32x32 image, counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    model = rt.make_model(model_name, (3, 32, 32))
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    with FlopCounterMode(display=False) as forward:
        model(x)
    with FlopCounterMode(display=False) as both:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return forward.get_total_flops() / 2, both.get_total_flops() / 2


def estimate(gpu_tflops: float, experiments) -> None:
    """Each seed-scale command's FLOPs (counted) and its time: on this CPU at the rate
    measured here, and on one GPU at an assumed sustained ``gpu_tflops``; ``experiments``:
    the :class:`~bagua_algos.experiments.reproduce.catalog.Experiment` entries, those with a cost counted."""
    rates, counts = {}, {}
    for model_name in sorted({e.cost.model for e in experiments if e.cost}):
        counts[model_name] = flops_per_image(model_name)
        torch.manual_seed(0)
        model = rt.make_model(model_name, (3, 32, 32))
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        seconds = rt.time_call(lambda: torch.nn.functional.cross_entropy(model(x), y).backward(), "cpu", 1, 3)
        rates[model_name] = 8 * counts[model_name][1] / seconds
        print(f"{model_name}: {counts[model_name][0] / 1e9:.2f} GFLOP forward, {counts[model_name][1] / 1e9:.2f} "
              f"forward + backward per image; this CPU ({torch.get_num_threads()} threads): "
              f"{1000 * seconds:.0f} ms per batch of 8, {rates[model_name] / 1e9:.1f} GFLOP/s")
    rows = []
    for e in experiments:
        if e.cost is None:
            continue
        c = e.cost
        forward, both = counts[c.model]
        # per epoch: every training image forward and backward; the test set through the
        # averaged model and every worker's (the runs evaluate all of them each epoch)
        per_epoch = CIFAR_TRAIN * both + (c.workers + 1) * CIFAR_TEST * forward
        total = c.runs * c.epochs * per_epoch
        rows.append([e.name, c.model, c.runs, c.epochs, f"{total / 1e15:.0f}",
                     f"{total / rates[c.model] / 86400:.0f}", f"{total / (gpu_tflops * 1e12) / 3600:.1f}"])
    print()
    print_table(["experiment", "model", "runs", "epochs", "PFLOP", "days on this CPU",
                 f"GPU hours at {gpu_tflops:g} TFLOP/s sustained (estimate)"], rows)
