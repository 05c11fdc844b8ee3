"""Name -> topology class registry and factory."""

from .gossip import ExponentialTopology, FullyConnectedTopology, OnePeerExponentialTopology, RingTopology
from .trees import BinaryTreeTopology, ChainTopology, DoubleBinaryTreeTopology

# Families that are trees on every number of ranks (a double binary tree: each of its
# two trees), the ones a tree algorithm such as RelaySGD accepts by name.
_TREES = (ChainTopology, BinaryTreeTopology, DoubleBinaryTreeTopology)
_REGISTRY = {cls.name: cls for cls in (*_TREES, RingTopology, FullyConnectedTopology, ExponentialTopology,
                                      OnePeerExponentialTopology)}


def available_topologies(trees_only=False):
    """Names accepted by ``get_topology``, in registration order; with ``trees_only``,
    only those that build a tree (``is_tree()``) on every number of ranks."""
    if trees_only:
        return [cls.name for cls in _TREES]
    return list(_REGISTRY)


def get_topology(name, world_size):
    """Build the topology registered as ``name`` on ``world_size`` ranks."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown topology {name!r}; valid names are: {', '.join(_REGISTRY)}"
        )
    return cls(world_size)
