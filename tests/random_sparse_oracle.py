"""An independent re-implementation of the random-sparse reducers of seed 001 (the
PowerSGD paper, Table 4, Appendix G.1-G.2, Algorithm 2) and of the training loop around
them, written from the reference code's semantics (epfml/powersgd, ``RandomSparseReducer``
and ``RandomSparseBlockReducer`` with ``train.py``), not from this package.

n workers are simulated in one process. The model is replicated: every worker holds the
same parameters x, so the loop keeps one copy of x, one momentum buffer, and one error
memory e_w per worker. Per step t:

1. each worker's gradient g_w of its own batch (no weight decay in it: the reference
   code adds weight decay after the reduction, ``optimizer_wd_before_reduce=False``);
2. A_w = g_w + e_w (``send_bfr = grad + memory``; A_w = g_w without error feedback);
3. for every tensor, one index set I_t shared by all workers, drawn from one generator
   per bucket seeded alike on every worker: Random K, b indices without replacement;
   Random Block, b consecutive indices from a uniform start, wrapping past the end;
   b = r·(n + m) for the tensor viewed as n × m (``view(shape[0], -1)``), at most its
   numel, "to match rank-r PowerSGD"; a tensor with b = numel is sent whole and draws
   nothing;
4. the values are averaged over workers and put back at I_t, zeros elsewhere, with NO
   rescaling by numel / b (``out.view(-1)[indices] = values``, the seed's
   M(I) ← (1/W) Σ_w S_w): what is not sent stays in the memory and goes later;
5. e_w ← A_w − D(C(A_w)) = A_w with I_t zeroed (``mem.view(-1)[indices] = 0``);
6. only then weight decay and momentum, on the decompressed average Δ (momentum after
   decompression, ``optimizer_mom_before_reduce=False``), and the step.

Two forms of momentum for step 6: ``"heavy_ball"`` is ``torch.optim.SGD``'s
(d = Δ + λx; buf ← μ·buf + d, buf = d at the first step; x ← x − γ·buf), the optimizer
this package's algorithms run under; ``"seed"`` is Algorithm 2's and the reference
code's default Nesterov form (d = Δ + λx; m ← μ·m + d, m = d at the first step;
x ← x − γ·(d + m)).

The draws follow this package's generator contract, so that a run can be compared with
the package's value for value: a bucket's generator is a CPU ``torch.Generator`` seeded
with (seed · 0x9E3779B1 + crc32(the bucket's tensor names joined by ",")) mod 2^63; per
step it draws the bucket's tensors in bucket order: a block's start as
``randint(numel, ())``, K's indices as the first b of ``randperm(numel)``. Sizes: the
reference code's r·(n + m); with ``min_compression_rate`` also this package's PowerSGD
rule (a matrix PowerSGD would not compress, n·m < rate·(n + m)·r, is sent whole).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch.func import functional_call, grad

__all__ = ["bucket_seed", "sparse_size", "RandomSparseReducer", "SGDMomentum", "train"]

METHODS = ("random_k", "random_block")
MOMENTUM_FORMS = ("heavy_ball", "seed")


def bucket_seed(seed: int, names: Sequence[str]) -> int:
    """The seed of a bucket's generator, the same on every worker."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(",".join(names).encode())) % (2**63)


def sparse_size(shape: Sequence[int], rank: int, min_compression_rate: Optional[float] = None) -> int:
    """Values sent for a tensor of ``shape``: r·(n + m), at most numel (the reference
    code's ``block_size``); with ``min_compression_rate``, numel where PowerSGD would
    send the matrix whole."""
    numel = math.prod(int(s) for s in shape)
    n = int(shape[0]) if len(shape) else 1
    m = numel // n
    if min_compression_rate is not None:
        r = min(rank, n, m)
        if len(shape) < 2 or n * m < min_compression_rate * (n + m) * r:
            return numel
        return min(numel, (n + m) * r)
    return min(numel, rank * (n + m))


