"""Bagua's centralized synchronous op: the bucket summed or averaged over the group,
exactly (allreduce, scatter-gather, hierarchical) or through the MinMaxUInt8 codec."""

from __future__ import annotations

from typing import Optional

import torch

from .. import comm
from .common import MINMAX_UINT8_BITS, is_whole_world, within_nodes
from .scatter_gather import compressed_scatter_gather

__all__ = ["CentralizedSynchronousOp", "COMPRESSIONS"]

COMPRESSIONS = (None, "MinMaxUInt8")


class CentralizedSynchronousOp:
    """Sum (``average=False``) or mean of the bucket over the group, in place.

    ``compression="MinMaxUInt8"`` (Bagua's low-precision op): the reduction goes
    through :func:`compressed_scatter_gather` at 8 bits, nearest rounding; with
    ``hierarchical`` the bucket is first reduced exactly within each node, the node
    leaders (local rank 0) run the compressed reduction among themselves, and each
    leader broadcasts the result within its node.
    """

    def __init__(self, hierarchical: bool, average: bool, scattergather: bool, compression: Optional[str], group):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
        if hierarchical and not is_whole_world(group):
            raise ValueError("hierarchical=True reduces over all workers (nodes of LOCAL_WORLD_SIZE); use the default group")
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)
        self.op = comm.ReduceOp.AVG if average else comm.ReduceOp.SUM
        self.scattergather = bool(scattergather)
        self.compression = compression
        self.group = group
        # One worker: the (exact) reduction is the bucket itself, so the op does nothing.
        # Not so for the flat compressed reduction, which still quantizes (twice).
        self.local_only = comm.get_world_size(group) == 1 and (compression is None or self.hierarchical)
        if compression is not None and self.hierarchical:
            # Node groups are created collectively: here, on every rank, not on first use.
            self._intra = comm.intra_node_group()
            self._leaders = comm.inter_node_group() if comm.leads_node() else None

    def __call__(self, bucket) -> None:
        if self.local_only:
            return
        flat = bucket.flat_view()
        if self.compression is not None:
            self._compressed(flat)
        elif self.hierarchical:
            comm.hierarchical_allreduce_inplace(flat, self.op)
        elif self.scattergather:
            self._reduce_scatter_gather(flat)
        else:
            comm.allreduce_inplace(flat, self.op, group=self.group)
        bucket.write_flat(flat)

    def _compressed(self, flat: torch.Tensor) -> None:
        x = flat if flat.dtype == torch.float32 else flat.float()
        if not self.hierarchical:
            compressed_scatter_gather(x, MINMAX_UINT8_BITS, self.average, self.group)
        else:
            def among_leaders(x):
                if self._leaders.nranks() > 1:  # (one node: the exact node average is already the result)
                    compressed_scatter_gather(x, MINMAX_UINT8_BITS, self.average, self._leaders)

            within_nodes(x, among_leaders, self._intra, self._leaders is not None, self.op)
        if x.data_ptr() != flat.data_ptr():
            flat.copy_(x)

    def _reduce_scatter_gather(self, flat: torch.Tensor) -> None:
        """Each worker reduces one chunk, then every worker gathers all chunks
        (``flat``: ``[W, L]``, a row per worker)."""
        size = comm.get_world_size(self.group)
        width, numel = flat.shape
        chunk = -(-numel // size)
        padded = flat if chunk * size == numel and flat.is_contiguous() else torch.cat(
            [flat, flat.new_zeros(width, chunk * size - numel)], dim=1)
        mine = flat.new_empty(width, chunk)
        comm.reduce_scatter(padded, mine, self.op, group=self.group)
        comm.allgather(mine, padded, group=self.group)
        if padded is not flat:
            flat.copy_(padded[:, :numel])
