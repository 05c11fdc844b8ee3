"""The one-process engine: the n workers of one job, stacked, on one device.

Example::

    >>> import torch
    >>> from bagua_algos.algorithms import RelayAlgorithm
    >>> from bagua_algos.engine import Engine
    >>> torch.manual_seed(0)                                    # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> engine = Engine(torch.nn.Linear(4, 2), 8, RelayAlgorithm(topology="chain"),
    ...                 lambda params: torch.optim.SGD(params, lr=0.1))
    >>> x, y = torch.randn(8, 5, 4), torch.randint(0, 2, (8, 5))  # [workers, batch, ...]
    >>> losses = engine.step(x, y, torch.nn.functional.cross_entropy)
    >>> losses.shape
    torch.Size([8])
"""

from __future__ import annotations

import torch

from ..arguments import check_int
from ..runtime.bucket import DEFAULT_BUCKET_SIZE
from .runtime import StackedRuntime

__all__ = ["Engine"]


class Engine:
    """n workers of ``algorithm`` training copies of ``module`` in one process.

    The algorithm runs as it runs in a job: its own ``AlgorithmImpl``, hooks and bucket
    ops, once per step for all n workers on stacked buckets, its collectives those of
    the engine's transport (:class:`~.runtime.StackedRuntime`, :mod:`.transport`). Nothing is registered
    for an algorithm: one outside the package, or written for Bagua, runs as the
    package's own do.

    Args:
        module: the model; its values are every worker's initial model (as after the
            per-rank runtime's broadcast of rank 0's model).
        n: the number of workers.
        algorithm: a bagua_algos ``Algorithm`` (the object ``with_bagua`` would take).
        optimizer: ``optimizer(params_list)`` builds the optimizer of the workers'
            stacked parameters (``[n, *shape]`` each, a row per worker); an elementwise
            torch optimizer (SGD, Adam, …) on them is each worker's own, its state
            stacked the same way. None for an algorithm that owns its optimizer (QAdam).
        device: where all workers live (the CPU or one GPU).
        bucket_size: the per-rank runtime's bucket size (bytes): it decides the buckets,
            which decide what the quantising and relaying algorithms cut into chunks.
        flat_optimizer: build the optimizer on the one ``[n, d]`` parameter matrix
            (``engine.model.params``, its ``.grad`` the stacked gradients) instead of on
            the parameters' ``[n, *shape]`` views. For an elementwise optimizer with one
            param group (SGD, Adam, AdamW: the same hyper-parameters for every
            parameter) this is the same arithmetic on every number, in one contiguous
            tensor: a fused kernel steps all of it in one call. On the views, each
            strided (a row of ``[n, d]`` apart), a fused optimizer is refused (torch's
            fused kernels write a strided tensor as if it were contiguous) and the
            for-loop and foreach ones step view by view. The zero padding of the
            buckets stays zero (its gradient is zero).
            The optimizer's state is then one ``[n, d]`` tensor per state name; param
            groups per parameter are not possible, and an algorithm that looks its
            parameters up in the optimizer (QAdam, low-precision decentralized,
            quasi-global momentum) is refused.

    ``step(x, y, loss_fn)`` is one training step of every worker: ``x[i]``, ``y[i]`` are
    worker i's batch. An algorithm the engine cannot run is refused by name when the
    engine is built (:class:`~.runtime.EngineRefusal`, a TypeError).
    """

    def __init__(self, module: torch.nn.Module, n: int, algorithm, optimizer, device="cpu",
                 bucket_size: int = DEFAULT_BUCKET_SIZE, flat_optimizer: bool = False):
        self.n = check_int("n", n, 1, what="a number of workers >= 1")
        if not isinstance(flat_optimizer, bool):
            raise TypeError(f"flat_optimizer must be True or False, got {flat_optimizer!r}")
        self.device = torch.device(device)
        self.algorithm = algorithm
        self.runtime = StackedRuntime(module, self.n, algorithm, optimizer, self.device, bucket_size,
                                      flat_optimizer=flat_optimizer)
        self.model = self.runtime.model
        self.optimizer = self.runtime.bagua_optimizers[0]

    @property
    def steps(self) -> int:
        """Training steps taken (``bagua_train_step_counter``)."""
        return self.runtime.bagua_train_step_counter

    @property
    def impl(self):
        """The algorithm's ``AlgorithmImpl`` (its state: error buffers, counters, …)."""
        return self.runtime.bagua_algorithm

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
        """One step of every worker; returns the ``[n]`` losses (detached)."""
        return self.runtime.step(x, y, loss_fn)
