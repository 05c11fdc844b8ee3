"""Gradient tracking (DSGT, Pu & Nedić 2020): each worker also gossips a tracker of the
average update, so that it steps along the workers' mean direction rather than its own.

Pu & Nedić's rule, for plain SGD with step α:

    x_{t+1} = W (x_t − α y_t),    y_{t+1} = W y_t + g_{t+1} − g_t,    y_0 = g_0.

Written, as the RelaySum paper runs it, with any local optimizer (its update u_t) and a
correction c (c_0 = 0), so that d_t = u_t + c_t = −α y_t is the tracked step:

1. x½ = x_t + u_t                                     (the user's optimizer)
2. x_{t+1} = W (x½ + c_t)                             (gossip)
3. c_{t+1} = W (c_t + u_t) − u_t                      (gossip)

so d_{t+1} = W d_t + u_{t+1} − u_t. The two gossips travel as one message of twice the
model's size: a row [x½ + c_t, c_t + u_t] per worker, mixed once. u_t = x½ − x_t needs
x_t, copied at forward.
"""

from __future__ import annotations

import torch

from ..runtime.algorithm import Algorithm
from ..runtime.bucket import BaguaBucket
from ..runtime.topology import check_topology_arg
from .adapt_then_combine import AdaptThenCombineImpl
from .table import AlgorithmConfig, register_algorithm

__all__ = ["GradientTrackingAlgorithm", "GradientTrackingAlgorithmImpl"]


class GradientTrackingAlgorithmImpl(AdaptThenCombineImpl):
    """``bucket.state["tracking_correction"]``: c_t, ``[W, L]`` (zero at the start)."""

    WORLD_SIZE_RULE = {
        "step counter and exchange count": "carried over",
        "tracking correction c (gossiped over the old topology)": "reset to zero: tracking starts again",
        "topology": "rebuilt for the new world size",
    }
    RESET_BUCKET_KEYS = frozenset({"tracking_correction"})
    keeps_previous = True

    def init_state(self, bucket: BaguaBucket, x: torch.Tensor) -> None:
        bucket.state["tracking_correction"] = torch.zeros_like(x)
        self._message: dict = {}

    def combine(self, bucket: BaguaBucket, x: torch.Tensor, optimizer) -> None:
        correction = bucket.state["tracking_correction"]
        length = x.shape[1]
        message = self._message.get(bucket.name)
        if message is None or message.shape != (x.shape[0], 2 * length):
            message = self._message[bucket.name] = torch.empty(x.shape[0], 2 * length, dtype=x.dtype,
                                                               device=x.device)
        model, tracker = message[:, :length], message[:, length:]
        update = torch.sub(x, self.previous[bucket.name])  # u_t = x½ − x_t
        torch.add(x, correction, out=model)  # x½ + c_t
        torch.add(correction, update, out=tracker)  # c_t + u_t
        self.mix_(bucket, message)
        x.copy_(model)  # x_{t+1}
        torch.sub(tracker, update, out=correction)  # c_{t+1} = W (c_t + u_t) − u_t


class GradientTrackingAlgorithm(Algorithm):
    """Gradient tracking over a topology, after the user's optimizer step.

    Args:
        topology: a topology's name (default ``"ring"``), a Topology, or the time-varying
            ``"one_peer_exponential"`` (each gossip then follows that exchange's pairing).

    Example::

        >>> from bagua_algos.algorithms import GradientTrackingAlgorithm
        >>> GradientTrackingAlgorithm().topology
        'ring'
    """

    def __init__(self, topology="ring"):
        check_topology_arg(topology)
        self.topology = topology

    def reify(self, process_group) -> GradientTrackingAlgorithmImpl:
        return GradientTrackingAlgorithmImpl(process_group, self.topology)


register_algorithm(
    "gradient_tracking", GradientTrackingAlgorithm,
    "Gradient tracking (DSGT): gossip the model and a tracker of the mean update",
    # A baseline of the RelaySum paper, on the ring. It gossips after the optimizer step,
    # so two workers (a ring of two mixes with weights 1/2) end every step equal: "drift".
    rows=[(130, AlgorithmConfig("gradient_tracking_ring", "gradient_tracking", {"topology": "ring"},
                                replicas="drift", exact_alone=True))],
)
