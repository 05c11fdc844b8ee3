"""Tree topologies: chain, binary tree, double binary tree."""

from .base import Topology
from .registry import register_topology


@register_topology(tree=True)
class ChainTopology(Topology):
    """Path graph ``0 - 1 - ... - (n-1)``: rank ``r`` neighbours ``r-1`` and ``r+1`` where they exist (left first)."""

    name = "chain"

    def _candidate_neighbors(self, rank):
        return [peer for peer in (rank - 1, rank + 1) if 0 <= peer < self.world_size]


@register_topology(tree=True)
class BinaryTreeTopology(Topology):
    """0-based binary tree as in the RelaySum code.

    Rank ``w > 0`` has parent ``w // 2`` (listed first) and children ``2w`` and
    ``2w + 1`` where they are ``< world_size``.  Rank 0 is the root and its only
    child is 1 (its formula children are ``{0, 1}`` minus itself).  Every rank
    ``w > 0`` has a unique parent ``w // 2 < w``, so this is a spanning tree
    with ``n - 1`` edges and maximum degree 3.
    """

    name = "binary_tree"

    def _candidate_neighbors(self, rank):
        n = self.world_size
        parent = [rank // 2] if rank > 0 else []
        children = [child for child in (2 * rank, 2 * rank + 1) if child < n]
        return parent + children


class MirroredTopology(Topology):
    """``base`` relabelled by ``r -> n - 1 - r``.

    ``neighbors(r) = [n - 1 - x for x in base.neighbors(n - 1 - r)]``, keeping
    the base's order (so a mirrored binary tree still lists the parent first).
    """

    def __init__(self, base):
        if not isinstance(base, Topology):
            raise ValueError(f"base must be a Topology, got {base!r}")
        super().__init__(base.world_size)
        self.base = base
        self.name = f"mirrored_{base.name}"

    def _candidate_neighbors(self, rank):
        last = self.world_size - 1
        return [last - peer for peer in self.base.neighbors(last - rank)]

    def __repr__(self):
        return f"MirroredTopology({self.base!r})"


@register_topology(tree=True)
class DoubleBinaryTreeTopology(Topology):
    """Two spanning trees: A = ``BinaryTreeTopology(n)``, B = A mirrored by ``r -> n-1-r``.

    ``trees`` is ``(A, B)``; RelaySGD runs over each tree separately (half of
    the model's coordinates per tree).  ``neighbors(rank)`` is the sorted union
    of the two trees' neighbour lists, used for degrees, edges and gossip
    weights of the combined graph.  ``is_tree()`` is defined as "every one of
    ``trees`` is a tree" (the union itself generally has cycles), and
    ``diameter()`` is the maximum of the trees' diameters.
    """

    name = "double_binary_tree"

    def __init__(self, world_size):
        super().__init__(world_size)
        tree_a = BinaryTreeTopology(world_size)
        self._trees = (tree_a, MirroredTopology(tree_a))

    @property
    def trees(self):
        """``(tree_a, tree_b)``: the binary tree and its mirror."""
        return self._trees

    def _candidate_neighbors(self, rank):
        return sorted({peer for tree in self._trees for peer in tree.neighbors(rank)})

    def is_tree(self):
        """True if every one of ``trees`` is a tree (not the union graph)."""
        return all(tree.is_tree() for tree in self._trees)

    def diameter(self):
        """Maximum of the two trees' diameters."""
        return max(tree.diameter() for tree in self._trees)
