"""Every worker's batches, as each rank draws them, in one process (the one-process
engine's data, ``bagua_algos.engine``: docs/engine.md, "Data").

Worker i's share is rank i's :class:`samplers.DistributedHeterogeneousSampler` share
(the same Dirichlet partition for the same seed, the same order per epoch) and its
batches are a ``DataLoader``'s over that sampler (consecutive runs of ``batch_size``,
the last one shorter: there is no ``drop_last``). The shares are equal in length (the sampler
pads them), so batch t of every worker has the same size and the n batches stack into
one ``[n, b]`` index tensor.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .heterogeneous import DistributedHeterogeneousSampler

__all__ = ["WorkerShares"]


class WorkerShares:
    """The n samplers of one dataset (given by its ``labels``)."""

    def __init__(self, labels, n: int, alpha: float, seed: int = 0, shuffle: bool = True):
        labels = np.asarray(labels.cpu() if torch.is_tensor(labels) else labels)
        first = DistributedHeterogeneousSampler(range(len(labels)), num_replicas=n, rank=0, alpha=alpha,
                                                seed=seed, shuffle=shuffle, labels=labels)
        # The partition is the same for every rank: drawn once, shared by the n samplers.
        self.samplers = [first] + [first.for_rank(rank) for rank in range(1, n)]
        self.n = n

    def __len__(self) -> int:
        return len(self.samplers[0])

    def class_histogram(self) -> np.ndarray:
        return self.samplers[0].class_histogram()

    def batches(self, epoch: int, batch_size: int, device=None) -> Iterator[torch.Tensor]:
        """The ``[n, b]`` sample indices of each step of ``epoch``."""
        orders = []
        for sampler in self.samplers:
            sampler.set_epoch(epoch)
            orders.append(list(sampler))
        order = torch.tensor(orders, dtype=torch.long, device=device)
        for start in range(0, order.shape[1], batch_size):
            yield order[:, start:start + batch_size]
