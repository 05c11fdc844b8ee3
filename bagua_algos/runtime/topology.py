"""Turning a ``topology=`` argument (a name or a Topology) into a checked Topology, and
a topology into the table of neighbours that gossip and relay read.

The one place where that happens: algorithms check the argument in their constructor
(:func:`check_topology_arg`) and resolve it against their process group in ``reify``;
the decentralized op resolves what it is given with the same function.
:class:`NeighbourTable` is the one ``[W, D]`` table of the neighbours of the workers a
process runs (:class:`~.gossip.Gossip`'s slots and weights, relay's tree slots)."""

from __future__ import annotations

from typing import Sequence

import torch

from topologies import Topology, available_topologies, get_topology


def check_topology_arg(topology, require_tree: bool = False) -> None:
    """Refuse what can never be a topology (checked in the Algorithm's constructor).

    With ``require_tree`` (RelaySGD) only the names of tree families are valid, and a
    Topology instance must be a tree already: its size is fixed, so ``is_tree()`` can be
    asked now rather than when the model is wrapped."""
    names = available_topologies(trees_only=require_tree)
    if isinstance(topology, str):
        if topology not in names and topology in available_topologies():
            raise ValueError(_not_a_tree(topology))
        if topology not in names:
            raise ValueError(f"unknown topology {topology!r}; valid names: {names}")
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology or one of {names}, got {type(topology).__name__}")
    elif require_tree and not topology.is_tree():
        raise ValueError(_not_a_tree(topology))


def _not_a_tree(topology) -> str:
    return (f"topology {topology!r} is not a tree; RelaySGD needs a tree: one of "
            f"{available_topologies(trees_only=True)}, or a Topology whose is_tree() is True")


def resolve_topology(topology, world_size: int, require_tree: bool = False,
                     members: str = "the process group", time_varying: bool = False) -> Topology:
    """``topology`` (a name or a Topology) over ``world_size`` ranks.

    A Topology instance must have exactly ``world_size`` ranks: the size of ``members``
    (the process group, or the node leaders for a gossip between nodes). With
    ``require_tree`` it is a tree: :func:`check_topology_arg` admits only tree names and
    tree instances. A time-varying topology (a new pairing every exchange) is refused
    unless the caller gossips along it (``time_varying=True``): a fixed mixing matrix
    would only see the union of its pairings.
    """
    check_topology_arg(topology, require_tree)
    if isinstance(topology, str):
        topology = get_topology(topology, world_size)
    elif topology.world_size != world_size:
        raise ValueError(
            f"topology {topology!r} has {topology.world_size} ranks but {members} has "
            f"{world_size}; build it with world_size={world_size}"
        )
    if topology.time_varying and not time_varying:
        raise ValueError(
            f"topology {topology!r} changes its peers every exchange; this algorithm gossips with one fixed "
            f"matrix: use a fixed topology ({', '.join(n for n in available_topologies() if n != topology.name)}), "
            f"or an algorithm that follows the pairings (sgp, gradient_tracking, decentralized with "
            f"quasi_global_momentum)"
        )
    if not topology.is_connected():
        raise ValueError(
            f"topology {topology!r} is not connected: ranks in different components never exchange "
            f"models, so they are never averaged; use a connected topology, e.g. one of {available_topologies()}"
        )
    return topology


class NeighbourTable:
    """The neighbours of the workers a process runs, in slots, with their
    Metropolis–Hastings weights: the one table gossip and relay's trees read.

    For ``rows`` (topology ranks, one per worker this process runs: W = 1 in a job, every
    rank on the one-process engine):

    - ``neighbours``: ``[W, D]`` int64, row w's k-th neighbour in the topology's order
      (:meth:`Topology.neighbors`), −1 past its degree; D (``slots``) the largest degree
      among the rows;
    - ``weight``: ``[W, D]`` float64, w_{i, j_k} of :meth:`Topology.gossip_weights`, 0.0
      where there is no neighbour;
    - ``self_weight``: ``[W]`` float64, w_ii.

    The weights stay float64 so that each is rounded once, to the tensor's dtype where it
    is used. A time-varying topology's table is that of the union of its pairings.
    """

    def __init__(self, topology: Topology, rows: Sequence[int]):
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
        rows = list(rows)
        for r in rows:  # Topology.neighbors checks them too, with a message naming "rank"
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < topology.world_size:
                raise ValueError(f"rows must be ranks of {topology!r}, ints in [0, {topology.world_size}); "
                                 f"got {r!r} in {rows}")
        self.rows = rows
        neighbours = [topology.neighbors(i) for i in rows]
        weights = [topology.gossip_weights(i) for i in rows]
        self.slots = max((len(nb) for nb in neighbours), default=0)
        pad = [self.slots - len(nb) for nb in neighbours]
        self.neighbours = torch.tensor([nb + [-1] * p for nb, p in zip(neighbours, pad)],
                                       dtype=torch.long).reshape(len(rows), self.slots)
        self.weight = torch.tensor([[w[j] for j in nb] + [0.0] * p for nb, w, p in zip(neighbours, weights, pad)],
                                   dtype=torch.float64).reshape(len(rows), self.slots)
        self.self_weight = torch.tensor([w[i] for i, w in zip(rows, weights)], dtype=torch.float64)
        self._weights_as: dict = {}  # (dtype, device) -> (self weights [W, 1], weights [W, D])

    def weights_as(self, x: torch.Tensor) -> tuple:
        """(self weights ``[W, 1]``, weights ``[W, D]``) in x's dtype and on its device,
        rounded once from the float64 table and kept."""
        key = (x.dtype, x.device)
        if key not in self._weights_as:
            self._weights_as[key] = (self.self_weight.unsqueeze(1).to(x.device, x.dtype),
                                     self.weight.to(x.device, x.dtype))
        return self._weights_as[key]

    def slot(self, k: int) -> list:
        """Slot ``k``'s neighbour of every row, None where a row has none."""
        return [None if j < 0 else j for j in self.neighbours[:, k].tolist()]
