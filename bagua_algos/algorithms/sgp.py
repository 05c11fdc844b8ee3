"""Stochastic Gradient Push (Assran et al. 2019) over the time-varying exponential graph,
one peer a step.

Push-sum keeps a numerator x_i and a weight w_i per worker (w_i = 1 at the start) and
trains the de-biased z_i = x_i / w_i:

1. x½_i = x_i − γ ∇f_i(z_i)                     (here: the user's optimizer step)
2. worker i keeps half of (x½_i, w_i) and pushes the other half to out_peer(i, t)
3. x_i ← (x½_i + x½_in) / 2,  w_i ← (w_i + w_in) / 2,  in = in_peer(i, t)
4. z_i = x_i / w_i

On :class:`~topologies.OnePeerExponentialTopology` exchange t pairs the workers by the
cyclic shift 2^(t mod ⌈log2 n⌉), a permutation: every worker receives exactly one half,
so the mixing matrix (I + P_t)/2 is doubly stochastic and every w_i stays exactly 1
(1/2 + 1/2 is exact in floating point). z = x then, and the weights, which would travel
as one extra number a message, are not sent. With a fixed topology instead, the step is
the Metropolis–Hastings gossip (also doubly stochastic).
"""

from __future__ import annotations

from ..arguments import check_int
from ..runtime.algorithm import Algorithm
from ..runtime.bucket import BaguaBucket
from ..runtime.topology import check_topology_arg
from .adapt_then_combine import AdaptThenCombineImpl
from .table import AlgorithmConfig, register_algorithm

__all__ = ["SGPAlgorithm", "SGPAlgorithmImpl"]


class SGPAlgorithmImpl(AdaptThenCombineImpl):
    WORLD_SIZE_RULE = {
        "step counter and exchange count (the pairing schedule)": "carried over",
        "topology": "rebuilt for the new world size",
    }

    def __init__(self, process_group, topology, push_sum_avg_steps: int = 1):
        super().__init__(process_group, topology)
        self.avg_steps = push_sum_avg_steps

    def combine(self, bucket: BaguaBucket, x, optimizer) -> None:
        # push_sum_avg_steps gossips, each the schedule's next exchange (on the exponential
        # graph the next shift 2^k); the hook counts the last one
        for j in range(self.avg_steps):
            if j:
                bucket.state["exchanges"] += 1
            self.mix_(bucket, x)


class SGPAlgorithm(Algorithm):
    """Stochastic Gradient Push, after the user's optimizer step.

    Args:
        topology: ``"one_peer_exponential"`` (default: one peer out and one in a step, the
            pairing shifting by 2^k), another topology's name, or a Topology.
        push_sum_avg_steps: gossip steps per optimizer step (default 1). The RelaySum
            paper's SGP runs 2 (epfml/relaysgd, ``push_sum_avg_steps``): k steps mix with
            W_{t+k-1} ... W_t, each the schedule's next pairing, and send k messages.

    Example::

        >>> from bagua_algos.algorithms import SGPAlgorithm
        >>> SGPAlgorithm().topology
        'one_peer_exponential'
    """

    def __init__(self, topology="one_peer_exponential", push_sum_avg_steps: int = 1):
        check_topology_arg(topology)
        self.topology = topology
        self.push_sum_avg_steps = check_int("push_sum_avg_steps", push_sum_avg_steps, 1,
                                            what="an integer >= 1 (gossip steps per optimizer step)")

    def reify(self, process_group) -> SGPAlgorithmImpl:
        return SGPAlgorithmImpl(process_group, self.topology, self.push_sum_avg_steps)


register_algorithm(
    "sgp", SGPAlgorithm, "Stochastic Gradient Push: one peer a step over the time-varying exponential graph",
    # A baseline of the RelaySum paper, over the time-varying exponential graph.
    rows=[(150, AlgorithmConfig("sgp", "sgp", {"topology": "one_peer_exponential"}, replicas="drift",
                                exact_alone=True))],
)
