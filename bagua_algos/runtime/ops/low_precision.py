"""Bagua's low-precision decentralized op: the ring step of D-PSGD on 8-bit weight
differences, the neighbours' copies kept in ``bucket.state``."""

from __future__ import annotations

from typing import Optional

import torch

from ...compression import minmax
from ...compression.scatter_gather import raise_if_marked
from .. import comm
from .common import MINMAX_UINT8_BITS, effective, is_whole_world, within_nodes

__all__ = ["LowPrecisionDecentralizedSynchronousOp", "low_precision_difference", "ring_peers"]


def ring_peers(index: int, size: int) -> tuple:
    """(left, right) neighbours of position ``index`` on a ring of ``size``."""
    return (index - 1) % size, (index + 1) % size


def low_precision_difference(x: torch.Tensor, weight: torch.Tensor, left: Optional[torch.Tensor] = None,
                             right: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The change a low-precision decentralized worker quantizes and sends, a new tensor:

        z = (x − x̂) + ((x̂_left + x̂ + x̂_right) / 3 − x̂) = x + x̂_left / 3 + x̂_right / 3 − 5 x̂ / 3

    on the ring: the local steps since the last exchange (x − x̂, as x̂ is where they
    started) plus the ring's mixing of the copies, so x̂ + z = W x̂ − γ Σ g (Tang et al.'s
    DCD-PSGD); summed in Bagua's kernel's order (x, then x̂_left, x̂_right, x̂ with
    factors 1/3, 1/3, −5/3). z = x − x̂ for a worker without ring neighbours (one
    gossiping worker: the ring of one). Elementwise, so the rows of stacked workers
    (``[n, d]``, neighbours' rows gathered) give each worker's own z."""
    if left is None and right is None:
        return x - weight
    if left is None or right is None:
        raise ValueError("left and right go together: give both ring neighbours' copies, or neither")
    return torch.add(x, left, alpha=1 / 3).add_(right, alpha=1 / 3).add_(weight, alpha=-5 / 3)


class LowPrecisionDecentralizedSynchronousOp:
    """Bagua's low-precision decentralized SGD step on a ring, run after the optimizer
    step (Bagua's ``decentralized_low_precision_synchronous``).

    Each worker i keeps w = x̂_i, the copy of its weights its peers also hold, and
    replicas l = x̂_{i-1}, r = x̂_{i+1} of its ring neighbours' (all equal to the
    initial model). With x the weights after the local step (x_t − γ g_t):

        z   = x + l / 3 + r / 3 − 5 w / 3        ((x − w) + (l + w + r) / 3 − w: the
                                                  local steps plus the ring's mixing)
        send Q(z) to both neighbours, receive Q(z_{i-1}), Q(z_{i+1})
        w  ← w + D(Q(z)),  l ← l + D(Q(z_{i-1})),  r ← r + D(Q(z_{i+1}))
        x  ← w

    Q is the MinMaxUInt8 codec (8 bits, nearest rounding, one header for the bucket),
    D its decoding: only compressed differences travel, and every replica moves by
    exactly what its owner applied, so l and r stay equal to the neighbours' w. With
    two workers the left and right neighbour are the same one (weights 1/3 and 2/3,
    as in Bagua); with one gossiping worker z = x − w. With ``hierarchical`` the
    weights are first averaged within each node, the node leaders run the ring among
    themselves and broadcast the result within their node.

    w, l and r are ``weight``, ``left_peer_weight`` and ``right_peer_weight`` (Bagua
    tensors of the bucket's length); they are put in ``bucket.state`` so a checkpoint
    holds them.
    """

    def __init__(self, bucket, weight, left_peer_weight, right_peer_weight, hierarchical: bool,
                 compression: str, group):
        if compression != "MinMaxUInt8":
            raise ValueError(f"compression must be 'MinMaxUInt8' for the low-precision decentralized op, got {compression!r}")
        for name, t in (("weight", weight), ("left_peer_weight", left_peer_weight),
                        ("right_peer_weight", right_peer_weight)):
            if not torch.is_tensor(t) or effective(t).numel() != bucket.numel * bucket.workers:
                raise ValueError(
                    f"{name} must be a tensor of the bucket's {bucket.numel} elements "
                    "(bucket.flattened_tensor().ensure_bagua_tensor(...) makes one), got "
                    f"{type(t).__name__ if not torch.is_tensor(t) else tuple(t.shape)}"
                )
            if not effective(t).is_floating_point():
                raise ValueError(f"{name} must be a float tensor, got {effective(t).dtype}")
        self.hierarchical = bool(hierarchical)
        self.compression = compression
        self.group = group
        if self.hierarchical:
            if not is_whole_world(group):
                raise ValueError("hierarchical=True gossips between nodes of all workers; use the default group")
            self._intra = comm.intra_node_group()
            self.is_leader = comm.leads_node()
            local = comm.get_local_size()
            self.peer_ranks = list(range(0, comm.get_world_size(), local))
            my_index = comm.get_node_rank()
        else:
            self._intra = None
            self.is_leader = True
            self.peer_ranks = comm.group_ranks(group)
            my_index = comm.group_rank(group)
        # every peer a [W] long tensor of global ranks (a worker's ring neighbours, W = 1 in a job)
        left, right = ring_peers(my_index, len(self.peer_ranks))
        ranks = torch.tensor(self.peer_ranks)
        self.left_rank = ranks[torch.as_tensor(left)].reshape(-1)
        self.right_rank = ranks[torch.as_tensor(right)].reshape(-1)
        self._me = torch.as_tensor(comm.get_rank()).reshape(-1)
        self._state = bucket.state
        # [W, L] views of the weights (Bagua's flattened_tensor() is [L] in a job): the same storage
        shape = (bucket.workers, bucket.numel)
        self._state["low_precision_weight"] = effective(weight).view(shape)
        self._state["low_precision_left_peer_weight"] = effective(left_peer_weight).view(shape)
        self._state["low_precision_right_peer_weight"] = effective(right_peer_weight).view(shape)

    def __call__(self, bucket) -> None:
        flat = bucket.flat_view()
        one_worker = (self._intra is None or self._intra.nranks() == 1) and len(self.peer_ranks) == 1
        if one_worker and flat.dtype == torch.float32:
            x = flat.detach()  # one worker: the step reads x once and ends writing x ← w
        else:
            x = flat.detach().clone() if flat.dtype == torch.float32 else flat.detach().float()
        within_nodes(x, self._ring_step, self._intra, self.is_leader)
        if x.data_ptr() != flat.data_ptr():
            with torch.no_grad():
                flat.copy_(x)
        bucket.write_flat(flat)

    # One gossiping worker on a GPU: nobody waits for its mark, so it is not read back
    # at once (that would make the host wait for the GPU every step): it is copied to
    # pinned memory and read at the next step, which raises then.
    _pending_mark = None

    def _check_pending_mark(self) -> None:
        pending, self._pending_mark = self._pending_mark, None
        if pending is not None:
            host, event, peers = pending
            event.synchronize()
            raise_if_marked([(host, "the weights")], peers)

    def _ring_step(self, x: torch.Tensor) -> None:
        w = self._state["low_precision_weight"]
        left = self._state["low_precision_left_peer_weight"]
        right = self._state["low_precision_right_peer_weight"]
        with torch.no_grad():
            z = low_precision_difference(x, w, *((left, right) if len(self.peer_ranks) > 1 else ()))
            # one encoding (one header) a worker: z is [W, L] (W = 1 in a job, the n rows on the engine)
            rows = z
            width = rows.shape[0]
            # NaN/inf: the mark; tell the neighbours, then raise with them (compression.scatter_gather)
            mine = minmax.encode_chunks(rows, MINMAX_UINT8_BITS, non_finite="mark").view(width, -1)

            def decode(buf):
                return minmax.decode_chunks(buf.reshape(-1), width, bits=MINMAX_UINT8_BITS,
                                            numel=rows.shape[1]).view(z.shape)

            def marked(buf):
                return minmax.marked(buf.reshape(-1), width)

            def ranks(r):
                return r.tolist()

            if len(self.peer_ranks) > 1:
                from_left, from_right = torch.empty_like(mine), torch.empty_like(mine)
                # Two messages to the same peer when n = 2: they pair up in posting order.
                comm.neighbor_exchange([(self.left_rank, mine), (self.right_rank, mine)],
                                       [(self.left_rank, from_left), (self.right_rank, from_right)],
                                       group=self.group)
                if width > 1:  # (a batched encode of several workers' rows marks every row for one
                    # bad row: they are then every ring member's, named from the values)
                    bad = ~torch.isfinite(rows).all(dim=1)
                    marks = torch.cat([bad[self.left_rank], bad[self.right_rank], bad])
                else:
                    marks = torch.cat([marked(buf) for buf in (from_left, from_right, mine)])
                raise_if_marked([(marks, "the weights")],
                                ranks(self.left_rank) + ranks(self.right_rank) + ranks(self._me))
                left.add_(decode(from_left).to(left.dtype))
                right.add_(decode(from_right).to(right.dtype))
            elif z.is_cuda:
                self._check_pending_mark()
                host = torch.empty(width, dtype=torch.bool, pin_memory=True)
                host.copy_(marked(mine), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending_mark = (host, event, ranks(self._me))
            else:
                raise_if_marked([(marked(mine), "the weights")], ranks(self._me))
            w.add_(decode(mine).to(w.dtype))
            x.copy_(w)
