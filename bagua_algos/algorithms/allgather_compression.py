"""The base the allgather compressors share (``top_k``, ``sign_norm``, ``signum``,
``atomo``): one op per bucket on the communication thread that forms the worker's
contribution, runs :func:`bagua_algos.compression.allgather.compress_aggregate` with
the bucket's codec and an allgather of the process group, and writes the update into
the gradients, which the user's optimizer then applies.

The contribution a of a bucket's gradient g (the per-worker state lives in
``bucket.state``, so it is checkpointed with ``bagua_state_dict``):

- with ``momentum`` β (Signum): m ← β·m + (1 − β)·g, a = m (``bucket.state["momentum"]``,
  zero at first);
- with ``error_feedback``: a = g + e (or m + e), and after the step e ← a − D(C(a))
  (``bucket.state["error"]``, zero at first): seed 001 Algorithm 2, lines 7 and 9;
  with ``error_decay`` β ≠ 1, a = β·e + g (DeMo's momentum, whose sent part is removed:
  the error buffer is then its m).

A subclass of :class:`AllgatherCompressionAlgorithm` says which codec a bucket gets
(``make_codec``) and sets ``error_feedback``, ``momentum`` and ``samples`` (whether the
codec draws random numbers: then rank r draws from a CPU generator seeded
``rank_seed(seed, r)``, saved in the algorithm's state dict).

Bytes (:attr:`AllgatherCompressionImpl.bytes_last_step`, ``bytes_total``,
``uncompressed_bytes_last_step``) are counted as PowerSGD counts them: what this worker
hands to the collective (its message), against what gradient allreduce would hand
(the bucket's gradient bytes).
"""

from __future__ import annotations

import warnings

import torch

from ..arguments import rank_seed
from ..compression.allgather import compress_aggregate
from ..runtime import comm
from .byte_counts import CountsBytes
from ..runtime.algorithm import Algorithm, AlgorithmImpl

__all__ = ["AllgatherCompressionAlgorithm", "AllgatherCompressionImpl", "contribution", "bucket_step",
           "allgather_into_rows", "optimizer_momenta", "warn_second_momentum"]


def contribution(grad: torch.Tensor, state: dict, momentum, error_feedback: bool,
                 error_decay: float = 1.0) -> torch.Tensor:
    """A new tensor: the worker's contribution of ``grad`` (the module's notes), updating
    ``state["momentum"]`` when ``momentum`` is not None. ``grad`` may be one worker's
    ``[N]`` or the engine's ``[W, N]``, with state of the same shape."""
    a = grad
    if momentum is not None:
        m = state["momentum"]
        m.mul_(momentum).add_(grad, alpha=1 - momentum)
        a = m
    if error_feedback:
        if error_decay != 1.0:
            return torch.mul(state["error"], error_decay).add_(a)  # β·e, then + a (two roundings, as demo.py)
        return a + state["error"]
    return a.clone()


@torch.no_grad()
def bucket_step(settings, codec, flat: torch.Tensor, state: dict, allgather, generator=None) -> int:
    """The step of one bucket, in place: ``flat`` (the bucket's gradients, ``[W, N]``: a
    row per worker, W = 1 in a job) becomes the update; ``state``
    holds the bucket's buffers (``settings.state_buffers()``, shaped as ``flat``).
    Returns the bytes a worker sent. The Bagua op and the DDP hook both run it."""
    a = contribution(flat, state, settings.momentum, settings.error_feedback, settings.error_decay)
    update, sent = compress_aggregate(codec, a, allgather, error=state.get("error"), generator=generator)
    flat.copy_(update.expand_as(flat))
    return sent


def optimizer_momenta(optimizers) -> list:
    """The nonzero ``momentum`` settings of the optimizers' parameter groups, sorted: what
    an algorithm keeping its own momentum (Signum, DeMo) warns about."""
    return sorted({group.get("momentum", 0) for opt in optimizers for group in opt.param_groups
                   if group.get("momentum", 0)})


def warn_second_momentum(optimizers, algorithm: str, momentum: str, before: str) -> None:
    """For an algorithm that keeps each worker's momentum and sends what follows from it
    (Signum's vote, DeMo's sign): warn when an optimizer has a momentum of its own, which
    would add a second one after the exchange (the method then is another). ``momentum``
    names the algorithm's setting, ``before`` what it comes before."""
    momenta = optimizer_momenta(optimizers)
    if momenta:
        warnings.warn(f"{algorithm}Algorithm keeps each worker's momentum ({momentum}) before {before}; the "
                      f"optimizer's momentum={momenta[0]} adds a second one after it, which is not {algorithm} "
                      "(use torch.optim.SGD(params, lr, weight_decay=...) without momentum)", stacklevel=3)


