"""The stacked state of n workers: one flat parameter matrix, every worker's model a row.

A worker's parameters are laid out as the per-rank runtime lays out its buckets:
parameters that require grad in reverse registration order (the order their gradients
become ready), cut into buckets by Bagua's rule (:func:`bagua_algos.runtime.bucket.
bucket_groups`), each bucket padded with zeros to a multiple of the algorithm's
alignment. So bucket b of every worker is the column range ``layout.buckets[b]`` of
``params`` (shape ``[n, d]``), and an algorithm's form acts on exactly the numbers a
process's bucket holds, in the same order.

The forward and backward of all workers are one call: ``torch.func.functional_call``
of the model under ``torch.func.vmap`` over the worker dimension, with every
parameter a view of its columns of ``params``; ``Σ_i loss_i`` is differentiated once,
which gives worker i its own gradient in row i (the workers share no parameter). A
linear layer becomes one batched matrix product, a convolution one grouped convolution.
The views are autograd leaves of their own (views of ``params.detach()``, sharing its
memory): differentiating through slices of one ``[n, d]`` leaf would make autograd
build a zero ``[n, d]`` gradient per parameter and add them all up, n·d work per
parameter tensor; instead each parameter's gradient is copied once into its columns of
the preallocated ``params.grad`` (on the direct path, engine/direct.py, the backward
writes it there itself).

Buffers (BatchNorm's running statistics and count) are stacked too, ``[n, ...]`` per
buffer, and passed to the same vmapped call: each worker's forward updates its own row
in place, as its process would update its module's buffers. Buffers are local, as with
``broadcast_buffers=False`` after the initial broadcast; the averaged model of
:meth:`StackedModel.averaged_state` averages them with the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call, vmap

from ..runtime.bucket import DEFAULT_BUCKET_SIZE, bucket_groups
from .direct import GradSink, direct_plan, stacked_loss

__all__ = ["Slot", "BucketRange", "Layout", "StackedModel"]


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a worker's flat vector."""

    name: str
    shape: tuple
    start: int
    numel: int


@dataclass(frozen=True)
class BucketRange:
    """Bucket ``name``'s columns: [start, end); its tensors fill [start, start + numel),
    the rest is the alignment's zero padding."""

    name: str
    start: int
    end: int
    numel: int
    slots: tuple  # the Slots of its tensors, in bucket order

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Layout:
    """A worker's flat vector: the parameters' slots and the buckets, in bucket order."""

    slots: tuple
    buckets: tuple
    numel: int  # d, padding included

    @classmethod
    def of(cls, module: torch.nn.Module, alignment: int = 1, bucket_size: int = DEFAULT_BUCKET_SIZE) -> "Layout":
        """The per-rank runtime's layout of ``module``'s trainable parameters (shared
        parameters once, under their first name), buckets padded to ``alignment``."""
        seen, named = set(), []
        for name, param in module.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                named.append((name, param))
        if not named:
            raise ValueError("the model has no parameter that requires grad: there is nothing to train")
        named.reverse()
        groups = bucket_groups([p.numel() * p.element_size() for _, p in named],
                               [(p.dtype, p.device) for _, p in named], bucket_size)
        named_groups = []
        for index, group in enumerate(groups):
            numel = sum(named[i][1].numel() for i in group)
            named_groups.append((str(index), [named[i] for i in group], (-numel) % alignment))
        return _layout_from(named_groups)

    @classmethod
    def of_buckets(cls, module: torch.nn.Module, groups) -> "Layout":
        """The layout of an algorithm's buckets: ``groups`` is ``(bucket name,
        [parameter name, ...], padding)`` per bucket, in bucket order."""
        params = dict(module.named_parameters())
        seen = set()
        named_groups = []
        for bucket_name, names, padding in groups:
            for name in names:
                if name in seen:
                    raise ValueError(f"parameter {name!r} is in two buckets")
                seen.add(name)
            named_groups.append((bucket_name, [(name, params[name]) for name in names], padding))
        return _layout_from(named_groups)


