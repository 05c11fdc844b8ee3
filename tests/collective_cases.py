"""The checks of every collective of comm, shared by the tests that run them
(tests/test_comm.py on the CPU, tests/test_host_staging.py through host copies,
tests/test_gpu.py on CUDA tensors): the deterministic inputs, :func:`all_collectives`
(run on a worker) and :func:`expected_collectives` (what a rank must then hold,
computed in the test process from the same inputs)."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

from bagua_algos.runtime import comm

TWO_NODES = {"LOCAL_WORLD_SIZE": "2"}  # ranks 0,1 on "node" 0, ranks 2,3 on "node" 1


def inp(name: str, rank: int, size: int, dtype=torch.int64) -> torch.Tensor:
    """The deterministic input of global rank ``rank`` for check ``name``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
    return torch.randint(-4, 5, (max(size, 0),), generator=g).to(dtype)


def v_counts(i: int, j: int) -> int:
    """Elements communicator rank i sends to rank j in the alltoall_v check."""
    return (i + 2 * j) % 3


def v_layout(i: int, n: int):
    """(send_counts, send_displs, send_size, recv_counts, recv_displs, recv_size) of
    communicator rank i: regions with gaps, sends placed in reverse rank order."""
    send_counts = [v_counts(i, j) for j in range(n)]
    send_displs, pos = [0] * n, 1
    for j in reversed(range(n)):
        send_displs[j] = pos
        pos += send_counts[j] + 1
    send_size = pos
    recv_counts = [v_counts(j, i) for j in range(n)]
    recv_displs, pos = [0] * n, 2
    for j in range(n):
        recv_displs[j] = pos
        pos += recv_counts[j] + 1
    return send_counts, send_displs, send_size, recv_counts, recv_displs, pos


def sym_counts(i: int, j: int) -> int:
    return (i + j) % 2 + 1


def v_inplace_layout(i: int, n: int):
    counts = [sym_counts(i, j) for j in range(n)]
    displs, pos = [0] * n, 0
    for j in range(n):
        displs[j] = pos
        pos += counts[j] + (j % 2)  # a gap after every odd rank's region
    return counts, displs, pos + 1


OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BOR", "BAND", "BXOR"]


