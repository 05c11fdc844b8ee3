"""Gossip topologies (graphs with cycles): ring, fully connected, exponential."""

from .base import Topology


class RingTopology(Topology):
    """Cycle: rank ``r`` neighbours ``(r - 1) mod n`` and ``(r + 1) mod n``.

    A ring of 2 lists its single neighbour once; a ring of 1 has none.
    """

    name = "ring"

    def _candidate_neighbors(self, rank):
        n = self.world_size
        return [(rank - 1) % n, (rank + 1) % n]


class FullyConnectedTopology(Topology):
    """Complete graph: every rank neighbours every other rank."""

    name = "fully_connected"

    def _candidate_neighbors(self, rank):
        return [peer for peer in range(self.world_size) if peer != rank]


class ExponentialTopology(Topology):
    """Rank ``r`` neighbours ``(r +- 2^k) mod n`` for ``k = 0, 1, ...`` while ``2^k < n``.

    Taken undirected (``+`` and ``-`` both included, so the relation is
    symmetric), deduplicated and without self loops.
    """

    name = "exponential"

    def _candidate_neighbors(self, rank):
        n = self.world_size
        peers = []
        hop = 1
        while hop < n:
            peers.append((rank + hop) % n)
            peers.append((rank - hop) % n)
            hop *= 2
        return peers