def _layout_from(named_groups) -> "Layout":
    """A layout from ``(bucket name, [(parameter name, parameter), ...], padding)``."""
    slots, buckets, offset = [], [], 0
    for bucket_name, members, padding in named_groups:
        start = offset
        bucket_slots = []
        for name, param in members:
            bucket_slots.append(Slot(name, tuple(param.shape), offset, param.numel()))
            offset += param.numel()
        numel = offset - start
        offset += padding
        slots.extend(bucket_slots)
        buckets.append(BucketRange(bucket_name, start, offset, numel, tuple(bucket_slots)))
    return Layout(tuple(slots), tuple(buckets), offset)


class StackedModel:
    """n copies of ``module`` as one ``[n, d]`` parameter matrix and stacked buffers.

    ``module`` gives the architecture and worker 0's initial values; every worker starts
    from them (what the per-rank runtime's initial broadcast of rank 0's model does).
    ``module`` itself is never trained: it is the function that ``functional_call`` runs.
    """

    def __init__(self, module: torch.nn.Module, n: int, layout: Layout, device: torch.device):
        self.module = module.to(device)
        self.n = n
        self.layout = layout
        self.device = torch.device(device)
        params = dict(self.module.named_parameters())
        dtypes = {params[s.name].dtype for s in layout.slots}
        if len(dtypes) > 1:
            raise ValueError(f"module: the engine stacks parameters of one dtype, this module has {sorted(map(str, dtypes))}; "
                             "convert it with module.to(dtype) first")
        dtype = dtypes.pop()
        flat = torch.zeros(layout.numel, dtype=dtype, device=self.device)
        for slot in layout.slots:
            flat[slot.start:slot.start + slot.numel].copy_(params[slot.name].detach().reshape(-1))
        # X: row i is worker i's flat vector; X.grad (preallocated, padding kept zero) holds
        # every worker's gradient after forward_backward.
        self.params = torch.nn.Parameter(flat.unsqueeze(0).repeat(n, 1))
        self.params.grad = torch.zeros_like(self.params)
        self._leaves = {name: view.requires_grad_() for name, view in self.param_views(self.params.detach()).items()}
        self._grad_targets = self.param_views(self.params.grad)
        self._grad_views = list(self._grad_targets.values())
        self.buffers = {name: b.detach().unsqueeze(0).repeat(n, *([1] * b.dim())).clone()
                        for name, b in self.module.named_buffers()}
        # Parameters that do not train (requires_grad=False): the same constant for everyone.
        self.frozen = {name: p.detach() for name, p in params.items()
                       if not any(s.name == name for s in layout.slots)}
        # A plain stack of linear layers and activations runs without vmap (direct.py).
        self._direct = direct_plan(self.module)
        # every submodule, to check training mode without module.train()'s recursive
        # setattr (a tenth of a millisecond a step on the MNIST MLP's engine step)
        self._submodules = tuple(self.module.modules())

    @property
    def grads(self) -> torch.Tensor:
        return self.params.grad

    def param_views(self, params: torch.Tensor | None = None) -> dict:
        """name -> the ``[n, *shape]`` view of its columns of ``params`` (default X)."""
        params = self.params if params is None else params
        return {s.name: params[:, s.start:s.start + s.numel].view(params.shape[0], *s.shape)
                for s in self.layout.slots}

    def worker_state(self, i: int) -> dict:
        """Worker i's ``state_dict``-like mapping (parameters and buffers, detached)."""
        out = {s.name: self.params[i, s.start:s.start + s.numel].detach().view(s.shape) for s in self.layout.slots}
        out.update({name: b[i] for name, b in self.buffers.items()})
        out.update(self.frozen)
        return out

    def averaged_state(self) -> dict:
        """The averaged model: the mean of every worker's parameters and floating buffers
        (an integer buffer, BatchNorm's batch count, is worker 0's)."""
        mean = self.params.detach().mean(0)
        out = {s.name: mean[s.start:s.start + s.numel].view(s.shape) for s in self.layout.slots}
        out.update({name: _average_buffer(b) for name, b in self.buffers.items()})
        out.update(self.frozen)
        return out

    def _with_average(self) -> tuple:
        """``[n + 1, d]`` parameters and ``[n + 1, ...]`` buffers: every worker's, then
        the averaged model's (:meth:`averaged_state`'s rule) as row n."""
        params = self.params.detach()
        params = torch.cat([params, params.mean(0, keepdim=True)])
        buffers = {name: torch.cat([b, _average_buffer(b).unsqueeze(0)]) for name, b in self.buffers.items()}
        return params, buffers

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn, accumulate: bool = False) -> torch.Tensor:
        """Every worker's loss on its own batch (``x[i]``, ``y[i]``), shape ``[n]``, and
        its gradient in row i of ``grads`` (added to what is there with ``accumulate``,
        as backward adds to a process's ``p.grad``); the forward updates each worker's
        buffers in place (training mode)."""
        if not all(m.training for m in self._submodules):
            self.module.train()

        sink = None
        if self._direct is not None:
            # the backward writes each parameter's gradient into its columns of X.grad (direct.py)
            sink = GradSink(self._grad_targets, accumulate)
            losses = stacked_loss(loss_fn)(self._direct(x, {**self._leaves, **self.frozen}, sink), y)
        else:
            def one(params, buffers, xi, yi):
                out = functional_call(self.module, ({**params, **self.frozen}, buffers), (xi,))
                return loss_fn(out, yi)

            losses = vmap(one, randomness="different")(self._leaves, self.buffers, x, y)
        grads = torch.autograd.grad(losses.sum(), list(self._leaves.values()), allow_unused=True)
        with torch.no_grad():
            for name, target, grad in zip(self._grad_targets, self._grad_views, grads):
                if sink is not None and name in sink.written:
                    continue  # written by the backward
                if grad is None:  # a parameter the loss does not use: no gradient, as in a process
                    if not accumulate:
                        target.zero_()
                elif accumulate:
                    target.add_(grad)
                else:
                    target.copy_(grad)
        return losses.detach()

    @torch.no_grad()
    def predict(self, x: torch.Tensor, chunk: int = 1000, with_average: bool = False) -> torch.Tensor:
        """Every worker's predicted class for the shared inputs ``x``: ``[n, len(x)]``
        (evaluation mode: BatchNorm uses each worker's running statistics). With
        ``with_average``, ``[n + 1, len(x)]``: row n is the averaged model's
        (:meth:`predict_averaged`'s), computed in the same batched call."""
        self.module.eval()
        params, buffers = self._with_average() if with_average else (self.params.detach(), self.buffers)
        views = self.param_views(params)
        if self._direct is not None and not buffers:
            def batched(views, buffers, xs):
                stacked = xs.unsqueeze(0).expand(params.shape[0], *xs.shape)
                return self._direct(stacked, {**views, **self.frozen}).argmax(-1)
        else:
            def one(params, buffers, xs):
                return functional_call(self.module, ({**params, **self.frozen}, buffers), (xs,)).argmax(-1)

            batched = vmap(one, in_dims=(0, 0, None))
        out = torch.cat([batched(views, buffers, x[s:s + chunk]) for s in range(0, len(x), chunk)], dim=1)
        self.module.train()
        return out

    @torch.no_grad()
    def predict_averaged(self, x: torch.Tensor, chunk: int = 1000) -> torch.Tensor:
        """The averaged model's predicted class for ``x``."""
        self.module.eval()
        state = self.averaged_state()
        out = torch.cat([functional_call(self.module, state, (x[s:s + chunk],)).argmax(-1)
                         for s in range(0, len(x), chunk)])
        self.module.train()
        return out


def _average_buffer(b: torch.Tensor) -> torch.Tensor:
    """The averaged model's value of a stacked buffer ``[n, ...]``: the mean of a
    floating one (computed in float32), worker 0's of an integer one (BatchNorm's count)."""
    return b.float().mean(0).to(b.dtype) if b.is_floating_point() else b[0]
