"""The heterogeneity sweep's runs on the one-process engine (``--engine sim``), and the
memory a run needs, checked before anything starts.

One run trains ``--workers`` stacked workers (bagua_algos.engine) with the same data,
model, optimizer and schedule as the per-rank path (heterogeneity_sweep.train_one) and
reports the same fields, from each worker's and the averaged model's test accuracy.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from bagua_algos.engine import Engine, refusal
from bagua_algos.engine.data import WorkerShares
from bagua_algos.runtime.bucket import DEFAULT_BUCKET_SIZE

# What one worker process costs before it trains anything (torch, gloo, the CUDA
# build's libraries): measured at about 640 MB on the 2-core machine (docs/results.md).
PROCESS_BYTES = 640 * 2**20
# Copies of the parameters the engine keeps per worker: parameters, gradients, the
# optimizer's momentum, the algorithm's state (messages, error buffers, replicas) and room
# for the step's temporaries.
PARAM_COPIES = 8
# Live activations per sample of a training step, as a multiple of what the forward's
# outputs hold (autograd keeps inputs and outputs; the backward makes as much again).
ACTIVATION_FACTOR = 4


def run_result(workers, curve_min, curve_avg, curve_loss, started: float, class_histogram) -> dict:
    """The fields of one run of the sweep, the same from both engines: the last epoch's
    accuracy of every worker, the curves per epoch, the seconds since ``started``
    (``time.perf_counter()``) and the per-worker class counts."""
    return {
        "final_min_worker_accuracy": curve_min[-1],
        "final_mean_worker_accuracy": sum(workers) / len(workers),
        "final_averaged_model_accuracy": curve_avg[-1],
        "worker_accuracies": workers,
        "curve_min_worker_accuracy": curve_min,
        "curve_averaged_model_accuracy": curve_avg,
        "curve_train_loss": curve_loss,
        "seconds": time.perf_counter() - started,
        "class_histogram": np.asarray(class_histogram).tolist(),
    }


class Diverged(RuntimeError):
    """A worker's training loss is not finite: the run stops, the sweep goes on."""


def stacked_config_error(config) -> str | None:
    """Why ``config`` cannot run on the engine (None when it can)."""
    algorithm = config.build_algorithm()
    why = refusal(algorithm)
    return None if why is None else f"the one-process engine does not run {type(algorithm).__name__}: {why}"


def activation_bytes_per_sample(model: torch.nn.Module, sample: torch.Tensor) -> int:
    """Bytes the outputs of ``model``'s leaf modules take for one sample (one forward)."""
    total = 0

    def count(module, inputs, output):
        nonlocal total
        if torch.is_tensor(output):
            total += output.numel() * output.element_size()

    hooks = [m.register_forward_hook(count) for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            model(sample.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return total


def available_bytes(device: torch.device) -> int:
    """Free memory where the workers will live: the GPU's free memory, or the host's
    MemAvailable (Linux), else the total from sysconf."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def needed_bytes(engine: str, workers: int, model: torch.nn.Module, sample: torch.Tensor, batch: int,
                 data_bytes: int, jobs: int = 1) -> int:
    """An estimate of the peak memory of the sweep: ``jobs`` runs at a time (``--jobs``,
    the engine's runs in forked processes that share the parent's data)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    per_worker = PARAM_COPIES * params + ACTIVATION_FACTOR * batch * activation_bytes_per_sample(model, sample)
    if engine == "processes":
        return workers * (PROCESS_BYTES + per_worker + data_bytes)
    return jobs * workers * per_worker + data_bytes


def train_stacked(args, data, config, alpha: float, lr: float, make_model) -> dict:
    """One run of the sweep on the engine; the same fields as ``train_one``'s."""
    torch.manual_seed(args.seed)
    module = make_model()
    if config.is_qadam:  # QAdam owns its optimizer: the engine builds it on the stacked parameter
        algorithm = config.build_algorithm(config.build_qadam_optimizer(module.parameters(), lr=lr))
        optimizer = None
    else:
        algorithm = config.build_algorithm()
        optimizer = lambda params: torch.optim.SGD(  # noqa: E731
            params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    engine = Engine(module, args.workers, algorithm, optimizer, device=data.train_x.device,
                    bucket_size=config.wrap_kwargs.get("bucket_size", DEFAULT_BUCKET_SIZE))
    shares = WorkerShares(data.train_y.cpu(), args.workers, alpha, args.seed)
    loss_fn = torch.nn.functional.cross_entropy
    curve_min, curve_avg, curve_loss = [], [], []
    workers = []
    started = time.perf_counter()
    for epoch in range(args.epochs):
        total = torch.zeros(args.workers, device=data.train_x.device)
        steps = 0
        for step, index in enumerate(shares.batches(epoch, args.batch_size, device=data.train_x.device)):
            if args.max_steps_per_epoch is not None and step >= args.max_steps_per_epoch:
                break
            total += engine.step(data.train_x[index], data.train_y[index], loss_fn)
            steps += 1
        losses = (total / max(steps, 1)).cpu()  # the epoch's one read of the losses
        bad = [i for i, v in enumerate(losses.tolist()) if not np.isfinite(v)]
        if bad:
            raise Diverged(f"worker {bad[0]}'s training loss is {losses[bad[0]].item()} in epoch {epoch} "
                           f"({len(bad)} of {args.workers} workers not finite)")
        # every worker's model and the averaged one (the last row) in one batched call
        accuracies = (engine.model.predict(data.test_x, with_average=True) == data.test_y).float().mean(1).tolist()
        workers, averaged = accuracies[:-1], accuracies[-1]
        curve_min.append(min(workers))
        curve_avg.append(averaged)
        curve_loss.append(float(losses.mean()))
    return run_result(workers, curve_min, curve_avg, curve_loss, started, shares.class_histogram())
