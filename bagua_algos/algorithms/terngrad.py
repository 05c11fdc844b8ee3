"""TernGrad-style low-bit gradient averaging (``terngrad``), on Bagua's scatter-gather.

Each bucket of gradients g (flattened, padded to a multiple of the world size n) goes
through :func:`bagua_algos.runtime.ops.compressed_scatter_gather` with the min-max codec
of :mod:`bagua_algos.compression.minmax` at ``bits`` bits: one chunk per worker, each
chunk quantized to 2^bits levels between its min and max, all-to-all, each worker
decodes and averages its chunk, quantizes it again, all-gather, decode. The result is
ĝ ≈ (1/n) Σ_i g_i. With stochastic rounding (the default, as TernGrad) each
quantization is unbiased, so E[ĝ] = (1/n) Σ_i g_i.

Random numbers (:class:`RoundingStream`): rank r's stream is a CPU generator seeded
``rank_seed(seed, r)`` (:func:`bagua_algos.arguments.rank_seed`, the one rule for
per-rank seeds), saved in the algorithm's ``state_dict``. Each bucket's reduction
draws one key from it and seeds a generator on the bucket's device with the key; the
codec's uniforms come from that generator (mt19937 on the CPU; on CUDA Philox, whose
Triton kernels key their own Philox with one draw of it). So a rank's stream advances
alike on every device, and the one-process engine, holding one stream per worker,
draws every worker's numbers as its process does on the same device. A CPU run and a
CUDA run of one seed round different values (each unbiased).

Options, applied to each worker's contribution before the first quantization:

- ``clip=c`` (TernGrad's gradient clipping): g ← clamp(g, −c·σ, c·σ), σ the standard
  deviation of the bucket's values, padding included (per bucket, not per layer;
  :func:`clip_rows_by_std`);
- ``error_feedback=True``: v = g + e is sent instead of g, and the error of the *first*
  quantization, the only one this worker controls, is kept for the next step:
  e ← v − D(Q(v)) (Q the chunk-wise encoding this worker sends, D its decoding). The
  second quantization (of the averaged chunk) is not fed back. e lives in the bucket's
  ``state`` (checkpointed).

A worker sends (n−1)/n · (N·bits/8 + 10n) bytes in the all-to-all and about N·bits/(8n)
+ 10 in the all-gather, per bucket of N values: about 2·bits/32 of a ring allreduce's
2·(n−1)/n · 4N (1/16 at 2 bits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..arguments import SEED_LIMIT, check_choice, check_flag, check_real, check_seed, rank_seed
from ..compression import minmax
from ..runtime.algorithm import Algorithm, AlgorithmImpl
from ..runtime.bucket import aligned_buckets
from ..runtime.ops import compressed_scatter_gather
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["TernGradAlgorithm", "TernGradAlgorithmImpl", "RoundingStream", "clip_by_std", "clip_rows_by_std"]


def clip_rows_by_std(rows: torch.Tensor, c: float) -> torch.Tensor:
    """TernGrad's clipping of each row of ``rows`` (``[R, m]``), in place: row r clamped
    to [−c·σ_r, c·σ_r], σ_r its population standard deviation (computed in float32);
    a row with σ_r = 0 (or NaN) is left alone. The bound is c·σ_r in float64 rounded
    to the rows' dtype once, as a Python-scalar clamp rounds it."""
    sigma = rows.float().std(dim=1, unbiased=False)
    bound = (sigma.double() * c).to(rows.dtype)
    bound = torch.where(sigma > 0, bound, torch.full_like(bound, float("inf"))).unsqueeze(1)
    return rows.clamp_(-bound, bound)


def clip_by_std(g: torch.Tensor, c: float) -> torch.Tensor:
    """:func:`clip_rows_by_std` of each worker's values, in place: the flat ``g`` of one
    worker as one row, or the one-process engine's ``[n, m]`` row by row."""
    clip_rows_by_std(g.view(1, -1) if g.dim() == 1 else g, c)
    return g


class RoundingStream:
    """The random numbers of one rank's stochastic rounding (the module's notes): a CPU
    generator seeded ``rank_seed(seed, rank)``; :meth:`reduction_generator` draws the
    next key from it and returns a generator on ``device`` seeded with that key, the one
    a bucket's reduction rounds with. The per-rank algorithm holds one, the
    one-process engine one per worker."""

    def __init__(self, seed: int, rank: int):
        self.generator = torch.Generator().manual_seed(rank_seed(seed, rank))
        self._on_device: dict = {}  # device → the generator a key seeds there

    def reduction_generator(self, device) -> torch.Generator:
        key = int(torch.randint(0, SEED_LIMIT - 1, (), generator=self.generator))  # a CPU draw: no device wait
        device = torch.device(device)
        generator = self._on_device.get(device)
        if generator is None:
            generator = self._on_device[device] = torch.Generator(device=device)
        return generator.manual_seed(key)