def allgather_into_rows(messages: torch.Tensor, group) -> torch.Tensor:
    """Every member's message as ``[n, B]`` in rank order, over ``group``, from this
    process's ``[W, B]`` messages (W = 1 in a job; the engine's n rows)."""
    n, size = comm.get_world_size(group), messages.shape[-1]
    out = torch.empty(n, size, dtype=messages.dtype, device=messages.device)
    comm.allgather(messages, out, group=group)
    return out


class AllgatherCompressionAlgorithm(Algorithm):
    """Settings every allgather compressor has (the subclasses set them)."""

    error_feedback: bool = False
    error_decay: float = 1.0  # β of a = β·e + g (DeMo); 1: plain error feedback
    momentum = None  # β of a momentum kept before compressing (Signum), or None
    samples: bool = False  # whether the codec draws random numbers
    seed: int = 0

    def make_codec(self, shapes: list, dtype: torch.dtype):
        raise NotImplementedError

    def check_optimizers(self, optimizers) -> None:
        """Called once the algorithm is bound to a model, with its optimizers: a subclass
        warns about one that would change what the algorithm means (Signum)."""

    def rank_generator(self, rank: int):
        """Rank ``rank``'s random stream (a CPU generator seeded ``rank_seed(seed, rank)``),
        or None when the codec draws nothing."""
        return torch.Generator().manual_seed(rank_seed(self.seed, rank)) if self.samples else None

    def state_buffers(self) -> tuple:
        """Names of the per-worker buffers of a bucket's state, each the bucket's size."""
        return (("momentum",) if self.momentum is not None else ()) + (("error",) if self.error_feedback else ())

    def reify(self, process_group) -> "AllgatherCompressionImpl":
        return AllgatherCompressionImpl(process_group, self)


class AllgatherCompressionImpl(CountsBytes, AlgorithmImpl):
    # At another world size every rank loads the first rank's file: its residual, loaded
    # by all n, would be sent n times, so each worker's own residual starts again at 0.
    WORLD_SIZE_RULE = {"step counter, momentum (the first rank's), random streams": "carried over",
                       "error-feedback residuals": "reset to zero (each worker's own residual)"}
    RESET_BUCKET_KEYS = frozenset({"error"})

    def __init__(self, process_group, settings: AllgatherCompressionAlgorithm):
        super().__init__(process_group)
        self.settings = settings
        self._codecs: dict = {}  # bucket name → its codec
        self._optimizers_checked = False
        # a random stream per worker row (the one-process engine's op runs every worker's rows)
        self.generators = [settings.rank_generator(rank) for rank in self.row_ranks] if settings.samples else None
        self.init_byte_counts()  # bytes_last_step, bytes_total, uncompressed_bytes_last_step

    def init_operations(self, bagua_ddp, bucket) -> None:
        if not self._optimizers_checked:
            self._optimizers_checked = True
            self.settings.check_optimizers(bagua_ddp.bagua_optimizers)
        bucket.clear_ops()
        self._codecs[bucket.name] = self.settings.make_codec(bucket.shapes, bucket.dtype)
        for name in self.settings.state_buffers():
            zeros = bucket.flat_zeros()  # [W, N], a row per worker
            if not (torch.is_tensor(bucket.state.get(name)) and bucket.state[name].shape == zeros.shape):
                bucket.state[name] = zeros
        bucket.append_python_op(lambda name, b=bucket: self._run(bagua_ddp, b), group=self.process_group)

    def _allgather(self, message: torch.Tensor) -> torch.Tensor:
        return allgather_into_rows(message, self.process_group)

    def _run(self, bagua_ddp, bucket) -> None:
        flat = bucket.flat_view()
        sent = bucket_step(self.settings, self._codecs[bucket.name], flat, bucket.state, self._allgather,
                           self.generators)
        bucket.write_flat(flat)
        self.count_bytes(bagua_ddp.bagua_train_step_counter, sent, bucket.numel * flat.element_size())


    def state_dict(self) -> dict:
        state = {"bytes_total": self.bytes_total}
        if self.generators is not None:
            state["generator_state"] = [g.get_state() for g in self.generators]  # a row's each
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.bytes_total = int(state.get("bytes_total", 0))
        saved = state.get("generator_state")
        if self.generators is not None and saved is not None:
            # (a job's checkpoint written before the streams were a list holds one state)
            for generator, value in zip(self.generators, saved if isinstance(saved, list) else [saved]):
                generator.set_state(value.clone())
