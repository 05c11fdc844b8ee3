"""The template algorithm: error-feedback scaled-sign SGD, a whole Bagua algorithm in one file.

Copy this file to start an algorithm: it registers itself and declares its row of the
algorithm table at its end (docs/DESIGN.md, "Adding an algorithm", says what else goes
with it: a test and the docs). It is also an example that runs::

    python -m bagua_algos.launch --backend gloo --nproc_per_node 2 examples/ef_sign_sgd.py --steps 60

and tests/test_template_algorithm.py checks it against a single-process oracle.

The math (Karimireddy et al., 2019, "Error feedback fixes SignSGD"), per bucket of d
gradient values on each of n workers:

1. p = g + e                      this worker's gradient plus the error it carries;
2. δ = (‖p‖₁ / d) · sign(p)       the message: one scale and d signs (a zero stays 0);
3. e ← p − δ                      the error, kept for the next step (in ``bucket.state``,
                                  so checkpoints carry it with no code here);
4. g ← (1/n) Σ_i δ_i              every worker applies the average of the n messages.

The wire: an all-gather of the n scales (float32) and of the n sign vectors as int8,
d + 4 bytes per worker instead of 4d: a quarter of the gradient's bytes. (Packing eight
signs a byte would make it 1/32; the template keeps to what one line of torch does.)

Written once, it also runs on the one-process engine (docs/engine.md), which runs this
same op for all n workers at once on stacked buckets: ``bucket.flat_view()`` is always
``[W, d]``, a row per worker (W = 1 in a job, n on the engine), and ``comm.allgather``
hands every worker the rows. So the
op keeps a worker's values in the last dimension (the scale is a mean over ``-1``), and
allocates its per-worker state like the bucket's tensor (``zeros_like``), not with a
per-rank shape. The sweep runs it from this file::

    python benchmarks/heterogeneity_sweep.py --configs 'examples/ef_sign_sgd.py:EFSignSGDAlgorithm'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bagua_algos.arguments import check_flag
from bagua_algos.runtime import comm
from bagua_algos.algorithms.table import AlgorithmConfig, register_algorithm
from bagua_algos.runtime.algorithm import Algorithm, AlgorithmImpl

if TYPE_CHECKING:
    from bagua_algos.runtime.bucket import BaguaBucket
    from bagua_algos.runtime.ddp import BaguaDistributedDataParallel

__all__ = ["EFSignSGDAlgorithm", "EFSignSGDAlgorithmImpl", "scaled_sign", "sign_message", "message_value"]


# The math is pure functions, tested on their own; the op below calls them, never
# restates them.
def sign_message(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 as it travels: the scale ‖p‖₁ / d and sign(p) as int8. ``p`` is one
    worker's d values (the scale is a 1-element tensor) or n workers' rows ``[n, d]``
    (the n scales as ``[n, 1]``)."""
    return p.abs().mean(-1, keepdim=True), torch.sign(p).to(torch.int8)


def message_value(scale: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """δ = scale · signs, the value a message stands for (broadcast: n scales as an
    (n, 1) tensor against n rows of signs give the n workers' δ at once)."""
    return scale * signs


def scaled_sign(p: torch.Tensor) -> torch.Tensor:
    """Step 2: δ = (‖p‖₁ / d) · sign(p), the scaled sign of a 1-D tensor."""
    return message_value(*sign_message(p))


class EFSignSGDAlgorithmImpl(AlgorithmImpl):
    """The state and hooks of one worker. The runtime's defaults do the rest: each gradient
    is registered, marked ready when accumulated, and its bucket's ops run on the
    communication thread while backward goes on; the post-backward hook waits."""

    # At another world size (a job resumed with more or fewer workers): what is carried
    # over and what is reset (the reset keys are not loaded; docs/elastic.md).
    WORLD_SIZE_RULE = {"step counter": "carried over",
                       "error buffers": "reset to zero (each worker's own residual)"}
    RESET_BUCKET_KEYS = frozenset({"ef_sign_error"})

    def __init__(self, process_group, error_feedback: bool):
        super().__init__(process_group)
        self.error_feedback = error_feedback

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        if self.error_feedback:
            # e: one per worker, shaped as the bucket's flat tensor ([W, d]: [1, d] in a job, [n, d] on the engine)
            bucket.state["ef_sign_error"] = torch.zeros_like(bucket.flat_view(), dtype=torch.float32)
        bucket.append_python_op(lambda name: self._average_signs(bucket), group=self.process_group)

    def _average_signs(self, bucket) -> None:
        flat = bucket.flat_view()  # the bucket's gradients, [W, d]: a row per worker
        with torch.no_grad():
            p = flat.float()
            if self.error_feedback:
                p = p + bucket.state["ef_sign_error"]                        # 1.
            scale, signs = sign_message(p)                                   # 2. δ, as sent
            if self.error_feedback:
                bucket.state["ef_sign_error"].copy_(p - message_value(scale, signs))  # 3. e ← p − δ
            n, d = self.world_size, p.shape[-1]
            scales = torch.empty(n, dtype=scale.dtype, device=scale.device)  # the same on every worker
            all_signs = torch.empty(n * d, dtype=torch.int8, device=signs.device)
            comm.allgather(scale, scales, group=self.process_group)         # every worker's message
            comm.allgather(signs, all_signs, group=self.process_group)
            mean = message_value(scales[:, None], all_signs.view(n, d)).sum(0).div_(n)  # 4.
            flat.copy_(mean.expand_as(flat))
        bucket.write_flat(flat)


class EFSignSGDAlgorithm(Algorithm):
    """Average scaled gradient signs, with error feedback.

    Args:
        error_feedback: carry each worker's compression error e into its next step
            (False: plain scaled signSGD, which may not converge).

    Example::

        >>> algorithm = EFSignSGDAlgorithm()                     # doctest: +SKIP
        >>> model = model.with_bagua([optimizer], algorithm)     # doctest: +SKIP
    """

    def __init__(self, error_feedback: bool = True):
        self.error_feedback = check_flag("error_feedback", error_feedback)

    def reify(self, process_group) -> EFSignSGDAlgorithmImpl:
        return EFSignSGDAlgorithmImpl(process_group, self.error_feedback)


# The name, and the algorithm's row (bagua_algos/algorithms/table.py): config_by_label
# ("ef_sign_sgd") finds it once this module is imported; copied into bagua_algos/algorithms/
# the file's rows are in ALGORITHM_TABLE, which the GPU, world-size-one and Lightning tests
# run, at their position (1000: after the package's rows, 10 to 370). Every worker applies
# the same mean message, so the models stay equal ("equal", the default); on another device
# a sign can flip on a rounding difference and move a weight by a learning-rate step.
register_algorithm(
    "ef_sign_sgd", EFSignSGDAlgorithm, "scaled gradient signs averaged, with error feedback",
    rows=[(1000, AlgorithmConfig("ef_sign_sgd", "ef_sign_sgd", tolerance=5e-3))],
)


def main(argv=None) -> None:
    """Train a small classifier on scikit-learn's digits, each worker on its own shard."""
    import argparse

    from sklearn.datasets import load_digits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)

    comm.init_process_group()
    rank, n = comm.get_rank(), comm.get_world_size()
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x[rank::n], dtype=torch.float32) / 16.0
    y = torch.tensor(y[rank::n])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model = model.with_bagua([optimizer], EFSignSGDAlgorithm())
    for step in range(args.steps):
        batch = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step * n + rank))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
