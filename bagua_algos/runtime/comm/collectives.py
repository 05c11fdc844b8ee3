"""The collectives and point-to-point calls with Bagua's names and signatures.

Each opens with :func:`_open` (itself or through the collective it forwards to): the
target communicator, nothing done outside it, its tensors checked; then it checks what
is its own (sizes, ranks, the operator) and launches its torch.distributed call, its
tensors moved through :class:`~.staging._Staging`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import _check_same_dtype, _check_tensor, _counts, _global_rank, _peer_rank, _reduce_op, _regions, _target
from ...arguments import check_int
from .counter import _count, _nbytes
from .env import get_rank
from .groups import BaguaCommunicator
from .handle import CommHandle, _finish, _skip
from .reduce_op import ReduceOp, _op_and_finish
from .staging import _Staging


# torch 2.14 renamed the *_tensor collectives to *_single (and warns on the old names).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_ABSENT = object()  # a tensor argument the collective does not take (None is a bad tensor)


def _open(what: str, comm, group, tensor=_ABSENT, *, send=_ABSENT, recv=_ABSENT, sizes=None):
    """The opening every collective shares: (the target communicator, what its rank
    arguments are: see :func:`~.checks._target`), or (None, None) where this process is
    not one of its members, for which the call does nothing and returns
    ``_skip(async_op)``. A member's tensors are checked first, in this order: ``tensor``
    (an in-place collective's, written in place, so contiguous), ``send`` (read, so any
    strides), ``recv`` (written in place, so contiguous); with both ``send`` and ``recv``,
    then ``sizes()`` (how their element counts must relate, where that is named before
    a dtype mismatch) and the check that they share a dtype."""
    c, ranks = _target(comm, group, what)
    if not c.is_member():
        return None, None
    if tensor is not _ABSENT:
        _check_tensor("tensor", tensor)
    if send is not _ABSENT:
        _check_tensor("send_tensor", send, contiguous=False)
    if recv is not _ABSENT:
        _check_tensor("recv_tensor", recv)
    if send is not _ABSENT and recv is not _ABSENT:
        if sizes is not None:
            sizes()
        _check_same_dtype("send_tensor", send, "recv_tensor", recv)
    return c, ranks


def _check_same_shape(send_tensor: torch.Tensor, recv_tensor: torch.Tensor) -> None:
    if recv_tensor.shape != send_tensor.shape:
        raise ValueError(
            f"recv_tensor shape {tuple(recv_tensor.shape)} differs from send_tensor shape {tuple(send_tensor.shape)}"
        )


def _check_same_numel(send_tensor: torch.Tensor, recv_tensor: torch.Tensor) -> None:
    """recv_tensor.numel() == send_tensor.numel() (the shapes may differ)."""
    if recv_tensor.numel() != send_tensor.numel():
        raise ValueError(
            f"recv_tensor must have as many elements as send_tensor ({send_tensor.numel()}), got {recv_tensor.numel()}"
        )


def _check_nranks_chunks(whole_name: str, whole: torch.Tensor, chunk_name: str, chunk: torch.Tensor, n: int,
                         where: str) -> None:
    """``whole`` holds one ``chunk``-sized piece per rank: numel = n × chunk.numel()."""
    if whole.numel() != n * chunk.numel():
        raise ValueError(
            f"{whole_name} must have nranks x {chunk_name}.numel() = {n} x {chunk.numel()} = "
            f"{n * chunk.numel()} elements {where}, got {whole.numel()}"
        )


def _check_divisible(name: str, tensor: torch.Tensor, n: int) -> None:
    """``tensor`` splits into n equal chunks, one per rank (n = 0 is not checked)."""
    if n and tensor.numel() % n:
        raise ValueError(f"{name}.numel() = {tensor.numel()} must be divisible by the number of ranks ({n})")


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *, group=None,
                      async_op: bool = False):
    """``tensor`` ← reduction over the communicator of every member's ``tensor``."""
    c, _ = _open("allreduce_inplace", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    op = _reduce_op(op, tensor)
    torch_op, finishers = _op_and_finish(op, c, tensor)
    _count(_nbytes(tensor))
    st = _Staging(c)
    work = dist.all_reduce(st(tensor, write=True), op=torch_op, group=c.torch_group, async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *,
              group=None, async_op: bool = False):
    """``recv_tensor`` ← reduction of every member's ``send_tensor``; ``send_tensor`` is kept."""
    c, _ = _open("allreduce", comm, group, send=send_tensor, recv=recv_tensor,
                 sizes=lambda: _check_same_shape(send_tensor, recv_tensor))
    if c is None:
        return _skip(async_op)
    op = _reduce_op(op, send_tensor)
    if recv_tensor.data_ptr() != send_tensor.data_ptr():
        recv_tensor.copy_(send_tensor)
    return allreduce_inplace(recv_tensor, op, group=c, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, comm=None, *, group=None, async_op: bool = False):
    """Every member's ``tensor`` ← ``tensor`` of rank ``src`` (see the module's note on ranks)."""
    c, ranks = _open("broadcast", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    src = _global_rank(c, ranks, src, "src")
    if get_rank() == src:
        _count(_nbytes(tensor))
    st = _Staging(c)
    work = dist.broadcast(st(tensor, write=get_rank() != src), src=src, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def reduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm=None,
           *, group=None, async_op: bool = False):
    """``recv_tensor`` of rank ``dst`` ← reduction of every member's ``send_tensor``.
    ``send_tensor`` is kept everywhere; other members' ``recv_tensor`` is untouched."""
    c, ranks = _open("reduce", comm, group, send=send_tensor, recv=recv_tensor,
                     sizes=lambda: _check_same_numel(send_tensor, recv_tensor))
    if c is None:
        return _skip(async_op)
    op = _reduce_op(op, send_tensor)
    dst = _global_rank(c, ranks, dst, "dst")
    if get_rank() == dst:
        buffer = recv_tensor
        if recv_tensor.data_ptr() != send_tensor.data_ptr():
            recv_tensor.view(-1).copy_(send_tensor.reshape(-1))
    else:
        buffer = send_tensor.detach().clone(memory_format=torch.contiguous_format)
    return _reduce_into(buffer, dst, op, c, async_op)


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm=None, *, group=None,
                   async_op: bool = False):
    """``tensor`` of rank ``dst`` ← reduction of every member's ``tensor``; the other
    members' ``tensor`` is left unchanged."""
    c, ranks = _open("reduce_inplace", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    op = _reduce_op(op, tensor)
    dst = _global_rank(c, ranks, dst, "dst")
    # gloo writes partial sums into the buffers of other members: they reduce a copy.
    buffer = tensor if get_rank() == dst or c.uses_nccl(tensor) else tensor.clone()
    return _reduce_into(buffer, dst, op, c, async_op)


def _reduce_into(buffer: torch.Tensor, dst: int, op: ReduceOp, c: BaguaCommunicator, async_op: bool):
    torch_op, finishers = _op_and_finish(op, c, buffer)
    if get_rank() != dst:
        finishers = []
        _count(_nbytes(buffer))
    st = _Staging(c)
    work = dist.reduce(st(buffer, write=get_rank() == dst), dst=dst, op=torch_op, group=c.torch_group, async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """``recv_tensor`` (nranks × ``send_tensor.numel()`` elements) ← every member's
    ``send_tensor``, in communicator-rank order."""
    c, _ = _open("allgather", comm, group, send=send_tensor, recv=recv_tensor)
    if c is None:
        return _skip(async_op)
    n = c.nranks()
    _check_nranks_chunks("recv_tensor", recv_tensor, "send_tensor", send_tensor, n, "for allgather")
    _count(_nbytes(send_tensor))
    st = _Staging(c)
    work = _all_gather_single(st(recv_tensor.view(-1), read=False, write=True),
                              st(send_tensor.reshape(-1).contiguous()), group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def allgather_inplace(tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`allgather`: ``tensor`` holds nranks equal chunks; each member's
    chunk at its rank is its input, and all chunks are the output."""
    c, _ = _open("allgather_inplace", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    n = c.nranks()
    _check_divisible("tensor", tensor, n)
    flat = tensor.view(-1)
    count = flat.numel() // n
    mine = flat[c.rank() * count:(c.rank() + 1) * count].clone()
    _count(_nbytes(mine))
    st = _Staging(c)
    work = _all_gather_single(st(flat, read=False, write=True), st(mine), group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm=None, *, group=None,
           async_op: bool = False):
    """``recv_tensor`` of rank ``dst`` (nranks × ``send_tensor.numel()`` elements) ←
    every member's ``send_tensor``, in communicator-rank order; ``recv_tensor`` of the
    other members is not used."""
    c, ranks = _open("gather", comm, group, send=send_tensor)
    if c is None:
        return _skip(async_op)
    dst, n, at_dst = _rooted(c, ranks, dst, "dst", "recv_tensor", recv_tensor, "send_tensor", send_tensor,
                             written=True)
    st = _Staging(c)
    chunks = list(st(recv_tensor.view(n, -1), read=False, write=True).unbind(0)) if at_dst else None
    if not at_dst:
        _count(_nbytes(send_tensor))
    work = dist.gather(st(send_tensor.reshape(-1).contiguous()), chunks, dst=dst, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def _rooted(c: BaguaCommunicator, ranks: str, root, root_name: str, whole_name: str, whole, part_name: str,
            part: torch.Tensor, *, written: bool) -> tuple[int, int, bool]:
    """The rooted half of gather's and scatter's opening: the root's global rank, then,
    on the root only, its ``whole`` tensor (nranks × ``part.numel()`` elements of
    ``part``'s dtype; contiguous where it is ``written`` in place, as gather's
    recv_tensor, any strides where it is only read, as scatter's send_tensor).
    Returns (global root, nranks, whether this is the root)."""
    root = _global_rank(c, ranks, root, root_name)
    n = c.nranks()
    at_root = get_rank() == root
    if at_root:
        _check_tensor(whole_name, whole, contiguous=written)
        _check_same_dtype(part_name, part, whole_name, whole)
        _check_nranks_chunks(whole_name, whole, part_name, part, n, f"on the {root_name} rank")
    return root, n, at_root


def _rooted_inplace(c: BaguaCommunicator, ranks: str, tensor: torch.Tensor, count, root, root_name: str):
    """Checks of an in-place gather/scatter (after :func:`_open`'s of ``tensor``):
    ``tensor`` holds nranks × ``count`` elements on the root and ``count`` elsewhere.
    Returns (global root, nranks, whether this is the root, ``tensor`` as 1-D)."""
    count = check_int("count", count, 0, what="a non-negative integer")
    root = _global_rank(c, ranks, root, root_name)
    n = c.nranks()
    at_root = get_rank() == root
    need = n * count if at_root else count
    if tensor.numel() != need:
        where = f"nranks x count = {n} x {count}" if at_root else "count"
        raise ValueError(f"tensor must have {where} = {need} elements on this rank, got {tensor.numel()}")
    return root, n, at_root, tensor.view(-1)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`gather`: on rank ``dst`` ``tensor`` has nranks × ``count``
    elements, its own input being chunk ``dst``; elsewhere it has ``count`` elements."""
    c, ranks = _open("gather_inplace", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    dst, n, at_dst, flat = _rooted_inplace(c, ranks, tensor, count, dst, "dst")
    st = _Staging(c)
    if at_dst:
        me = c.rank()
        send = flat[me * count:(me + 1) * count].clone()
        chunks = list(st(flat.view(n, count), read=False, write=True).unbind(0))
    else:
        send, chunks = flat, None
        _count(_nbytes(send))
    work = dist.gather(st(send), chunks, dst=dst, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm=None, *, group=None,
            async_op: bool = False):
    """Each member's ``recv_tensor`` ← its chunk (by communicator rank) of rank
    ``src``'s ``send_tensor`` (nranks × ``recv_tensor.numel()`` elements; not used on
    the other members)."""
    c, ranks = _open("scatter", comm, group, recv=recv_tensor)
    if c is None:
        return _skip(async_op)
    src, n, at_src = _rooted(c, ranks, src, "src", "send_tensor", send_tensor, "recv_tensor", recv_tensor,
                             written=False)
    st = _Staging(c)
    chunks = list(st(send_tensor.reshape(n, -1).contiguous()).unbind(0)) if at_src else None
    if at_src:
        _count(_nbytes(recv_tensor) * (n - 1))
    work = dist.scatter(st(recv_tensor.view(-1), read=False, write=True), chunks, src=src, group=c.torch_group,
                        async_op=True)
    return _finish(st.handle([work]), async_op)


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`scatter`: on rank ``src`` ``tensor`` has nranks × ``count``
    elements (its own share, chunk ``src``, stays in place); elsewhere it has ``count``
    elements and receives this member's chunk."""
    c, ranks = _open("scatter_inplace", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    src, n, at_src, flat = _rooted_inplace(c, ranks, tensor, count, src, "src")
    st = _Staging(c)
    if at_src:  # its own chunk comes back into a scratch buffer: the share stays in place
        out, chunks = st(torch.empty_like(flat[:count]), read=False), list(st(flat.view(n, count)).unbind(0))
        _count(_nbytes(out) * (n - 1))
    else:
        out, chunks = st(flat, read=False, write=True), None
    work = dist.scatter(out, chunks, src=src, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *,
                   group=None, async_op: bool = False):
    """Member k's ``recv_tensor`` ← reduction of chunk k of every member's
    ``send_tensor`` (nranks × ``recv_tensor.numel()`` elements)."""
    c, _ = _open("reduce_scatter", comm, group, send=send_tensor, recv=recv_tensor)
    if c is None:
        return _skip(async_op)
    n = c.nranks()
    _check_nranks_chunks("send_tensor", send_tensor, "recv_tensor", recv_tensor, n, "for reduce_scatter")
    op = _reduce_op(op, send_tensor)
    torch_op, finishers = _op_and_finish(op, c, recv_tensor)
    _count(_nbytes(recv_tensor) * (n - 1))
    st = _Staging(c)
    work = _reduce_scatter_single(st(recv_tensor.view(-1), read=False, write=True),
                                  st(send_tensor.reshape(-1).contiguous()), op=torch_op, group=c.torch_group,
                                  async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *, group=None,
                           async_op: bool = False):
    """In-place :func:`reduce_scatter`: ``tensor`` holds nranks equal chunks; afterwards
    member k's chunk k holds the reduction of every member's chunk k (the other chunks
    are left unchanged)."""
    c, _ = _open("reduce_scatter_inplace", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    n = c.nranks()
    _check_divisible("tensor", tensor, n)
    op = _reduce_op(op, tensor)
    flat = tensor.view(-1)
    count = flat.numel() // n
    out = torch.empty_like(flat[:count])
    torch_op, finishers = _op_and_finish(op, c, out)
    mine = flat[c.rank() * count:(c.rank() + 1) * count]
    _count(_nbytes(out) * (n - 1))
    st = _Staging(c)
    work = _reduce_scatter_single(st(out, read=False, write=True), st(flat), op=torch_op, group=c.torch_group,
                                  async_op=True)
    return _finish(st.handle([work], finishers + [lambda: mine.copy_(out)]), async_op)


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """Chunk j of member i's ``send_tensor`` → chunk i of member j's ``recv_tensor``
    (both of nranks equal chunks)."""
    c, _ = _open("alltoall", comm, group, send=send_tensor, recv=recv_tensor)
    if c is None:
        return _skip(async_op)
    n = c.nranks()
    _check_divisible("send_tensor", send_tensor, n)
    _check_same_numel(send_tensor, recv_tensor)
    send = send_tensor.reshape(-1)
    if send.data_ptr() == recv_tensor.data_ptr() or not send.is_contiguous():
        send = send.clone()
    if n:
        _count(_nbytes(send) // n * (n - 1))
    st = _Staging(c)
    work = dist.all_to_all_single(st(recv_tensor.view(-1), read=False, write=True), st(send), group=c.torch_group,
                                  async_op=True)
    return _finish(st.handle([work]), async_op)


def alltoall_inplace(tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`alltoall`."""
    return alltoall(tensor, tensor, comm, group=group, async_op=async_op)


def alltoall_v(send_tensor: torch.Tensor, send_counts, send_displs, recv_tensor: torch.Tensor, recv_counts,
               recv_displs, comm=None, *, group=None, async_op: bool = False):
    """All-to-all with a count and a displacement per rank (as MPI_Alltoallv).

    Member i sends the ``send_counts[j]`` elements of ``send_tensor`` (flattened) from
    offset ``send_displs[j]`` to member j (j a communicator rank), which stores them
    at offset ``recv_displs[i]`` of its ``recv_tensor``, where ``recv_counts[i]`` must
    equal member i's ``send_counts[j]`` (that pairing is not checked across ranks).
    Elements of ``recv_tensor`` outside the receive regions are left unchanged.
    """
    c, _ = _open("alltoall_v", comm, group, send=send_tensor, recv=recv_tensor)
    if c is None:
        return _skip(async_op)
    n = c.nranks()
    send_counts = _counts("send_counts", send_counts, n)
    send_displs = _counts("send_displs", send_displs, n, sum(send_counts))
    recv_counts = _counts("recv_counts", recv_counts, n)
    recv_displs = _counts("recv_displs", recv_displs, n, sum(recv_counts))
    send_packed = _regions("send_counts", send_counts, "send_displs", send_displs, "send_tensor",
                           send_tensor.numel(), disjoint=False)
    recv_packed = _regions("recv_counts", recv_counts, "recv_displs", recv_displs, "recv_tensor",
                           recv_tensor.numel(), disjoint=True)
    return _alltoall_v(send_tensor.reshape(-1), send_counts, send_displs, send_packed, recv_tensor.view(-1),
                       recv_counts, recv_displs, recv_packed, c, async_op)


def alltoall_v_inplace(tensor: torch.Tensor, counts, displs, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`alltoall_v`: the region ``displs[j]``, ``counts[j]`` of ``tensor``
    is sent to member j and replaced by what member j sends (so member j's
    ``counts[i]`` must equal this member's ``counts[j]``)."""
    c, _ = _open("alltoall_v_inplace", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    n = c.nranks()
    counts = _counts("counts", counts, n)
    displs = _counts("displs", displs, n, sum(counts))
    packed = _regions("counts", counts, "displs", displs, "tensor", tensor.numel(), disjoint=True)
    flat = tensor.view(-1)
    return _alltoall_v(flat, counts, displs, packed, flat, counts, displs, packed, c, async_op, copy_send=True)


def _alltoall_v(send, send_counts, send_displs, send_packed, recv, recv_counts, recv_displs, recv_packed,
                c: BaguaCommunicator, async_op: bool, copy_send: bool = False):
    if send_packed:
        send_buf = send[:sum(send_counts)]
        if copy_send or not send_buf.is_contiguous() or send_buf.data_ptr() == recv.data_ptr():
            send_buf = send_buf.clone()
    else:
        send_buf = torch.cat([send[d:d + k] for k, d in zip(send_counts, send_displs)])
    finishers = []
    if recv_packed:
        recv_buf = recv[:sum(recv_counts)]
    else:
        recv_buf = torch.empty(sum(recv_counts), dtype=recv.dtype, device=recv.device)

        def unpack():
            offset = 0
            for k, d in zip(recv_counts, recv_displs):
                recv[d:d + k].copy_(recv_buf[offset:offset + k])
                offset += k

        finishers.append(unpack)
    me = c.rank()
    _count(sum(k for j, k in enumerate(send_counts) if j != me) * send_buf.element_size())
    st = _Staging(c)
    work = dist.all_to_all_single(st(recv_buf, read=False, write=True), st(send_buf), output_split_sizes=recv_counts,
                                  input_split_sizes=send_counts, group=c.torch_group, async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def barrier(comm=None, *, group=None, async_op: bool = False):
    """Block until every member of the communicator has entered ``barrier``."""
    c, _ = _open("barrier", comm, group)
    if c is None:
        return _skip(async_op)
    work = dist.barrier(group=c.torch_group, async_op=True)
    return _finish(CommHandle([work]), async_op)


def send(tensor: torch.Tensor, dst: int, comm=None, *, group=None, async_op: bool = False):
    """Send ``tensor`` to rank ``dst`` (an int, or a ``[1]`` long tensor: one worker's
    peer) (blocking unless ``async_op``)."""
    c, ranks = _open("send", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    dst = _global_rank(c, ranks, _peer_rank(dst, "dst"), "dst")
    if dst == get_rank():
        raise ValueError(f"dst={dst} is this process's own rank; send to another rank")
    _count(_nbytes(tensor))
    st = _Staging(c)
    work = dist.isend(st(tensor), dst=dst, group=c.torch_group)
    return _finish(st.handle([work]), async_op)


def recv(tensor: torch.Tensor, src: int, comm=None, *, group=None, async_op: bool = False):
    """Receive ``tensor`` from rank ``src`` (an int, or a ``[1]`` long tensor: one
    worker's peer) (blocking unless ``async_op``)."""
    c, ranks = _open("recv", comm, group, tensor)
    if c is None:
        return _skip(async_op)
    src = _global_rank(c, ranks, _peer_rank(src, "src"), "src")
    if src == get_rank():
        raise ValueError(f"src={src} is this process's own rank; receive from another rank")
    st = _Staging(c)
    work = dist.irecv(st(tensor, read=False, write=True), src=src, group=c.torch_group)
    return _finish(st.handle([work]), async_op)
