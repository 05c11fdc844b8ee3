"""What the algorithms that gossip after the optimizer step share (not an algorithm
itself): D², gradient tracking, D-PSGD with quasi-global momentum and Stochastic
Gradient Push.

Each step is "adapt, then combine", as the RelaySum paper's baselines run
(Vogels et al. 2021; Lin et al. 2021; Tang et al. 2018; Assran et al. 2019):

1. forward and backward at x_t, gradients local (no communication);
2. the user's optimizer takes the local step: x½ = x_t + u_t (u_t: its update);
3. the algorithm's :meth:`AdaptThenCombineImpl.combine` turns x½ into x_{t+1}, with one
   gossip x ← W_t x over the topology (:class:`~bagua_algos.runtime.gossip.Gossip`, the
   package's one gossip, which the decentralized op runs too)
   and whatever correction the algorithm keeps.

The parameters are the Bagua tensors, in one flattened bucket, and every rule is written
for a leading worker dimension: ``x`` is ``[W, L]``, a row per worker this process runs
(one in a job; the n stacked workers on the one-process engine), and the gossip goes
through ``comm``, so the same code runs as processes and on the engine. An algorithm
that needs x_t (the weights before the step) sets ``keeps_previous``: they are copied
at forward, when the weights are x_t.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..runtime import comm
from ..runtime.algorithm import ForwardPreHook, PostOptimizerStepHook
from ..runtime.bucket import BaguaBucket
from ..runtime.gossip import Gossip
from ..runtime.topology import resolve_topology
from .model_averaging import ModelAveragingAlgorithmImpl

if TYPE_CHECKING:
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["AdaptThenCombineImpl"]


class AdaptThenCombineImpl(ModelAveragingAlgorithmImpl):
    """Base of the algorithms that gossip after the local step. Subclasses implement
    :meth:`init_state` and :meth:`combine`; state they keep per bucket goes in
    ``bucket.state`` (checkpointed with no code of theirs). ``bucket.state["exchanges"]``
    counts the gossips (a time-varying topology's schedule)."""

    keeps_previous = False  # copy x_t at forward into self.previous[bucket name]
    follows_time_varying = True  # a time-varying topology's pairings are followed

    def __init__(self, process_group, topology):
        super().__init__(process_group)
        self.topology = resolve_topology(topology, self.world_size, time_varying=self.follows_time_varying)
        self.rows = self.row_ranks
        self.gossip = Gossip(self.topology, self.rows, comm.group_ranks(process_group), process_group)
        self.previous: dict = {}  # bucket name → x_t, [W, L]

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        tensors = [t for group in tensors for t in group]
        if not tensors:
            raise ValueError(
                f"{type(self).__name__}: the module has no parameter that requires grad, so there are no weights "
                "to gossip; wrap a module with trainable parameters"
            )
        return [BaguaBucket(tensors, flatten=do_flatten, name="0")]

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()  # nothing runs in backward: the gossip follows the step
        bucket.state.setdefault("exchanges", 0)
        rows = bucket.flat_view()
        if self.keeps_previous:
            self.previous[bucket.name] = rows.detach().clone()
        self.init_state(bucket, rows)

    def init_forward_pre_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> ForwardPreHook:
        def hook(inputs):
            if self.keeps_previous:
                for bucket in bagua_ddp.bagua_buckets:
                    self.previous[bucket.name].copy_(bucket.flat_view())

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        def hook(optimizer):
            for bucket in bagua_ddp.bagua_buckets:
                flat = bucket.flat_view()
                self.combine(bucket, flat, optimizer)  # [W, L], a row per worker
                bucket.state["exchanges"] += 1
                bucket.write_flat(flat)

        return hook

    def mix_(self, bucket: BaguaBucket, x: torch.Tensor) -> None:
        """x ← W_t x in place, t this bucket's exchange count."""
        self.gossip.mix_(x, bucket.state["exchanges"])

    # --- what an algorithm defines --------------------------------------------------
    def init_state(self, bucket: BaguaBucket, x: torch.Tensor) -> None:
        """Set up ``bucket.state`` (``x``: the weights after the broadcast, ``[W, L]``)."""

    def combine(self, bucket: BaguaBucket, x: torch.Tensor, optimizer) -> None:
        """x½ → x_{t+1}, in place on ``x`` (``[W, L]``)."""
        raise NotImplementedError
