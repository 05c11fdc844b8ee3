"""Communication topologies for decentralized training (pure Python)."""

from .base import Topology
from .gossip import (ExponentialTopology, FullyConnectedTopology, OnePeerExponentialTopology, RingTopology,
                     ShiftOneTopology, shift_one_peer)
from .registry import available_topologies, get_topology
from .trees import (
    BinaryTreeTopology,
    ChainTopology,
    DoubleBinaryTreeTopology,
    MirroredTopology,
)

__all__ = [
    "Topology",
    "ChainTopology",
    "BinaryTreeTopology",
    "MirroredTopology",
    "DoubleBinaryTreeTopology",
    "RingTopology",
    "FullyConnectedTopology",
    "ExponentialTopology",
    "OnePeerExponentialTopology",
    "ShiftOneTopology",
    "shift_one_peer",
    "available_topologies",
    "get_topology",
]
