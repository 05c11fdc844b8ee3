"""The neighbour exchange of decentralized algorithms, and ``all_gather_object``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .checks import GLOBAL_RANKS, _check_tensor, _global_rank, _peer_rank, _target
from .counter import _count, _nbytes
from .env import _require_init, get_rank
from .groups import _as_communicator
from .handle import CommHandle
from .staging import _Staging


def start_neighbor_exchange(
    sends: Mapping[int, torch.Tensor] | Sequence[tuple[int, torch.Tensor]],
    recvs: Mapping[int, torch.Tensor] | Sequence[tuple[int, torch.Tensor]],
    group=None,
) -> CommHandle:
    """Post all sends and receives of one step at once.

    ``sends`` and ``recvs`` map a peer's global rank to a tensor (or are lists of
    ``(peer, tensor)`` pairs when a peer gets several tensors; pairs to the same peer
    are matched in posting order). A peer is an int or, as the plugin's algorithms
    give it on every backend, the ``[W]`` long tensor of its workers' peers, here
    ``[1]`` (-1: no peer, the pair is skipped). Returns a handle; ``wait()`` blocks until all are
    done. A pair with this process's own rank is a local copy. When every tensor is a
    CUDA tensor of a group with NCCL, the step is one ``batch_isend_irecv`` (NCCL groups
    its sends and receives, so no order of posting can deadlock); otherwise each send
    and receive is posted on gloo on its own (``irecv`` / ``isend``, receives first,
    each kind in order), CUDA tensors staged through host memory.

    Why receives first on gloo: measured over bandwidth-limited links, a worker that
    sends to two neighbours and receives from both finished in 1.6–1.75× the time when
    its sends were posted first
    (21 MB per message over emulated 100 Mbit/s and 1 Gbit/s links, 4 workers on a
    chain: 6.3 s against 4.0 s, 654 ms against 373 ms; docs/benchmarks.md).
    """
    _require_init("start_neighbor_exchange()")
    c = _as_communicator(group)
    send_items = list(sends.items()) if isinstance(sends, Mapping) else list(sends)
    recv_items = list(recvs.items()) if isinstance(recvs, Mapping) else list(recvs)
    for kind, items in (("sends", send_items), ("recvs", recv_items)):
        for i, (peer, t) in enumerate(items):
            _check_tensor(f"{kind}[{i}] tensor", t)
            peer = items[i] = _peer_rank(peer, f"{kind}[{i}] peer"), t
            if peer[0] is not None:
                _global_rank(c, GLOBAL_RANKS, peer[0], f"{kind}[{i}] peer")
    send_items = [(p, t) for p, t in send_items if p is not None]  # (a [1] peer of -1: none)
    recv_items = [(p, t) for p, t in recv_items if p is not None]
    me = get_rank()
    own_sends = [t for peer, t in send_items if peer == me]
    own_recvs = [t for peer, t in recv_items if peer == me]
    if len(own_sends) != len(own_recvs):
        raise ValueError(
            f"{len(own_sends)} sends but {len(own_recvs)} receives with this process's own rank {me}; they pair up in order"
        )
    for src, dst in zip(own_sends, own_recvs):
        dst.copy_(src)
    send_items = [(p, t) for p, t in send_items if p != me]
    recv_items = [(p, t) for p, t in recv_items if p != me]
    _count(sum(_nbytes(t) for _, t in send_items))
    if not (send_items or recv_items):
        return CommHandle()
    g = c.torch_group
    if all(c.uses_nccl(t) for _, t in send_items + recv_items):
        ops = [dist.P2POp(dist.isend, t, peer, g) for peer, t in send_items]
        ops += [dist.P2POp(dist.irecv, t, peer, g) for peer, t in recv_items]
        return CommHandle(dist.batch_isend_irecv(ops))
    st = _Staging(c, force=True)
    works = [dist.irecv(st(t, read=False, write=True), src=peer, group=g) for peer, t in recv_items]
    works += [dist.isend(st(t), dst=peer, group=g) for peer, t in send_items]
    return st.handle(works)


def neighbor_exchange(sends, recvs, group=None) -> None:
    """Blocking :func:`start_neighbor_exchange`."""
    start_neighbor_exchange(sends, recvs, group).wait()


def all_gather_object(obj, comm=None, *, group=None) -> list:
    """Every member's picklable ``obj``, in communicator-rank order (e.g. to compare
    model fingerprints before any tensor is sent)."""
    c, _ = _target(comm, group, "all_gather_object")
    out = [None] * c.nranks()
    dist.all_gather_object(out, obj, group=c.torch_group)
    return out


def broadcast_object(obj, src: int = 0, comm=None, *, group=None):
    """Bagua's ``broadcast_object(obj, src=0, comm=None)``: the picklable ``obj`` of
    rank ``src`` (a communicator rank with ``comm=``, a global rank with ``group=``),
    returned on every member; ``obj`` is ignored elsewhere. A process outside the
    communicator gets its own ``obj`` back. It travels as CPU bytes (over gloo, also in
    an NCCL job), so it never touches a GPU."""
    c, ranks = _target(comm, group, "broadcast_object")
    if not c.is_member():
        return obj
    src = _global_rank(c, ranks, src, "src")
    box = [obj if get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=c.torch_group, device=torch.device("cpu"))
    return box[0]