def all_collectives(cn: str, obj, device: str = "cpu") -> dict:
    """Run every collective over communicator ``obj`` (named ``cn``) on tensors of
    ``device``; the outputs, on the CPU."""
    c = comm._as_communicator(obj)
    me, i, n = comm.get_rank(), c.rank(), c.nranks()
    last = n - 1
    out = {"ranks": list(c.ranks), "rank": i}

    def x(k, size, dtype=torch.int64):
        return inp(f"{cn}/{k}", me, size, dtype).to(device)

    zeros = functools.partial(torch.zeros, device=device)
    full = functools.partial(torch.full, device=device)

    for name in OPS:
        t = x(name, 5)
        assert comm.allreduce_inplace(t, comm.ReduceOp[name], obj) is None
        out["allreduce_inplace/" + name] = t
    t = x("AVGf", 5, torch.float64)
    comm.allreduce_inplace(t, comm.ReduceOp.AVG, obj)
    out["allreduce_inplace/AVGf"] = t
    t = x("AVGi", 5)
    comm.allreduce_inplace(t, comm.ReduceOp.AVG, obj)
    out["allreduce_inplace/AVGi"] = t
    send, recv = x("allreduce", 4), zeros(4, dtype=torch.int64)
    comm.allreduce(send, recv, comm.ReduceOp.MIN, obj)
    out["allreduce"] = (send, recv)
    t = x("broadcast", 3)
    comm.broadcast(t, last, obj)
    out["broadcast"] = t
    send, recv = x("reduce", 3), full((3,), 99)
    comm.reduce(send, recv, 0, comm.ReduceOp.SUM, obj)
    out["reduce"] = (send, recv)
    t = x("reduce_inplace", 3)
    comm.reduce_inplace(t, last, comm.ReduceOp.MAX, obj)
    out["reduce_inplace"] = t
    send, recv = x("allgather", 2), zeros(2 * n, dtype=torch.int64)
    comm.allgather(send, recv, obj)
    out["allgather"] = recv
    t = x("allgather_inplace", 2 * n)
    comm.allgather_inplace(t, obj)
    out["allgather_inplace"] = t
    send, recv = x("gather", 2), full((2 * n,), 99)
    comm.gather(send, recv, last, obj)
    out["gather"] = recv
    t = x("gather_inplace", 2 * n if i == 0 else 2)
    comm.gather_inplace(t, 2, 0, obj)
    out["gather_inplace"] = t
    send, recv = x("scatter", 2 * n), zeros(2, dtype=torch.int64)
    comm.scatter(send, recv, 0, obj)
    out["scatter"] = recv
    t = x("scatter_inplace", 2 * n if i == last else 2)
    comm.scatter_inplace(t, 2, last, obj)
    out["scatter_inplace"] = t
    send, recv = x("reduce_scatter", 2 * n), zeros(2, dtype=torch.int64)
    comm.reduce_scatter(send, recv, comm.ReduceOp.SUM, obj)
    out["reduce_scatter"] = recv
    send, recv = x("reduce_scatter_avg", 2 * n, torch.float64), zeros(2, dtype=torch.float64)
    comm.reduce_scatter(send, recv, comm.ReduceOp.AVG, obj)
    out["reduce_scatter_avg"] = recv
    t = x("reduce_scatter_inplace", 2 * n)
    comm.reduce_scatter_inplace(t, comm.ReduceOp.MAX, obj)
    out["reduce_scatter_inplace"] = t
    send, recv = x("alltoall", 2 * n), zeros(2 * n, dtype=torch.int64)
    comm.alltoall(send, recv, obj)
    out["alltoall"] = recv
    t = x("alltoall_inplace", 2 * n)
    comm.alltoall_inplace(t, obj)
    out["alltoall_inplace"] = t
    if i >= 0:
        sc, sd, ss, rc, rd, rs = v_layout(i, n)
        send, recv = x("alltoall_v", ss), full((rs,), 99)
        comm.alltoall_v(send, sc, sd, recv, rc, rd, obj)
        out["alltoall_v"] = recv
        # packed layout (displacements are the prefix sums), counts as tensors
        send, recv = x("alltoall_v_packed", sum(sc)), zeros(sum(rc), dtype=torch.int64)
        prefix = lambda cs: [sum(cs[:j]) for j in range(n)]  # noqa: E731
        comm.alltoall_v(send, torch.tensor(sc, device=device), prefix(sc), recv, rc, torch.tensor(prefix(rc), device=device), obj)
        out["alltoall_v_packed"] = recv
        # Bagua's own example: NumPy counts and n + 1 displacements ending with the total
        send, recv = x("alltoall_v_packed", sum(sc)), zeros(sum(rc), dtype=torch.int64)
        comm.alltoall_v(send, np.array(sc), np.array(prefix(sc) + [sum(sc)]), recv, np.array(rc),
                        np.array(prefix(rc) + [sum(rc)]), obj)
        out["alltoall_v_bagua_displs"] = recv
        counts, displs, size = v_inplace_layout(i, n)
        t = x("alltoall_v_inplace", size)
        comm.alltoall_v_inplace(t, counts, displs, obj)
        out["alltoall_v_inplace"] = t
        if n > 1:
            if i == 0:
                comm.send(x("send", 3), last, obj)
            elif i == last:
                t = zeros(3, dtype=torch.int64)
                comm.recv(t, 0, obj)
                out["recv"] = t
    assert comm.barrier(obj) is None
    t = x("async", 4)
    handle = comm.allreduce_inplace(t, comm.ReduceOp.SUM, obj, async_op=True)
    assert isinstance(handle, comm.CommHandle)
    handle.wait()
    out["async"] = t
    return {k: tuple(v.cpu() for v in val) if isinstance(val, tuple) else
            val.cpu() if isinstance(val, torch.Tensor) else val for k, val in out.items()}


def _reduce(name, tensors):
    stack = torch.stack(tensors)
    if name == "SUM":
        return stack.sum(0)
    if name == "PRODUCT":
        return stack.prod(0)
    if name == "MIN":
        return stack.min(0).values
    if name == "MAX":
        return stack.max(0).values
    bitwise = {"BOR": torch.bitwise_or, "BAND": torch.bitwise_and, "BXOR": torch.bitwise_xor}[name]
    return functools.reduce(bitwise, tensors)


