"""Communication topologies for decentralized training (pure Python)."""

from .base import Topology
from .registry import available_topologies, get_topology, register_topology
# the trees first: they register in import order, and the tree families are listed first
from .trees import (
    BinaryTreeTopology,
    ChainTopology,
    DoubleBinaryTreeTopology,
    MirroredTopology,
)
from .gossip import (ExponentialTopology, FullyConnectedTopology, OnePeerExponentialTopology, RingTopology,  # noqa: E402
                     ShiftOneTopology, shift_one_peer)

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
    "register_topology",
]