class TernGradAlgorithmImpl(AlgorithmImpl):
    WORLD_SIZE_RULE = {
        "step counter": "carried over",
        "error-feedback buffers": "reset to zero (each rank's own residual, over buckets padded for the old n)",
        "rounding stream": "reset to rank_seed(seed, the new rank)",
    }
    RESET_STATE_KEYS = frozenset({"generator_state"})
    RESET_BUCKET_KEYS = frozenset({"terngrad_error"})

    def __init__(self, process_group, bits: int = 2, stochastic: bool = True, error_feedback: bool = False,
                 clip=None, seed: int = 0):
        super().__init__(process_group)
        self.bits = bits
        self.stochastic = stochastic
        self.error_feedback = error_feedback
        self.clip = clip
        self.seed = seed
        # a stream per worker row (one in a job; the one-process engine's op runs them all)
        self.rounding = [RoundingStream(seed, rank) for rank in self.row_ranks]

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        return aligned_buckets(tensors, do_flatten, self.world_size)  # one chunk per worker

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        if self.error_feedback:
            bucket.state["terngrad_error"] = bucket.flat_zeros(torch.float32)  # [W, N], a row per worker
        bucket.append_python_op(lambda name: self._reduce(bucket), group=self.process_group)

    def _rounding_generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of one bucket's stochastic rounding: a generator on ``device``
        seeded with the next key of this rank's stream (None with nearest rounding,
        which draws nothing). The buckets run in a fixed order on the communication
        thread, so the keys are reproducible."""
        if not self.stochastic:
            return None
        key = int(torch.randint(0, SEED_LIMIT - 1, (), generator=self.generator))  # a CPU draw: no device wait
        generator = self._key_generators.get(device)
        if generator is None:
            generator = self._key_generators[device] = torch.Generator(device=device)
        return generator.manual_seed(key)

    def _reduce(self, bucket) -> None:
        flat = bucket.flat_view()
        with torch.no_grad():
            v = flat.detach().float().clone()  # every worker's contribution, [W, N]
            if self.clip is not None:
                clip_rows_by_std(v, self.clip)
            if self.error_feedback:
                v.add_(bucket.state["terngrad_error"])
            result = v.clone()
            # the buckets run in a fixed order on the communication thread: reproducible keys
            generator = None
            if self.stochastic:
                generator = [stream.reduction_generator(result.device) for stream in self.rounding]
            sent = compressed_scatter_gather(result, self.bits, True, self.process_group,
                                             stochastic=self.stochastic, generator=generator)
            if self.error_feedback:
                # e ← v − D(Q(v)): the error of this worker's own (first) quantization.
                bucket.state["terngrad_error"].copy_(v.sub_(sent))
            flat.copy_(result)
        bucket.write_flat(flat)

    def state_dict(self) -> dict:
        return {"generator_state": [stream.generator.get_state() for stream in self.rounding]}  # a row's each

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        saved = state.get("generator_state")
        if saved is None:
            return
        # (a job's checkpoint written before the streams were a list holds one state)
        for stream, value in zip(self.rounding, saved if isinstance(saved, list) else [saved]):
            stream.generator.set_state(value.clone())


class TernGradAlgorithm(Algorithm):
    """TernGrad-style quantized gradient averaging on Bagua's scatter-gather pattern.

    Args:
        bits: bits per value, 1, 2, 4 or 8 (2: TernGrad's ternary levels are 3; here
            4 evenly spaced levels between the chunk's min and max).
        stochastic: stochastic (unbiased) rounding; False: nearest.
        error_feedback: keep the error of this worker's quantization and add it to the
            next step's gradient.
        clip: None (off) or c > 0: clip the gradient to ±c·σ before quantizing
            (TernGrad suggests c = 2.5).
        seed: the stochastic rounding of rank r draws from a CPU generator seeded
            ``rank_seed(seed, r)`` (the module's notes say how on each device).
    """

    def __init__(self, bits: int = 2, stochastic: bool = True, error_feedback: bool = False, clip=None,
                 seed: int = 0):
        self.bits = check_choice("bits", bits, minmax.VALID_BITS)
        self.stochastic = check_flag("stochastic", stochastic)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        if clip is not None:
            clip = check_real("clip", clip, 0.0, low_open=True,
                              what="None (no clipping) or a finite number > 0 (e.g. 2.5)")
        self.clip = clip
        self.seed = check_seed(seed)

    def reify(self, process_group) -> TernGradAlgorithmImpl:
        return TernGradAlgorithmImpl(process_group, bits=self.bits, stochastic=self.stochastic,
                                     error_feedback=self.error_feedback, clip=self.clip, seed=self.seed)


register_algorithm(
    "terngrad", TernGradAlgorithm, "gradients averaged through low-bit (1/2/4/8) min-max quantized scatter-gather",
    rows=[
        # The TernGrad paper's setting: 2 bits, stochastic, clipped at 2.5 σ. Unclipped, the
        # sweep's non-IID runs collapse (0.64 at α = 0.1), it seems because the largest entries
        # set each chunk's range and the 4 levels round the rest to ±range/3 (docs/results.md).
        (160, AlgorithmConfig("terngrad", "terngrad", {"bits": 2, "clip": 2.5}, device_independent=False,
                              tolerance=5e-3, in_sweep=True)),
        (170, AlgorithmConfig("terngrad_nearest", "terngrad", {"stochastic": False}, tolerance=5e-3)),
    ],
)
