"""Gossip topologies (graphs with cycles): ring, fully connected, exponential, and the
two time-varying pairings: the one-peer exponential graph and Bagua's shift_one."""

from .base import Topology
from .registry import register_topology


@register_topology
class RingTopology(Topology):
    """Cycle: rank ``r`` neighbours ``(r - 1) mod n`` and ``(r + 1) mod n``.

    A ring of 2 lists its single neighbour once; a ring of 1 has none.
    """

    name = "ring"

    def _candidate_neighbors(self, rank):
        n = self.world_size
        return [(rank - 1) % n, (rank + 1) % n]


@register_topology
class FullyConnectedTopology(Topology):
    """Complete graph: every rank neighbours every other rank."""

    name = "fully_connected"

    def _candidate_neighbors(self, rank):
        return [peer for peer in range(self.world_size) if peer != rank]


@register_topology
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


@register_topology
class OnePeerExponentialTopology(ExponentialTopology):
    """The time-varying exponential graph of Stochastic Gradient Push (Assran et al.
    2019): at exchange ``t`` (counted from 0) rank ``r`` sends to ``(r + 2^k) mod n`` and
    receives from ``(r - 2^k) mod n``, ``k = t mod m``, ``m`` the number of hops
    ``2^k < n`` (``period``). One peer out and one in per exchange.

    Its neighbours (the union over a period) are the exponential graph's. Each exchange's
    pairing is a cyclic shift, a permutation of the ranks, so the mixing matrix
    ``(I + P_t) / 2`` of an exchange is doubly stochastic on any ``n``.
    """

    name = "one_peer_exponential"
    time_varying = True

    @property
    def period(self):
        """Number of distinct hops ``2^k < n`` (0 for one rank): the schedule's period."""
        hops, hop = 0, 1
        while hop < self.world_size:
            hops, hop = hops + 1, hop * 2
        return hops

    def hop(self, step):
        """The shift ``2^(step mod period)`` of exchange ``step`` (0 for one rank)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return 2 ** (step % self.period) if self.period else 0

    def out_peer(self, rank, step):
        """The rank ``rank`` sends to at exchange ``step``."""
        return (self._check_rank(rank) + self.hop(step)) % self.world_size

    def in_peer(self, rank, step):
        """The rank ``rank`` receives from at exchange ``step``."""
        return (self._check_rank(rank) - self.hop(step)) % self.world_size


def shift_one_peer(rank, world_size, step):
    """Bagua's shift_one pairing at exchange ``step`` (counted from 0), n even.

    Ranks below n/2 pair with the upper half: r ↦ ((step + r) mod n/2) + n/2, and
    r ≥ n/2 ↦ (r − n/2 − step) mod n/2, the inverse map, so the pairs are symmetric.
    """
    if world_size % 2:
        raise ValueError(f"shift_one needs an even number of workers, got {world_size}")
    half = world_size // 2
    if rank < half:
        return (step + rank) % half + half
    return (rank - half - step) % half


class ShiftOneTopology(Topology):
    """Bagua's ``peer_selection_mode="shift_one"`` as a time-varying topology: at exchange
    ``t`` rank ``r`` pairs with :func:`shift_one_peer` ``(r, n, t)``; the pairing is
    symmetric, so a rank sends to and receives from the same peer
    (``out_peer == in_peer``), and each exchange's mixing matrix ``(I + P_t) / 2`` is
    doubly stochastic. Its neighbours (the union over the period n/2) are the other half
    of the ranks. Not registered by name: Bagua selects it with its peer selection mode.
    """

    name = "shift_one"
    time_varying = True

    def __init__(self, world_size):
        super().__init__(world_size)
        if world_size % 2:
            raise ValueError(f"shift_one needs an even number of workers, got world_size={world_size}")

    @property
    def period(self):
        """n/2 exchanges: then every rank has met every rank of the other half."""
        return self.world_size // 2

    def _candidate_neighbors(self, rank):
        return [shift_one_peer(rank, self.world_size, t) for t in range(self.period)]

    def _check_step(self, step):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return step

    def out_peer(self, rank, step):
        """The rank ``rank`` sends to at exchange ``step`` (its pair)."""
        return shift_one_peer(self._check_rank(rank), self.world_size, self._check_step(step))

    def in_peer(self, rank, step):
        """The rank ``rank`` receives from at exchange ``step``: its pair, as it sends to it."""
        return self.out_peer(rank, step)
