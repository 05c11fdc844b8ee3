"""Turning a ``topology=`` argument (a name or a Topology) into a checked Topology.

The one place where that happens: algorithms check the argument in their constructor
(:func:`check_topology_arg`) and resolve it against their process group in ``reify``;
the decentralized op resolves what it is given with the same function."""

from __future__ import annotations

from topologies import Topology, available_topologies, get_topology


def check_topology_arg(topology) -> None:
    """Refuse what can never be a topology (checked in the Algorithm's constructor)."""
    if isinstance(topology, str):
        if topology not in available_topologies():
            raise ValueError(f"unknown topology {topology!r}; valid names: {available_topologies()}")
    elif not isinstance(topology, Topology):
        raise TypeError(
            f"topology must be a Topology or one of {available_topologies()}, got {type(topology).__name__}"
        )


def resolve_topology(topology, world_size: int, require_tree: bool = False,
                     members: str = "the process group") -> Topology:
    """``topology`` (a name or a Topology) over ``world_size`` ranks.

    A Topology instance must have exactly ``world_size`` ranks: the size of ``members``
    (the process group, or the node leaders for a gossip between nodes).
    """
    check_topology_arg(topology)
    if isinstance(topology, str):
        topology = get_topology(topology, world_size)
    elif topology.world_size != world_size:
        raise ValueError(
            f"topology {topology!r} has {topology.world_size} ranks but {members} has "
            f"{world_size}; build it with world_size={world_size}"
        )
    if require_tree and not topology.is_tree():
        raise ValueError(
            f"topology {topology!r} is not a tree; RelaySGD needs a tree "
            "(chain, binary_tree or double_binary_tree)"
        )
    if not topology.is_connected():
        raise ValueError(
            f"topology {topology!r} is not connected: ranks in different components never exchange "
            f"models, so they are never averaged; use a connected topology, e.g. one of {available_topologies()}"
        )
    return topology
