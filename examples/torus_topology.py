"""The template topology: a two-dimensional torus, a whole topology in one file.

Copy this file to add a topology (docs/DESIGN.md, "Adding a topology"). A topology only
names each rank's neighbours (``_candidate_neighbors``); the base class derives the
edges, degrees, distances, the tree test and the Metropolis–Hastings gossip weights, and
``@register_topology`` makes it reachable by name wherever a topology is taken::

    DecentralizedAlgorithm(hierarchical=False, topology="torus")   # after importing this file
    DecentralizedAlgorithm(hierarchical=False, topology=TorusTopology(16))   # or an instance

The graph: the n ranks on an r × c grid (r the largest divisor of n with r ≤ √n, c = n / r),
rank k at row k // c and column k % c, each joined to the ranks above, below, left and
right of it with wrap-around. Each rank has at most four neighbours (fewer where r or c
is 1 or 2), so a gossip step moves about as many bytes as on a ring of the same n, while
the diameter is ⌊r/2⌋ + ⌊c/2⌋ instead of ⌊n/2⌋: information spreads in O(√n) steps.

It also runs, on the one-process engine, D-PSGD over the torus against the ring::

    python examples/torus_topology.py --workers 16 --steps 30

printing how far the workers' models are from their average (the consensus distance),
which the torus closes faster. tests/test_topology_template.py runs it.
"""

from __future__ import annotations

import argparse
import math

from topologies import Topology, register_topology

__all__ = ["TorusTopology", "grid_shape"]


def grid_shape(world_size: int) -> tuple[int, int]:
    """(rows, columns): rows the largest divisor of ``world_size`` not above its square root."""
    rows = max(d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0)
    return rows, world_size // rows


@register_topology
class TorusTopology(Topology):
    """The ranks on a rows × columns grid (:func:`grid_shape`) with wrap-around: rank k
    neighbours up, down, left and right of it (duplicates and itself dropped by the base)."""

    name = "torus"

    def _candidate_neighbors(self, rank):
        rows, cols = grid_shape(self.world_size)
        row, col = divmod(rank, cols)
        return [((row - 1) % rows) * cols + col, ((row + 1) % rows) * cols + col,
                row * cols + (col - 1) % cols, row * cols + (col + 1) % cols]


def consensus_distance(topology: str, workers: int, steps: int) -> float:
    """(1/n) Σ_i ‖x_i − x̄‖² after ``steps`` of D-PSGD on the one-process engine: n workers
    fitting a linear model, each to targets of its own linear function (non-IID data)."""
    import torch

    from bagua_algos.algorithms import DecentralizedAlgorithm
    from bagua_algos.engine import Engine

    torch.manual_seed(0)
    engine = Engine(torch.nn.Linear(8, 1), workers, DecentralizedAlgorithm(hierarchical=False, topology=topology),
                    lambda params: torch.optim.SGD(params, lr=0.05))
    targets = torch.randn(workers, 8, 1)  # worker i fits y = x · w_i
    for _ in range(steps):
        x = torch.randn(workers, 16, 8)
        engine.step(x, x @ targets, torch.nn.functional.mse_loss)
    rows = engine.model.params.detach()  # [n, d]: a row per worker
    return float(((rows - rows.mean(0)) ** 2).sum(1).mean())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="D-PSGD over the torus against the ring on the one-process engine")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args(argv)
    if args.workers < 2 or args.steps < 1:
        p.error(f"--workers must be at least 2 and --steps at least 1, got {args.workers} and {args.steps}")
    torus = TorusTopology(args.workers)
    print(f"torus {grid_shape(args.workers)}: diameter {torus.diameter()}, "
          f"ring: diameter {args.workers // 2}")
    for name in ("ring", "torus"):
        print(f"{name}: consensus distance after {args.steps} steps "
              f"{consensus_distance(name, args.workers, args.steps):.4g}")


if __name__ == "__main__":
    main()