class RandomSparseReducer:
    """Random K or Random Block with (optional) error memory, for ``workers`` simulated
    workers. ``buckets``: lists of parameter names (each list one generator, drawn in
    its order); ``shapes``: name -> shape."""

    def __init__(self, method: str, buckets: Sequence[Sequence[str]], shapes: Dict[str, Sequence[int]],
                 workers: int, rank: int, seed: int = 0, error_feedback: bool = True,
                 min_compression_rate: Optional[float] = None, device=None):
        if method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
        self.method = method
        self.buckets = [list(b) for b in buckets]
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.workers = workers
        self.error_feedback = error_feedback
        self.sizes = {k: sparse_size(s, rank, min_compression_rate) for k, s in self.shapes.items()}
        self.generators = []
        for names in self.buckets:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(bucket_seed(seed, names))
            self.generators.append(generator)
        self.memory = [{k: torch.zeros(math.prod(s), device=device) for k, s in self.shapes.items()}
                       for _ in range(workers)]
        self.values_sent = 0  # per worker, all steps

    def _indices(self, generator: torch.Generator, name: str, device) -> Optional[torch.Tensor]:
        numel, size = math.prod(self.shapes[name]), self.sizes[name]
        if size == numel:
            return None
        if self.method == "random_block":
            start = int(torch.randint(numel, (), generator=generator))
            return ((start + torch.arange(size)) % numel).to(device)
        return torch.randperm(numel, generator=generator)[:size].to(device)

    def reduce(self, grads: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """{name: Δ}, the decompressed average every worker applies, from each worker's
        gradients ``grads[w]``; updates the memories."""
        if len(grads) != self.workers:
            raise ValueError(f"grads must hold one dict per worker ({self.workers}), got {len(grads)}")
        out = {}
        for generator, names in zip(self.generators, self.buckets):
            for name in names:
                sent = [grads[w][name].reshape(-1) + (self.memory[w][name] if self.error_feedback else 0)
                        for w in range(self.workers)]
                indices = self._indices(generator, name, sent[0].device)
                if indices is None:  # sent whole: the plain mean, nothing left behind
                    out[name] = torch.stack(sent).mean(0).view(self.shapes[name])
                    for w in range(self.workers):
                        self.memory[w][name].zero_()
                    self.values_sent += sent[0].numel()
                    continue
                mean = torch.stack([a[indices] for a in sent]).mean(0)
                update = torch.zeros_like(sent[0])
                update[indices] = mean  # no rescaling by numel / b
                out[name] = update.view(self.shapes[name])
                for w in range(self.workers):
                    residual = sent[w].clone()
                    residual[indices] = 0
                    self.memory[w][name] = residual
                self.values_sent += indices.numel()
        return out


class SGDMomentum:
    """The optimizer step after the reduction, applied to the replicated parameters."""

    def __init__(self, momentum: float, weight_decay: float, form: str = "heavy_ball"):
        if form not in MOMENTUM_FORMS:
            raise ValueError(f"form must be one of {list(MOMENTUM_FORMS)}, got {form!r}")
        self.momentum, self.weight_decay, self.form = momentum, weight_decay, form
        self.buffers: Dict[str, torch.Tensor] = {}

    def step(self, params: Dict[str, torch.Tensor], updates: Dict[str, torch.Tensor], lr: float) -> None:
        with torch.no_grad():
            for name, p in params.items():
                d = updates[name] + self.weight_decay * p
                if name not in self.buffers:
                    self.buffers[name] = d.clone()
                else:
                    self.buffers[name].mul_(self.momentum).add_(d)
                step = self.buffers[name] if self.form == "heavy_ball" else d + self.buffers[name]
                p.sub_(lr * step)


def train(module: torch.nn.Module, reducer: Optional[RandomSparseReducer], optimizer: SGDMomentum,
          batches: Iterable, loss_fn: Callable, lr: Callable[[int], float] | float) -> Dict[str, torch.Tensor]:
    """Train the replicated ``module``'s parameters (copied; ``module`` is untouched) on
    ``batches``: per step ``(x, y)`` with x of [workers, batch, ...], worker w's gradient
    taken on x[w], y[w] (the mean loss of its batch); ``reducer`` None: the plain mean
    (full-precision SGD). Returns the final parameters."""
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in module.named_buffers()}

    def loss_of(p, x, y):
        return loss_fn(functional_call(module, {**p, **buffers}, (x,)), y)

    gradient = grad(loss_of)
    for t, (x, y) in enumerate(batches):
        grads = [gradient(params, x[w], y[w]) for w in range(x.shape[0])]
        if reducer is None:
            updates = {k: torch.stack([g[k] for g in grads]).mean(0) for k in params}
        else:
            updates = reducer.reduce(grads)
        optimizer.step(params, updates, lr(t) if callable(lr) else lr)
    return params
