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
from .forms import form_for
from .runtime import StackedRuntime
from .stacked import Layout, StackedModel

__all__ = ["Engine"]


class Engine:
    """n workers of ``algorithm`` training copies of ``module`` in one process.

    Args:
        module: the model; its values are every worker's initial model (as after the
            per-rank runtime's broadcast of rank 0's model).
        n: the number of workers.
        algorithm: a bagua_algos ``Algorithm`` (the object ``with_bagua`` would take).
        optimizer: ``optimizer(params_list)`` builds the optimizer of the stacked
            ``[n, d]`` parameter; an elementwise torch optimizer (SGD, Adam, …) on it is
            each worker's own optimizer, its state stacked the same way.
        device: where all workers live (the CPU or one GPU).
        bucket_size: the per-rank runtime's bucket size (bytes): it decides the buckets,
            which decide what the quantising and relaying forms cut into chunks.

    ``step(x, y, loss_fn)`` is one training step of every worker: ``x[i]``, ``y[i]`` are
    worker i's batch.
    """

    def __init__(self, module: torch.nn.Module, n: int, algorithm, optimizer, device="cpu",
                 bucket_size: int = DEFAULT_BUCKET_SIZE):
        self.n = check_int("n", n, 1, what="a number of workers >= 1")
        self.device = torch.device(device)
        self.algorithm = algorithm
        form_class = form_for(algorithm)
        self.runtime = None
        self.form = None
        if form_class is None:  # the algorithm's own hooks and ops, on stacked buckets
            self.runtime = StackedRuntime(module, self.n, algorithm, optimizer, self.device, bucket_size)
            self.model = self.runtime.model
            self.optimizer = self.runtime.bagua_optimizers[0]
        else:
            layout = Layout.of(module, alignment=form_class.alignment(algorithm, self.n), bucket_size=bucket_size)
            self.model = StackedModel(module, self.n, layout, self.device)
            self.optimizer = form_class.make_optimizer(algorithm, self.model.params, optimizer)
            self.form = form_class(algorithm, self)
        self.steps = 0  # bagua_train_step_counter

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
        """One step of every worker; returns the ``[n]`` losses (detached)."""
        self.steps += 1
        if self.runtime is not None:
            return self.runtime.step(x, y, loss_fn)
        self.form.before_forward(self.steps)
        losses = self.model.forward_backward(x, y, loss_fn)  # overwrites every gradient
        self.form.after_backward(self.steps)
        self.optimizer.step()
        self.form.after_step(self.steps)
        return losses