def expected_collectives(cn: str, members: list[int], i: int) -> dict:
    """What communicator rank ``i`` of ``members`` must hold after all_collectives."""
    n, last, me = len(members), len(members) - 1, members[i]

    def x(k, r, size, dtype=torch.int64):
        return inp(f"{cn}/{k}", r, size, dtype)

    def every(k, size, dtype=torch.int64):
        return [x(k, r, size, dtype) for r in members]

    e = {}
    for name in OPS:
        e["allreduce_inplace/" + name] = _reduce(name, every(name, 5))
    e["allreduce_inplace/AVGf"] = _reduce("SUM", every("AVGf", 5, torch.float64)) / n
    e["allreduce_inplace/AVGi"] = torch.div(_reduce("SUM", every("AVGi", 5)), n, rounding_mode="floor")
    e["allreduce"] = (x("allreduce", me, 4), _reduce("MIN", every("allreduce", 4)))
    e["broadcast"] = x("broadcast", members[last], 3)
    e["reduce"] = (x("reduce", me, 3), _reduce("SUM", every("reduce", 3)) if i == 0 else torch.full((3,), 99))
    e["reduce_inplace"] = _reduce("MAX", every("reduce_inplace", 3)) if i == last else x("reduce_inplace", me, 3)
    e["allgather"] = torch.cat(every("allgather", 2))
    e["allgather_inplace"] = torch.cat([x("allgather_inplace", r, 2 * n)[2 * j:2 * j + 2] for j, r in enumerate(members)])
    e["gather"] = torch.cat(every("gather", 2)) if i == last else torch.full((2 * n,), 99)
    if i == 0:
        e["gather_inplace"] = torch.cat([x("gather_inplace", members[0], 2 * n)[:2]]
                                        + [x("gather_inplace", r, 2) for r in members[1:]])
    else:
        e["gather_inplace"] = x("gather_inplace", me, 2)
    e["scatter"] = x("scatter", members[0], 2 * n)[2 * i:2 * i + 2]
    e["scatter_inplace"] = (x("scatter_inplace", me, 2 * n) if i == last
                            else x("scatter_inplace", members[last], 2 * n)[2 * i:2 * i + 2])
    e["reduce_scatter"] = _reduce("SUM", every("reduce_scatter", 2 * n))[2 * i:2 * i + 2]
    e["reduce_scatter_avg"] = _reduce("SUM", every("reduce_scatter_avg", 2 * n, torch.float64))[2 * i:2 * i + 2] / n
    t = x("reduce_scatter_inplace", me, 2 * n)
    t[2 * i:2 * i + 2] = _reduce("MAX", every("reduce_scatter_inplace", 2 * n))[2 * i:2 * i + 2]
    e["reduce_scatter_inplace"] = t
    e["alltoall"] = torch.cat([x("alltoall", r, 2 * n)[2 * i:2 * i + 2] for r in members])
    e["alltoall_inplace"] = torch.cat([x("alltoall_inplace", r, 2 * n)[2 * i:2 * i + 2] for r in members])
    _, _, _, rc, rd, rs = v_layout(i, n)
    recv = torch.full((rs,), 99)
    packed = []
    for j, r in enumerate(members):
        sc_j, sd_j, ss_j, _, _, _ = v_layout(j, n)
        recv[rd[j]:rd[j] + rc[j]] = x("alltoall_v", r, ss_j)[sd_j[i]:sd_j[i] + sc_j[i]]
        start = sum(sc_j[:i])
        packed.append(x("alltoall_v_packed", r, sum(sc_j))[start:start + sc_j[i]])
    e["alltoall_v"] = recv
    e["alltoall_v_packed"] = e["alltoall_v_bagua_displs"] = torch.cat(packed)
    counts, displs, size = v_inplace_layout(i, n)
    t = x("alltoall_v_inplace", me, size)
    for j, r in enumerate(members):
        c_j, d_j, size_j = v_inplace_layout(j, n)
        t[displs[j]:displs[j] + counts[j]] = x("alltoall_v_inplace", r, size_j)[d_j[i]:d_j[i] + c_j[i]]
    e["alltoall_v_inplace"] = t
    if n > 1 and i == last:
        e["recv"] = x("send", members[0], 3)
    e["async"] = _reduce("SUM", every("async", 4))
    return e


def staging_communicators() -> dict:
    """The communicators whose collectives are compared across transports (created
    collectively: every worker of a 4-worker TWO_NODES job calls this, in order): the
    job, the subgroup [1, 2, 3], this node's and the node leaders'."""
    default = comm._get_default_group()
    sub = comm.new_group([3, 1, 2])
    return {"world": None, "sub": sub, "intra": default.get_intra_node_communicator(),
            "inter": default.get_inter_node_communicator()}
