"""Name -> topology class registry and factory."""

from .gossip import ExponentialTopology, FullyConnectedTopology, RingTopology
from .trees import BinaryTreeTopology, ChainTopology, DoubleBinaryTreeTopology

_REGISTRY = {
    cls.name: cls
    for cls in (
        ChainTopology,
        BinaryTreeTopology,
        DoubleBinaryTreeTopology,
        RingTopology,
        FullyConnectedTopology,
        ExponentialTopology,
    )
}


def available_topologies():
    """Names accepted by ``get_topology``, in registration order."""
    return list(_REGISTRY)


def get_topology(name, world_size):
    """Build the topology registered as ``name`` on ``world_size`` ranks."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown topology {name!r}; valid names are: {', '.join(_REGISTRY)}"
        )
    return cls(world_size)
