"""D² (Tang et al. 2018): decentralized SGD corrected for the variance between workers'
data, so that heterogeneity does not bias the fixed point as it does D-PSGD's.

Tang et al.'s rule, for plain SGD with step γ:

    x_1     = W (x_0 − γ g_0)
    x_{t+1} = W (2 x_t − x_{t−1} − γ g_t + γ g_{t−1}).

Written, as the RelaySum paper runs it, with any local optimizer (its update u_t, e.g.
−γ g_t, or a local-momentum step) and a correction c:

1. x½ = x_t + u_t                                    (the user's optimizer)
2. y  = x½ + c_t                                     (c_0 = 0)
3. x_{t+1} = W y                                     (one gossip)
4. c_{t+1} = x_{t+1} − x½

With u_t = −γ g_t, step 2 is 2x_t − x_{t−1} − γg_t + γg_{t−1}: c_t = x_t − x_{t−1} − u_{t−1}.

W is the topology's Metropolis–Hastings matrix and must stay fixed (the correction is
the difference of two of its products). D² asks for λ_min(W) > −1/3; an even ring's
weights of 1/3 reach −1/3 exactly (the alternating mode neither grows nor decays), the
setting of the RelaySum paper's ring.
"""

from __future__ import annotations

import torch

from ..runtime.algorithm import Algorithm
from ..runtime.bucket import BaguaBucket
from ..runtime.topology import check_topology_arg
from .adapt_then_combine import AdaptThenCombineImpl
from .table import AlgorithmConfig, register_algorithm

__all__ = ["D2Algorithm", "D2AlgorithmImpl"]


class D2AlgorithmImpl(AdaptThenCombineImpl):
    """``bucket.state["d2_correction"]``: c_t, ``[W, L]`` (zero at the start)."""

    WORLD_SIZE_RULE = {
        "step counter and exchange count": "carried over",
        "correction c (a difference of the old topology's gossip)": "reset to zero: the next step is D²'s first",
        "topology": "rebuilt for the new world size",
    }
    RESET_BUCKET_KEYS = frozenset({"d2_correction"})
    follows_time_varying = False  # the correction needs one fixed W

    def init_state(self, bucket: BaguaBucket, x: torch.Tensor) -> None:
        bucket.state["d2_correction"] = torch.zeros_like(x)
        self._y: dict = {}

    def combine(self, bucket: BaguaBucket, x: torch.Tensor, optimizer) -> None:
        correction = bucket.state["d2_correction"]
        y = self._y.get(bucket.name)
        if y is None or y.shape != x.shape:
            y = self._y[bucket.name] = torch.empty_like(x)
        torch.add(x, correction, out=y)  # y = x½ + c_t
        self.mix_(bucket, y)  # x_{t+1} = W y
        torch.sub(y, x, out=correction)  # c_{t+1} = x_{t+1} − x½
        x.copy_(y)


class D2Algorithm(Algorithm):
    """D² over a fixed topology, after the user's optimizer step.

    Args:
        topology: a fixed topology's name (default ``"ring"``) or a Topology; its
            Metropolis–Hastings weights are W.

    Example::

        >>> from bagua_algos.algorithms import D2Algorithm
        >>> D2Algorithm(topology="ring").topology
        'ring'
    """

    def __init__(self, topology="ring"):
        check_topology_arg(topology)
        self.topology = topology

    def reify(self, process_group) -> D2AlgorithmImpl:
        return D2AlgorithmImpl(process_group, self.topology)


register_algorithm(
    "d2", D2Algorithm, "D²: gossip with a correction for heterogeneous data",
    # A baseline of the RelaySum paper, on the ring. It gossips after the optimizer step,
    # so two workers (a ring of two mixes with weights 1/2) end every step equal: "drift".
    rows=[(120, AlgorithmConfig("d2_ring", "d2", {"topology": "ring"}, replicas="drift", exact_alone=True))],
)
