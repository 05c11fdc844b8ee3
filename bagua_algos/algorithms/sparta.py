"""SPARTA, sparse parameter averaging (Baioumy & Cheema 2025), registered as ``sparta``:
after every optimizer step each worker averages a small random subset of its
parameters with the other workers; optionally with DiLoCo's outer step every H steps.

Each step, per bucket of the parameters (a worker's L values):

1. the same k = max(1, round(``fraction``·L)) places on every worker, a uniformly random
   k-subset of the L places (:func:`sparta_places`: the first k distinct values of a
   stream of uniform draws from 0..L−1, in O(k) work, not the O(L) of a permutation of
   all L places; where k > L/8, the first k of a random permutation), drawn from a CPU
   generator that every worker seeds alike (``stable_seed(seed, the bucket's tensor
   names)``) and advances alike (its state in ``bucket.state["sparta_rng_state"]``, so a
   checkpoint resumes the same draws);
2. an allreduce-mean of the parameters at those places (k values a worker);
3. every worker writes the mean back there; the other L − k parameters stay its own.

With ``sync_every=H`` a DiLoCo outer step follows SPARTA's average after steps H, 2H, …
(the DiLoCo impl itself, :class:`~bagua_algos.algorithms.diloco.DiLoCoAlgorithmImpl`,
held by this one: its θ_outer, outer Nesterov SGD and checkpointed state), with
DiLoCo's outer settings (``outer_lr``, ``outer_momentum``, ``nesterov``; its defaults
when not given).

Followed: exo-explore/gym's exogym/strategy/sparta.py (``SparseCommunicator``: after the
optimizer step, for each parameter an all-reduce of the chosen entries, divided by the
number of workers, written back; the default fraction 0.005 there) and
exogym/strategy/sparta_diloco.py (SPARTA's average, then DiLoCo's communication, after
each step). What differs: gym draws each parameter's places as an independent
Bernoulli(p) mask on rank 0 (``torch.bernoulli`` over the parameter's whole shape:
O(L) work a parameter and step) and broadcasts the mask every step; here every worker
draws the same places from the shared seeded generator, so no mask travels, and a
bucket sends exactly k values (the same expected share p of each parameter). The
default ``fraction`` is 0.0005 (0.05 % of the parameters a step).

Bytes: k values of the parameters' dtype a bucket and step (the allreduce counts a
worker's contribution), plus DiLoCo's at its synchronisations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..arguments import check_int, check_real, check_seed
from ..compression.powersgd import stable_seed
from ..runtime import comm
from ..runtime.algorithm import Algorithm, PostOptimizerStepHook
from ..runtime.bucket import BaguaBucket
from .diloco import DiLoCoAlgorithm, DiLoCoAlgorithmImpl
from .model_averaging import ModelAveragingAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["SpartaAlgorithm", "SpartaAlgorithmImpl", "sparta_size", "sparta_places"]


def sparta_size(numel: int, fraction: float) -> int:
    """The places a bucket of ``numel`` values averages a step: max(1, round(fraction·numel))."""
    return min(numel, max(1, round(fraction * numel)))


def sparta_batch(numel: int, k: int) -> int:
    """How many uniform draws :func:`sparta_places` takes at a time for k distinct places
    of ``numel``: k, plus about the repeats k draws expect (k²/(2·numel)), doubled, plus 8."""
    return k + (k * k) // numel + 8


def sparta_places(numel: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """k distinct places of 0..numel−1, a uniformly random k-subset, ascending (int64, CPU).

    Where 8k <= numel: batches of :func:`sparta_batch` draws ``torch.randint(numel)`` from
    ``generator`` until the stream holds k distinct values; the places are its first k
    distinct values in the order drawn (sampling with replacement and skipping repeats
    picks each next place uniformly from those not yet picked, as a permutation's next
    entry does). O(k log k) work whatever ``numel``. Else the first k of
    ``torch.randperm(numel)`` (k is then an eighth of numel or more: the permutation's
    O(numel) is O(k), and the draws' repeats and sorts cost more: at numel = 10**7 on
    one CPU thread, fraction 0.0005: 0.7 ms against the permutation's 360 ms; 0.05:
    73 ms against 400 ms; 0.2: 700 ms against 430 ms)."""
    if 8 * k > numel:
        return torch.randperm(numel, generator=generator)[:k].sort().values
    batch = sparta_batch(numel, k)
    stream = torch.randint(numel, (batch,), generator=generator)
    while True:
        values, inverse = torch.unique(stream, sorted=True, return_inverse=True)
        if len(values) >= k:
            break
        stream = torch.cat([stream, torch.randint(numel, (batch,), generator=generator)])
    # each distinct value's first position in the stream; the k earliest of them
    first = torch.full((len(values),), len(stream), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(len(stream)), "amin")
    return values[first.argsort()[:k]].sort().values


class SpartaAlgorithmImpl(ModelAveragingAlgorithmImpl):
    """One bucket of the parameters (DiLoCo's fragment bucket when synchronising); its
    ``state`` holds the generator of the places (``sparta_rng_state``) and, with
    ``sync_every``, DiLoCo's."""

    WORLD_SIZE_RULE = {
        "step counter": "carried over (the schedules)",
        "places' generator": "carried over (the same on every rank, whatever n)",
        "with sync_every, DiLoCo's outer model, outer momentum and outer steps":
            "carried over (the same on every rank, whatever n)",
    }

    def __init__(self, process_group, settings: "SpartaAlgorithm"):
        super().__init__(process_group)
        self.settings = settings
        self.diloco = None if settings.diloco is None else DiLoCoAlgorithmImpl(process_group, settings.diloco)
        self.sparta_bytes = 0  # what SPARTA's averages handed to collectives (a worker's)

    @property
    def bytes_total(self) -> int:
        """SPARTA's bytes and DiLoCo's, a worker's."""
        return self.sparta_bytes + (0 if self.diloco is None else self.diloco.bytes_total)

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        if self.diloco is not None:
            return self.diloco.tensors_to_buckets(tensors, do_flatten)
        flat = [t for group in tensors for t in group]
        if not flat:
            raise ValueError("SpartaAlgorithm: the module has no parameter that requires grad")
        return [BaguaBucket(flat, flatten=do_flatten, name="sparta")]

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()  # no bucket ops: the averages run on the training thread after the step
        if self.diloco is not None:
            self.diloco.init_operations(bagua_ddp, bucket)
        if "sparta_rng_state" not in bucket.state:
            names = ",".join(t.bagua_tensor_name for t in bucket.tensors)
            bucket.state["sparta_rng_state"] = torch.Generator().manual_seed(
                stable_seed(self.settings.seed, names)).get_state()

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        diloco_hook = None if self.diloco is None else self.diloco.init_post_optimizer_step_hook(bagua_ddp)

        def hook(optimizer):
            for bucket in bagua_ddp.bagua_buckets:
                self.average_places(bucket)
            if diloco_hook is not None:
                diloco_hook(optimizer)

        return hook

    @torch.no_grad()
    def average_places(self, bucket: BaguaBucket) -> None:
        """Steps 1–3 on one bucket."""
        state = bucket.state
        generator = torch.Generator()
        generator.set_state(state["sparta_rng_state"])
        size = sum(torch.Size(shape).numel() for shape in bucket.shapes)  # a worker's (no padding)
        places = sparta_places(size, sparta_size(size, self.settings.fraction), generator)
        state["sparta_rng_state"] = generator.get_state()
        weights = bucket.flat_view()  # [W, L], a row per worker
        places = places.to(weights.device)
        chosen = weights[..., places]
        comm.allreduce_inplace(chosen, comm.ReduceOp.AVG, group=self.process_group)
        weights[..., places] = chosen
        bucket.write_flat(weights)
        self.sparta_bytes += places.numel() * weights.element_size()

    def on_detach(self, bagua_ddp: BaguaDistributedDataParallel) -> None:
        if self.diloco is not None:
            self.diloco.on_detach(bagua_ddp)

    def state_dict(self) -> dict:
        state = {"sparta_bytes": self.sparta_bytes}
        if self.diloco is not None:
            state["diloco"] = self.diloco.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sparta_bytes = int(state.get("sparta_bytes", 0))
        if self.diloco is not None and "diloco" in state:
            self.diloco.load_state_dict(state["diloco"])


class SpartaAlgorithm(Algorithm):
    """SPARTA: after every step, a random ``fraction`` of the parameters (the same places
    on every worker) averaged; with ``sync_every``, DiLoCo's outer step every H steps too.

    Args:
        fraction: the share of the parameters averaged a step, in (0, 1] (at least one
            value a bucket).
        sync_every: None (SPARTA alone) or H >= 1, a DiLoCo outer step after steps H, 2H, ….
        seed: the places' generator (the same on every worker), an int in [0, 2**63).
        outer_lr, outer_momentum, nesterov: DiLoCo's outer SGD (with ``sync_every``
            only; None: DiLoCo's 0.7, 0.9, True).
    """

    def __init__(self, fraction: float = 0.0005, sync_every=None, seed: int = 0, outer_lr=None,
                 outer_momentum=None, nesterov=None):
        self.fraction = check_real("fraction", fraction, 0.0, 1.0, low_open=True,
                                   what="the share of the parameters averaged a step, in (0, 1]")
        self.seed = check_seed(seed)
        outer = {name: value for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum),
                                                  ("nesterov", nesterov)) if value is not None}
        if sync_every is None:
            if outer:
                raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in outer.items())} sets DiLoCo's outer step, "
                                 "which runs only with sync_every=H (an int >= 1); leave it None without sync_every")
            self.sync_every, self.diloco = None, None
        else:
            self.sync_every = check_int("sync_every", sync_every, 1,
                                        what="None or the inner steps between DiLoCo's outer steps, an int >= 1")
            self.diloco = DiLoCoAlgorithm(sync_every=self.sync_every, **outer)

    def reify(self, process_group) -> SpartaAlgorithmImpl:
        return SpartaAlgorithmImpl(process_group, self)


register_algorithm(
    "sparta", SpartaAlgorithm,
    "SPARTA: a random fraction of the parameters (the same places everywhere) averaged after every step",
    rows=[
        # A random 5 % of the parameters (the same places everywhere) averaged after every
        # step; alone an average of one is the identity. Then with DiLoCo's outer step every 2 steps.
        (350, AlgorithmConfig("sparta", "sparta", {"fraction": 0.05}, replicas="drift", exact_alone=True)),
        (360, AlgorithmConfig("sparta_diloco", "sparta", {"fraction": 0.05, "sync_every": 2}, replicas="drift")),
    ],
)
