"""QAdam's two updates side by side: Bagua 0.9.2's (the default) and the frozen one.

    python benchmarks/qadam_variants.py [--workers 2] [--steps 300]

Each of the given (warm-up steps, learning rate) settings trains the same two-layer MLP
on scikit-learn's digits with ``qadam`` (hierarchical=False, batch 32 per worker, a
seeded model and per-rank batches) once with ``variant="bagua"`` and once with
``variant="frozen"``, and rank 0 prints the mean loss of the first 5 and last 10 steps
and the training accuracy of the final model (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from bagua_algos.experiments.common import init_for_device, launch_self, launched_worker, without_flag

SETTINGS = ((8, 0.01), (20, 0.01), (100, 0.001))  # (warmup_steps, lr)
MODULE = "bagua_algos.experiments.qadam_variants"  # what each worker runs (launch_self)


def train(variant: str, warmup: int, lr: float, steps: int, x, y) -> tuple[float, float, float]:
    import torch

    from bagua_algos import algorithms as A
    from bagua_algos.runtime import comm

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = A.QAdamOptimizer(model.parameters(), lr=lr, warmup_steps=warmup, variant=variant)
    model.with_bagua([optimizer], A.QAdamAlgorithm(optimizer, hierarchical=False))
    g = torch.Generator().manual_seed(comm.get_rank())
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=g)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.bagua_ddp.detach()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return sum(losses[:5]) / 5, sum(losses[-10:]) / 10, accuracy


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="qadam_variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="local workers (default 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.steps < 10:
        parser.error("--workers must be >= 1 and --steps >= 10")
    if not launched_worker(MODULE):  # the parent, whatever RANK its environment holds
        launch_self(MODULE, args.workers, without_flag(argv, "--workers"), "QADAM_VARIANTS_COMMAND")
        return
    import torch
    from sklearn.datasets import load_digits

    from bagua_algos.runtime import comm

    torch.set_num_threads(1)
    init_for_device("cpu")
    digits = load_digits()
    x, y = torch.tensor(digits.data / 16.0, dtype=torch.float32), torch.tensor(digits.target)
    for warmup, lr in SETTINGS:
        for variant in ("bagua", "frozen"):
            first, last, accuracy = train(variant, warmup, lr, args.steps, x, y)
            if comm.get_rank() == 0:
                print(f"warmup {warmup:3d} lr {lr:g} {variant:6s}: first-5 loss {first:.3f}, last-10 loss {last:.3f}, "
                      f"train accuracy {accuracy:.4f}", flush=True)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
