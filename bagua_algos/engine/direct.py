"""Sequential models of linear layers and elementwise activations, run on the stacked
batch directly, without ``vmap``.

Under ``vmap`` a linear layer decomposes into ``matmul(x, W.t()) + b``: the forward is a
batched product plus a broadcast add, and the backward computes the gradient of
``W.t()`` and transposes it, so copying it into the worker's ``[out, in]`` columns is a
transposed, cache-hostile copy. For the MLPs of the sweep this made the engine's
forward and backward about 2.4× the cost of the same products written out (measured on
the sweep's 64-128-128-10 MLP, 16 workers × 16, 2 CPU cores). :class:`StackedLinear`
writes them out:

    forward   Y_i = X_i W_iᵀ + b_i        one ``baddbmm`` over the worker dimension
    backward  ∂X_i = G_i W_i              one ``bmm``
              ∂W_i = G_iᵀ X_i             one ``bmm``, already in W's row-major layout
              ∂b_i = Σ_rows G_i

The weight and bias gradients go straight to the engine's gradient matrix: the
forward is given a :class:`GradSink` (parameter name → its ``[n, *shape]`` view of
``params.grad``) and the backward writes ``∂W_i`` with ``bmm(..., out=view)`` and
``∂b_i`` with ``sum(..., out=view)`` (added with ``accumulate``), returning no gradient
for the leaf. Through autograd, each gradient was a contiguous tensor the engine then
copied into its columns (a row of the ``[n, d]`` matrix apart): a pass over every
parameter a step, about a tenth of the engine's DiLoCo step on the MNIST MLP at 8
workers (one thread). The values are the same products, bit for bit.

A model qualifies (:func:`direct_plan`) when it is one of ``nn.Linear``, ``nn.Flatten``
and the elementwise activations in :data:`ELEMENTWISE`, or an ``nn.Sequential`` of them
(nested ones included), with no hooks; anything else runs under ``vmap`` as before. Both
paths compute each worker's loss of its own batch with its own parameters: the same
arithmetic, and the equality test holds either to the multi-process run.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

__all__ = ["ELEMENTWISE", "GradSink", "StackedLinear", "direct_plan", "stacked_loss"]

ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softplus,
               nn.Hardtanh, nn.Identity)
"""Activations applied per element: the worker dimension in front changes nothing."""


class GradSink:
    """Where the backward of :class:`StackedLinear` writes the parameters' gradients:
    ``targets`` maps a parameter's name to its ``[n, *shape]`` view of the engine's
    gradient matrix; ``accumulate`` adds to what is there (else overwrites). ``written``
    collects the names written in this backward: a name written twice (one parameter
    used by two layers) is added to the second time, as autograd would sum the two."""

    def __init__(self, targets: dict, accumulate: bool = False):
        self.targets = targets
        self.accumulate = accumulate
        self.written: set = set()

    def write(self, name: str, compute, out_compute) -> None:
        """``compute()`` the gradient and add it to ``name``'s view, or ``out_compute(view)``
        it straight into the view (the first write without ``accumulate``)."""
        target = self.targets[name]
        if self.accumulate or name in self.written:
            target.add_(compute())
        else:
            out_compute(target)
        self.written.add(name)


class StackedLinear(torch.autograd.Function):
    """n linear layers at once: ``x`` ``[n, m, in]``, ``weight`` ``[n, out, in]``,
    ``bias`` ``[n, out]`` or None → ``[n, m, out]``. With ``sink`` (a :class:`GradSink`)
    and ``names`` (the weight's and bias's names in it, or None), a parameter's gradient
    is written into the sink and none is returned for it."""

    @staticmethod
    def forward(ctx, x, weight, bias, sink=None, names=(None, None)):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.sink, ctx.names = sink, names
        if bias is None:
            return torch.bmm(x, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        sink, (weight_name, bias_name) = ctx.sink, ctx.names
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            if weight_name is None:
                grad_weight = torch.bmm(grad.transpose(1, 2), x)
            else:
                sink.write(weight_name, lambda: torch.bmm(grad.transpose(1, 2), x),
                           lambda out: torch.bmm(grad.transpose(1, 2), x, out=out))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            if bias_name is None:
                grad_bias = grad.sum(1)
            else:
                sink.write(bias_name, lambda: grad.sum(1), lambda out: torch.sum(grad, 1, out=out))
        return grad_x, grad_weight, grad_bias, None, None


def _linear(prefix: str) -> Callable:
    weight_name, bias_name = f"{prefix}weight", f"{prefix}bias"

    def apply(h: torch.Tensor, params: dict, sink: Optional[GradSink] = None) -> torch.Tensor:
        n, features = h.shape[0], h.shape[-1]
        weight, bias = params[weight_name], params.get(bias_name)
        # A frozen parameter (requires_grad=False) is one tensor shared by every worker.
        weight = weight if weight.dim() == 3 else weight.expand(n, *weight.shape)
        bias = bias if bias is None or bias.dim() == 2 else bias.expand(n, *bias.shape)
        targets = {} if sink is None else sink.targets
        names = (weight_name if weight_name in targets else None, bias_name if bias_name in targets else None)
        if names == (None, None):
            out = StackedLinear.apply(h.reshape(n, -1, features), weight, bias)
        else:
            out = StackedLinear.apply(h.reshape(n, -1, features), weight, bias, sink, names)
        return out.reshape(*h.shape[:-1], out.shape[-1])

    return apply


def _flatten(start: int, end: int) -> Callable:
    # A worker's tensor [b, ...] is the stacked one's [n, b, ...] minus its first dimension.
    start, end = (start + 1 if start >= 0 else start), (end + 1 if end >= 0 else end)
    return lambda h, params, sink=None: h.flatten(start, end)


def _elementwise(module: nn.Module) -> Callable:
    return lambda h, params, sink=None: module(h)


def _steps(module: nn.Module, prefix: str, out: list) -> bool:
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return False
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        children = [child for child in module._modules.values() if child is not None]
        if len({id(child) for child in children}) < len(children):
            return False  # a layer used twice (named_children would list it once): vmap runs it
        return all(_steps(child, f"{prefix}{name}.", out) for name, child in module.named_children())
    if type(module) is nn.Linear:
        out.append(_linear(prefix))
    elif type(module) is nn.Flatten:
        out.append(_flatten(module.start_dim, module.end_dim))
    elif type(module) in ELEMENTWISE:
        out.append(_elementwise(module))
    else:
        return False
    return True


def direct_plan(module: nn.Module) -> Optional[Callable]:
    """``forward(x, params, sink=None)`` running ``module`` on the stacked batch ``x``
    ``[n, b, ...]`` with ``params`` (name → ``[n, *shape]``), the gradients of the
    parameters ``sink`` names written into it by the backward (:class:`GradSink`), or
    None when ``module`` is not a plain sequence of the layers above (it then runs
    under ``vmap``)."""
    steps: list = []
    if not _steps(module, "", steps) or not steps:
        return None

    def forward(x: torch.Tensor, params: dict, sink: Optional[GradSink] = None) -> torch.Tensor:
        for step in steps:
            x = step(x, params, sink)
        return x

    return forward


def stacked_loss(loss_fn: Callable) -> Callable:
    """``losses(out, y)``: every worker's ``loss_fn(out[i], y[i])``, shape ``[n]``.

    ``F.cross_entropy`` with its defaults (the sweep's loss) is computed on all rows at
    once, ``reduction="none"``, and averaged per worker: the per-worker mean it is by
    definition, without ``vmap``'s batching of ``nll_loss`` (a third of the MLP's step).
    Any other loss runs under ``vmap``."""
    if loss_fn is torch.nn.functional.cross_entropy:
        def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            n = out.shape[0]
            rows = torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="none")
            return rows.view(n, -1).mean(1)

        return cross_entropy
    return torch.func.vmap(loss_fn)
