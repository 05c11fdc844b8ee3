"""The ``Topology`` base class: an undirected communication graph over ranks.

A topology on ``world_size`` ranks is an undirected simple graph whose
vertices are the ranks ``0 .. world_size - 1``.  Subclasses only say who a
rank's neighbours are (``_candidate_neighbors``); everything else (edges,
degrees, BFS distances, diameter, connectivity, tree test, gossip weights)
is derived here.  Plain Python only: no torch, no numpy.
"""

from collections import deque
from fractions import Fraction


def check_world_size(world_size):
    """Return ``world_size`` if it is an ``int >= 1`` (bool excluded), else raise ``ValueError``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"world_size must be an int >= 1, got {world_size!r}"
        )
    return world_size


class Topology:
    """Undirected communication graph over the ranks ``0 .. world_size - 1``.

    Subclasses set ``name`` and implement ``_candidate_neighbors(rank)``; the
    candidates may contain duplicates or ``rank`` itself (e.g. ``r + 1 mod 2``
    equals ``r - 1 mod 2``); these are removed here, keeping first-seen order.
    The neighbour relation is expected to be symmetric.
    """

    name = "topology"
    # A time-varying topology (OnePeerExponentialTopology, ShiftOneTopology) names each
    # exchange's peers (out_peer(rank, step) / in_peer(rank, step)); its neighbours are
    # their union over a period.
    time_varying = False

    def __init__(self, world_size):
        self.world_size = check_world_size(world_size)
        self._adjacency = None

    # ----------------------------------------------------------------- hooks
    def _candidate_neighbors(self, rank):
        raise NotImplementedError

    # ------------------------------------------------------------ validation
    def _check_rank(self, rank):
        n = self.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(
                f"rank must be an int in [0, {n}) for world_size={n}, got {rank!r}"
            )
        return rank

    # ------------------------------------------------------------- structure
    def _adjacency_lists(self):
        if self._adjacency is None:
            adjacency = []
            for rank in range(self.world_size):
                seen = []
                for peer in self._candidate_neighbors(rank):
                    if peer != rank and peer not in seen:
                        seen.append(peer)
                adjacency.append(tuple(seen))
            self._adjacency = tuple(adjacency)
        return self._adjacency

    def neighbors(self, rank):
        """Neighbours of ``rank``: no duplicates, never ``rank`` itself."""
        return list(self._adjacency_lists()[self._check_rank(rank)])

    def degree(self, rank):
        """Number of neighbours of ``rank``."""
        return len(self._adjacency_lists()[self._check_rank(rank)])

    def edges(self):
        """Each undirected edge once, as ``(i, j)`` with ``i < j``, sorted."""
        return sorted(
            (rank, peer)
            for rank, peers in enumerate(self._adjacency_lists())
            for peer in peers
            if rank < peer
        )

    @property
    def trees(self):
        """The spanning trees the topology is made of; ``(self,)`` by default.

        Tree algorithms (e.g. RelaySGD) can iterate over ``topology.trees``
        uniformly whether the topology is one tree or several.
        """
        return (self,)

    # ------------------------------------------------------------- distances
    def distances_from(self, rank):
        """BFS hop counts from ``rank``; ``None`` for unreachable ranks."""
        adjacency = self._adjacency_lists()
        dist = [None] * self.world_size
        dist[self._check_rank(rank)] = 0
        queue = deque([rank])
        while queue:
            u = queue.popleft()
            for v in adjacency[u]:
                if dist[v] is None:
                    dist[v] = dist[u] + 1
                    queue.append(v)
        return dist

    def is_connected(self):
        """True if every rank is reachable from rank 0."""
        return None not in self.distances_from(0)

    def diameter(self):
        """max over pairs (i, j) of the shortest-path hop count; 0 for one rank.

        Raises ``ValueError`` if the graph is disconnected (infinite diameter).
        """
        best = 0
        for rank in range(self.world_size):
            dist = self.distances_from(rank)
            if None in dist:
                raise ValueError(f"{self!r} is disconnected; its diameter is infinite")
            best = max(best, max(dist))
        return best

    def is_tree(self):
        """True if the graph is connected and has exactly ``world_size - 1`` edges."""
        return len(self.edges()) == self.world_size - 1 and self.is_connected()

    # ---------------------------------------------------------------- gossip
    def _exact_gossip_weights(self, rank):
        # Metropolis-Hastings: W_ij = 1 / (max(deg_i, deg_j) + 1) on edges,
        # W_ii = 1 - sum_{j != i} W_ij.  Symmetric by construction, and each
        # off-diagonal row sum is <= deg_i / (deg_i + 1) < 1, so W_ii > 0.
        adjacency = self._adjacency_lists()
        deg_i = len(adjacency[rank])
        row = {
            peer: Fraction(1, max(deg_i, len(adjacency[peer])) + 1)
            for peer in adjacency[rank]
        }
        row[rank] = 1 - sum(row.values(), Fraction(0))
        return row

    def gossip_weights(self, rank):
        """Row ``rank`` of the Metropolis-Hastings matrix as ``{peer: weight}``.

        Contains ``rank`` itself and each neighbour; all other entries are 0.
        Needs only the degrees of ``rank`` and its neighbours.
        """
        row = self._exact_gossip_weights(self._check_rank(rank))
        return {peer: float(weight) for peer, weight in row.items()}

    def gossip_matrix(self):
        """Metropolis-Hastings mixing matrix ``W`` as a list of float rows.

        ``W_ij = 1 / (max(deg_i, deg_j) + 1)`` for each edge ``{i, j}``,
        ``W_ii = 1 - sum_{j != i} W_ij`` and 0 elsewhere.  ``W`` is symmetric,
        nonnegative and doubly stochastic.
        """
        n = self.world_size
        matrix = []
        for rank in range(n):
            row = [0.0] * n
            for peer, weight in self._exact_gossip_weights(rank).items():
                row[peer] = float(weight)
            matrix.append(row)
        return matrix

    def __repr__(self):
        return f"{type(self).__name__}(world_size={self.world_size})"
