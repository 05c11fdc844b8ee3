"""The memory a run of the sweep (or of ``reproduce``) needs, and what the machine has,
checked before anything starts."""

from __future__ import annotations

import os

import torch

__all__ = ["PROCESS_BYTES", "PARAM_COPIES", "ACTIVATION_FACTOR", "activation_bytes_per_sample", "available_bytes",
           "needed_bytes"]

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
